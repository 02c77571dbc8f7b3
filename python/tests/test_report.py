"""Reports of ttrace.check and ``python -m ttrace check``, on traces written by the Tracer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import ttrace


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def trace(directory, scale_fc2: float = 1.0, steps: int = 1, **kw):
    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        net.fc2.weight.mul_(scale_fc2)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    tracer = ttrace.Tracer(net, directory, **kw)
    for _ in range(steps):
        with tracer.step():
            net(x).sum().backward()
    written = tracer.close()
    return tracer, written


@pytest.fixture
def pair(tmp_path):
    trace(tmp_path / "ref")
    trace(tmp_path / "same")
    trace(tmp_path / "bug", scale_fc2=1.01)
    return tmp_path


def test_identical_runs_pass_and_report_every_tensor(pair):
    r = ttrace.check(pair / "ref/step0", pair / "same/step0")
    assert r.passed and bool(r) and r.failures == 0 and r.first_failure is None
    ids = [row.id for row in r.rows]
    assert ids[:2] == ["fc1|fwd.input.0", "fc1|fwd.output.0"]
    assert "fc2.weight|param_grad" in ids
    assert str(r).startswith(f"PASS: all {len(ids)} tensors within their thresholds")
    assert sum(r.pricing_counts.values()) == len(ids)
    d = json.loads(r.to_json())
    assert d["passed"] is True and len(d["rows"]) == len(ids)


def test_a_changed_weight_fails_at_its_module(pair):
    r = ttrace.check(pair / "ref/step0", pair / "bug/step0")
    assert not r.passed
    assert r.first_failure == "fc2|fwd.output.0"
    assert r.localization["module"] == "fc2"
    assert r.failed_rows[0].error_eps > r.failed_rows[0].threshold_eps
    assert "FAIL:" in str(r) and "localized: module fc2" in str(r)


def test_python_m_ttrace_check_exit_codes_and_json(pair, tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "ttrace", "check", *map(str, a)],
                                    capture_output=True, text=True, timeout=120)
    ok = run(pair / "ref/step0", pair / "same/step0", "--json", tmp_path / "r.json")
    assert ok.returncode == 0, ok.stderr
    assert "PASS" in ok.stdout
    assert json.loads((tmp_path / "r.json").read_text())["passed"] is True
    bad = run(pair / "ref/step0", pair / "bug/step0")
    assert bad.returncode == 1 and "localized: module fc2" in bad.stdout
    missing = run(pair / "ref/step0", tmp_path / "nowhere")
    assert missing.returncode == 2 and "error:" in missing.stderr
    # A report path inside a trace directory could replace its files: refused, nothing written.
    inside = pair / "same/step0/rank0.safetensors"
    before = inside.read_bytes()
    refused = run(pair / "ref/step0", pair / "same/step0", "--json", inside)
    assert refused.returncode == 2 and "refusing to write the report inside" in refused.stderr
    assert inside.read_bytes() == before


def test_python_m_ttrace_check_escapes_and_exits_as_the_rust_cli(pair, tmp_path):
    import os

    def run(*a: object, stdout: object = subprocess.PIPE) -> "subprocess.CompletedProcess[str]":
        return subprocess.run([sys.executable, "-m", "ttrace", "check", *map(str, a)],
                              stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=120)

    # A path holding an escape sequence and a newline: the message is one escaped line.
    hostile = tmp_path / "x\x1b[31m\nPASS: forged"
    bad = run(pair / "ref/step0", hostile)
    assert bad.returncode == 2
    assert "\x1b" not in bad.stderr and bad.stderr.count("\n") == 1, repr(bad.stderr)
    assert bad.stderr.startswith("ttrace: error: ") and "\\u{1b}" in bad.stderr
    # Output that cannot be written is an error (exit 2), not a verdict — even for a pass.
    if os.path.exists("/dev/full"):
        with open("/dev/full", "w") as full:
            out = run(pair / "ref/step0", pair / "same/step0", stdout=full)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert "standard output" in out.stderr


def test_every_nth_step_and_module_selection(tmp_path):
    tracer, written = trace(tmp_path / "t", steps=5, every=2, modules=["fc*"])
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == ["step0", "step2", "step4"]
    manifest = json.loads((tmp_path / "t/step2/manifest.rank0.json").read_text())
    ids = {e["id"] for e in manifest["tensors"]}
    assert ids and all(i.startswith("fc") for i in ids)
    # The bytes reported are the tensor data of the files (read back with the safetensors
    # package, an independent reader).
    from safetensors.numpy import load_file

    total = 0
    for step in ("step0", "step2", "step4"):
        data = load_file(str(tmp_path / "t" / step / "rank0.safetensors"))
        total += sum(a.nbytes for a in data.values())
    assert written == total == tracer.bytes_written > 0


def test_recorded_values_are_the_module_outputs(tmp_path):
    from safetensors.numpy import load_file

    torch.manual_seed(0)
    net = Net()
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    tracer = ttrace.Tracer(net, tmp_path / "t", background=False)
    with tracer.step():
        net(x).sum().backward()
    tracer.close()
    data = load_file(str(tmp_path / "t/step0/rank0.safetensors"))
    with torch.no_grad():
        h = net.fc1(x)
    assert (data["fc1|fwd.output.0"] == h.numpy()).all()
    assert (data["fc1.weight|param_grad"] == net.fc1.weight.grad.numpy()).all()


def test_every_recorded_tensor_is_the_tensor_the_hooks_saw(tmp_path):
    """Tensors handed from one module to the next are stored once (two ids, one key); every
    id's stored values equal an independent copy taken by the test's own hooks — also where
    freed memory is reused by later tensors of the same shape."""
    from safetensors.numpy import load_file

    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(6)])
    seen = {}
    for name, m in net.named_modules():
        if name and not list(m.children()):
            def fwd(mod, args, out, name=name):
                seen[f"{name}|fwd.input.0"] = args[0].detach().clone()
                seen[f"{name}|fwd.output.0"] = out.detach().clone()

            def bwd(mod, gin, gout, name=name):
                seen[f"{name}|grad.output.0"] = gout[0].detach().clone()
                if gin[0] is not None:
                    seen[f"{name}|grad.input.0"] = gin[0].detach().clone()

            m.register_forward_hook(fwd)
            m.register_full_backward_hook(bwd)
    x = torch.randn(4, 16, requires_grad=True)
    tracer = ttrace.Tracer(net, tmp_path / "t", background=False)
    with tracer.step():
        net(x).sum().backward()
    tracer.close()
    step = tmp_path / "t/step0"
    data = load_file(str(step / "rank0.safetensors"))
    entries = json.loads((step / "manifest.rank0.json").read_text())["tensors"]
    shared = [e for e in entries if e["key"] != e["id"]]
    assert shared, "consecutive modules' tensors should share storage in the file"
    for e in entries:
        if e["id"] in seen:
            assert (data[e["key"]] == seen[e["id"]].numpy()).all(), e["id"]
    assert len(data) < len(entries)


def test_keyword_inputs_are_recorded_after_positional_ones(tmp_path):
    from safetensors.numpy import load_file

    class Scale(nn.Module):
        def forward(self, x, *, gate):
            return x * gate

    class Net2(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.scale = Scale()

        def forward(self, x):
            h = self.fc(x)
            return self.scale(h, gate=torch.sigmoid(h))

    torch.manual_seed(0)
    net = Net2()
    x = torch.randn(3, 4)
    tracer = ttrace.Tracer(net, tmp_path / "t", background=False)
    with tracer.step():
        net(x).sum().backward()
    tracer.close()
    data = load_file(str(tmp_path / "t/step0/rank0.safetensors"))
    entries = {e["id"]: e["key"] for e in json.loads(
        (tmp_path / "t/step0/manifest.rank0.json").read_text())["tensors"]}
    with torch.no_grad():
        h = net.fc(x)
    assert (data[entries["scale|fwd.input.1"]] == torch.sigmoid(h).numpy()).all()
    assert (data[entries["scale|fwd.input.0"]] == h.numpy()).all()


def test_a_change_made_between_traced_modules_is_localized_to_the_gap(tmp_path):
    class Glue(nn.Module):
        def __init__(self, scale: float) -> None:
            super().__init__()
            self.fc1, self.fc2, self.scale = nn.Linear(8, 8), nn.Linear(8, 4), scale

        def forward(self, x):
            return self.fc2(self.fc1(x) * self.scale)  # functional code between the modules

    for name, scale in (("ref", 1.0), ("cand", 1.001)):
        torch.manual_seed(0)
        net = Glue(scale)
        tracer = ttrace.Tracer(net, tmp_path / name)
        with tracer.step():
            net(torch.randn(4, 8, generator=torch.Generator().manual_seed(1))).sum().backward()
        tracer.close()
    r = ttrace.check(tmp_path / "ref/step0", tmp_path / "cand/step0")
    assert r.first_failure == "fc2|fwd.input.0"
    assert r.localization["module"] == "fc2" and r.localization["born_after"] == "fc1"
    assert "born in untraced code between module fc1 and module fc2" in str(r)


class Tweaked(nn.Linear):
    """A linear layer whose output is changed inside its own forward (a bug in the layer)."""

    def __init__(self, n_in: int, n_out: int, tweak=None) -> None:
        super().__init__(n_in, n_out)
        self.tweak = tweak

    def forward(self, x):
        y = super().forward(x)
        return self.tweak(y) if self.tweak is not None else y


class Wide(nn.Module):
    def __init__(self, tweak=None) -> None:
        super().__init__()
        self.fc = Tweaked(64, 128, tweak)
        self.out = nn.Linear(128, 8)

    def forward(self, x):
        return self.out(self.fc(x))


def _wide_trace(directory, tweak=None):
    torch.manual_seed(0)
    net = Wide(tweak)
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    tracer = ttrace.Tracer(net, directory)
    with tracer.step():
        net(x).sum().backward()
    tracer.close()
    return directory / "step0"


def test_the_report_names_the_tests_that_fired_with_their_estimates(tmp_path):
    ref = _wide_trace(tmp_path / "ref")
    # A planted scale of 1e-6 (8 ε of FP32 once rounded) on the fc output, and one element of it
    # moved by 1e-3 of the tensor's root mean square in another run.
    scaled = _wide_trace(tmp_path / "scaled", lambda y: y * (1.0 + 1e-6))

    def corrupt(y):
        y = y.clone()
        y.view(-1)[4321] += 1e-3 * y.detach().pow(2).mean().sqrt()
        return y

    sparse = _wide_trace(tmp_path / "sparse", corrupt)
    eps = 2.0 ** -23
    r = ttrace.check(ref, scaled)
    row = next(x for x in r.rows if x.id == "fc|fwd.output.0")
    assert r.first_failure == "fc|fwd.output.0" and "scale" in row.fired
    scale = next(f for f in row.findings if f["detector"] == "scale")
    # The scale the FP32 multiply applies: fl(1 + 1e-6) - 1 = 8 ε.
    applied = float(torch.tensor(1.0 + 1e-6, dtype=torch.float32)) - 1.0
    assert scale["fired"] and abs(scale["estimate"] * eps / applied - 1.0) < 0.01
    assert "scale" in str(r)
    r = ttrace.check(ref, sparse)
    row = next(x for x in r.rows if x.id == "fc|fwd.output.0")
    assert r.first_failure == "fc|fwd.output.0" and "sparse" in row.fired
    found = next(f for f in row.findings if f["detector"] == "sparse")
    assert found["at"] == 4321 and found["count"] == 1
    # The scale and bias tests are quiet on a single element.
    assert not any(f["fired"] for f in row.findings if f["detector"] in ("scale", "bias"))
