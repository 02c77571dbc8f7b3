#!/usr/bin/env python3
"""How far apart two correct FP32 reductions are: the round-off a norm test must allow.

The synthetic activations of `cargo run --release -p ttrace-lab --example power` (y = x·W,
x [100, 512] standard normal, W scaled by 1/√512, every product rounded to FP32 and summed in
FP32), the reference summed sequentially, against candidates that split the reduction in two
halves (a row-parallel linear on two ranks) or change the kernel's order, as a GEMM of another
shape may. Prints ‖cand − ref‖/‖ref‖ in ε = 2⁻²³, and the local model's order and kernel
terms u·(√(2s/3) + √(K/3)), s = 2 (`papers/checking.md` §6), before its χ² tail.

The model takes each rounding's relative error with variance u²/3, its largest over data (a
value at the bottom of its binade); a significand m has u²/(3m²), and the logarithmic
significands of Gaussian data average E[1/m²] = 3/(8 ln 2) = 0.54, hence a model about
1/√0.54 = 1.36 times the typical difference of two independent orders. (`papers/checking.md`
§7, power by data class.) Needs numpy.

    python3 scripts/reduction_orders.py
"""
import numpy as np


def seq(x):
    return np.cumsum(x, axis=-1, dtype=np.float32)[..., -1]


def pairwise(x):
    while x.shape[-1] > 1:
        x = (x[..., 0::2] + x[..., 1::2]).astype(np.float32)
    return x[..., 0]


def blocked(x, bs):
    parts = [seq(x[..., i:i + bs]) for i in range(0, x.shape[-1], bs)]
    return seq(np.stack(parts, axis=-1))


def main() -> None:
    rng = np.random.default_rng(1)
    rows = cols = 100
    k = 512
    a = rng.standard_normal((rows, k)).astype(np.float32)
    b = (rng.standard_normal((cols, k)) / np.sqrt(k)).astype(np.float32)
    p = (a[:, None, :] * b[None, :, :]).astype(np.float32)
    exact = p.astype(np.float64).sum(-1)
    ref = seq(p)
    h = k // 2
    f32 = np.float32
    lo, hi = p[..., :h], p[..., h:]
    cands = {
        "split, each half in the reference's order": (seq(lo) + seq(hi)).astype(f32),
        "split, each half reversed": (seq(lo[..., ::-1]) + seq(hi[..., ::-1])).astype(f32),
        "split, halves blocked by 16": (blocked(lo, 16) + blocked(hi, 16)).astype(f32),
        "split, halves pairwise": (pairwise(lo) + pairwise(hi)).astype(f32),
        "unsplit, reversed (another kernel)": seq(p[..., ::-1]),
    }
    eps = 2.0**-23
    u = eps / 2
    rn = np.linalg.norm(ref.astype(np.float64))
    d = np.linalg.norm(ref - exact) / rn / eps
    print(f"{'reference against the exact sums':<45} {d:5.2f} ε")
    for name, c in cands.items():
        d = np.linalg.norm(c.astype(np.float64) - ref) / rn / eps
        print(f"{name:<45} {d:5.2f} ε")
    model = u * (np.sqrt(4 / 3) + np.sqrt(k / 3)) / eps
    print(f"{'the local model (order + kernel terms)':<45} {model:5.2f} ε")


if __name__ == "__main__":
    main()
