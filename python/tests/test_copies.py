"""Host copies of recorded tensors: the bounded pool of reused buffers (its waits and its
refusals), and traces recorded through it identical to traces recorded without reuse."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from models import Mlp
import ttrace
from ttrace._copies import Copier, HostCopy, HostPool


def test_buffers_are_reused_by_size_and_the_pool_stays_within_its_capacity():
    pool = HostPool(100, pin=False)
    a = pool.acquire(40)
    assert a is not None and a.numel() == 40 and pool.allocated == 40
    pool.release(a, handed=False)
    again = pool.acquire(40)
    assert again is not None and again.data_ptr() == a.data_ptr()
    # A size that does not fit beside what is in use, with nothing handed to the writer:
    # refused at once rather than waiting for a release that cannot come.
    held = pool.acquire(50)
    assert held is not None and pool.allocated == 90
    assert pool.acquire(20) is None
    assert pool.acquire(101) is None
    # Free buffers of other sizes make room.
    pool.release(again, handed=False)
    other = pool.acquire(30)
    assert other is not None and pool.allocated == 80


def test_a_full_pool_waits_for_the_writer_then_reuses_its_buffer():
    pool = HostPool(64, pin=False)
    first = HostCopy(torch.zeros(0), pool.acquire(64), None, pool)
    buffer_ptr = first._buffer.data_ptr() if first._buffer is not None else None
    first.hand()
    got = []
    entering = threading.Event()

    def record() -> None:
        entering.set()
        got.append(pool.acquire(64))

    t = threading.Thread(target=record)
    t.start()
    assert entering.wait(timeout=10)
    time.sleep(0.2)
    # The pool is full and its one buffer is with the writer: the record waits (it neither
    # refuses nor allocates beyond the capacity) until the writer gives the buffer back.
    assert t.is_alive() and not got
    first.release()
    t.join(timeout=10)
    assert not t.is_alive()
    assert got[0] is not None and got[0].data_ptr() == buffer_ptr
    assert pool.allocated == 64 and pool.handed == 0 and pool.allocations == 1


def test_copies_hold_the_values_and_scale_where_the_tensor_lives():
    copier = Copier(1 << 20)
    x = torch.randn(3, 5, dtype=torch.bfloat16).t()  # not contiguous
    c = copier.copy(x)
    assert c.pooled and c.tensor.is_contiguous()
    assert torch.equal(c.wait(), x)
    half = copier.copy(x, 0.5)
    assert torch.equal(half.wait(), x * 0.5)
    c.release()
    assert copier.copy(x).tensor.data_ptr() == c.tensor.data_ptr()
    # Beyond the pool: a plain copy, counted.
    small = Copier(8)
    big = small.copy(torch.ones(16))
    assert not big.pooled and small.unpooled == 1 and torch.equal(big.wait(), torch.ones(16))


def _trace(directory: Path, pool_bytes: int, steps: int, background: bool = True
           ) -> ttrace.Tracer:
    torch.manual_seed(0)
    net = Mlp(16, 32)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    tracer = ttrace.Tracer(net, directory, pool_bytes=pool_bytes, background=background)
    for _ in range(steps):
        with tracer.step():
            net(torch.randn(8, 16)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    tracer.close()
    return tracer


@pytest.mark.parametrize("pool_bytes,background",
                         [(0, True), (3000, True), (1 << 30, True), (1 << 30, False)])
def test_traces_through_the_pool_equal_traces_without_it(tmp_path, pool_bytes, background):
    # Three steps, buffers reused from step to step (or the pool too small for a step, so
    # that records wait for the background writer, or no pool at all): every stored tensor
    # equal to the unpooled trace's, every manifest identical.
    steps = 3
    plain = _trace(tmp_path / "plain", 0, steps)
    assert plain.bytes_written > 0
    pooled = _trace(tmp_path / "pooled", pool_bytes, steps, background)
    for n in range(steps):
        a, b = tmp_path / "plain" / f"step{n}", tmp_path / "pooled" / f"step{n}"
        assert (a / "manifest.rank0.json").read_bytes() == (b / "manifest.rank0.json").read_bytes()
        ta, tb = ttrace.load_all(a), ttrace.load_all(b)
        assert ta.keys() == tb.keys() and len(ta) >= 10
        for k in ta:
            assert np.array_equal(ta[k], tb[k]), k
    # Closed: every buffer came back and was freed (none leaked), none is waited for.
    pool = pooled._copier.pool("cpu")
    assert pool.handed == 0 and pool.allocated == 0
    if pool_bytes == 1 << 30:
        assert pooled._copier.unpooled == 0
    if pool_bytes == 1 << 30 and not background:
        # Written before the next step records: each step reuses the first one's buffers.
        assert pool.allocations * steps == pooled._copier.copies
    if pool_bytes == 0:
        assert pooled._copier.unpooled >= 10


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_recording_on_a_cuda_device_never_synchronizes(tmp_path):
    # PyTorch's sync debug mode raises on any operation that makes the host wait for the
    # device: recording a step (hooks, copies into pinned buffers) must not; the writer waits
    # on the copies' events, outside the mode. The trace holds the values the device computed.
    torch.manual_seed(0)
    net = Mlp(16, 32).cuda()
    x = torch.randn(8, 16, device="cuda")
    tracer = ttrace.Tracer(net)  # records from now until write()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = net(x)
        out.square().mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tracer.write(tmp_path)
    tracer.close()
    values = ttrace.load_all(tmp_path)
    assert np.array_equal(values["fc2|fwd.output.0"], out.detach().cpu().double().numpy())
    assert tracer._copier.pool("cuda").allocations > 0


def test_a_process_that_exits_without_close_leaves_complete_steps(tmp_path):
    # Steps handed to the background writer are flushed at exit (atexit): every step
    # directory has its tensors and its manifest, and each reads back whole.
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import torch, torch.nn as nn, ttrace
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        tracer = ttrace.Tracer(net, {str(tmp_path)!r}, pool_bytes=1 << 16)
        for _ in range(3):
            with tracer.step():
                net(torch.randn(128, 64)).sum().backward()
        # no tracer.close()
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    for n in range(3):
        step = tmp_path / f"step{n}"
        assert (step / "manifest.rank0.json").exists() and (step / "rank0.safetensors").exists()
        values = ttrace.load_all(step)
        assert len(values) >= 8 and all(np.isfinite(v).all() for v in values.values())
