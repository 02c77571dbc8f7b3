"""Online checking (``Tracer(model, directory, online=REFERENCE)``): a multi-process job
checks its traced step against a reference while it runs, writing no tensor.

Oracle: the same job run again with the tracer writing its step (the runs are deterministic on
the CPU), checked by ``ttrace.check`` from the files — the online report must be that check's
JSON and text exactly, in every field.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import ttrace
from ttrace.errors import InvalidInputError

import harness
from conftest import run_job


def _online(tmp_path: Path, job: str, world: int, ref: Path, bug: str = "",
            **env: str) -> Path:
    d = tmp_path / f"{job}-{world}-{bug or 'clean'}-online"
    run_job(job, d, world, bug, env={"TTRACE_TEST_ONLINE": str(ref), **env})
    return d


@pytest.mark.parametrize("job,world,bug,ref_world,env", [
    ("tp", 2, "", 1, {}),
    pytest.param("tp", 2, "wrong-shard", 1, {}, marks=pytest.mark.full),
    pytest.param("fsdp", 2, "", 1, {}, marks=pytest.mark.full),
    ("fsdp", 2, "grad-summed", 1, {}),
    # A reference traced at TP 2 for a step at TP 4.
    pytest.param("tp", 4, "wrong-shard", 2, {}, marks=pytest.mark.full),
    # A reference traced at TP 2 for a step at DP 2 × TP 2 (FSDP2 over the data ranks, the
    # Llama under torchtitan's TP plan), clean and with a planted bug.
    pytest.param("llama", 4, "", 2, {"TP": "2"}, marks=pytest.mark.full),
    ("llama", 4, "softmax-scale-local", 2, {"TP": "2"}),
])
def test_an_online_check_reports_what_checking_the_written_step_reports(
        traces, tmp_path, job, world, bug, ref_world, env):
    ref = traces(job, ref_world, **({"TP": str(ref_world)} if env and ref_world > 1 else {}))
    written = ttrace.check(ref, traces(job, world, bug, **env))
    assert written.passed == (bug == ""), str(written)
    if ref_world > 1:
        # The same verdicts as against the one-rank reference.
        one = ttrace.check(traces(job, 1), traces(job, world, bug, **env))
        assert [(r.id, r.passed) for r in written.rows] == [(r.id, r.passed) for r in one.rows]
        assert written.first_failure == one.first_failure
    d = _online(tmp_path, job, world, ref, bug,
                **{f"TTRACE_TEST_{k}": v for k, v in env.items()})
    step = d / "step0"
    # Nothing reached the disk but the report (rank 0's).
    assert sorted(os.listdir(step)) == ["report.json", "report.txt"]
    assert json.loads((step / "report.json").read_text()) == written.raw
    assert (step / "report.txt").read_text().rstrip("\n") == written.text.rstrip("\n")
    stats = [json.loads((tmp_path / f"{d.name}.rank{r}.json").read_text())
             for r in range(world)]
    # No rank held the whole step, and the ranks' own shards make it up.
    assert sum(s["own_bytes"] for s in stats) == stats[0]["step_bytes"]
    for s in stats:
        assert s["held_bytes"] < s["step_bytes"], stats
    if job == "fsdp":
        # Each rank averaged its loss over its own batch and the tracer left that to the
        # checker: the set-up read activation gradients of both runs to settle it, fetched.
        assert written.loss_normalization is not None
        assert all(s["setup_rounds"] >= 1 and s["setup_tensors"] >= 1 for s in stats), stats


def test_a_rank_that_dies_before_the_check_stops_the_others_with_a_typed_error(
        traces, tmp_path):
    ref = traces("tp", 1)
    d = tmp_path / "dies"
    with pytest.raises(harness.JobFailed) as e:
        harness.run_job("tp", d, 2, env={"TTRACE_TEST_ONLINE": str(ref),
                                         "TTRACE_TEST_ONLINE_DIE": "1",
                                         "TTRACE_TEST_ONLINE_TIMEOUT": "10"}, timeout=120)
    # Rank 0 (the first failing rank reported) raised the distributed check's error.
    assert "rank 0 failed" in str(e.value), str(e.value)
    assert "DistributedCheckError" in str(e.value), str(e.value)
    assert not (d / "step0" / "report.json").exists()


def test_online_arguments_are_checked(tmp_path, traces):
    model = torch.nn.Linear(4, 4)
    with pytest.raises(InvalidInputError, match="needs a directory"):
        ttrace.Tracer(model, online=str(tmp_path))
    with pytest.raises(InvalidInputError, match="needs a directory"):
        ttrace.Tracer(model, tmp_path / "t", summaries=True, online=str(tmp_path))
    with pytest.raises(InvalidInputError, match="not a directory"):
        ttrace.Tracer(model, tmp_path / "t", online=str(tmp_path / "missing"))
    with pytest.raises(InvalidInputError, match="positive"):
        ttrace.Tracer(model, tmp_path / "t", online=str(tmp_path), online_timeout=0)
    # Without torch.distributed there are no other ranks to check with: said at the step's
    # end, and nothing is written.
    tracer = ttrace.Tracer(model, tmp_path / "t", online=str(traces("tp", 1)))
    with pytest.raises(InvalidInputError, match="torch.distributed"):
        with tracer.step():
            model(torch.randn(2, 4)).sum().backward()
    tracer.close()
    assert not (tmp_path / "t" / "step0").exists()
