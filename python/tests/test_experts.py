"""Expert parallelism: the MoE Llama of moe.py with its experts divided among two or four
ranks (gloo), tokens dispatched to their experts' owners by all-to-all and back, traced with
``experts=`` and checked against the model run whole on one process; torchtitan's own MoE
(titan_moe.py) under its own expert parallelism, traced with nothing but a directory (its
grouped experts recorded expert by expert); planted bugs modelled on public MoE reports found
where they are born. Also the tracer's refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ttrace
from harness import stored
from ttrace.errors import InvalidInputError

EXPERTS = "layers.*.feed_forward.experts.*"


def fragments(step: Path):
    """Every rank's manifest fragment, read as JSON (independently of ttrace's reader)."""
    return [json.loads(p.read_text()) for p in sorted(step.glob("manifest.rank*.json"))]


@pytest.mark.parametrize("dtype,world,env", [
    ("float32", 2, {}),
    ("bfloat16", 2, {"SEED": "1"}),
    # Eight experts of which each token takes two, two per rank, on four ranks.
    pytest.param("float32", 4, {"BATCH": "4", "EXPERTS": "8,2"}, marks=pytest.mark.full),
])
def test_clean_expert_parallel_runs_pass(traces, dtype, world, env):
    cand = traces("ep", world, "", dtype, **env)
    report = ttrace.check(traces("ep", 1, "", dtype, **env), cand)
    assert report.passed, str(report)
    experts = int(env.get("EXPERTS", "4,2").split(",")[0])
    # Per layer: the MoE layer, its router, and every expert (itself and w1, w2, w3), each
    # with inputs, outputs and gradients: all of them checked.
    ids = {r.id for r in report.rows}
    for layer in ("0", "1"):
        for e in range(experts):
            assert f"layers.{layer}.feed_forward.experts.{e}|fwd.input.0" in ids
            assert f"layers.{layer}.feed_forward.experts.{e}.w2.weight|param_grad" in ids
        assert f"layers.{layer}.feed_forward|fwd.output.0" in ids
    # The trace: each expert's tensors written by its owner alone (rank e // per), marked
    # owned along dp and replicated along it; the dense tensors by every rank.
    per = experts // world
    holders: "dict[str, set]" = {}
    for k, m in enumerate(fragments(cand)):
        for e in m["tensors"]:
            holders.setdefault(e["id"], set()).add(k)
            if ".experts." in e["id"]:
                assert e["owned"] == "dp" and e["layout"]["dp"] == {"kind": "replicate"}
            else:
                assert "owned" not in e
    for tid, ranks in holders.items():
        if ".experts." in tid:
            owner = int(tid.split(".experts.")[1].split(".")[0].split("|")[0]) // per
            assert ranks == {owner}, tid
        else:
            assert ranks == set(range(world)), tid
    # The one-process reference owns nothing.
    (ref,) = fragments(traces("ep", 1, "", dtype, **env))
    assert not any("owned" in e for e in ref["tensors"])


#: Each planted bug: where it must be localized — (a test on the localization, what it says).
BUGS = {
    # torchtitan issue 2387's class: a router's gradient never reduced over the data ranks.
    "router-grad-not-reduced": lambda loc: loc["tensor"].endswith("feed_forward.gate.weight"
                                                                  "|param_grad"),
    # The load-balancing loss scaled by the wrong group's size: the router's gradient (the
    # MoE layer's backward, in which it flows).
    "aux-loss-wrong-group": lambda loc: (loc["pass"] == "backward"
                                         and loc["module"] in ("layers.1.feed_forward",
                                                               "layers.1.feed_forward.gate")),
    # The combine: the MoE layer's output, on the rank that dropped the weights.
    "routing-weight-not-applied": lambda loc: (loc["tensor"] == "layers.0.feed_forward"
                                               "|fwd.output.0" and loc["rank"] == 1),
    "wrong-permutation-back": lambda loc: loc["tensor"] == "layers.0.feed_forward|fwd.output.0",
    # The dispatch: an expert's input, born between the router and the expert.
    "dispatch-misrouted": lambda loc: (
        loc["tensor"].startswith("layers.0.feed_forward.experts.")
        and loc["tensor"].endswith("|fwd.input.0")
        and "between module layers.0.feed_forward.gate and" in loc["detail"]),
    # Dropped tokens: an expert's rows counted against the reference's.
    "capacity-drops": lambda loc: (loc["tensor"].startswith("layers.0.feed_forward.experts.")
                                   and "routing:" in loc["detail"]
                                   and "tokens fewer" in loc["detail"]),
    # The experts' gradients never divided by the data ranks.
    "expert-grad-not-scaled": lambda loc: (loc["pass"] == "backward"
                                           and ".experts." in (loc["parameter"] or "")),
}


#: Every bug in FP32; in BF16 (the matrix runs all of them in both) the three whose BF16
#: margins are the smallest: the load-balancing loss (1.4×), the dispatch (26×) and the
#: combine's weights (314×).
CASES = [(b, "float32") for b in sorted(BUGS)] + [
    (b, "bfloat16") for b in ("aux-loss-wrong-group", "dispatch-misrouted",
                              "routing-weight-not-applied")]
# The quick slice: the router, the dispatch, the combine and the experts' gradients once each
# (the heavy sweep, --full, runs every case).
QUICK = {("router-grad-not-reduced", "float32"), ("dispatch-misrouted", "float32"),
         ("routing-weight-not-applied", "bfloat16"), ("expert-grad-not-scaled", "float32")}


@pytest.mark.parametrize("bug,dtype", [c if c in QUICK else pytest.param(*c, marks=pytest.mark.full)
                                       for c in CASES])
def test_planted_moe_bugs_are_found_where_they_are_born(traces, bug, dtype):
    report = ttrace.check(traces("ep", 1, "", dtype), traces("ep", 2, bug, dtype))
    assert not report.passed
    loc = report.localization
    assert loc is not None and BUGS[bug](loc), (bug, loc)


def test_the_tracer_refuses_experts_it_cannot_record(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(InvalidInputError, match="list of module-name patterns"):
        ttrace.Tracer(model, tmp_path, experts="0")  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="no module matches"):
        ttrace.Tracer(model, tmp_path, experts=["experts.*"])
    with pytest.raises(InvalidInputError, match="microbatches > 1"):
        ttrace.Tracer(model, tmp_path, experts=["0"], microbatches=2)
    with pytest.raises(InvalidInputError, match="summaries"):
        ttrace.Tracer(model, tmp_path, experts=["0"], summaries=True)


#: torchtitan's grouped experts, recorded expert by expert.
TITAN = "layers.{}.moe.routed_experts.inner_experts.{}"


@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.full), "bfloat16"])
def test_torchtitan_expert_parallel_moe_passes_expert_by_expert(traces, dtype):
    # torchtitan 0.3.0's Qwen3-MoE parallelized by torchtitan (experts sharded over the two
    # FSDP2 ranks, tokens dispatched by its AllToAllTokenDispatcher), traced with no argument.
    ref, cand = traces("titan_moe", 1, "", dtype), traces("titan_moe", 2, "", dtype)
    report = ttrace.check(ref, cand)
    assert report.passed, str(report)
    ids = {r.id for r in report.rows}
    for layer in (0, 1):
        for e in range(4):
            for role in ("fwd.input.0", "fwd.output.0", "grad.input.0"):
                assert f"{TITAN.format(layer, e)}|{role}" in ids
            assert f"{TITAN.format(layer, e)}.w2_EDF|param_grad" in ids
        assert f"layers.{layer}.moe.routed_experts|fwd.output.0" in ids
    for m in fragments(cand):
        for e in m["tensors"]:
            assert ("owned" in e) == (".inner_experts." in e["id"]), e["id"]
    if dtype != "float32":
        return  # safetensors' NumPy reader has no BF16
    # The trace, read with safetensors: expert e's rows written by its owner (rank e // 2)
    # alone, owned along dp — the reference's rows of that expert, in the same order, and
    # together every (token, choice) pair of the batch (4 × 16 tokens, top 2).
    per_rank = [stored(cand, r) for r in (0, 1)]
    whole = stored(ref)
    for layer in (0, 1):
        rows = 0
        for e in range(4):
            tid = f"{TITAN.format(layer, e)}|fwd.input.0"
            owner, other = per_rank[e // 2], per_rank[1 - e // 2]
            assert tid in owner and tid not in other, tid
            got, want = owner[tid], whole[tid]
            assert got.shape == want.shape and (got.view("u1") == want.view("u1")).all(), tid
            rows += want.shape[0]
            grad = f"{TITAN.format(layer, e)}.w1_EFD|param_grad"
            assert grad in owner and grad not in other and owner[grad].shape == (32, 64)
        assert rows == 4 * 16 * 2


#: torchtitan's MoE: each planted bug (titan_moe.plant) and where it must be localized.
TITAN_BUGS = {
    # The combine: the routing module's output (dispatch, experts, combine).
    "unpermute-skipped": lambda loc: loc["tensor"] == "layers.0.moe.routed_experts|fwd.output.0",
    "scores-not-applied": lambda loc: (loc["tensor"] == "layers.0.moe.routed_experts"
                                       "|fwd.output.0" and loc["rank"] == 1),
    # The dispatch: an expert's rows, born between the router and the expert.
    "permute-skipped": lambda loc: (
        loc["tensor"].startswith("layers.0.moe.routed_experts.inner_experts.")
        and loc["tensor"].endswith("|fwd.input.0")
        and "between module layers.0.moe.router.gate and" in loc["detail"]),
    # Rank 1's experts (2 and 3) computing with each other's weights: born in expert 2, which
    # rank 1 holds (rank 0's experts are right).
    "experts-swapped": lambda loc: (loc["tensor"] == TITAN.format(0, 2) + "|fwd.output.0"
                                    and loc["rank"] == 1),
    # The experts' gradients halved: an expert's parameter gradient — every rank's experts,
    # so no rank named.
    "expert-grad-halved": lambda loc: (loc["pass"] == "backward"
                                       and ".inner_experts." in (loc["parameter"] or "")
                                       and loc["rank"] is None),
}


@pytest.mark.parametrize("bug", [
    b if b in ("experts-swapped", "expert-grad-halved")
    else pytest.param(b, marks=pytest.mark.full) for b in sorted(TITAN_BUGS)])
def test_planted_torchtitan_moe_bugs_are_found_where_they_are_born(traces, bug):
    report = ttrace.check(traces("titan_moe", 1), traces("titan_moe", 2, bug))
    assert not report.passed
    loc = report.localization
    assert loc is not None and TITAN_BUGS[bug](loc), (bug, loc)
