"""Writing traced steps: each step's host copies and manifest handed to the Rust core (the one
writer of the trace format), on a background thread so that the step does not wait on the
disk, or inline; and the merge of several ranks' manifest fragments."""

from __future__ import annotations

import atexit
import json
import os
import queue
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union, cast

import torch

from .. import _ttrace
from .. import arith as _arith
from .._copies import Checks, HostCopy
from .._summaries import Pending, ShardStats, Summarizer, entry_stats
from ..errors import TtraceError
from .record import _DTYPES, _StepRecord


@dataclass
class StepJob:
    """One rank's step as the writer takes it."""

    #: The step directory.
    directory: str
    #: The rank's safetensors file name.
    file: str
    #: (key, format, shape, host copy) of each stored tensor.
    tensors: List[Tuple[str, str, List[int], HostCopy]]
    #: The step's header and entries (the core adds the format and version).
    manifest: Dict[str, Any]
    #: Every host copy the step made, released once written.
    made: List[HostCopy]
    #: The checksums of the records that share a copy by identity (a device's).
    checks: Checks


@dataclass
class SummaryJob:
    """One rank's step of statistics (``Tracer(..., summaries=True)``)."""

    #: The tracer's directory (the summary files are appended there).
    directory: str
    #: The line without the statistics: its entries are completed from ``pending``.
    line: Dict[str, Any]
    #: Extremes computed per side for each entry.
    kept: List[int]
    #: Extremes asked for per side.
    k: int
    #: The statistics on their way to the host.
    pending: Pending
    #: Where a tensor that cannot be summarized is reported: (id, reason).
    skipped: List[Tuple[str, str]]


def entry_fields(tid: str, t: Any, meta: Dict[str, Any]) -> Dict[str, Any]:
    """The manifest fields of a recorded tensor that summary lines share: id, dtype, layout,
    module, guessed axes (``meta``: what the step recorded about it)."""
    e: Dict[str, Any] = {"id": tid, "dtype": _DTYPES[t.dtype], "layout": meta["layout"].to_json()}
    if meta["module"] is not None:
        e["module"] = meta["module"]
    if meta["guessed"]:
        e["guessed"] = meta["guessed"]
    if meta.get("owned"):
        e["owned"] = meta["owned"]
    return e


def step_job(directory: str, order: List[str], record: _StepRecord, rank: int,
             mesh: Dict[str, Any], recipe: Optional[str], dp_loss_auto: bool,
             pipeline: Optional[Tuple[int, int, int, int, int]] = None) -> StepJob:
    """One rank's step for the writer: its stored tensors (a host copy that several ids name
    stored once, under the first id) and the manifest's header and entries — to which the
    Rust core adds the format and version, building the manifest and validating it as every
    reader does (one writer). ``pipeline``: (stages, this rank's stage, microbatches, global
    rank, the dimension microbatches were concatenated along) of a pipelined or microbatched
    step: ``rank`` is then the rank within the stage,
    and the file is named by the global rank."""
    fname = f"rank{pipeline[3] if pipeline else rank}.safetensors"
    tensors, entries = [], []
    keys: Dict[int, str] = {}
    for tid in order:
        t = cast(HostCopy, record.records[tid])
        key = keys.get(id(t))
        if key is None:
            key = keys[id(t)] = tid
            tensors.append((tid, _DTYPES[t.dtype], list(t.shape), t))
        entries.append({"rank": rank, "file": fname, "key": key,
                        **entry_fields(tid, t, record.meta[tid])})
        if pipeline is not None and pipeline[0] > 1:
            entries[-1]["stage"] = pipeline[1]
    manifest: Dict[str, Any] = {"mesh": mesh, "run": _arith.run_settings(), "tensors": entries}
    if recipe:
        manifest["recipe"] = recipe
    if dp_loss_auto:
        manifest["dp_loss"] = "auto"
    if pipeline is not None:
        manifest["pipeline"] = {"stages": pipeline[0], "microbatches": pipeline[2],
                                "dim": pipeline[4]}
    return StepJob(directory, fname, tensors, manifest, record.made,
                   Checks([c for _, _, _, c in tensors if c.checks] + record.folded))


def summary_job(directory: str, step: int, order: List[str], record: _StepRecord, rank: int,
                mesh: Dict[str, Any], summarizer: Summarizer,
                skipped: List[Tuple[str, str]]) -> "SummaryJob":
    """One rank's step of statistics for the writer: the line's header and entries, and the
    statistics set moving to the host."""
    stats = [cast(ShardStats, record.records[tid]) for tid in order]
    entries = [{**entry_fields(tid, st, record.meta[tid]), "shape": list(st.shape)}
               for tid, st in zip(order, stats)]
    line: Dict[str, Any] = {"format": "ttrace-summaries", "version": 1, "step": step,
                            "rank": rank, "mesh": mesh, "tensors": entries}
    return SummaryJob(directory, line, [st.kept for st in stats], summarizer.k,
                      summarizer.gather(stats), skipped)


class StepWriter:
    """Writes one rank's steps through the Rust core: tensors first, the manifest fragment
    ``manifest.rank{r}.json`` last and atomically (an interrupted step leaves no manifest
    naming missing files). In the background (a daemon thread started on the first step;
    :meth:`flush` waits for it and re-raises its first error) or inline."""

    def __init__(self, rank: int, fsync: bool, background: bool) -> None:
        self.rank = rank
        self.fsync = fsync
        self.background = background
        #: Bytes of tensor data written so far (all steps).
        self.bytes_written = 0
        self._queue: "queue.Queue[Optional[Union[StepJob, SummaryJob]]]" = queue.Queue()
        self._errors: List[BaseException] = []
        self._thread: Optional[threading.Thread] = None
        self._atexit = False

    def hand(self, job: Union[StepJob, SummaryJob]) -> None:
        """Write ``job``: queued for the background thread, or now."""
        for c in job.made if isinstance(job, StepJob) else []:
            c.hand()
        if not self.background:
            self._write(job)
            return
        self._start()
        self._queue.put(job)

    def _write(self, job: Union[StepJob, SummaryJob]) -> None:
        if isinstance(job, SummaryJob):
            self._write_summaries(job)
            return
        stored: list = []
        try:
            if len(job.checks):
                changed = job.checks.mismatches()
                if changed:
                    raise TtraceError(
                        f"{job.directory}: not written: the memory of {changed[0]!r} (and "
                        f"{len(changed) - 1} more) is an earlier record's, at the same version, "
                        "yet its contents changed in between — a write torch did not count (a "
                        "collective in place, an assignment through .data) — so the shared copy "
                        "would be wrong; record with Tracer(..., share=False)", "Storage")
            os.makedirs(job.directory, exist_ok=True)
            # The device copies are complete once their events are (the only wait for the
            # device, on this thread).
            stored = [
                (key, fmt, shape, t.wait().reshape(-1).view(torch.uint8).numpy())
                for key, fmt, shape, t in job.tensors
            ]
            self.bytes_written += _ttrace.write_step(
                job.directory, job.file, stored, {"rank": str(self.rank)},
                f"manifest.rank{self.rank}.json", json.dumps(job.manifest), self.fsync
            )
        finally:
            del stored
            for c in job.made:
                c.release()

    def _write_summaries(self, job: SummaryJob) -> None:
        # The statistics are on the host once their transfers' events are (the only wait for
        # the device, on this thread); the Rust core validates and appends the line.
        values = job.pending.wait()
        entries = []
        for e, v, kept in zip(job.line["tensors"], values, job.kept):
            stats = entry_stats(v, kept, job.k)
            if stats is None:
                job.skipped.append((e["id"], "its float64 sums overflow: not summarized"))
                continue
            entries.append({**e, **stats})
        line = {**job.line, "tensors": entries}
        text = json.dumps(line, allow_nan=False)
        _ttrace.append_summaries(job.directory, text, self.fsync)
        self.bytes_written += len(text) + 1

    def _start(self) -> None:
        if self._thread is not None:
            return

        def run() -> None:
            while True:
                job = self._queue.get()
                try:
                    if job is None:
                        return
                    self._write(job)
                except BaseException as e:  # reported by flush()
                    self._errors.append(e)
                finally:
                    self._queue.task_done()

        self._thread = threading.Thread(target=run, name="ttrace-writer", daemon=True)
        self._thread.start()
        if not self._atexit:
            atexit.register(self.flush)
            self._atexit = True

    def flush(self) -> int:
        """Wait until every handed step is on disk; re-raises a write error. Returns the bytes
        written so far."""
        if self._thread is not None:
            self._queue.join()
        if self._errors:
            e = self._errors.pop(0)
            self._errors.clear()
            if isinstance(e, TtraceError):
                raise e
            raise TtraceError(f"writing the trace failed: {e}", "File") from e
        return self.bytes_written

    def close(self) -> None:
        """Stop the background thread (after the steps handed to it are written)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if self._atexit:
            atexit.unregister(self.flush)
            self._atexit = False


def finish(directory: Union[str, "os.PathLike[str]"]) -> str:
    """Merge every ``manifest.rank*.json`` of ``directory`` into ``manifest.json`` (rank
    order) — for several ranks emulated in one process. ``ttrace check`` reads fragments
    without this. The fragments must agree on the mesh, recipe and loss normalization
    (:class:`~ttrace.errors.TraceError` otherwise); the Rust core merges and writes, as it
    reads."""
    _ttrace.merge_manifests(os.fspath(directory))
    return os.fspath(directory)
