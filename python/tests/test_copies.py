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


class _AddsInPlace(torch.nn.Module):
    """Linear layers, each output then written in place (a version torch counts) before the
    next layer reads it."""

    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
            x.add_(1.0)
        return x


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_copies_hold_the_values_before_later_writes_and_share_by_identity(tmp_path):
    # Each layer's output is copied as recorded, then written in place by the step's next
    # kernel: the copy must read it first, however far the transfers lag behind the kernels
    # (hundreds of MB queued). A tensor handed on unchanged is copied once, by identity,
    # as on the CPU by comparing contents.
    torch.manual_seed(0)
    net = _AddsInPlace(4096, 8).cuda()
    x = torch.randn(4096, 4096, device="cuda")
    with torch.no_grad():
        expected, h = [], x
        for layer in net.layers:
            h = layer(h)
            expected.append(h.clone())
            h.add_(1.0)
        tracer = ttrace.Tracer(net, tmp_path)
        with tracer.step():
            net(x)
    tracer.close()
    values = ttrace.load_all(tmp_path / "step0")
    for i, e in enumerate(expected):
        assert np.array_equal(values[f"layers.{i}|fwd.output.0"], e.cpu().double().numpy()), i
        if i + 1 < len(expected):
            after = (e + 1.0).cpu().double().numpy()
            assert np.array_equal(values[f"layers.{i + 1}|fwd.input.0"], after), i
    torch.manual_seed(0)
    mlp = Mlp(16, 32)
    copies = []
    for device in ("cpu", "cuda"):
        t = ttrace.Tracer(mlp.to(device), tmp_path / device)
        with t.step():
            mlp(torch.randn(8, 16, device=device)).square().mean().backward()
        t.close()
        copies.append(t._copier.copies)
    assert copies[0] == copies[1]


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


def _identity_sharing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Share records by identity on the CPU too, as on a device (the path a GPU takes)."""
    from ttrace.tracer import keep

    monkeypatch.setattr(keep, "_shares_by_identity", lambda local: True)


def test_identity_sharing_stores_what_comparing_contents_stores(tmp_path, monkeypatch):
    # A device shares a tensor handed on by identity (no comparison that would wait for the
    # device) and the writer verifies the checksums: the trace equals the one whose sharing
    # was decided by comparing contents, and the copies made are as few.
    steps = 2
    compared = _trace(tmp_path / "compared", 1 << 30, steps)
    _identity_sharing(monkeypatch)
    shared = _trace(tmp_path / "shared", 1 << 30, steps)
    assert shared._copier.copies == compared._copier.copies
    for n in range(steps):
        a, b = tmp_path / "compared" / f"step{n}", tmp_path / "shared" / f"step{n}"
        assert (a / "manifest.rank0.json").read_bytes() == (b / "manifest.rank0.json").read_bytes()
        ta, tb = ttrace.load_all(a), ttrace.load_all(b)
        assert ta.keys() == tb.keys()
        for k in ta:
            assert np.array_equal(ta[k], tb[k]), k
    # Without sharing every record is copied; the writer still stores equal contents once.
    torch.manual_seed(0)
    net = Mlp(16, 32)
    tracer = ttrace.Tracer(net, tmp_path / "unshared", share=False)
    with tracer.step():
        net(torch.randn(8, 16)).square().mean().backward()
    tracer.close()
    assert tracer._copier.copies > compared._copier.copies // steps
    one = ttrace.load_all(tmp_path / "unshared" / "step0")
    assert one.keys() == ttrace.load_all(tmp_path / "compared" / "step0").keys()


class _WritesThroughData(torch.nn.Module):
    """fc1, then an in-place write through ``.data`` (which torch's version counter does not
    see) before fc2 reads the same memory."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h.data.mul_(2.0)
        return self.fc2(h)


def test_a_write_torch_did_not_count_is_an_error_never_a_wrong_trace(tmp_path, monkeypatch):
    # fc2's input has fc1's output's memory and version, but not its contents: sharing by
    # identity would store fc1's values under fc2's input. The writer's checksum sees it: the
    # step is not written (no manifest naming it) and close() raises, saying what to do.
    _identity_sharing(monkeypatch)
    torch.manual_seed(0)
    net = _WritesThroughData()
    x = torch.randn(3, 4)
    tracer = ttrace.Tracer(net, tmp_path / "shared")
    with tracer.step():
        net(x).sum().backward()
    with pytest.raises(ttrace.TtraceError) as e:
        tracer.close()
    assert e.value.kind == "Storage"
    assert "fc2|fwd.input.0" in str(e.value) and "share=False" in str(e.value)
    assert not (tmp_path / "shared" / "step0" / "manifest.rank0.json").exists()
    # share=False records what each module saw.
    tracer = ttrace.Tracer(net, tmp_path / "copied", share=False)
    with tracer.step():
        net(x).sum().backward()
    tracer.close()
    values = ttrace.load_all(tmp_path / "copied" / "step0")
    with torch.no_grad():
        h = net.fc1(x)
    assert np.array_equal(values["fc1|fwd.output.0"], h.double().numpy())
    assert np.array_equal(values["fc2|fwd.input.0"], (2.0 * h).double().numpy())


class _ReturnsItsInput(torch.nn.Module):
    """Adds one to its input in place through ``.data`` and returns it (a collective reducing
    in place does the same)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.data.add_(1.0)
        return x


def test_within_one_module_call_the_tensor_is_copied_again(tmp_path, monkeypatch):
    # The module's input and output are the same memory at the same version, but the module
    # wrote to it: within one call the record is copied again, never shared by identity.
    _identity_sharing(monkeypatch)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), _ReturnsItsInput())
    x = torch.randn(2, 4)
    with torch.no_grad():
        h = net[0](x)
    tracer = ttrace.Tracer(net, tmp_path)
    with torch.no_grad(), tracer.step():
        y = net(x)
    tracer.close()
    values = ttrace.load_all(tmp_path / "step0")
    assert not torch.equal(h, y)
    assert np.array_equal(values["0|fwd.output.0"], h.double().numpy())
    assert np.array_equal(values["1|fwd.input.0"], h.double().numpy())
    assert np.array_equal(values["1|fwd.output.0"], y.double().numpy())
