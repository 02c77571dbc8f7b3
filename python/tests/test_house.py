"""The house plan (docs/architecture.md) at file level: no import cycle between the Rust
source files of the library or the lab, and no arrow from the checker/reader side to the
simulator side — counted by ``scripts/module_graph.py`` (``tests/lint.rs`` checks the rooms
inside ``cargo test``; files need the script's path resolution)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "module_graph.py"


def plan(src: Path) -> str:
    out = subprocess.run([sys.executable, str(SCRIPT), str(src)], capture_output=True,
                         text=True, timeout=120, check=True)
    return out.stdout


def count(text: str, label: str) -> int:
    m = re.search(re.escape(label) + r"\D*(\d+)", text)
    assert m is not None, f"no '{label}' in the script's output:\n{text}"
    return int(m.group(1))


def test_the_library_and_the_lab_have_no_file_cycle_and_no_arrow_to_the_simulator() -> None:
    for src in (ROOT / "src", ROOT / "lab" / "src"):
        text = plan(src)
        assert count(text, "file cycles:") == 0, text
        assert count(text, "simulator side (file arrows):") == 0, text
    assert count(plan(ROOT / "src"), "rooms") >= 15


def test_the_script_sees_a_cycle_and_an_arrow_to_the_simulator(tmp_path: Path) -> None:
    # Two files of the checker side importing each other, one of them the simulator's model.
    (tmp_path / "check").mkdir()
    (tmp_path / "engine").mkdir()
    (tmp_path / "lib.rs").write_text("pub mod check;\npub mod engine;\n")
    (tmp_path / "check" / "mod.rs").write_text("mod a;\nmod b;\n")
    (tmp_path / "check" / "a.rs").write_text("use crate::check::b::g;\npub fn f() { g() }\n")
    (tmp_path / "check" / "b.rs").write_text(
        "use crate::check::a::f;\nuse crate::engine::model::Gpt;\npub fn g() { f() }\n")
    (tmp_path / "engine" / "mod.rs").write_text("pub mod model;\n")
    (tmp_path / "engine" / "model.rs").write_text("pub struct Gpt;\n")
    text = plan(tmp_path)
    assert count(text, "file cycles:") == 1, text
    assert count(text, "simulator side (file arrows):") == 1, text
