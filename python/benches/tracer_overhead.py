"""The tracer's overhead: traced training steps against untraced ones, in the same run.

    python python/benches/tracer_overhead.py [--steps 10] [--out DIR]

Model: a CPU FP32 MLP of 8 blocks (LayerNorm → Linear(512, 2048) → GELU → Linear(2048, 512),
residual), 1,024 tokens (batch 8 × sequence 128). Each configuration runs ``--steps`` training
steps (forward, backward, zero_grad) after one warm-up step; the traced figure includes
waiting for the background writer at the end (``tracer.close()``), so the files are on disk.
Ratios are against the median untraced step measured in the same run, interleaved with the
traced ones. Configurations:

* full: every leaf module, every step, written (≈ 0.74 GB per step);
* full, record only: the same without writing (``write`` skipped) — the hooks and copies;
* selective: only the ``fc2`` linears, every step, written;
* every 10th step: full tracing of one step in ten, written.
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
    def __init__(self, d: int = 512) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


def build() -> "tuple[nn.Module, torch.Tensor]":
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(8)])
    x = torch.randn(8, 128, 512, generator=torch.Generator().manual_seed(1))
    return model, x


def step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).pow(2).mean().backward()
    model.zero_grad(set_to_none=True)


def untraced(model: nn.Module, x: torch.Tensor, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        step(model, x)
    return (time.perf_counter() - t0) / n


def traced(model: nn.Module, x: torch.Tensor, n: int, out: str, write: bool = True,
           **kw) -> "tuple[float, int]":
    shutil.rmtree(out, ignore_errors=True)
    tracer = ttrace.Tracer(model, out, **kw)
    if not write:
        tracer.write = lambda directory, combine=False: directory  # type: ignore[assignment]
    t0 = time.perf_counter()
    for _ in range(n):
        with tracer.step():
            step(model, x)
    written = tracer.close()
    elapsed = (time.perf_counter() - t0) / n
    shutil.rmtree(out, ignore_errors=True)
    return elapsed, written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=None, help="where traces go (default: a temporary dir)")
    args = ap.parse_args()
    model, x = build()
    base = args.out or tempfile.mkdtemp(prefix="ttrace-bench-")
    out = os.path.join(base, "t")
    step(model, x)  # warm-up
    configs = [
        ("full", dict()),
        ("full, record only", dict(write=False)),
        ("selective (fc2 only)", dict(modules=lambda n, m: n.endswith("fc2"))),
        ("every 10th step", dict(every=10)),
    ]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.steps} steps each")
    print(f"{'configuration':<24} {'untraced s/step':>16} {'traced s/step':>14} {'ratio':>7} "
          f"{'MB/traced step':>15}")
    for name, kw in configs:
        write = kw.pop("write", True)
        n = args.steps * (10 if "every" in kw else 1)
        base_t = statistics.median(untraced(model, x, max(1, n // 3)) for _ in range(3))
        t, written = traced(model, x, n, out, write=write, **kw)
        steps_written = n // kw.get("every", 1) if write else 0
        mb = written / max(steps_written, 1) / 1e6
        print(f"{name:<24} {base_t:>16.4f} {t:>14.4f} {t / base_t:>7.2f} {mb:>15.1f}")
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
