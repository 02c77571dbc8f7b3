"""The tracer's overhead: traced training steps against untraced ones, in the same run.

    python python/benches/tracer_overhead.py [--steps 10] [--out DIR] [--device cpu|cuda|all]

Models: on the CPU an FP32 MLP of 8 blocks (LayerNorm → Linear(512, 2048) → GELU →
Linear(2048, 512), residual), 1,024 tokens (batch 8 × sequence 128); on a CUDA device (when
one is available; ``--device all`` runs both) the same MLP in BF16 with hidden size 2048 and
4,096 tokens (issue 35's case). Each configuration runs ``--steps`` training steps (forward,
backward, zero_grad) after one warm-up step; the traced figure includes waiting for the
background writer at the end (``tracer.close()``), so the files are on disk. Ratios are
against the median untraced step measured in the same run, interleaved with the traced ones.
Configurations:

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


def disk_rate(directory: str) -> float:
    """Bytes per second written to ``directory`` through the page cache (512 MiB)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "rate.bin")
    block = os.urandom(8 << 20)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(64):
            f.write(block)
    elapsed = time.perf_counter() - t0
    os.remove(path)
    return 64 * len(block) / elapsed


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
           **kw) -> "tuple[float, int, int]":
    shutil.rmtree(out, ignore_errors=True)
    tracer = ttrace.Tracer(model, out, **kw)
    if not write:
        tracer.write = lambda directory, combine=False: directory  # type: ignore[assignment]
    sync(x)
    t0 = time.perf_counter()
    for _ in range(n):
        with tracer.step():
            step(model, x)
    written = tracer.close()
    sync(x)
    elapsed = (time.perf_counter() - t0) / n
    shutil.rmtree(out, ignore_errors=True)
    summarizer = getattr(tracer, "_summarizer", None)
    return elapsed, written, summarizer.bytes_read if summarizer is not None else 0


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
    disk = disk_rate(out)
    pinned = pinned_rate(device) if device == "cuda" else None
    summaries = summary_rate(device)
    print(f"\n{device}: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{steps} steps each; disk {disk / 1e9:.2f} GB/s"
          + (f", device → pinned host {pinned / 1e9:.1f} GB/s" if pinned else "")
          + f"; summary statistics {summaries / 1e9:.2f} GB/s")
    print(f"{'configuration':<24} {'untraced s/step':>16} {'traced s/step':>14} {'ratio':>7} "
          f"{'MB/traced step':>15} {'floor s/step':>13}")
    for name, kw in configs:
        write = kw.pop("write", True)
        n = steps * (10 if "every" in kw else 1)
        base_t = statistics.median(untraced(model, x, max(1, n // 3)) for _ in range(3))
        t, written, summarized = traced(model, x, n, out, write=write, **kw)
        steps_written = n // kw.get("every", 1) if write else 0
        per_step = written / max(steps_written, 1)
        # The floor of a traced step: its bytes moved at the measured rate (twice that, for
        # issue 35's device target), averaged over the steps of the run.
        rate = pinned if pinned else disk
        share = steps_written / n
        floor = base_t + (2.0 if pinned else 1.0) * per_step * share / rate
        if summarized:
            # Summaries: their statistics' pass over the recorded bytes at the rate measured
            # alone (the bytes written are a few hundred per tensor).
            floor += summarized / n / summaries
        print(f"{name:<24} {base_t:>16.4f} {t:>14.4f} {t / base_t:>7.2f} "
              f"{per_step / 1e6:>15.1f} {floor:>13.4f}")


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
