"""The GPU check (python/benches/gpu_check.py) runs on the CPU too — one case of each kind — so
the script that a CUDA machine runs stays working where no GPU is: its products and traced
steps pass clean, its planted bugs are found, and it writes its JSON table."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parents[1] / "benches" / "gpu_check.py"


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_runs_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    code = _script().main(["--device", "cpu", "--quick", "--out", str(out)])
    table = json.loads(out.read_text())
    assert code == 0, [r for r in table["rows"] if not r.get("passed", True)]
    s = table["summary"]
    sections = {r["section"] for r in table["rows"]}
    assert sections == {"products", "fp8", "steps"}
    assert s["failures"] == 0 and s["steps_clean"] >= 6
    # Every planted bug the step can show above round-off is found.
    assert s["steps_bugs_found"] >= s["steps_bugs"] - 2
    # Column- and batch-split products are priced as kernels of unknown order, not bit identity.
    split = [r for r in table["rows"] if r["section"] == "products" and r["case"] == "colpar8"]
    assert split and all(r["passed"] and r["relative"] > 0 for r in split)
