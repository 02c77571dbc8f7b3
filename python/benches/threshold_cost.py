"""What a linear layer's threshold costs beside the layer itself, from Python (issue 34).

    python python/benches/threshold_cost.py [--shapes 64x64x64,...] [--runs 5]

``ttrace.linear_threshold`` (BF16 x and weight, FP32 accumulation, sequential against
split-K 8 with FP32 partials), guaranteed and probabilistic (δ = 10⁻⁶), against the same
product in NumPy (``x @ weight.T`` in float32), one thread each, in the same process: each
threshold is timed right after a product, and the row reports the medians and the median of
the pairs' ratios. Issue 34's target: within 5× one BLAS GEMM of the same shape and threads
(median over the shapes, 10× at worst).

The thread counts are fixed before NumPy and ttrace load (this is a script, not a library).
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Callable, List, Tuple  # noqa: E402

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

import ttrace  # noqa: E402

REFERENCE = "in=bf16,acc=f32,out=f32"
CANDIDATE = REFERENCE + ",order=splitk:8:f32:tree"
DEFAULT_SHAPES = "64x64x64,16x1024x16,64x1024x64,128x128x128,256x256x256,512x512x512,1024x1024x1024"


def pairs(runs: int, op: Callable[[], object], th: Callable[[], object]) -> Tuple[float, float, float]:
    """Median op time, median threshold time and median ratio of `runs` interleaved pairs."""
    op()
    th()
    ops: List[float] = []
    ths: List[float] = []
    for _ in range(runs):
        s = time.perf_counter()
        op()
        o = time.perf_counter() - s
        s = time.perf_counter()
        th()
        t = time.perf_counter() - s
        ops.append(o)
        ths.append(t)
    ratios = [t / o for o, t in zip(ops, ths)]
    return statistics.median(ops), statistics.median(ths), statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="m×k×n, comma-separated")
    parser.add_argument("--runs", type=int, default=5, help="timed pairs per row")
    args = parser.parse_args()
    rng = np.random.default_rng(34)
    print(f"{'m×k×n':<16} {'GEMM s':>10} {'guar. s':>10} {'ratio':>7} {'prob. s':>10} {'ratio':>7}")
    ratios: dict[str, List[float]] = {"guaranteed": [], "probabilistic": []}
    for spec in args.shapes.split(","):
        m, k, n = (int(v) for v in spec.split("x"))
        x = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
        w = rng.standard_normal((n, k)).astype(ml_dtypes.bfloat16)
        x32, w32 = x.astype(np.float32), w.astype(np.float32)
        runs = 1 if m * k * n >= 1 << 30 else args.runs
        row = [spec]
        for name, guaranteed in (("guaranteed", True), ("probabilistic", False)):
            op_s, th_s, ratio = pairs(
                runs,
                lambda: x32 @ w32.T,
                lambda g=guaranteed: ttrace.linear_threshold(  # type: ignore[misc]
                    x, w, reference=REFERENCE, candidate=CANDIDATE, guaranteed=g
                ),
            )
            ratios[name].append(ratio)
            if name == "guaranteed":
                row.append(f"{op_s:>10.3e}")
            row += [f"{th_s:>10.3e}", f"{ratio:>7.1f}"]
        print(f"{row[0]:<16} " + " ".join(row[1:]))
    for name, rs in ratios.items():
        print(f"{name}: median {statistics.median(rs):.1f}×, worst {max(rs):.1f}× (target 5×, 10×)")


if __name__ == "__main__":
    main()
