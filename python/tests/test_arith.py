"""The arithmetic a run used travels with its trace: autocast and TF32 recorded per module call,
priced by the checker — clean runs pass, planted bugs are still found, and a setting the checker
has no model for is refused, never priced as something else.

The steps are the worked example's tensor-parallel MLP (python/examples/tp_demo.py) in FP32
under CPU autocast, and with TF32 emulated on the CPU (every linear layer's operands rounded to
TF32, as the GPU's tensor cores round them; the setting declared as a GPU run records it).
The GPU runs of the same steps are in python/benches/gpu_check.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, List

import pytest

torch = pytest.importorskip("torch")

import harness  # noqa: E402
import ttrace  # noqa: E402
from ttrace import arith  # noqa: E402
from ttrace.errors import TraceError  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "examples" / "tp_demo.py"


def _run(out: Path, *args: str) -> ttrace.CheckReport:
    demo: Any = harness.load_script(DEMO, "tp_demo")
    demo.main(["--out", str(out), "--dtype", "fp32", "--tokens", "256", "--d", "128", *args])
    return ttrace.check(out / "reference", out / "candidate")


def _strip(directory: Path, keys: List[str]) -> None:
    """Remove recorded settings from a trace's manifest (what a trace without them says)."""
    path = directory / "manifest.json"
    m = json.loads(path.read_text())
    for e in m["tensors"]:
        for k in keys:
            e.get("module", {}).pop(k, None)
    path.write_text(json.dumps(m))


def test_settings_are_read_without_changing_them() -> None:
    before = torch.get_float32_matmul_precision()
    assert arith.module_settings("cpu") == {"device": "cpu"}
    with torch.autocast("cpu", dtype=torch.float16):
        assert arith.module_settings("cpu")["autocast"] == "f16"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert arith.module_settings("cpu")["autocast"] == "bf16"
    assert "autocast" not in arith.module_settings("cpu")
    torch.set_float32_matmul_precision("medium")
    try:
        assert arith.module_settings("cpu").get("fp32_matmul") == "bf16"
    finally:
        torch.set_float32_matmul_precision(before)
    assert torch.get_float32_matmul_precision() == before
    run = arith.run_settings()
    assert run["torch"] == torch.__version__


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("seed", [0, 1])
def test_autocast_clean_runs_pass(tmp_path: Path, dtype: str, seed: int) -> None:
    report = _run(tmp_path / "run", "--autocast", dtype, "--seed", str(seed))
    assert report.passed, str(report)
    assert report.arithmetic["candidate"][f"autocast={dtype}"] > 0
    assert f"reference autocast={dtype}" in str(report)
    m = json.loads((tmp_path / "run" / "candidate" / "manifest.json").read_text())
    fc1 = [e for e in m["tensors"] if e["id"] == "fc1|grad.input.0"]
    assert fc1 and all(e["module"]["autocast"] == dtype for e in fc1)
    assert all(e["dtype"] == "f32" for e in fc1)  # stored in FP32, computed in the autocast dtype


def test_autocast_f16_gradients_in_the_subnormal_range(tmp_path: Path) -> None:
    """TP 8 with FP16 autocast: the input gradients (about 1e-5) lie in FP16's subnormal
    range, where rounding shrinks values toward zero; the scale test fired on the clean step
    (0.44 against 0.40) until tensors there were left to the norm and the sparse test."""
    report = _run(tmp_path / "run", "--autocast", "f16", "--tp", "8", "--tokens", "1024",
                  "--d", "256")
    assert report.passed, str(report)


def test_autocast_f16_without_the_recorded_setting_is_a_false_alarm(tmp_path: Path) -> None:
    """The negative control: the same clean FP16-autocast step, its setting removed from both
    manifests, is priced as FP32 arithmetic and fails — what every such run did before."""
    out = tmp_path / "run"
    assert _run(out, "--autocast", "f16").passed
    for side in ("reference", "candidate"):
        _strip(out / side, ["autocast"])
    report = ttrace.check(out / "reference", out / "candidate")
    assert not report.passed, str(report)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_fp8_products_clean_runs_pass(tmp_path: Path, dtype: str) -> None:
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no FP8 dtype")
    report = _run(tmp_path / "run", "--fp8", "fast", "--dtype", dtype)
    assert report.passed, str(report)
    m = json.loads((tmp_path / "run" / "candidate" / "manifest.json").read_text())
    assert all(e["module"]["quantize"] == "e4m3" for e in m["tensors"] if e["id"].startswith("fc2|"))


@pytest.mark.parametrize("tf32", ["both", "candidate"])
def test_tf32_clean_runs_pass(tmp_path: Path, tf32: str) -> None:
    report = _run(tmp_path / "run", "--tf32", tf32)
    assert report.passed, str(report)


def test_tf32_candidate_without_the_recorded_setting_is_a_false_alarm(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert _run(out, "--tf32", "candidate").passed
    _strip(out / "candidate", ["fp32_matmul"])
    assert not ttrace.check(out / "reference", out / "candidate").passed


@pytest.mark.parametrize(
    "args,bug,module",
    [
        (["--autocast", "f16"], "double-bias", "fc2"),
        (["--autocast", "f16"], "no-grad-allreduce", "ln"),
        (["--autocast", "f16"], "scale", "bias2"),
        (["--autocast", "bf16"], "double-bias", "fc2"),
        (["--tf32", "candidate"], "double-bias", "fc2"),
        (["--tf32", "candidate"], "no-grad-allreduce", "ln"),
        (["--tf32", "both"], "scale", "bias2"),
        (["--fp8", "fast", "--dtype", "bf16"], "double-bias", "fc2"),
        (["--fp8", "fast"], "no-grad-allreduce", "ln"),
    ],
)
def test_bugs_are_found_under_gpu_arithmetic(
    tmp_path: Path, args: List[str], bug: str, module: str
) -> None:
    report = _run(tmp_path / "run", *args, "--bug", bug)
    assert not report.passed
    assert report.localization["module"] == module, str(report)


def test_an_arithmetic_without_a_model_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert _run(out, "--autocast", "bf16").passed
    path = out / "candidate" / "manifest.json"
    m = json.loads(path.read_text())
    for e in m["tensors"]:
        if e["id"].startswith("fc1|"):
            e["module"]["autocast"] = "e4m3"
    path.write_text(json.dumps(m))
    with pytest.raises(TraceError) as info:
        ttrace.check(out / "reference", out / "candidate")
    assert info.value.kind == "UnpricedArithmetic"
    assert "fc1|" in str(info.value) and "autocast=e4m3" in str(info.value)
