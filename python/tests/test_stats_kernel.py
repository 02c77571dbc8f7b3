"""The fused statistics kernels of summaries on CUDA (``ttrace._stats_kernel``), run here by
Triton's interpreter on the CPU, against the Rust core's one pass over the same values: equal
counts and extremes (ties and non-finite values included), sums within float64 round-off,
through one, two and three levels of the extremes' reduction."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import math
    import torch
    from ttrace import _stats_kernel
    from ttrace._summaries import Summarizer
    from ttrace.tracer.record import _DTYPES

    def values(n, dtype, pattern, g):
        x = (torch.randn(n, generator=g) * 3)
        if pattern == "ties":
            x = torch.randint(-2, 3, (n,), generator=g).double()
        if pattern == "special" and n > 2:
            x[:: max(n // 7, 1)] = float("nan")
            x[1:: max(n // 5, 2)] = float("inf")
            x[2:: max(n // 3, 3)] = float("-inf")
        if pattern == "none finite":
            x = torch.full((n,), float("nan"))
            x[::2] = float("-inf")
        return x.to(dtype)

    g = torch.Generator().manual_seed(11)
    checked = 0
    # Small blocks (the interpreter is slow) reach several levels of the extremes' reduction
    # with few elements; the real block size once.
    cases = [(64, dtype, n, pattern, k)
             for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64)
             for n in (1, 65, 700)
             for pattern in ("random", "ties", "special", "none finite")
             for k in (1, 8) if k <= n]
    cases += [(64, dtype, 700, "special", 16) for dtype in (torch.float32, torch.bfloat16)]
    cases += [(64, torch.float32, 5000, "special", 5), (64, torch.bfloat16, 5000, "ties", 8),
              (4096, torch.float32, 9000, "special", 5), (4096, torch.float16, 9000, "ties", 8)]
    for block, dtype, n, pattern, k in cases:
        _stats_kernel.BLOCK = block
        x = values(n, dtype, pattern, g)
        rust = Summarizer(k).summarize(x, _DTYPES[dtype]).values.tolist()
        got = _stats_kernel.stats(x, k).tolist()
        where = (block, dtype, n, pattern, k)
        assert len(got) == len(rust), where
        assert got[:3] == rust[:3], (where, got[:3], rust[:3])
        assert got[6:] == rust[6:], (where, got[6:], rust[6:])
        for a, b in zip(got[3:6], rust[3:6]):
            # Both float64 sums of n terms in some order.
            assert abs(a - b) <= 4 * n * 2.0 ** -53 * (abs(a) + abs(b) + 1), where
        checked += 1
    for bad in (torch.zeros(3, 3), torch.zeros(4)[::2], torch.zeros(2)):
        try:
            _stats_kernel.stats(bad, 3)
        except ValueError:
            checked += 1
    print("checked", checked)
""")


def test_fused_kernels_equal_the_rust_pass_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2] == "checked" and int(out.stdout.split()[-1]) == 89, out.stdout
