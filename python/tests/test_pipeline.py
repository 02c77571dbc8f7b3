"""Pipeline parallelism and microbatches: torch's own pipeline schedules
(``torch.distributed.pipelining``: GPipe, 1F1B, interleaved 1F1B) on two ranks with gloo,
traced through their ``PipelineStage`` objects and checked against the model run whole on one
process; planted bugs modelled on pipeline and gradient-accumulation reports found where they
are born. Also gradient accumulation in one process, and the tracer's refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ttrace
from fakes import FakeMesh
from ttrace.errors import InvalidInputError, UnsupportedLayoutError

#: Four layers on two stages (two each; interleaved: one per virtual stage), four microbatches
#: of one sequence each.
PP = dict(LAYERS="4", BATCH="4")


def pp(traces, world=1, bug="", dtype="float32", **env):
    return traces("pp", world, bug, dtype, **PP, **env)


def fragments(step: Path):
    """Every rank file's manifest fragment, read as JSON (independently of ttrace's reader)."""
    return {p.name: json.loads(p.read_text()) for p in sorted(step.glob("manifest.rank*.json"))}


@pytest.mark.parametrize("schedule,dtype,rescale", [
    pytest.param("1f1b", "float32", "0", marks=pytest.mark.full),
    ("interleaved", "bfloat16", "0"),
    ("gpipe", "float32", "1")])
def test_clean_pipelines_pass_against_the_model_run_whole(traces, schedule, dtype, rescale):
    cand = pp(traces, 2, dtype=dtype, SCHEDULE=schedule, RESCALE=rescale)
    report = ttrace.check(pp(traces, dtype=dtype), cand)
    assert report.passed, str(report)
    assert len(report.rows) > 200
    # Each microbatch's loss its own mean (and the gradients divided by 4 at the end) makes
    # every activation gradient 4 times the reference's; torchtitan's 1/4 rescale does not.
    loss = report.loss_normalization
    assert loss is not None and loss["microbatches"] == 4
    assert loss["divisor"] == (1 if rescale == "1" else 4)
    assert loss["error_chosen"] < 1e-2 < loss[("error_local" if rescale == "1"
                                                else "error_global")]
    # The trace: one stage's mesh (one rank), each stage's rank writing rank 0 of it into its
    # own file, its entries naming its stage; the first stage holds the embedding, the last
    # the output layer, and interleaving gives each rank a layer of each half.
    frags = fragments(cand)
    assert set(frags) == {"manifest.rank0.json", "manifest.rank1.json"}
    for k, (name, m) in enumerate(frags.items()):
        assert m["pipeline"] == {"stages": 2, "microbatches": 4, "dim": 0}
        assert {e["rank"] for e in m["tensors"]} == {0}
        assert {e["stage"] for e in m["tensors"]} == {k}
        assert {e["file"] for e in m["tensors"]} == {f"rank{k}.safetensors"}
    ids = [{e["id"] for e in m["tensors"]} for m in frags.values()]
    assert "tok_embeddings|fwd.output.0" in ids[0] and "output|fwd.output.0" in ids[1]
    layers = [{i.split(".")[1] for i in s if i.startswith("layers.")} for s in ids]
    assert layers == ([{"0", "2"}, {"1", "3"}] if schedule == "interleaved"
                      else [{"0", "1"}, {"2", "3"}])
    # Microbatches concatenated: the candidate's activations have the reference's batch (the
    # safetensors header read by hand).
    raw = (cand / "rank0.safetensors").read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert header["tok_embeddings|fwd.output.0"]["shape"] == [4, 16, 64]


def test_pipeline_stages_that_are_tensor_parallel_pass(traces):
    # 4 ranks: a (pp, tp) = (2, 2) device mesh, torchtitan's TP + SP plan on each stage's part
    # over mesh["tp"], the stages' groups mesh["pp"]: the tracer finds the stage from the
    # PipelineStage and each tensor's tp placement from its DTensors.
    cand = pp(traces, 4, TP="2")
    report = ttrace.check(pp(traces), cand)
    assert report.passed, str(report)
    frags = fragments(cand)
    assert len(frags) == 4
    for k, m in enumerate(frags.values()):
        assert m["pipeline"] == {"stages": 2, "microbatches": 4, "dim": 0}
        assert m["mesh"]["tp"] == 2 and {e["rank"] for e in m["tensors"]} == {k % 2}
        assert {e["stage"] for e in m["tensors"]} == {k // 2}
    wq = [r for r in report.rows if r.id == "layers.2.attention.wq.weight|param_grad"]
    assert wq and wq[0].passed


def test_pipeline_stages_that_are_fully_sharded_pass(traces):
    # 4 ranks: (pp, dp) = (2, 2), FSDP2 over dp on each stage's layers and part, each dp rank 4
    # of the 8 sequences as 4 microbatches: the loss settled as dp · M = 8 times the
    # reference's, the parameter gradients gathered from their FSDP2 shards.
    cand = traces("pp", 4, "", "float32", LAYERS="4", BATCH="8", DP="2")
    report = ttrace.check(traces("pp", LAYERS="4", BATCH="8"), cand)
    assert report.passed, str(report)
    loss = report.loss_normalization
    assert loss is not None and (loss["dp"], loss["microbatches"], loss["divisor"]) == (2, 4, 8)
    frags = fragments(cand)
    for k, m in enumerate(frags.values()):
        assert m["mesh"]["dp"] == 2 and {e["rank"] for e in m["tensors"]} == {k % 2}
        assert {e["stage"] for e in m["tensors"]} == {k // 2}


#: bug → (first failing tensor, a phrase of its localization or note, or None)
BUGS = {
    # A schedule that loses one microbatch's weight gradient of a stage's layer (the
    # zero-bubble dW step skipped, a gradient overwritten instead of accumulated).
    "microbatch-grad-dropped": ("layers.2.feed_forward.w2.weight|param_grad", None),
    # One microbatch's gradient counted twice.
    "microbatch-grad-doubled": ("layers.2.feed_forward.w2.weight|param_grad", None),
    # Each microbatch's loss its own mean and the accumulated gradients never divided by the
    # microbatches (scale_grads off without torchtitan's loss rescale).
    "grads-not-scaled": ("output.weight|param_grad", None),
    # The second stage's input detached: no gradient flows back over the stage boundary.
    "stage-input-detached": ("layers.2.attention_norm|grad.input.0", "none flowed back"),
    # The first stage's output scaled on its way to the second (a wrong boundary buffer).
    "stage-output-scaled": ("layers.2.attention_norm|fwd.input.0",
                            "at the boundary between pipeline stages 0 and 1 (sent from stage "
                            "0 to stage 1): born in untraced code between module "
                            "layers.1.feed_forward.w2 and module layers.2.attention_norm"),
    # The last stage's targets in another microbatch order than the inputs.
    "microbatch-order": ("output|grad.output.0", "the difference is in some microbatches only"),
}


# The quick slice: one bug of each pass (the heavy sweep, --full, runs them all).
QUICK = {"microbatch-grad-dropped", "stage-input-detached", "microbatch-order"}


@pytest.mark.parametrize("bug", [b if b in QUICK else pytest.param(b, marks=pytest.mark.full)
                                 for b in sorted(BUGS)])
def test_pipeline_bugs_are_found_where_they_are_born(traces, bug):
    report = ttrace.check(pp(traces), pp(traces, 2, bug))
    first, phrase = BUGS[bug]
    assert not report.passed
    assert report.first_failure == first, str(report)
    if phrase is not None:
        assert phrase in report.text, str(report)
    # Every one of them fails first on the second stage (layers 2 and 3, the output), and the
    # report says so.
    assert report.localization is not None and report.localization["stage"] == 1


@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.full), "bfloat16"])
def test_ddp_gradient_accumulation_with_no_sync_passes_and_an_unsynced_step_is_found(traces,
                                                                                    dtype):
    # DDP on 2 ranks, each accumulating 2 microbatches of its share (no_sync but for the last),
    # each microbatch's loss its own mean: the activation gradients are dp · M = 4 times the
    # reference's, settled from it.
    report = ttrace.check(traces("ddp", dtype=dtype),
                          traces("ddp", 2, dtype=dtype, ACCUMULATE="2"))
    assert report.passed, str(report)
    loss = report.loss_normalization
    assert loss is not None and (loss["dp"], loss["microbatches"], loss["divisor"]) == (2, 2, 4)
    # Every microbatch under no_sync (the last all-reduce skipped too): each rank keeps its
    # own gradients, found where the replicas first differ.
    bad = ttrace.check(traces("ddp", dtype=dtype),
                       traces("ddp", 2, "accumulate-never-synced", dtype, ACCUMULATE="2"))
    assert not bad.passed
    assert bad.first_failure == "block1.fc2.weight|param_grad"
    assert "rank 1's copy differs" in bad.text


def _accumulate(directory: Path, microbatches: int, calls: "list[int] | None" = None,
                **kw) -> ttrace.Tracer:
    """A two-layer model's step of 4 samples traced whole (``microbatches`` 1) or as
    gradient accumulation over ``microbatches`` chunks, each chunk's loss its own mean and
    the gradients divided at the end; ``calls``: the chunks run (default all)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    x = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(1))
    tracer = ttrace.Tracer(model, directory, microbatches=microbatches, **kw)
    with tracer.step():
        chunks = x.chunk(microbatches)
        for k in (calls if calls is not None else range(microbatches)):
            model(chunks[k]).pow(2).mean().backward()
        for p in model.parameters():
            p.grad /= microbatches
    tracer.close()
    return tracer


def test_gradient_accumulation_is_checked_against_the_whole_batch(tmp_path):
    _accumulate(tmp_path / "ref", 1)
    _accumulate(tmp_path / "cand", 2)
    report = ttrace.check(tmp_path / "ref" / "step0", tmp_path / "cand" / "step0")
    assert report.passed, str(report)
    assert report.loss_normalization is not None
    assert report.loss_normalization["divisor"] == 2
    # The weight gradients' element tests run on the concatenated operands (4 samples).
    stored = ttrace.load(tmp_path / "cand" / "step0", "0|fwd.input.0")
    assert tuple(stored.shape) == (4, 3, 8)


def test_a_microbatch_skipped_is_refused_naming_the_module(tmp_path):
    with pytest.raises(InvalidInputError, match="ran 3 times .* 2 microbatches"):
        _accumulate(tmp_path / "c", 2, calls=[0, 1, 0])


class _Total(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum()


def test_tensors_without_a_batch_dimension_cannot_be_concatenated(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), _Total())
    x = torch.randn(2, 8)
    for skip in (False, True):
        tracer = ttrace.Tracer(model, tmp_path / f"s{skip}", microbatches=2,
                               unsupported="skip" if skip else "raise")
        if skip:
            with tracer.step():
                for xb in x.chunk(2):
                    model(xb).backward()
            assert any("no dimension 0" in why for _, why in tracer.skipped)
        else:
            with pytest.raises(UnsupportedLayoutError, match="no dimension 0"):
                with tracer.step():
                    for xb in x.chunk(2):
                        model(xb[0]).sum().backward()
        tracer.close()


def test_bad_pipeline_settings_are_refused():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(InvalidInputError, match="microbatches must be at least 1"):
        ttrace.Tracer(model, microbatches=0)
    with pytest.raises(InvalidInputError, match="stage= needs stages="):
        ttrace.Tracer(model, stage=1)
    with pytest.raises(InvalidInputError, match="stage 2 of 2 pipeline stages"):
        ttrace.Tracer(model, stages=2, stage=2)
    with pytest.raises(InvalidInputError, match="summaries=True"):
        ttrace.Tracer(model, "d", summaries=True, microbatches=2)
    # A device mesh with a pipeline dimension of 2 (this rank on stage 1), checked online:
    # refused (the online check hands shards between processes by their rank in the mesh).
    with pytest.raises(InvalidInputError, match="online= does not check a pipelined run"):
        ttrace.Tracer(model, "d", online="ref", mesh=FakeMesh(("pp",), (2,), (1,)))
    # Two parts holding one computing module: refused.
    with pytest.raises(InvalidInputError, match="in two model parts"):
        a = torch.nn.Sequential(torch.nn.Linear(2, 2))
        b = torch.nn.Sequential(torch.nn.Linear(2, 2))
        ttrace.Tracer([a, b])
