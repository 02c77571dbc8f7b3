"""Checking traced steps online (``Tracer(model, directory, online=REFERENCE)``): each rank's
shards are never written; the ranks check the step together over ``torch.distributed`` and
rank 0 writes the report a check of the written step gives.

At the end of a traced step every rank holds its own shards (the host copies the writer would
have written). Then, over a gloo group of the job's processes:

1. every rank sends every other its manifest fragment and its file's safetensors header (a
   few hundred bytes per tensor);
2. the check's set-up (layouts the tracer only guessed, the loss normalization) reads a few
   tensors: the ranks find the same missing ids (:meth:`OnlineTrace.needs`), each sends its
   shards of them to all, and the set-up is tried again until it reads nothing missing — it
   then decides on the bytes the written step would hold;
3. each tensor is assigned to a checker rank (largest first, balanced by bytes:
   ``ttrace.check.share_owners``), and every rank sends its shard of each tensor to that
   rank — point to point, so each shard crosses the network once;
4. each rank checks its share (read, merge, compare: the same first pass as ``ttrace
   check``), the shares (a few hundred bytes per tensor) are all-gathered and every rank
   combines them into the report; rank 0 writes ``report.json`` (what ``ttrace check --json``
   writes) and ``report.txt`` into ``directory/step{n}``.

The verdicts, ratios and localization are those of checking the written step (the same
functions on the same bytes). What a rank holds at the peak: its own shards, the tensors it
checks and those the set-up read. An error on any rank (a copy changed under the tracer, a
reference that does not fit) is raised on every rank at the same point; a rank that dies or
does not answer within the timeout makes the others raise
:class:`~ttrace.errors.DistributedCheckError`, and nothing is reported as a pass.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .. import _ttrace, errors
from .._distributed import DEFAULT_TIMEOUT, Said, attempt, gather_said
from ..errors import InvalidInputError
from ..report import CheckReport, report_of
from .writing import StepJob


def reference_step(reference: str, step: int) -> str:
    """The reference step checked against traced step ``step``: ``reference/step{step}`` when
    the reference is a trace of several steps, else ``reference`` itself (one step, checked
    against every traced step)."""
    per_step = os.path.join(reference, f"step{step}")
    if os.path.isdir(per_step):
        return per_step
    names = os.listdir(reference) if os.path.isdir(reference) else []
    if "manifest.json" in names or any(n.startswith("manifest.rank") for n in names):
        return reference
    raise InvalidInputError(
        f"online reference {reference!r} holds neither step{step} nor a traced step "
        "(manifest.json)", "InvalidParameter")


class OnlineChecker:
    """The online check of a tracer's steps over ``group`` (default: the whole
    ``torch.distributed`` world), each process one rank of the traced mesh."""

    def __init__(self, reference: str, pricing: str = "auto", group: Any = None,
                 timeout: Optional[float] = None) -> None:
        if pricing not in ("auto", "local"):
            raise InvalidInputError(f"pricing must be 'auto' or 'local' (got {pricing!r})",
                                    "InvalidParameter")
        if timeout is not None and not timeout > 0:
            raise InvalidInputError(f"timeout must be positive seconds, not {timeout!r}",
                                    "InvalidParameter")
        if not os.path.isdir(reference):
            raise InvalidInputError(f"online reference {reference!r} is not a directory",
                                    "InvalidParameter")
        self.reference = reference
        self.pricing = pricing
        self.timeout = timeout
        self._group = group
        self._channel: Any = None
        #: What the last check moved, on this rank: ``own_bytes`` (its shards),
        #: ``step_bytes`` (every rank's), ``held_bytes`` (what it held at the end: its own,
        #: the tensors it checked, those the set-up read), ``setup_rounds`` and
        #: ``setup_tensors`` (fetched to every rank for the set-up), and ``seconds`` per phase.
        self.last: Dict[str, Any] = {}

    # -- the channel ------------------------------------------------------------------------

    def _open(self) -> Any:
        """The gloo group the check talks over, made once by every member (collectively)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise InvalidInputError(
                "online checking needs an initialized torch.distributed process group "
                "(torch.distributed.init_process_group, or torchrun); a one-process run is "
                "checked with ttrace.check after writing it", "InvalidParameter")
        if self._channel is None:
            group = self._group if self._group is not None else dist.group.WORLD
            members = dist.get_process_group_ranks(group)
            try:
                self._channel = dist.new_group(
                    ranks=members, backend="gloo",
                    timeout=datetime.timedelta(seconds=self.timeout or DEFAULT_TIMEOUT),
                    use_local_synchronization=True)
            except Exception as e:  # the store's and the backend's error types vary
                raise errors.DistributedCheckError(
                    f"online check: the ranks {members} did not all join its group (one died, "
                    f"or did not reach the step's end in time): {e}", "CheckerRank") from None
        return self._channel

    def close(self) -> None:
        """Destroy the gloo group (every member calls it)."""
        if self._channel is not None:
            import torch.distributed as dist

            try:
                dist.destroy_process_group(self._channel)
            except Exception:  # pragma: no cover - best effort on a broken group
                pass
            self._channel = None

    def _gather(self, said: Said) -> List[Any]:
        """Every rank's payload; an error any rank said is raised on every rank."""
        return gather_said(self._channel, said, "online check, rank")

    def _each(self, f: Any) -> List[Any]:
        """``f()`` on this rank, every rank's result gathered (an error raised on all)."""
        return self._gather(attempt(f))

    # -- the check ----------------------------------------------------------------------------

    def check(self, job: StepJob, step: int, rank: int, world: int) -> CheckReport:
        """Check the step of ``job`` (this rank's, ``rank`` of the traced mesh's ``world``)
        with every other rank; the same report on every rank."""
        import torch.distributed as dist

        channel = self._open()
        me, n = dist.get_rank(channel), dist.get_world_size(channel)
        label = os.path.join(job.directory) + " (online)"
        arrays: Dict[str, Any] = {}

        def local() -> Tuple[int, str, str, bytes, str, int]:
            if n != world:
                raise InvalidInputError(
                    f"the traced mesh has {world} ranks but the online check's group "
                    f"{n} processes: one process per rank", "InvalidParameter")
            changed = job.checks.mismatches() if len(job.checks) else []
            if changed:
                raise errors.TtraceError(
                    f"{job.directory}: not checked: the memory of {changed[0]!r} changed "
                    "after it was recorded, without torch counting the write; record with "
                    "Tracer(..., share=False)", "Storage")
            for key, _, _, t in job.tensors:
                arrays[key] = t.wait().reshape(-1).view(torch.uint8).numpy()
            header = _ttrace.encode_header(
                job.file, [(k, f, s, arrays[k]) for k, f, s, _ in job.tensors])
            return (rank, json.dumps(job.manifest), job.file, bytes(header),
                    reference_step(self.reference, step),
                    sum(int(a.nbytes) for a in arrays.values()))

        clock = [time.perf_counter()]

        def lap() -> float:
            clock.append(time.perf_counter())
            return round(clock[-1] - clock[-2], 4)

        parts = self._each(local)
        ranks = sorted(p[0] for p in parts)
        if ranks != list(range(world)):
            raise InvalidInputError(f"the online check's processes hold ranks {ranks}, not "
                                    f"0 to {world - 1} once each", "InvalidParameter")
        parts.sort(key=lambda p: p[0])
        ref = parts[0][4]
        trace = _ttrace.OnlineTrace(label, [p[1] for p in parts], [(p[2], p[3]) for p in parts])
        for key, a in arrays.items():
            trace.hold(job.file, key, a)
        seconds = {"headers": lap()}
        fetched, rounds = self._set_up(trace, ref, rank, arrays, job.file)
        seconds["set_up"] = lap()
        self._deliver(trace, ref, rank, me, n, arrays, job.file, fetched)
        seconds["deliver"] = lap()
        shares = self._each(lambda: bytes(trace.check_share(ref, me, n)))
        seconds["check_share"] = lap()
        raw_json, text = trace.combine(ref, self.pricing, shares)
        seconds["combine"] = lap()
        self.last = {"own_bytes": sum(int(a.nbytes) for a in arrays.values()),
                     "step_bytes": sum(int(p[5]) for p in parts),
                     "held_bytes": int(trace.held_bytes), "setup_rounds": rounds,
                     "setup_tensors": len(fetched), "seconds": seconds}
        report = report_of(raw_json, text)
        if me == 0:
            os.makedirs(job.directory, exist_ok=True)
            _ttrace.write_atomic(os.path.join(job.directory, "report.json"),
                                 raw_json.encode())
            _ttrace.write_atomic(os.path.join(job.directory, "report.txt"),
                                 (text.rstrip("\n") + "\n").encode())
        return report

    def _mine(self, trace: Any, ids: Sequence[str], rank: int,
              file: str) -> List[Tuple[str, str]]:
        """(file, key) of this rank's shards of ``ids``, each once."""
        out: Dict[Tuple[str, str], None] = {}
        for tid in ids:
            for r, f, k in trace.entries(tid):
                if r == rank and f == file:
                    out[(f, k)] = None
        return list(out)

    def _set_up(self, trace: Any, ref: str, rank: int, arrays: Dict[str, Any],
                file: str) -> "Tuple[set[str], int]":
        """Fetch to every rank the shards the check's set-up reads, until it reads nothing
        missing; the ids fetched and the rounds it took."""
        fetched: "set[str]" = set()
        rounds = 0
        while True:
            everyone = self._each(lambda: list(trace.needs(ref)))
            needed = sorted({tid for ids in everyone for tid in ids} - fetched)
            if not needed:
                return fetched, rounds
            rounds += 1
            payload = [(f, k, arrays[k]) for f, k in self._mine(trace, needed, rank, file)]
            for got in self._gather(("ok", payload)):
                for f, k, a in got:
                    if not trace.holds(f, k):
                        trace.hold(f, k, a)
            fetched.update(needed)

    def _deliver(self, trace: Any, ref: str, rank: int, me: int, n: int,
                 arrays: Dict[str, Any], file: str, fetched: "set[str]") -> None:
        """Send each checker rank this rank's shards of the tensors it checks (point to
        point), and receive those of the tensors this rank checks."""
        import numpy as np
        import torch.distributed as dist

        # Every rank computes the same assignment; only whether it could is exchanged.
        said = attempt(lambda: list(trace.owners(ref, n)))
        self._gather(("ok", None) if said[0] == "ok" else said)
        owners = said[1]
        by_owner: List[List[str]] = [[] for _ in range(n)]
        for tid, o in owners:
            if tid not in fetched:
                by_owner[o].append(tid)
        outgoing = [[] if p == me else self._mine(trace, by_owner[p], rank, file)
                    for p in range(n)]
        plans = self._gather(("ok", [[(f, k, int(arrays[k].nbytes)) for f, k in out]
                                     for out in outgoing]))
        channel = self._channel
        pending = []
        received = []
        for s in range(1, n):
            dst, src = (me + s) % n, (me - s) % n
            if outgoing[dst]:
                buf = torch.from_numpy(np.concatenate([arrays[k] for _, k in outgoing[dst]]))
                pending.append(dist.isend(buf, dist.get_global_rank(channel, dst),
                                          group=channel))
            plan = plans[src][me]
            if plan:
                into = torch.empty(sum(b for _, _, b in plan), dtype=torch.uint8)
                pending.append(dist.irecv(into, dist.get_global_rank(channel, src),
                                          group=channel))
                received.append((plan, into))
        try:
            for w in pending:
                if w is not None:
                    w.wait()
        except Exception as e:
            raise errors.DistributedCheckError(
                f"online check, rank {me} of {n}: the shards did not all arrive (a rank died, "
                f"or did not answer in time): {e}", "CheckerRank") from None
        for plan, into in received:
            at = 0
            flat = into.numpy()
            for f, k, b in plan:
                if not trace.holds(f, k):
                    trace.hold(f, k, flat[at:at + b])
                at += b
