"""Summaries-only tracing (``Tracer(..., summaries=True)``): the statistics the tracer writes,
checked against NumPy on the tensors a full trace of the same step stores, and the comparison
of two summary traces — on real multi-process tensor-parallel runs (gloo, CPU)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest
import torch

from models import Mlp
import ttrace
from ttrace.errors import InvalidInputError, TtraceError


def _steps(directory: Path, summaries: bool, steps: int = 2, bug: bool = False) -> None:
    """``steps`` training steps of the MLP (the same seeds every time), traced in full or as
    summaries; ``bug``: fc2's output scaled by 1.001 from step 1 on."""
    torch.manual_seed(0)
    net = Mlp(8, 16)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    tracer = ttrace.Tracer(net, directory, summaries=summaries, background=not summaries)
    for s in range(steps):
        x = torch.randn(4, 8, generator=g)
        if bug and s >= 1:
            net.fc2.register_forward_hook(lambda m, a, o: o * 1.001)
        with tracer.step():
            net(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    tracer.close()


def _lines(directory: Path, rank: int = 0) -> List[Dict[str, Any]]:
    text = (directory / f"summaries.rank{rank}.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def test_statistics_are_those_of_the_stored_tensors(tmp_path):
    # The oracle: NumPy on the tensors a full trace of the same steps stores (read with
    # ttrace.load_all; sums in float64 with math.fsum).
    _steps(tmp_path / "full", summaries=False)
    _steps(tmp_path / "sum", summaries=True)
    lines = _lines(tmp_path / "sum")
    assert [line["step"] for line in lines] == [0, 1]
    for line in lines:
        full = ttrace.load_all(tmp_path / "full" / f"step{line['step']}")
        assert [e["id"] for e in line["tensors"]] == list(full)
        for e in line["tensors"]:
            x = full[e["id"]].reshape(-1)
            assert e["shape"] == list(full[e["id"]].shape)
            fin = x[np.isfinite(x)]
            assert (e["nan"], e["pinf"], e["ninf"]) == (0, 0, 0)
            n = len(fin)
            for key, want in (("sum", math.fsum(fin)), ("sum_sq", math.fsum(fin * fin)),
                              ("sum_abs", math.fsum(abs(fin)))):
                allowed = n * 2.0 ** -53 * math.fsum(abs(fin) ** (2 if key == "sum_sq" else 1))
                assert abs(e[key] - want) <= allowed, (e["id"], key, e[key], want)
            k = min(8, n)
            assert e["k"] == 8
            assert e["top"] == sorted(fin.tolist(), reverse=True)[:k]
            assert e["bottom"] == sorted(fin.tolist())[:k]
    # A few hundred bytes per tensor.
    size = (tmp_path / "sum" / "summaries.rank0.jsonl").stat().st_size
    per_tensor = size / sum(len(line["tensors"]) for line in lines)
    assert per_tensor < 1000, per_tensor


def test_non_finite_values_are_counted_and_left_out_of_the_sums(tmp_path):
    net = torch.nn.Sequential(torch.nn.Identity())
    tracer = ttrace.Tracer(net, tmp_path, summaries=True, background=False)
    x = torch.tensor([1.0, float("nan"), float("inf"), -2.0, float("-inf"), float("inf")])
    with tracer.step():
        net(x)
    tracer.close()
    e = _lines(tmp_path)[0]["tensors"][0]
    assert e["id"] == "0|fwd.input.0"
    assert (e["nan"], e["pinf"], e["ninf"]) == (1, 2, 1)
    assert (e["sum"], e["sum_sq"], e["sum_abs"]) == (-1.0, 5.0, 3.0)
    assert (e["top"], e["bottom"]) == ([1.0, -2.0], [-2.0, 1.0])


def test_a_bug_is_proven_from_summaries_and_the_same_run_proves_nothing(tmp_path):
    _steps(tmp_path / "ref", summaries=True, steps=3)
    _steps(tmp_path / "same", summaries=True, steps=3)
    _steps(tmp_path / "bug", summaries=True, steps=3, bug=True)
    same = ttrace.check_summaries(tmp_path / "ref", tmp_path / "same", rtol=1e-6)
    assert same.proven == 0 and bool(same)
    assert "NO DIFFERENCE PROVEN — not a pass" in str(same)
    bad = ttrace.check_summaries(tmp_path / "ref", tmp_path / "bug", rtol=1e-6)
    assert not bad
    # Born at step 1 in fc2's output (nothing before it differs).
    assert bad.first_proven == (1, "fc2|fwd.output.0")
    assert [s["step"] for s in bad.steps if s["proven"]] == [1, 2]
    # Without a threshold only the bounds are reported.
    loose = ttrace.check_summaries(tmp_path / "ref", tmp_path / "bug")
    assert loose.proven == 0
    assert loose.steps[1]["largest"]["rel_lower"] > 1e-4


def test_command_line_on_summaries_exit_codes(tmp_path):
    _steps(tmp_path / "ref", summaries=True)
    _steps(tmp_path / "same", summaries=True)
    _steps(tmp_path / "bug", summaries=True, bug=True)
    (tmp_path / "full").mkdir()

    def run(*args: str) -> "subprocess.CompletedProcess[str]":
        return subprocess.run([sys.executable, "-m", "ttrace", "check", *args],
                              capture_output=True, text=True, timeout=120)

    ref, bug = str(tmp_path / "ref"), str(tmp_path / "bug")
    same = run(ref, str(tmp_path / "same"), "--rtol", "1e-6")
    assert same.returncode == 0 and "not a pass" in same.stdout, same
    itself = run(ref, ref, "--rtol", "1e-6")
    assert itself.returncode == 2 and "compared with itself" in itself.stderr, itself
    out = run(ref, bug, "--rtol", "1e-6", "--json", str(tmp_path / "r.json"))
    assert out.returncode == 1 and "DIFFERENCE PROVEN" in out.stdout, out
    assert json.loads((tmp_path / "r.json").read_text())["steps"][1]["proven"]
    mixed = run(ref, str(tmp_path / "full"))
    assert mixed.returncode == 2 and "summaries compare only with summaries" in mixed.stderr
    rtol_full = run(str(tmp_path / "full"), str(tmp_path / "full"), "--rtol", "1")
    assert rtol_full.returncode == 2 and "summary traces only" in rtol_full.stderr


def test_summaries_need_a_directory_and_step(tmp_path):
    net = Mlp(4, 4)
    with pytest.raises(InvalidInputError):
        ttrace.Tracer(net, summaries=True)
    tracer = ttrace.Tracer(net, tmp_path, summaries=True)
    with pytest.raises(InvalidInputError):
        tracer.write(tmp_path / "x")
    tracer.close()


def test_a_writer_error_surfaces_and_leaves_no_torn_line(tmp_path):
    # The directory is a file: the background writer's error is raised by close().
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    net = Mlp(4, 4)
    tracer = ttrace.Tracer(net, blocker, summaries=True)
    with tracer.step():
        net(torch.randn(2, 4)).sum().backward()
    with pytest.raises(TtraceError):
        tracer.close()
    # A restarted run into the same directory: refused at its first step, the file intact.
    _steps(tmp_path / "run", summaries=True)
    before = (tmp_path / "run" / "summaries.rank0.jsonl").read_bytes()
    with pytest.raises(InvalidInputError, match="steps must increase"):
        _steps(tmp_path / "run", summaries=True)
    assert (tmp_path / "run" / "summaries.rank0.jsonl").read_bytes() == before


def test_tensor_parallel_summaries_merge_and_prove_the_wrong_shard(traces):
    # Real runs: DTensor tensor + sequence parallelism on 2 ranks against 1 rank, three steps
    # of summaries each; per-tensor thresholds from the full check of the same runs.
    ref = traces("tp", 1, SUMMARIES="1").parent
    clean = traces("tp", 2, SUMMARIES="1").parent
    wrong = traces("tp", 2, "wrong-shard", SUMMARIES="1").parent
    full = ttrace.check(traces("tp", 1), traces("tp", 2))
    assert full.passed
    ok = ttrace.check_summaries(ref, clean, thresholds=full)
    assert ok.proven == 0, str(ok)
    # Every tensor compared but the partial sums (row-parallel fc2's output before its
    # reduce-scatter, and their gradients): a sum's statistics are not its addends'.
    n = len(_lines(ref)[0]["tensors"])
    for s in ok.steps:
        assert s["compared"] + len(s["not_comparable"]) == n
        assert s["compared"] >= n // 2, str(ok)
        assert all("partial sum" in why for _, why in s["not_comparable"]), str(ok)
    bad = ttrace.check_summaries(ref, wrong, thresholds=full)
    assert bad.proven > 0, str(bad)
    # The bug is born in block1.fc1 (its weight's shards swapped, its bias not): nothing
    # before it is proven (summaries prove no difference that is not there), and its output —
    # no permutation of the right one, since the bias stays — is proven at once.
    assert bad.first_proven == (0, "block1.fc1|fwd.output.0"), str(bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                   torch.float8_e4m3fn])
def test_device_path_matches_the_rust_pass(dtype):
    # The reductions a CUDA tensor gets (run here on the CPU) against the Rust core's one pass
    # the CPU tensors get: the same counts and extremes, sums within float64 round-off.
    from ttrace._summaries import Summarizer, _device_stats
    from ttrace.tracer.record import _DTYPES

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(300_007, generator=g) * 3).to(dtype)
    if dtype != torch.float8_e4m3fn:
        x[::9_973] = torch.tensor([float("nan"), float("inf"), float("-inf")]).to(dtype).repeat(11)[
            :len(x[::9_973])]
    rust = Summarizer(5).summarize(x, _DTYPES[dtype]).values.tolist()
    torch_path = _device_stats(x, 5).tolist()
    assert rust[:3] == torch_path[:3]
    assert rust[6:] == torch_path[6:]
    for a, b in zip(rust[3:6], torch_path[3:6]):
        assert abs(a - b) <= 1e-12 * max(abs(a), abs(b), 1.0)


@pytest.mark.parametrize("n", [4096 * 25, 4096 * 40 + 17, 1_000_003])
def test_extremes_from_the_chunks_ends_equal_a_full_sort(n, monkeypatch):
    # The device path's extremes come from each chunk's maximum (minimum): equal to sorting
    # the whole tensor, wherever the extremes sit (one chunk, the tail, chunk boundaries) and
    # with ties.
    from ttrace import _summaries
    from ttrace._summaries import _CHUNK, _extreme

    monkeypatch.setattr(_summaries, "_MIN_CHUNKS", 1)  # chunked at every size here

    g = torch.Generator().manual_seed(n)
    base = torch.randn(n, generator=g)
    cases = {"random": base,
             "ties": torch.randint(-3, 4, (n,), generator=g).float(),
             "one chunk": base.clone().index_fill_(0, torch.arange(100, 164), 50.0)
             .index_fill_(0, torch.arange(300, 364), -50.0),
             "tail": torch.cat([base[: n - 9], torch.linspace(-90, 90, 9)]),
             "boundaries": base.clone().index_fill_(
                 0, torch.arange(_CHUNK - 1, n, _CHUNK), 7.0)}
    for name, v in cases.items():
        ordered = torch.sort(v).values
        for k in (1, 5, 8, 64):
            if n // _CHUNK < 4 * k:
                continue  # the whole-tensor topk
            assert torch.equal(_extreme(v, k, True), ordered.flip(0)[:k]), (name, k)
            assert torch.equal(_extreme(v, k, False), ordered[:k]), (name, k)


def test_a_disk_that_fills_leaves_only_whole_lines(tmp_path):
    # A file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored) stands in for a full disk: the writes
    # beyond it fail; the step's error reaches close() and the file ends with a whole line.
    script = f"""
import resource, signal, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
import torch, ttrace
from models import Mlp
net = Mlp(8, 16)
tracer = ttrace.Tracer(net, {str(tmp_path / "s")!r}, summaries=True)
try:
    for _ in range(6):
        with tracer.step():
            net(torch.randn(4, 8)).sum().backward()
    tracer.close()
except ttrace.TtraceError as e:
    print("ERROR", e)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert "ERROR" in out.stdout and "cannot append" in out.stdout, out
    data = (tmp_path / "s" / "summaries.rank0.jsonl").read_bytes()
    assert 0 < len(data) <= 20000 and data.endswith(b"\n")
    steps = [json.loads(line)["step"] for line in data.decode().splitlines()]
    assert steps == list(range(len(steps))) and len(steps) < 6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_summaries_on_a_cuda_device_never_synchronize(tmp_path):
    # PyTorch's sync debug mode raises on any operation that makes the host wait for the
    # device: a whole summarized step (hooks, reductions, the step's one transfer) must not.
    # The statistics are those the Rust pass computes from the same values on the CPU.
    from ttrace._summaries import Summarizer

    torch.manual_seed(0)
    net = Mlp(16, 32).cuda()
    x = torch.randn(8, 16, device="cuda")
    tracer = ttrace.Tracer(net, tmp_path, summaries=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        with tracer.step():
            out = net(x)
            out.square().mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tracer.close()
    entry = {e["id"]: e for e in _lines(tmp_path)[0]["tensors"]}["fc2|fwd.output.0"]
    cpu = Summarizer().summarize(out.detach().cpu(), "f32").values.tolist()
    assert (entry["nan"], entry["pinf"], entry["ninf"]) == tuple(int(v) for v in cpu[:3])
    assert entry["top"] == cpu[6:14] and entry["bottom"] == cpu[14:22]
    for key, v in zip(("sum", "sum_sq", "sum_abs"), cpu[3:6]):
        assert abs(entry[key] - v) <= 1e-12 * max(abs(v), 1.0)


def test_summaries_every_step_beside_a_full_trace_every_other_step(tmp_path):
    # The continuous-use setup: two tracers on one model, summaries every step and a full
    # trace one step in two; the full steps' tensors have the summaries' statistics.
    torch.manual_seed(0)
    net = Mlp(8, 16)
    summaries = ttrace.Tracer(net, tmp_path / "sum", summaries=True)
    full = ttrace.Tracer(net, tmp_path / "full", every=2)
    for _ in range(4):
        with summaries.step(), full.step():
            net(torch.randn(4, 8)).sum().backward()
    summaries.close()
    full.close()
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["step0", "step2"]
    lines = _lines(tmp_path / "sum")
    assert [line["step"] for line in lines] == [0, 1, 2, 3]
    for step in (0, 2):
        stored = ttrace.load_all(tmp_path / "full" / f"step{step}")
        entries = {e["id"]: e for e in lines[step]["tensors"]}
        assert set(stored) == set(entries)
        for tid, x in stored.items():
            assert entries[tid]["top"][0] == x.max() and entries[tid]["bottom"][0] == x.min()
            assert abs(entries[tid]["sum_sq"] - math.fsum((x * x).reshape(-1))) <= (
                1e-12 * entries[tid]["sum_sq"])


def test_thresholds_from_a_report_file_are_parsed_as_the_command_line_parses_them(tmp_path):
    _steps(tmp_path / "ref", summaries=True)
    _steps(tmp_path / "bug", summaries=True, bug=True)
    report = tmp_path / "check.json"
    report.write_text('{"report": {"verdicts": [{"id": "a", "id": "b", "threshold": 1}]}}')
    with pytest.raises(InvalidInputError, match="thresholds"):
        ttrace.check_summaries(tmp_path / "ref", tmp_path / "bug", thresholds=report)
    # A threshold of 0 for fc2's output only (null: none priced, so none given).
    report.write_text('{"report": {"verdicts": [{"id": "fc2|fwd.output.0", "threshold": 0},'
                      ' {"id": "fc1|fwd.output.0", "threshold": null}]}}')
    out = ttrace.check_summaries(tmp_path / "ref", tmp_path / "bug", thresholds=report)
    assert [b["id"] for s in out.steps for b in s["proven"]] == ["fc2|fwd.output.0"]
    assert out.first_proven == (1, "fc2|fwd.output.0")
