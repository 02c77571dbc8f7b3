"""A check shared among torch.distributed ranks (``-m ttrace check --distributed`` as torchrun
starts it, ``ttrace.check(..., group=)``) on real engines' traces: the single-machine check's
report and exit code on every number of checker ranks, and the same typed error on every rank
when a rank cannot read its share or dies.

Oracle: the single-machine check of the same pair (``python -m ttrace check --json``), byte
for byte: its JSON report and its printed text."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from pathlib import Path
from typing import List

import pytest

import harness

import ttrace

torch = pytest.importorskip("torch")

SP2 = dict(TP="2", SP="1")


def single(ref: Path, cand: Path, out: Path) -> "tuple[int, str, bytes]":
    """The single-machine check: exit code, printed report, JSON report."""
    import subprocess

    p = subprocess.run([sys.executable, "-m", "ttrace", "check", str(ref), str(cand), "--json",
                        str(out)], capture_output=True, text=True, timeout=240)
    assert p.returncode in (0, 1), p.stderr
    return p.returncode, p.stdout, out.read_bytes()


def distributed(ref: Path, cand: Path, out: Path, world: int) -> List["tuple[int, str, str]"]:
    return harness.run_ranks(
        lambda r: ["-m", "ttrace", "check", "--distributed", str(ref), str(cand), "--json",
                   str(out)], world, timeout=240)


@pytest.mark.parametrize("case,worlds", [
    pytest.param("clean-tp2-sp-bf16", (2, 8), marks=pytest.mark.full),
    ("softmax-scale-local", (3,)),
    pytest.param("grad-corrupt-one-rank", (4,), marks=pytest.mark.full),
])
def test_the_distributed_check_gives_the_single_machine_report(traces, tmp_path, case, worlds):
    if case == "clean-tp2-sp-bf16":
        bias = dict(BIAS="1")
        ref = traces("mgpt", 1, "", "bfloat16", **bias)
        cand = traces("mgpt", 2, "", "bfloat16", **SP2, **bias)
    elif case == "softmax-scale-local":
        ref = traces("mgpt", 1, "", "bfloat16")
        cand = traces("mgpt", 2, "softmax-scale-local", "bfloat16", TP="2")
    else:
        ref = traces("mgpt", 1, "", "float32")
        cand = traces("mgpt", 4, "grad-corrupt-one-rank", "float32", **SP2)
    code, text, report = single(ref, cand, tmp_path / "single.json")
    assert code == (0 if case.startswith("clean") else 1), text
    for world in worlds:
        out = tmp_path / f"distributed{world}.json"
        ranks = distributed(ref, cand, out, world)
        for r, (rc, stdout, stderr) in enumerate(ranks):
            assert rc == code, f"{case}, rank {r} of {world}: exit {rc}\n{stderr[-3000:]}"
            # Rank 0 prints the report; the others print nothing.
            assert stdout == (text if r == 0 else ""), f"{case}, rank {r} of {world}"
        assert out.read_bytes() == report, f"{case} on {world} ranks: JSON reports differ"


def test_check_with_a_group_returns_the_same_report_on_every_rank(traces, tmp_path):
    # The Python entry point, on a gloo group made for it and with its own timeout.
    ref = traces("mgpt", 1, "", "bfloat16")
    cand = traces("mgpt", 2, "softmax-scale-local", "bfloat16", TP="2")
    want = ttrace.check(ref, cand).to_json()
    script = (
        "import hashlib, sys, torch.distributed as dist, ttrace\n"
        "dist.init_process_group('gloo')\n"
        "g = dist.new_group(backend='gloo')\n"
        f"rep = ttrace.check({str(ref)!r}, {str(cand)!r}, group=g, timeout=120)\n"
        "print(hashlib.sha256(rep.to_json().encode()).hexdigest(), rep.passed)\n"
        "dist.destroy_process_group()\n")
    ranks = harness.run_ranks(lambda r: ["-c", script], 2, timeout=240)
    digest = hashlib.sha256(want.encode()).hexdigest()
    for rc, stdout, stderr in ranks:
        assert rc == 0, stderr[-3000:]
        assert stdout.split() == [digest, "False"]


def test_a_rank_that_cannot_read_its_share_gives_every_rank_the_same_error(traces, tmp_path):
    ref = traces("mgpt", 1, "", "bfloat16")
    cand = traces("mgpt", 2, "softmax-scale-local", "bfloat16", TP="2")
    # Rank 1 is given a copy of the candidate with one shard file cut short.
    broken = tmp_path / "broken"
    shutil.copytree(cand, broken)
    victim = sorted(broken.glob("*.safetensors"))[-1]
    victim.write_bytes(victim.read_bytes()[:-64])
    out = tmp_path / "never.json"
    ranks = harness.run_ranks(
        lambda r: ["-m", "ttrace", "check", "--distributed", str(ref),
                   str(broken if r == 1 else cand), "--json", str(out)], 3, timeout=240)
    errors = [stderr.strip().splitlines()[-1] for _, _, stderr in ranks]
    for r, (rc, stdout, _) in enumerate(ranks):
        assert rc == 2, f"rank {r}: exit {rc}"
        assert stdout == "", f"rank {r} printed a report"
    assert len(set(errors)) == 1, errors
    assert errors[0].startswith("ttrace: error: checker rank 1: "), errors[0]
    assert "truncated" in errors[0], errors[0]
    assert not out.exists()


def test_a_rank_that_dies_stops_every_other_rank_without_a_verdict(traces, tmp_path):
    ref = traces("mgpt", 1, "", "bfloat16")
    cand = traces("mgpt", 2, "softmax-scale-local", "bfloat16", TP="2")
    dies = ("import os, torch.distributed as dist\n"
            "dist.init_process_group('gloo')\n"
            "os._exit(3)\n")
    start = time.monotonic()
    ranks = harness.run_ranks(
        lambda r: ["-c", dies] if r == 2 else
        ["-m", "ttrace", "check", "--distributed", "--timeout", "30", str(ref), str(cand)],
        3, timeout=200)
    assert time.monotonic() - start < 180
    assert ranks[2][0] == 3
    for r in (0, 1):
        rc, stdout, stderr = ranks[r]
        assert rc == 2, f"rank {r}: exit {rc}\n{stderr[-2000:]}"
        assert stdout == ""
        assert "did not all answer" in stderr, stderr[-2000:]


def test_distributed_arguments_are_checked(traces, tmp_path):
    import subprocess

    ref = traces("mgpt", 1, "", "bfloat16")
    cand = traces("mgpt", 2, "softmax-scale-local", "bfloat16", TP="2")
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    for args, needle in [
        (["--distributed"], "runs under torchrun"),
        (["--timeout", "5"], "--timeout applies to --distributed only"),
    ]:
        p = subprocess.run([sys.executable, "-m", "ttrace", "check", str(ref), str(cand),
                            *args], capture_output=True, text=True, env=env, timeout=120)
        assert p.returncode == 2 and needle in p.stderr, (args, p.stderr)
    with pytest.raises(ttrace.InvalidInputError, match="initialized"):
        ttrace.check(ref, cand, group=object())
    with pytest.raises(ttrace.InvalidInputError, match=r"\(group=\) only"):
        ttrace.check(ref, cand, timeout=10)
