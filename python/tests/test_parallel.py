"""Real multi-process PyTorch runs (gloo on CPU), traced with no layout declarations and
checked against their one-process reference: DTensor tensor parallelism with sequence
parallelism at TP 2, and FSDP2 at DP 2 — clean runs pass, planted bugs fail at their module."""

from __future__ import annotations

import json

import pytest

import harness
import ttrace

DTYPES = ["float32", "bfloat16"]


def _manifest_layouts(step0):
    out = {}
    for f in sorted(step0.glob("manifest.rank*.json")):
        for e in json.loads(f.read_text())["tensors"]:
            out.setdefault(e["id"], e["layout"])
    return out


def _stored(step0, tid, rank):
    """The value rank ``rank`` stored for a scalar tensor, read with safetensors."""
    return float(harness.stored(step0, rank)[tid].reshape(()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtensor_tensor_parallel_clean_run_passes(traces, dtype):
    ref, cand = traces("tp", dtype=dtype), traces("tp", 2, dtype=dtype)
    report = ttrace.check(ref, cand)
    assert report.passed, str(report)
    # Every tensor of the reference was compared, and the layouts came from the placements:
    # the column-parallel output is split along its last dimension, the sequence-parallel
    # norm's input along the sequence, the row-parallel weight gradient along dim 1.
    assert len(report.rows) == len(_manifest_layouts(ref)) > 30
    layouts = _manifest_layouts(cand)
    assert layouts["block0.fc1|fwd.output.0"]["tp"] == {"kind": "split", "dim": 2, "groups": 1}
    assert layouts["block0.norm|fwd.input.0"]["tp"] == {"kind": "split", "dim": 1, "groups": 1}
    assert layouts["block0.fc2.weight|param_grad"]["tp"] == {"kind": "split", "dim": 1, "groups": 1}
    assert layouts["block0.act|fwd.input.0"]["tp"]["kind"] == "split"


@pytest.mark.full
def test_a_bf16_sequence_parallel_step_of_4096_tokens_on_the_cpu_passes(traces):
    # PyTorch's CPU LayerNorm backward adds each row into a BF16 buffer (a sequential sum
    # rounded after every row); under sequence parallelism each rank sums half the tokens, in
    # other chains. Priced with an FP32 accumulator, all four norm parameter gradients of a
    # correct 2,048-token step failed by up to 3.6x; priced as the kernel accumulates, with
    # the random walk's sqrt(k), the bias gradients of this 4,096-token step (hidden 256)
    # still failed (26.8 eps against 25.7: the sums stagnate, their errors grow with k); with
    # the chain run on the arriving gradient's rows they pass.
    size = {"MLP": "256,1024,1024,4"}
    ref = traces("tp", 1, dtype="bfloat16", **size)
    report = ttrace.check(ref, traces("tp", 2, dtype="bfloat16", **size))
    assert report.passed, str(report)
    norms = [r for r in report.rows if ".norm." in r.id and r.id.endswith("|param_grad")]
    assert len(norms) == 4 and all(r.threshold_eps > 5 for r in norms), str(report)
    # The bias gradients' thresholds cover the measured stagnation (about 25 eps per run).
    biases = [r for r in norms if r.id.endswith(".bias|param_grad")]
    assert all(r.threshold_eps > 40 for r in biases), str(report)


def test_an_n_dimensional_root_mesh_needs_no_declarations(traces, recwarn):
    """transformers' and torchtitan's meshes: a 4-D root (pp, dp_replicate, fsdp, tp) with
    sizes 1 but tp, the parameters on its tp sub-mesh — traced with no argument, the size-1
    dimensions ignored, no deprecated torch API called."""
    ref, cand = traces("tp"), traces("tp", 2, MESH="nd")
    report = ttrace.check(ref, cand)
    assert report.passed, str(report)
    layouts = _manifest_layouts(cand)
    assert layouts["block0.fc1|fwd.output.0"]["tp"] == {"kind": "split", "dim": 2, "groups": 1}
    mesh = json.loads(sorted(cand.glob("manifest.rank*.json"))[0].read_text())["mesh"]
    assert (mesh["tp"], mesh["dp"], mesh["cp"]) == (2, 1, 1)


def test_megatron_layers_under_context_parallelism_pass_and_an_unreduced_gradient_is_named(
        traces):
    # TP 2 × CP 2: each rank holds Megatron's load-balanced sequence chunks (cp chunks on the
    # sequence dimension, found from the values; was refused at the Tracer's construction).
    report = ttrace.check(traces("megatron"), traces("megatron", 4, CP="2"))
    assert report.passed, str(report)
    assert report.inferred_layouts["act|fwd.input.0"]["cp"] == {"kind": "cp_chunks", "dim": 0}
    # The gradients not all-reduced over cp: replicas that differ, with the rank and the
    # reading-too-early cause named.
    bad = ttrace.check(traces("megatron"), traces("megatron", 4, "cp-grad-not-reduced", CP="2"))
    assert bad.first_failure is not None and bad.first_failure.endswith("|param_grad")
    assert all(r.id.endswith("|param_grad") for r in bad.failed_rows)
    assert "declared replicated along cp" in bad.localization["detail"]
    assert "finalize_model_grads" in bad.localization["detail"]


def test_a_deferred_reduction_never_done_is_named_at_its_module(traces):
    # block0.fc2 under RowwiseParallel(output_layouts=Partial()): the tracer records its
    # output as the partial sum it is (so it merges right); the residual add uses one rank's
    # addend. The clean run without SP passes; the bug is named at fc2, not the gap after it.
    assert ttrace.check(traces("tp"), traces("tp", 2, SP="0")).passed
    report = ttrace.check(traces("tp"), traces("tp", 2, "fc2-partial", SP="0"))
    assert not report.passed
    loc = report.localization
    assert loc["module"] == "block0.fc2" and loc["tensor"] == "block0.fc2|fwd.output.0"
    assert "missing all-reduce" in loc["detail"], loc


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtensor_wrong_weight_shard_fails_at_its_module(traces, dtype):
    report = ttrace.check(traces("tp", dtype=dtype), traces("tp", 2, "wrong-shard", dtype))
    assert not report.passed
    assert report.first_failure == "block1.fc1|fwd.output.0"
    assert report.localization is not None
    assert report.localization["module"] == "block1.fc1"
    assert report.localization["pass"] == "forward"
    # Nothing before the bug fails.
    first = [r.id for r in report.rows].index("block1.fc1|fwd.output.0")
    assert all(r.passed for r in report.rows[:first])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fsdp2_clean_run_passes(traces, dtype):
    ref, cand = traces("fsdp", dtype=dtype), traces("fsdp", 2, dtype=dtype)
    report = ttrace.check(ref, cand)
    assert report.passed, str(report)
    layouts = _manifest_layouts(cand)
    # Parameters sharded on dim 0 over dp (DTensor), activations split along the batch.
    assert layouts["block0.fc1.weight|param_grad"]["dp"] == {"kind": "split", "dim": 0, "groups": 1}
    assert layouts["block0.fc1|fwd.output.0"]["dp"] == {"kind": "split", "dim": 0, "groups": 1}


@pytest.mark.parametrize("dtype", DTYPES)
def test_fsdp2_summed_gradients_fail_at_the_first_parameter_gradient(traces, dtype):
    report = ttrace.check(traces("fsdp", dtype=dtype), traces("fsdp", 2, "grad-summed", dtype))
    assert not report.passed
    failing = {r.id for r in report.failed_rows}
    assert failing and all(i.startswith("block1.") and i.endswith("|param_grad") for i in failing)
    assert report.localization["module"] == "block1.fc2"
    assert report.localization["pass"] == "backward"


def test_megatron_tensor_parallel_layers_need_no_declarations(traces):
    ref, cand = traces("megatron"), traces("megatron", 2)
    report = ttrace.check(ref, cand)
    assert report.passed, str(report)
    layouts = _manifest_layouts(cand)
    # Megatron's [s, b, h] activations: the column-parallel output split along h, the
    # row-parallel weight along its input dimension, the GELU between them inherits the split.
    assert layouts["fc1|fwd.output.0"]["tp"] == {"kind": "split", "dim": 2, "groups": 1}
    assert layouts["fc2.weight|param_grad"]["tp"] == {"kind": "split", "dim": 1, "groups": 1}
    assert layouts["act|fwd.output.0"]["tp"]["kind"] == "split"
    assert layouts["fc1|grad.input.0"]["tp"] == {"kind": "replicate"}


def test_megatron_missing_gradient_all_reduce_fails_where_the_partial_sum_is_consumed(traces):
    # ColumnParallelLinear(disable_grad_reduce=True) hands its input gradient on as a partial
    # sum (recorded as such); the LayerNorm before it back-propagates it as if it were whole,
    # and its ranks' input gradients disagree.
    report = ttrace.check(traces("megatron"), traces("megatron", 2, "no-grad-allreduce"))
    assert not report.passed
    assert report.localization["module"] == "norm"
    assert report.localization["pass"] == "backward"
    assert "synchronization is missing" in report.localization["detail"]
    layouts = _manifest_layouts(traces("megatron", 2, "no-grad-allreduce"))
    assert layouts["fc1|grad.input.0"]["tp"] == {"kind": "partial"}


def test_ddp_clean_run_passes_under_the_reference_module_names(traces):
    ref, cand = traces("ddp"), traces("ddp", 2)
    report = ttrace.check(ref, cand)
    assert report.passed, str(report)
    assert "block0.fc1|fwd.output.0" in _manifest_layouts(cand)
    # Each rank's loss is the mean over its half of the batch; the tracer was not told, and
    # the checker settled it from the reference (the gradients are twice the reference's).
    loss = report.loss_normalization
    assert loss is not None and loss["local_mean"] and loss["dp"] == 2, loss
    assert loss["error_local"] < 1e-6 < 0.5 < loss["error_global"]
    assert "each rank averaged its loss over its own share of the batch" in str(report)


def test_ddp_weight_never_broadcast_fails_at_its_module(traces):
    report = ttrace.check(traces("ddp"), traces("ddp", 2, "unsynced-weight"))
    assert not report.passed
    assert report.localization["module"] == "block1.fc2"
    assert report.localization["pass"] == "forward"


def test_a_scalar_loss_under_data_parallelism_is_judged_as_the_mean_of_the_ranks(traces):
    # The loss as a module of its own: each rank's output is the mean over its half of the
    # batch, the reference's the mean over the whole — the mean of the ranks' values (was
    # refused as "each rank's own value").
    ref, cand = traces("ddp", LOSS="local"), traces("ddp", 2, LOSS="local")
    report = ttrace.check(ref, cand)
    assert report.passed, str(report)
    row = next(r for r in report.rows if r.id == "loss|fwd.output.0")
    assert row.elements == 1
    assert _manifest_layouts(cand)["loss|fwd.output.0"]["dp"] == {"kind": "partial"}
    # Independently: the means the two ranks stored (as computed: the tracer was not told the
    # normalization) average to the reference's loss, and the checker read them so.
    halves = [_stored(cand, "loss|fwd.output.0", r) for r in (0, 1)]
    whole = _stored(ref, "loss|fwd.output.0", 0)
    assert abs(sum(halves) / 2 - whole) <= 4 * 2.0**-24 * abs(whole)
    assert abs(sum(halves) - whole) > 0.5 * abs(whole)
    assert report.loss_normalization["local_mean"]
    bug = ttrace.check(ref, traces("ddp", 2, "unsynced-weight", LOSS="local"))
    assert bug.localization["module"] == "net.block1.fc2"


@pytest.mark.parametrize("dtype", DTYPES)
def test_llama_with_torchtitans_tensor_parallel_plan_passes_clean(traces, dtype):
    # Vocabulary-parallel embedding (a masked partial before its reduce-scatter: recorded as
    # the caller receives it), PrepareModuleInput, sequence-parallel RMSNorms, functional
    # attention between traced projections.
    report = ttrace.check(traces("llama", dtype=dtype), traces("llama", 2, dtype=dtype))
    assert report.passed, str(report)
    assert len(report.rows) > 100
    layouts = _manifest_layouts(traces("llama", 2, dtype=dtype))
    assert layouts["tok_embeddings|fwd.output.0"]["tp"] == {"kind": "split", "dim": 1, "groups": 1}


def _site(step0, site, like=None):
    """An attention site's query, key, value and output as the ranks stored them (read with
    safetensors); the ranks' shards joined along the dimension where they are smaller than
    ``like`` (the reference's tensors: the tracer leaves the split of these plain tensors for
    the checker to infer), else rank 0's."""
    import torch
    from safetensors.torch import load_file

    entries = [e for f in sorted(step0.glob("manifest.rank*.json"))
               for e in json.loads(f.read_text())["tensors"]]
    out = []
    for i, tid in enumerate([f"{site}|fwd.input.{i}" for i in range(3)] + [f"{site}|fwd.output.0"]):
        mine = sorted((e for e in entries if e["id"] == tid), key=lambda e: e["rank"])
        parts = [load_file(str(step0 / e["file"]))[e["key"]].double() for e in mine]
        cut = [d for d in range(parts[0].dim())
               if like is not None and parts[0].shape[d] < like[i].shape[d]]
        out.append(torch.cat(parts, cut[0]) if cut else parts[0])
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_llama_attention_sites_are_priced_through_the_attention_op(traces, dtype):
    # The tracer records what each scaled_dot_product_attention call computes (no mask, no
    # dropout, the default scale, causal: the registry's attention:causal); the checker prices
    # its output by the exact attention of both runs' inputs plus the op's own rounding.
    # Oracle: torch's attention in float64 on the inputs the ranks stored, merged here.
    import torch
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    ref, cand = traces("llama", dtype=dtype), traces("llama", 2, dtype=dtype)
    report = ttrace.check(ref, cand)
    assert report.passed, str(report)
    rows = [r for r in report.rows if r.id.endswith(".sdpa|fwd.output.0")]
    assert len(rows) == 2 and all(r.pricing == "op" for r in rows), rows
    modules = [e.get("module", {}) for f in cand.glob("manifest.rank*.json")
               for e in json.loads(f.read_text())["tensors"] if ".sdpa|" in e["id"]]
    assert modules and all(m.get("op") == "attention:causal" for m in modules)
    for r in rows:
        site = r.id.split("|")[0]
        q, k, v, o = _site(ref, site)
        qc, kc, vc, oc = _site(cand, site, (q, k, v, o))
        carried = float((sdpa(qc, kc, vc, is_causal=True) - sdpa(q, k, v, is_causal=True)).norm())
        threshold = r.threshold_eps * report.eps * float(o.norm())
        # The threshold holds the exact carried difference and the observed one; its own
        # rounding part is a few units of the format, not an allowance.
        assert carried <= threshold and float((oc - o).norm()) <= threshold
        assert threshold - carried <= 64 * 2.0 ** -(24 if dtype == "float32" else 8) * float(o.norm())
        assert q.shape == qc.shape
    # A candidate that calls the attention with another scale is judged by the reference's
    # op: the site fails, priced by it.
    bug = ttrace.check(ref, traces("llama", 2, "softmax-scale-local", dtype))
    first = next(r for r in bug.rows if r.id == bug.first_failure)
    assert first.id.endswith(".sdpa|fwd.output.0") and first.pricing == "op" and first.ratio > 2


def _stored_merged(step0, tid):
    """A tensor as rank 0 stored it, read with safetensors (the loss site's tensors are
    replicated over the tensor-parallel ranks)."""
    from safetensors.torch import load_file

    for f in sorted(step0.glob("manifest.rank*.json")):
        for e in json.loads(f.read_text())["tensors"]:
            if e["id"] == tid and e["rank"] == 0:
                return load_file(str(step0 / e["file"]))[e["key"]].double()
    raise KeyError(tid)


@pytest.mark.parametrize("dtype", DTYPES)
def test_llama_cross_entropy_is_priced_through_the_cross_entropy_ops(traces, tmp_path, dtype):
    # losses=True: the job's functional cross-entropy is a loss site, its targets recorded; the
    # checker prices its loss and its logits' gradient through the registry's ops. Oracle:
    # torch's cross-entropy in float64 on the logits and targets the ranks stored.
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    ref, cand = traces("llama", dtype=dtype, LOSSES="1"), traces("llama", 2, dtype=dtype, LOSSES="1")
    report = ttrace.check(ref, cand)
    assert report.passed, str(report)
    rows = {r.id: r for r in report.rows}
    site = "cross_entropy"
    assert rows[f"{site}|fwd.output.0"].pricing == "op"
    assert rows[f"{site}|grad.input.0"].pricing == "op"
    z, t = _stored_merged(ref, f"{site}|fwd.input.0"), _stored_merged(ref, f"{site}|fwd.input.1")
    zc = _stored_merged(cand, f"{site}|fwd.input.0")
    assert torch.equal(t, _stored_merged(cand, f"{site}|fwd.input.1"))
    ce = torch.nn.functional.cross_entropy
    loss, loss_c = ce(z, t.long()), ce(zc, t.long())
    r = rows[f"{site}|fwd.output.0"]
    threshold = r.threshold_eps * report.eps * abs(float(loss))
    assert abs(float(loss_c - loss)) <= threshold
    # The gradient: (softmax − one-hot)/rows, both runs, against its threshold.
    onehot = torch.nn.functional.one_hot(t.long(), z.shape[1]).double()
    g, gc = (torch.softmax(z, 1) - onehot) / len(t), (torch.softmax(zc, 1) - onehot) / len(t)
    r = rows[f"{site}|grad.input.0"]
    assert float((gc - g).norm()) <= r.threshold_eps * report.eps * float(g.norm())
    # The candidate's logits gradient off by 2^-10 of itself (a loss scaled by 1 + 2^-10): the
    # site's gradient fails, priced by the op.
    bad = tmp_path / "bad"
    shutil.copytree(cand, bad)
    for f in sorted(bad.glob("manifest.rank*.json")):
        for e in json.loads(f.read_text())["tensors"]:
            if e["id"] == f"{site}|grad.input.0":
                data = load_file(str(bad / e["file"]))
                data[e["key"]] = (data[e["key"]].double() * (1 + 2.0 ** -10)).to(
                    data[e["key"]].dtype)
                save_file(data, str(bad / e["file"]))
    failed = ttrace.check(ref, bad)
    assert failed.first_failure == f"{site}|grad.input.0", str(failed)
    assert next(r for r in failed.rows if r.id == failed.first_failure).pricing == "op"


@pytest.mark.parametrize("dtype", DTYPES)
def test_llama_softmax_scale_from_the_local_width_is_born_in_the_attention_core(traces, dtype):
    # The scaled product and softmax run in functional code inside the attention module,
    # between the traced q/k/v projections and the output projection: the call of
    # scaled_dot_product_attention is traced as the attention site inside the module, and the
    # wrong scale is found there — its inputs agree, its output does not.
    report = ttrace.check(traces("llama", dtype=dtype),
                          traces("llama", 2, "softmax-scale-local", dtype))
    assert not report.passed
    assert report.first_failure == "layers.0.attention.sdpa|fwd.output.0"
    assert report.localization["module"] == "layers.0.attention.sdpa"
    assert report.localization["kind"] == "attention"
    # The reshapes and rotary code around the site are the gaps the report lists (in the
    # clean run too).
    gaps = ttrace.check(traces("llama", dtype=dtype), traces("llama", 2, dtype=dtype)).untraced_gaps
    assert any(g["after"] == "layers.0.attention.wv" and g["before"] == "layers.0.attention.sdpa"
               for g in gaps), gaps
