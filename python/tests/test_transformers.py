"""Hugging Face transformers' own tensor parallelism (``DistributedConfig(tp_size=N)``: its
``tp_plan`` on one n-D root mesh ``(pp, dp_replicate, fsdp, tp)``), traced with nothing but a
directory — multi-process gloo jobs on CPU, tiny Llama and Qwen3 configurations: clean runs
pass in FP32 and BF16 at TP 2 and 4 with every tensor priced by its module kind (the SDPA
call inside each attention module traced as an attention site), and planted bugs fail at the
module they are born in, with the rank; and its expert parallelism (``ep_size`` over the data
ranks) on a tiny Mixtral and a tiny Qwen2-MoE."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import ttrace  # noqa: E402


@pytest.mark.parametrize(
    "family,dtype,tp",
    [("llama", "float32", 2), pytest.param("llama", "bfloat16", 4, marks=pytest.mark.full),
     ("qwen3", "bfloat16", 2), pytest.param("qwen3", "float32", 4, marks=pytest.mark.full)],
)
def test_transformers_tensor_parallel_clean_run_passes(traces, family, dtype, tp):
    ref = traces("hf", dtype=dtype, FAMILY=family)
    cand = traces("hf", tp, dtype=dtype, FAMILY=family)
    report = ttrace.check(ref, cand)
    assert report.passed, str(report)
    # No generic pricing: activations, rotary tables, norms and attention have their kinds.
    assert not any("generic" in rule for rule in report.pricing_counts), report.pricing_counts
    sites = [r.id for r in report.rows if ".self_attn.sdpa|" in r.id]
    assert any(i.endswith("sdpa|fwd.output.0") for i in sites)
    assert any(i.endswith("sdpa|grad.input.0") for i in sites)


def test_a_one_rank_rotary_offset_is_found_where_it_is_born(traces):
    ref = traces("hf", FAMILY="llama")
    report = ttrace.check(ref, traces("hf", 2, "rotary", FAMILY="llama"))
    assert not report.passed
    # Replicas that disagree are reported as such, with the rank — not read as partial sums.
    assert report.localization["module"] == "model.rotary_emb", str(report)
    assert report.localization["rank"] == 1, str(report)
    assert "rank 1's copy differs" in report.localization["detail"]


def test_a_scaled_attention_output_on_one_rank_is_found(traces):
    ref = traces("hf", dtype="bfloat16", FAMILY="qwen3")
    report = ttrace.check(ref, traces("hf", 2, "scale-o", dtype="bfloat16", FAMILY="qwen3"))
    assert not report.passed
    # Born in o_proj's output hook (registered before the tracer, which records the output
    # as the caller receives it): localized to o_proj, with the rank (was the gap after it).
    assert report.localization["module"] == "model.layers.0.self_attn.o_proj", str(report)
    assert report.localization["rank"] == 1, str(report)


def test_a_missing_all_reduce_is_found_at_the_module_that_skipped_it(traces):
    ref = traces("hf", FAMILY="llama")
    report = ttrace.check(ref, traces("hf", 2, "no-allreduce-o", FAMILY="llama"))
    assert not report.passed
    # o_proj's own output, a Partial() made local, merges to the right sum: the difference
    # shows where its caller uses one rank's addend — and is named at o_proj (was the gap
    # after it).
    loc = report.localization
    assert loc["module"] == "model.layers.0.self_attn.o_proj", str(report)
    assert loc["tensor"] == "model.layers.0.self_attn.o_proj|fwd.output.0"
    assert "partial sum over tp" in loc["detail"] and "missing all-reduce" in loc["detail"]
    assert loc["rank"] is None  # every rank skipped it


@pytest.mark.parametrize("family,dtype", [
    pytest.param("mixtral", "float32", marks=pytest.mark.full),
    pytest.param("mixtral", "bfloat16", marks=pytest.mark.full),
    ("qwen2_moe", "bfloat16")])
def test_transformers_expert_parallel_moe_passes_and_a_scaled_expert_output_is_found(
        traces, family, dtype):
    # transformers' own expert parallelism (DistributedConfig(fsdp_size=2, ep_size=2,
    # ep_implementation="all_to_all")): a tiny Mixtral's (Qwen2-MoE's, with its shared expert
    # and its one-row shared-expert gate, which FSDP shards unevenly over the two ranks: its
    # gradient is gathered when read) stacked experts sharded by expert over the data ranks,
    # tokens dispatched by all-to-all — traced with nothing but a directory. The grouped experts module is traced whole (its children see the dispatched
    # tokens) with the sparse MoE block routing to it, and its weights' "ep" mesh dimension,
    # the data ranks here, is read as the dp axis.
    ref = traces("hf", dtype=dtype, FAMILY=family)
    report = ttrace.check(ref, traces("hf", 2, dtype=dtype, FAMILY=family))
    assert report.passed, str(report)
    ids = {r.id for r in report.rows}
    assert "model.layers.0.mlp.experts.gate_up_proj|param_grad" in ids
    assert "model.layers.0.mlp.experts|fwd.output.0" in ids
    assert "model.layers.0.mlp|fwd.output.0" in ids
    assert not any(".mlp.experts.act_fn" in i for i in ids)
    bug = ttrace.check(ref, traces("hf", 2, "experts-scaled", dtype=dtype, FAMILY=family))
    assert not bug.passed
    assert bug.first_failure == "model.layers.0.mlp.experts|fwd.output.0", str(bug)
    assert bug.localization["rank"] == 1, str(bug)

