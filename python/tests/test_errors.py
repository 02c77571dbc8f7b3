"""Bad input gives a clear Python exception of the documented class, never a crash; importing
ttrace changes nothing process-wide."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import ttrace
from ttrace import InvalidInputError, TraceError

from conftest import run_job
from test_report import trace


def test_bad_policy_names_the_side_and_the_variant():
    x = np.ones((2, 8), np.float32)
    with pytest.raises(InvalidInputError) as e:
        ttrace.sum_threshold(x, reference="in=f32,acc=f32,out=f32", candidate="in=bf17")
    assert e.value.kind == "UnknownFormat" and "candidate policy 'in=bf17'" in str(e.value)
    assert isinstance(e.value, ValueError)


def test_bad_arrays_are_refused_with_their_variant():
    p = "in=f32,acc=f32,out=f32"
    with pytest.raises(InvalidInputError) as e:
        ttrace.matmul_threshold(np.ones((2, 3), np.float32), np.ones((4, 2), np.float32),
                                reference=p)
    assert e.value.kind == "ShapeMismatch"
    with pytest.raises(InvalidInputError) as e:
        ttrace.sum_threshold(np.ones((2, 3), np.int32), reference=p)
    assert e.value.kind == "UnknownFormat"
    t = ttrace.sum_threshold(np.ones((2, 3), np.float32), reference=p)
    with pytest.raises(InvalidInputError) as e:
        t.check(np.ones(2, np.float32), np.ones(3, np.float32))
    assert e.value.kind == "ShapeMismatch"
    with pytest.raises(InvalidInputError) as e:
        ttrace.sum_threshold(np.ones((2, 3), np.float32), reference=p, delta=2.0)
    assert e.value.kind == "InvalidParameter"


def test_unreadable_traces_raise_trace_errors(tmp_path):
    trace(tmp_path / "ref")
    with pytest.raises(TraceError) as e:
        ttrace.check(tmp_path / "ref/step0", tmp_path / "missing")
    assert e.value.kind == "File"
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceError):
        ttrace.check(tmp_path / "ref/step0", tmp_path / "empty")
    with pytest.raises(InvalidInputError) as e:
        ttrace.check(tmp_path / "ref/step0", tmp_path / "ref/step0", pricing="magic")
    assert e.value.kind == "InvalidParameter"


def test_a_rank_that_wrote_nothing_is_an_error(tmp_path):
    trace(tmp_path / "ref")
    trace(tmp_path / "cand")
    step = tmp_path / "cand/step0"
    m = json.loads((step / "manifest.rank0.json").read_text())
    m["mesh"]["dp"] = 2  # two ranks declared, rank 1 wrote nothing
    for e in m["tensors"]:
        e["layout"]["dp"] = {"kind": "replicate"}
    (step / "manifest.rank0.json").write_text(json.dumps(m))
    with pytest.raises(TraceError) as e:
        ttrace.check(tmp_path / "ref/step0", step)
    assert "rank 1" in str(e.value) or "shard" in str(e.value)


def test_mixed_dtypes_and_renamed_modules_are_reported(tmp_path):
    trace(tmp_path / "ref")
    # The candidate in float64: not an error, but every tensor's difference is judged, at the
    # wider of the two dtypes, and the change is named where it fails.
    torch.manual_seed(0)
    from test_report import Net

    net = Net().double()
    tracer = ttrace.Tracer(net, tmp_path / "wide")
    with tracer.step():
        net(torch.randn(5, 8, generator=torch.Generator().manual_seed(1)).double()).sum().backward()
    tracer.close()
    report = ttrace.check(tmp_path / "ref/step0", tmp_path / "wide/step0")
    assert not report.passed
    assert "stored as f64 in the candidate but as f32 in the reference" in str(report)
    # A candidate whose modules are named differently has none of the reference's tensors.
    trace(tmp_path / "cand")
    step = tmp_path / "cand/step0"
    manifest = json.loads((step / "manifest.rank0.json").read_text())
    for e in manifest["tensors"]:
        if e["id"].startswith("fc1"):
            e["id"] = "first" + e["id"][len("fc1"):]
    (step / "manifest.rank0.json").write_text(json.dumps(manifest))
    with pytest.raises(TraceError) as e:
        ttrace.check(tmp_path / "ref/step0", step)
    assert e.value.kind == "UnknownName" and "fc1|fwd.input.0" in str(e.value)


def test_write_errors_surface_and_leave_no_manifest(tmp_path):
    (tmp_path / "t").write_text("a file where the trace directory should go")
    torch.manual_seed(0)
    from test_report import Net

    net = Net()
    tracer = ttrace.Tracer(net, tmp_path / "t")
    with tracer.step():
        net(torch.randn(2, 8)).sum().backward()
    with pytest.raises(ttrace.TtraceError):
        tracer.close()
    assert list(tmp_path.glob("**/manifest*.json")) == []


def test_unknown_modules_and_bad_options_are_refused():
    from test_report import Net

    with pytest.raises(InvalidInputError, match="no module named 'fc9'"):
        ttrace.Tracer(Net(), "x", modules=["fc9"])
    with pytest.raises(InvalidInputError):
        ttrace.Tracer(Net(), "x", every=0)
    with pytest.raises(InvalidInputError):
        ttrace.Tracer(Net(), "x", unsupported="ignore")


@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_a_placement_the_format_cannot_express_is_named(tmp_path, mode):
    # Two ranks: on a mesh dimension of size 1 every placement is the whole tensor (and is
    # traced as such), so the refusal needs a dimension the placement spans.
    run_job("unsupported", tmp_path / mode, world=2, bug="skip" if mode == "skip" else "")


def test_import_has_no_process_wide_side_effects():
    code = (
        "import sys, warnings, logging\n"
        "import numpy  # numpy's own import adds warning filters: measure ttrace's alone\n"
        "filters = list(warnings.filters); level = logging.getLogger().level\n"
        "import ttrace, ttrace.testing\n"
        "assert warnings.filters == filters, 'warning filters changed'\n"
        "assert logging.getLogger().level == level\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("detached", [False, True])
def test_a_rust_panic_arrives_as_internal_error_and_the_interpreter_goes_on(detached):
    from ttrace import _ttrace

    with pytest.raises(ttrace.InternalError) as e:
        _ttrace._panic_for_tests(detached)
    assert "deliberate panic" in str(e.value) and e.value.kind == "Panic"
    # Still usable afterwards.
    assert ttrace.parse_policy("in=f32,acc=f32,out=f32").startswith("in=f32")
