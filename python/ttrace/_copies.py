"""Host copies of recorded tensors that never make the device wait for the host.

A traced tensor is copied to host memory for the writer. On a CUDA device the copy is queued on
the tensor's own stream, into a *pinned* buffer taken from a bounded pool and reused step after
step, and followed by an event; the host goes on at once, and only the writer thread waits for
the event before it reads the bytes. Being on the same stream, the copy reads the tensor before
any later kernel of the step can write to it (an in-place activation, autograd accumulating a
gradient into it): the device spends the transfer's time in the step (the bytes over the
device-to-pinned-host bandwidth), the host never waits. (A copy on a side stream would overlap
the transfer with the step's kernels but race with such writes: its reads are not ordered
before them.) A CPU tensor is copied into a reused buffer of the same pool kind (not pinned).

Policy (``Tracer(..., pool_bytes=...)``): the pool holds at most ``pool_bytes`` of buffers per
device kind (default 8 GiB; a step whose copies do not fit is partly copied outside it, see
below). A copy that does not fit waits for the buffers of steps already handed to the writer;
when none are in flight (the current step alone fills the pool) it is made into a fresh,
unpooled host tensor instead — synchronously on CUDA — so a step is never stalled by its own
records and never deadlocks. Pinned memory is slow to allocate (about 1.6 GB/s measured on an
H100 host): the first traced step pays it, later steps reuse the buffers.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Tuple

import torch

__all__ = ["Checks", "Copier", "HostCopy", "HostPool", "bits", "checksum", "to_host"]

#: Default bytes of reusable host buffers per device kind.
DEFAULT_POOL_BYTES = 8 << 30


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns as integers (bitwise comparison: -0.0 differs from 0.0, a NaN
    equals itself)."""
    return t.contiguous().view(_INT_OF_SIZE[t.element_size()])


def checksum(t: torch.Tensor) -> torch.Tensor:
    """The sum of ``t``'s bit patterns as signed integers of its element size, in int64
    (wrapping): a 0-dimensional tensor where ``t`` lives, computed without synchronizing.
    Order-free and exact, so a host copy of the same bytes sums to the same value on any
    device; any change of one element changes it."""
    return bits(t.detach()).sum(dtype=torch.int64)


def to_host(flat: torch.Tensor) -> Tuple[torch.Tensor, Any]:
    """A small result on its way to the host: on CUDA an asynchronous copy into pinned memory,
    ordered after the work on the current stream, and the event that ends it (the writer
    thread waits on it); elsewhere a plain copy and ``None``."""
    if flat.device.type != "cuda":
        return flat.to("cpu"), None
    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(flat.device))
    return host, event


class HostPool:
    """Host buffers (``uint8`` tensors) of at most ``capacity`` bytes in all, reused by exact
    size (a training step records the same shapes every step). ``pin``: page-locked memory,
    which a CUDA device copies into without staging."""

    def __init__(self, capacity: int, pin: bool) -> None:
        if capacity < 0:
            raise ValueError("capacity must be non-negative")
        self.capacity = capacity
        self.pin = pin
        self._free: Dict[int, List[torch.Tensor]] = {}
        #: Bytes of every buffer the pool owns (free, in use or handed to the writer).
        self.allocated = 0
        #: Buffers handed to the writer and not yet released (what a full pool may wait for).
        self.handed = 0
        #: Buffers allocated so far (each reuse saves one).
        self.allocations = 0
        self._cond = threading.Condition()

    def _evict(self, nbytes: int) -> None:
        """Drop free buffers until ``nbytes`` more fit (smallest first), if they can."""
        for size in sorted(self._free):
            while self._free[size] and self.allocated + nbytes > self.capacity:
                self._free[size].pop()
                self.allocated -= size

    def acquire(self, nbytes: int) -> Optional[torch.Tensor]:
        """A buffer of exactly ``nbytes``, or ``None`` when the pool cannot hold it without
        waiting for buffers that nobody will release (none handed to the writer)."""
        if nbytes > self.capacity:
            return None
        with self._cond:
            while True:
                bucket = self._free.get(nbytes)
                if bucket:
                    return bucket.pop()
                if self.allocated + nbytes > self.capacity:
                    self._evict(nbytes)
                if self.allocated + nbytes <= self.capacity:
                    self.allocated += nbytes
                    self.allocations += 1
                    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
                if self.handed == 0:
                    return None
                self._cond.wait()

    def clear(self) -> None:
        """Drop the free buffers (their memory goes back to the allocator); buffers still in
        use stay counted in :attr:`allocated`."""
        with self._cond:
            for size, bucket in self._free.items():
                self.allocated -= size * len(bucket)
            self._free.clear()

    def hand(self, count: int) -> None:
        """``count`` buffers were handed to the writer: a full pool may wait for them."""
        with self._cond:
            self.handed += count

    def release(self, buffer: torch.Tensor, handed: bool) -> None:
        """Give ``buffer`` back (``handed``: it was counted by :meth:`hand`)."""
        with self._cond:
            self._free.setdefault(buffer.numel(), []).append(buffer)
            if handed:
                self.handed -= 1
            self._cond.notify_all()


class HostCopy:
    """A recorded tensor's host copy: ``tensor`` (contiguous, on the host), whose bytes are
    final once :meth:`wait` returns; its buffer goes back to its pool on :meth:`release`."""

    __slots__ = ("tensor", "origin", "checks", "_buffer", "_event", "_pool", "_handed")

    def __init__(self, tensor: torch.Tensor, buffer: Optional[torch.Tensor] = None,
                 event: Any = None, pool: Optional[HostPool] = None) -> None:
        self.tensor = tensor
        #: The checksum of the memory copied (:func:`checksum`, taken where it lives when the
        #: copy was queued), for copies later records may share by identity.
        self.origin: Optional[torch.Tensor] = None
        #: Later records that share this copy by identity, each with the checksum of the
        #: memory they saw (still on its device): the writer compares them with ``origin``.
        self.checks: List[Tuple[str, torch.Tensor]] = []
        self._buffer = buffer
        self._event = event
        self._pool = pool
        self._handed = False

    @property
    def shape(self) -> torch.Size:
        return self.tensor.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def pooled(self) -> bool:
        return self._buffer is not None

    def wait(self) -> torch.Tensor:
        """Block until the copy is complete (a no-op for synchronous copies); the tensor."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self.tensor

    def hand(self) -> None:
        """Mark the copy as handed to the writer (see :meth:`HostPool.hand`)."""
        if self._pool is not None and self._buffer is not None and not self._handed:
            self._handed = True
            self._pool.hand(1)

    def release(self) -> None:
        """Return the buffer to its pool (once; the tensor must not be used afterwards)."""
        if self._pool is not None and self._buffer is not None:
            self.wait()
            buffer, self._buffer = self._buffer, None
            self._pool.release(buffer, self._handed)


class Copier:
    """Makes the host copies: pooled, and asynchronous on CUDA devices."""

    def __init__(self, pool_bytes: int = DEFAULT_POOL_BYTES) -> None:
        self.pool_bytes = pool_bytes
        self._pools: Dict[str, HostPool] = {}
        #: Copies made, and those made outside the pool (it was full with the current
        #: step's records).
        self.copies = 0
        self.unpooled = 0

    def pool(self, kind: str) -> HostPool:
        """The pool for tensors on devices of ``kind`` (``"cuda"``: pinned)."""
        p = self._pools.get(kind)
        if p is None:
            p = self._pools[kind] = HostPool(self.pool_bytes, pin=kind == "cuda")
        return p

    def clear(self) -> None:
        """Drop every pool's free buffers (a closed tracer keeps no host memory)."""
        for p in self._pools.values():
            p.clear()

    def copy(self, t: torch.Tensor, scale: Optional[float] = None) -> HostCopy:
        """A host copy of ``t`` (times ``scale``, applied where ``t`` lives)."""
        self.copies += 1
        src = t.detach()
        if scale is not None:
            src = src * scale
        nbytes = src.numel() * src.element_size()
        cuda = src.device.type == "cuda"
        pool = self.pool("cuda" if cuda else "cpu")
        buffer = pool.acquire(nbytes) if nbytes > 0 else None
        if buffer is None:
            self.unpooled += nbytes > 0
            return HostCopy(src.to("cpu", copy=True).contiguous())
        host = buffer.view(src.dtype).view(src.shape) if nbytes > 0 else buffer
        if not cuda:
            host.copy_(src)
            return HostCopy(host, buffer, None, pool)
        # On the tensor's stream: after the work that produced it, before any that follows
        # (which may write to it); the event marks the copy's end for the writer.
        host.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(src.device))
        return HostCopy(host, buffer, event, pool)


class Checks:
    """The checksums of the copies that later records share by identity and of the memory
    those records saw (:attr:`HostCopy.origin`, :attr:`HostCopy.checks`), on their way to the
    host in one asynchronous transfer per device; :meth:`mismatches` (on the writer thread)
    compares them."""

    def __init__(self, copies: List[HostCopy]) -> None:
        #: (sharing id, part, position of the copy's checksum, position of the id's).
        self._items: List[Tuple[str, int, int, int]] = []
        self._parts: List[Tuple[torch.Tensor, Any]] = []
        parts: Dict[Any, int] = {}
        values: List[List[torch.Tensor]] = []
        for c in copies:
            if not c.checks or c.origin is None:
                continue
            part = parts.setdefault(c.origin.device, len(parts))
            if part == len(values):
                values.append([])
            at = len(values[part])
            values[part].append(c.origin)
            for tid, value in c.checks:
                self._items.append((tid, part, at, len(values[part])))
                values[part].append(value)
        for part in parts.values():
            self._parts.append(to_host(torch.stack(values[part])))

    def __len__(self) -> int:
        return len(self._items)

    def mismatches(self) -> List[str]:
        """The ids whose memory differed from the copy they share (waits for the transfers:
        call it on the writer thread)."""
        sums: List[List[int]] = []
        for host, event in self._parts:
            if event is not None:
                event.synchronize()
            sums.append(host.tolist())
        return [tid for tid, part, origin, at in self._items
                if sums[part][origin] != sums[part][at]]
