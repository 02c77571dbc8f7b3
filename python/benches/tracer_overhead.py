"""The tracer's overhead: traced training steps against untraced ones, in the same run.

    python python/benches/tracer_overhead.py [--steps 10] [--out DIR] [--device cpu|cuda|all]

Models: on the CPU an FP32 MLP of 8 blocks (LayerNorm → Linear(512, 2048) → GELU →
Linear(2048, 512), residual), 1,024 tokens (batch 8 × sequence 128); on a CUDA device (when
one is available; ``--device all`` runs both) the same MLP in BF16 with hidden size 2048 and
4,096 tokens (issue 35's case). First, single traced steps among untraced ones (every leaf
module written, the pinned pool warm, the writer idle): the traced step's time against its
floor, and the writer's rate after it against the disk's. Then each configuration runs
``--steps`` training steps (forward, backward, zero_grad) after one traced warm-up step, timed
apart (the pool's pinned buffers and the statistics kernels' compilation are paid once per
process): the loop (the writer draining in the background) and the total with the wait for
the writer at ``tracer.close()``, so the files are on disk. Ratios are against the median
untraced step measured in the same run, interleaved with the traced ones. Configurations:

* full: every leaf module, every step, written;
* full, record only: the same without writing (``write`` skipped) — the hooks and copies;
* selective: only the ``fc2`` linears, every step, written;
* every 10th step: full tracing of one step in ten, written;
* summaries every step: every leaf module's statistics (``summaries=True``), every step,
  written (issue 35's target: within 1.05× the untraced step).

Each row is printed beside its floor: the untraced step plus the bytes written per traced
step over the rate measured here for moving them — device to pinned host memory on CUDA
(issue 35's target: within 2× those bytes' time), and the disk's page-cache write rate
(what a written step cannot beat on average when every step is written); for summaries, plus
the bytes their statistics read per step over the rate that computation reaches alone.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.nn as nn

import ttrace


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


def build(device: str) -> "tuple[nn.Module, torch.Tensor]":
    torch.manual_seed(0)
    if device == "cuda":
        model = nn.Sequential(*[Block(2048) for _ in range(8)]).to("cuda", torch.bfloat16)
        x = torch.randn(4, 1024, 2048, device="cuda", dtype=torch.bfloat16)
    else:
        model = nn.Sequential(*[Block(512) for _ in range(8)])
        x = torch.randn(8, 128, 512, generator=torch.Generator().manual_seed(1))
    return model, x


def sync(x: torch.Tensor) -> None:
    if x.is_cuda:
        torch.cuda.synchronize(x.device)


def step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).float().pow(2).mean().backward()
    model.zero_grad(set_to_none=True)


def pinned_rate(device: str) -> float:
    """Bytes per second from the device into pinned host memory (256 MiB, best of 3)."""
    n = 256 << 20
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return n / best


def disk_rate(directory: str, blocks: int = 64) -> float:
    """Bytes per second written to ``directory`` through the page cache (``blocks`` of 8 MiB:
    512 MiB by default; about a traced step's bytes on CUDA), from distinct memory as the
    writer's copies are (one block written again and again would be read from the CPU's
    cache, a rate no writer of a step's bytes reaches)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "rate.bin")
    data = torch.randint(0, 256, (blocks << 23,), dtype=torch.uint8).numpy()
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for b in range(blocks):
            f.write(memoryview(data[b << 23:(b + 1) << 23]))
    elapsed = time.perf_counter() - t0
    os.remove(path)
    return data.nbytes / elapsed


def read_rate(device: str) -> float:
    """Bytes per second a device reads in one reduction (1 GiB of BF16, best of 3): the floor
    of any pass over the recorded bytes there."""
    x = torch.ones(1 << 29, dtype=torch.bfloat16, device=device)
    best = float("inf")
    for _ in range(3):
        sync(x)
        t0 = time.perf_counter()
        x.sum()
        sync(x)
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 2 / best


def summary_rate(device: str) -> float:
    """Bytes per second the statistics of summaries are computed at, alone (64 MiB of FP32
    in 8 MiB tensors, best of 3): the Rust pass on the CPU, the torch reductions on a device."""
    from ttrace._summaries import Summarizer

    s = Summarizer()
    xs = [torch.randn(2 << 20, device=device) for _ in range(8)]
    best = float("inf")
    for _ in range(3):
        sync(xs[0])
        t0 = time.perf_counter()
        pending = s.gather([s.summarize(x, "f32") for x in xs])
        pending.wait()
        best = min(best, time.perf_counter() - t0)
    return sum(x.numel() * 4 for x in xs) / best


def untraced(model: nn.Module, x: torch.Tensor, n: int) -> float:
    sync(x)
    t0 = time.perf_counter()
    for _ in range(n):
        step(model, x)
    sync(x)
    return (time.perf_counter() - t0) / n


def traced(model: nn.Module, x: torch.Tensor, n: int, out: str, write: bool = True,
           **kw) -> "dict[str, float]":
    """``n`` traced steps after a traced warm-up step: the loop's seconds per step (the writer
    draining in the background), the wait for it at ``close()``, the bytes written, the
    statistics' bytes, the host copies made outside the pinned pool (each one a synchronous
    copy), and the warm-up step's seconds (its files written)."""
    shutil.rmtree(out, ignore_errors=True)
    tracer = ttrace.Tracer(model, out, **kw)
    if not write:
        tracer.write = lambda directory, combine=False: directory  # type: ignore[assignment]
    # One traced warm-up step, timed apart: the pool's pinned buffers and the statistics
    # kernels' compilation are paid once per process.
    sync(x)
    w0 = time.perf_counter()
    with tracer.step():
        step(model, x)
    sync(x)
    tracer.flush()
    first = time.perf_counter() - w0
    before = tracer.bytes_written
    summarizer = getattr(tracer, "_summarizer", None)
    read_before = summarizer.bytes_read if summarizer is not None else 0
    sync(x)
    t0 = time.perf_counter()
    for _ in range(n):
        with tracer.step():
            step(model, x)
    sync(x)
    t1 = time.perf_counter()
    written = tracer.close() - before
    sync(x)
    t2 = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    copier = tracer._copier
    return {"loop": (t1 - t0) / n, "close": t2 - t1, "total": (t2 - t0) / n,
            "written": written, "first": first,
            "summarized": summarizer.bytes_read - read_before if summarizer is not None else 0,
            "copies": copier.copies, "unpooled": copier.unpooled}


def one_step(model: nn.Module, x: torch.Tensor, steps: int, out: str) -> "dict[str, float]":
    """Single traced steps among untraced ones, every leaf module written: the pool warm (a
    first traced step before), the writer idle when each starts. The traced step's seconds
    (the device's work done), and the writer's rate from the step's end until its files are
    written (median of ``steps``)."""
    shutil.rmtree(out, ignore_errors=True)
    tracer = ttrace.Tracer(model, out)
    with tracer.step():
        step(model, x)
    tracer.flush()
    times, rates, written = [], [], 0
    for _ in range(steps):
        for _ in range(3):
            step(model, x)
        sync(x)
        before = tracer.bytes_written
        t0 = time.perf_counter()
        with tracer.step():
            step(model, x)
        sync(x)
        t1 = time.perf_counter()
        written = tracer.flush() - before
        t2 = time.perf_counter()
        times.append(t1 - t0)
        rates.append(written / max(t2 - t1, 1e-9))
    tracer.close()
    shutil.rmtree(out, ignore_errors=True)
    return {"step": statistics.median(times), "rate": statistics.median(rates),
            "written": written, "unpooled": tracer._copier.unpooled,
            "copies": tracer._copier.copies}


def run(device: str, steps: int, out: str) -> None:
    model, x = build(device)
    step(model, x)  # warm-up
    sync(x)
    configs = [
        ("full", dict()),
        ("full, record only", dict(write=False)),
        ("selective (fc2 only)", dict(modules=lambda n, m: n.endswith("fc2"))),
        ("every 10th step", dict(every=10)),
        ("summaries every step", dict(summaries=True)),
    ]
    disk = disk_rate(out, 256 if device == "cuda" else 64)
    pinned = pinned_rate(device) if device == "cuda" else None
    # The floor of the statistics' pass: the device's read rate; on the CPU the Rust pass
    # alone.
    summaries = read_rate(device) if device == "cuda" else summary_rate(device)
    print(f"\n{device}: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{steps} steps each; disk {disk / 1e9:.2f} GB/s"
          + (f", device → pinned host {pinned / 1e9:.1f} GB/s" if pinned else "")
          + f"; {'device read' if pinned else 'summary statistics'} {summaries / 1e9:.2f} GB/s")
    base_t = statistics.median(untraced(model, x, max(1, steps)) for _ in range(3))
    one = one_step(model, x, steps, out)
    floor = base_t + (2.0 if pinned else 1.0) * one["written"] / (pinned or disk)
    print(f"one traced step among untraced ones (every leaf module, pool warm, writer idle): "
          f"{one['step']:.4f} s against {base_t:.4f} s untraced ({one['step'] / base_t:.2f}x), "
          f"floor {floor:.4f} s ({one['written'] / 1e6:.0f} MB"
          + (", 2x at the pinned rate" if pinned else " at the disk's rate")
          + f"); the writer then at {one['rate'] / 1e9:.2f} GB/s, "
          f"{one['rate'] / disk:.2f} of the disk's; unpooled copies {one['unpooled']}"
          f"/{one['copies']}")
    print("loop: the traced steps with the writer in the background; total: with the wait for "
          "the writer at close(); write GB/s: the bytes over the total time")
    print(f"{'configuration':<24} {'untraced s/step':>16} {'loop s/step':>12} {'ratio':>6} "
          f"{'total s/step':>13} {'ratio':>6} {'MB/traced step':>15} {'floor s/step':>13} "
          f"{'write GB/s':>11} {'unpooled':>9} {'first step s':>13}")
    for name, kw in configs:
        write = kw.pop("write", True)
        n = steps * (10 if "every" in kw else 1)
        base_t = statistics.median(untraced(model, x, max(1, n // 3)) for _ in range(3))
        r = traced(model, x, n, out, write=write, **kw)
        steps_written = n // kw.get("every", 1) if write else 0
        per_step = r["written"] / max(steps_written, 1)
        # The floor of a traced step: its bytes moved at the measured rate (twice that, for
        # issue 35's device target), averaged over the steps of the run.
        rate = pinned if pinned else disk
        share = steps_written / n
        floor = base_t + (2.0 if pinned else 1.0) * per_step * share / rate
        if r["summarized"]:
            # Summaries: their statistics' pass over the recorded bytes at the floor's rate
            # (the bytes written are a few hundred per tensor).
            floor += r["summarized"] / n / summaries
        wrate = r["written"] / (r["total"] * n) / 1e9 if r["written"] else 0.0
        print(f"{name:<24} {base_t:>16.4f} {r['loop']:>12.4f} {r['loop'] / base_t:>6.2f} "
              f"{r['total']:>13.4f} {r['total'] / base_t:>6.2f} {per_step / 1e6:>15.1f} "
              f"{floor:>13.4f} {wrate:>11.2f} {r['unpooled']:>4}/{r['copies']:<4} "
              f"{r['first']:>13.3f}", flush=True)
    if device == "cuda":
        from ttrace import _summaries

        print(f"summaries' statistics: {'fused Triton kernels' if _summaries._fused else 'torch reductions'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=None, help="where traces go (default: a temporary dir)")
    ap.add_argument("--device", choices=("cpu", "cuda", "all"), default=None,
                    help="default: cuda when available, else cpu")
    args = ap.parse_args()
    devices = {"cpu": ["cpu"], "cuda": ["cuda"], "all": ["cpu", "cuda"]}.get(
        args.device or "", ["cuda" if torch.cuda.is_available() else "cpu"])
    base = args.out or tempfile.mkdtemp(prefix="ttrace-bench-")
    for device in devices:
        run(device, args.steps, os.path.join(base, device))
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
