"""A check shared among the ranks of a ``torch.distributed`` process group
(:func:`ttrace.check` with ``group=``; ``torchrun ... -m ttrace check --distributed``).

Every rank reads, merges and compares only the tensors assigned to it (largest first, each to
the rank with the fewest bytes so far: balanced by bytes, whatever the traced run's layout),
then the shares — a few hundred bytes per tensor — are all-gathered over gloo and every rank
combines them into the report a single-machine check writes, bit for bit. A rank that cannot
read its tensors sends its error instead: every rank raises the same typed error. A rank that
dies or does not answer within the timeout makes the others raise
:class:`~ttrace.errors.DistributedCheckError`; nothing is reported as a pass.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable, List, Optional, Tuple

from . import _ttrace, errors

#: Seconds a checker rank waits for the others (their reading included) before giving up.
DEFAULT_TIMEOUT = 1800.0


def _raise_as(cls_name: str, message: str, kind: str) -> None:
    cls = getattr(errors, cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.TtraceError)):
        cls = errors.TraceError
    raise cls(message, kind)


#: What one rank says in a collective: ("ok", payload) or ("error", class, kind, message).
Said = Tuple[Any, ...]


def attempt(f: Callable[[], Any]) -> Said:
    """``f()`` as this rank says it to the others: its result, or the error it raised (a
    ttrace error with its class and kind; a file or value error as a ``TraceError``)."""
    try:
        return ("ok", f())
    except errors.TtraceError as e:
        return ("error", type(e).__name__, e.kind, str(e))
    except (OSError, ValueError) as e:
        return ("error", "TraceError", "File", str(e))


def gather_said(channel: Any, said: Said, who: str) -> List[Any]:
    """Every rank's payload, all-gathered over ``channel``; an error any rank said is raised
    on every rank as its own class and kind (``{who} r: …``), and a rank that does not answer
    makes the others raise :class:`~ttrace.errors.DistributedCheckError`."""
    import torch.distributed as dist

    rank, n = dist.get_rank(channel), dist.get_world_size(channel)
    everything: List[Any] = [None] * n
    try:
        dist.all_gather_object(everything, said, group=channel)
    except Exception as e:  # the backend's own error types vary by version
        raise errors.DistributedCheckError(
            f"{who} {rank} of {n}: the other ranks did not all answer (one died, or did not "
            f"finish in time): {e}", "CheckerRank") from None
    for r, got in enumerate(everything):
        if not (isinstance(got, tuple) and got and got[0] in ("ok", "error")):
            raise errors.DistributedCheckError(f"{who} {r} sent nothing readable",
                                               "CheckerRank")
        if got[0] == "error":
            _raise_as(str(got[1]), f"{who} {r}: {got[3]}", str(got[2]))
    return [g[1] for g in everything]


def shared_check(reference: str, candidate: str, pricing: str, group: Any,
                 timeout: Optional[float]) -> Tuple[str, str]:
    """(report as JSON, report as text) of checking ``candidate`` against ``reference`` with
    the ranks of ``group`` (a ``torch.distributed`` process group, or
    ``torch.distributed.group.WORLD``) sharing the reading. Every rank of the group must call
    it with the same traces."""
    try:
        import torch.distributed as dist
    except ImportError as e:  # pragma: no cover - torch is a test dependency
        raise errors.InvalidInputError(
            f"a distributed check needs torch.distributed: {e}", "InvalidParameter") from None
    if not (dist.is_available() and dist.is_initialized()):
        raise errors.InvalidInputError(
            "group= needs an initialized torch.distributed process group "
            "(torch.distributed.init_process_group, or torchrun)", "InvalidParameter")
    if timeout is not None and not timeout > 0:
        raise errors.InvalidInputError(f"timeout must be positive seconds, not {timeout!r}",
                                       "InvalidParameter")
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise errors.InvalidInputError(
            "this process is not a member of the group given to check", "InvalidParameter")
    # Shares travel as Python objects over gloo (NCCL's object collectives need a current CUDA
    # device and move the bytes through it): a gloo group of the same ranks when the group is
    # not one already, created by the group's ranks alone.
    channel = group
    made = None
    if dist.get_backend(group) != "gloo" or timeout is not None:
        members = dist.get_process_group_ranks(group)
        made = dist.new_group(
            ranks=members, backend="gloo",
            timeout=datetime.timedelta(seconds=timeout or DEFAULT_TIMEOUT),
            use_local_synchronization=True)
        channel = made
    try:
        everything = gather_said(
            channel, attempt(lambda: bytes(_ttrace.check_share(reference, candidate, rank, ranks))),
            "checker rank")
        return _ttrace.combine_shares(reference, candidate, pricing, everything)
    finally:
        if made is not None:
            try:
                dist.destroy_process_group(made)
            except Exception:  # pragma: no cover - best effort on a broken group
                pass

