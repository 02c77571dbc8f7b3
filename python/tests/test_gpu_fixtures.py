"""What an NVIDIA H100's cuBLAS computed (tests/fixtures/h100: BF16, FP16, FP32 and TF32
products, the K dimension split over 2 and 8 ranks as a row-parallel linear does), against
ttrace's thresholds for it: every case lies within the threshold of a kernel of unknown order
(``order=any``), each rank's partial in the training dtype, added in rank order.

The oracle is the GPU: its outputs are stored, the inputs drawn again by the fixture's own
``data.py`` (NumPy's PCG64, checked against the stored input sums). The FP8 fixtures are
tested in Rust (tests/gpu_fixtures.rs), where the tensor-core model runs bit for bit.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

import harness  # noqa: E402
import ttrace  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "h100"

#: The slice of each product priced in the test command: one row, two columns. Every element
#: of every product (about an hour on two cores): TTRACE_FIXTURES_FULL=1.
FULL = os.environ.get("TTRACE_FIXTURES_FULL") == "1"
ROWS = slice(None) if FULL else slice(0, 1)
COLS = slice(None) if FULL else slice(0, 2)


def _data() -> Any:
    return harness.load_script(FIXTURES / "data.py", "h100_data")


def _cases() -> List[Dict[str, Any]]:
    return list(json.loads((FIXTURES / "cases.json").read_text())["cublas"])


_FMT = {"bf16": "bf16", "fp16": "f16", "fp32": "f32", "tf32": "tf32"}


@pytest.fixture(scope="module")
def outputs() -> Dict[str, Any]:
    return dict(safetensors_torch.load_file(str(FIXTURES / "cublas_gemm.safetensors")))


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c["key"])
def test_cublas_products_lie_within_their_thresholds(case: Dict[str, Any], outputs: Dict[str, Any]) -> None:
    data = _data()
    x, w = data.inputs(case)
    assert abs(float(x.double().sum()) - case["x_sum"]) <= 1e-9 * max(1.0, abs(case["x_sum"]))
    assert abs(float(w.double().sum()) - case["w_sum"]) <= 1e-9 * max(1.0, abs(case["w_sum"]))
    x, w = x[ROWS], w[COLS]
    ref = outputs[case["key"] + "/ref"][ROWS, COLS]
    fmt = _FMT[case["dtype"]]
    stored = "f32" if fmt == "tf32" else fmt
    reference = f"in={fmt},acc=f32,out={stored},order=any"
    for parts in (2, 8):
        got = outputs[f"{case['key']}/rowpar{parts}"][ROWS, COLS]
        candidate = (f"in={fmt},acc=f32,out={stored},"
                     f"order=splitk:{parts}:{stored}:seq:inner=any")
        t = ttrace.matmul_threshold(x, w.t(), reference=reference, candidate=candidate)
        v = t.check(ref, got)
        assert v.passed, f"{case['key']} rowpar{parts}: ratio {v.ratio:.3g}"
        # Not vacuous: a small multiple of the 2·parts roundings to the training dtype and of
        # FP32 accumulation over K, relative to the magnitude of what is summed, ‖|x|·|w|ᵀ‖
        # (both sides round their inputs alike; TF32 products accumulate in FP32).
        u_out = 2.0 ** -{"bf16": 8, "f16": 11, "f32": 24, "tf32": 24}[fmt]
        scale = float((x.double().abs() @ w.double().abs().t()).norm())
        allowed = 16 * (u_out * math.sqrt(2 * parts) + 2.0 ** -24 * math.sqrt(case["k"])) * scale
        assert t.abs_frobenius < allowed, (t, allowed)


def test_a_sequential_fp32_threshold_is_what_tf32_breaks(outputs: Dict[str, Any]) -> None:
    """The H100's TF32 products differ from FP32 arithmetic by far more than FP32 round-off:
    priced as FP32 they fail, priced as TF32 they pass — the trace must say which ran."""
    data = _data()
    failed = 0
    cases = [c for c in _cases() if c["dtype"] == "tf32"]
    for case in cases:
        x, w = data.inputs(case)
        x, w = x[ROWS], w[COLS]
        got = outputs[case["key"] + "/ref"][ROWS, COLS]
        exact = (x.double() @ w.double().t()).numpy()
        t32 = ttrace.matmul_threshold(x, w.t(), reference="in=f64,acc=f64,out=f64",
                                      candidate="in=f32,acc=f32,out=f32,order=any")
        failed += not t32.check(exact, got).passed
        ttf = ttrace.matmul_threshold(x, w.t(), reference="in=f64,acc=f64,out=f64",
                                      candidate="in=tf32,acc=f32,out=f32,order=any")
        assert ttf.check(exact, got).passed, case["key"]
    assert failed == len(cases)
    assert np.isfinite(failed)
