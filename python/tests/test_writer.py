"""The one writer of the trace format: the tracer hands each step's header and entries to the
Rust core, which builds the manifest, validates it as every reader does and writes it — and
merges fragments as it reads them."""

from __future__ import annotations

import json
from typing import Any, List

import numpy as np
import pytest
import torch

from models import Mlp
import ttrace
from ttrace import _ttrace
from ttrace.errors import InvalidInputError, TraceError
from ttrace.tracer import Mesh, column_parallel, row_parallel


def _traced_step(directory: Any, handed: List[str], monkeypatch: pytest.MonkeyPatch,
                 **kwargs: Any) -> None:
    """One step of the MLP traced into ``directory``, with what the tracer hands the core
    appended to ``handed``."""
    real = _ttrace.write_step

    def spy(*args: Any) -> int:
        handed.append(args[5])
        return real(*args)

    monkeypatch.setattr(_ttrace, "write_step", spy)
    torch.manual_seed(0)
    net = Mlp(8, 16)
    tracer = ttrace.Tracer(net, directory, background=False, **kwargs)
    with tracer.step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            net(torch.randn(4, 8)).float().sum().backward()
    tracer.close()


@pytest.mark.parametrize("config", ["plain", "tp2-declared", "dp2-recipe"])
def test_the_core_writes_every_field_the_tracer_recorded(tmp_path, monkeypatch, config):
    # The oracle is the tracer's own record of the step (the JSON it hands over): the written
    # manifest holds exactly it, with the format and version the core adds — layouts,
    # guesses, module kinds and arithmetic, the run's settings, the recipe and the loss
    # normalization alike.
    kwargs: dict = {
        "plain": {},
        "tp2-declared": {"mesh": Mesh(tp=2), "rank": 1,
                         "layouts": {"fc1": column_parallel(), "fc2": row_parallel()}},
        "dp2-recipe": {"mesh": Mesh(dp=2), "rank": 0, "recipe": "bf16"},
    }[config]
    handed: List[str] = []
    _traced_step(tmp_path, handed, monkeypatch, **kwargs)
    assert len(handed) == 1
    rank = kwargs.get("rank", 0)
    written = json.loads((tmp_path / "step0" / f"manifest.rank{rank}.json").read_text())
    assert written.pop("format") == "ttrace-trace"
    assert written.pop("version") == 2  # the trace format version 2 (named mesh axes)
    recorded = json.loads(handed[0])
    assert written == recorded
    # What the configurations put there, so that the comparison is not of empty records.
    entries = recorded["tensors"]
    assert len(entries) >= 8 and "torch" in recorded["run"]
    assert any(e.get("module", {}).get("autocast") == "bf16" for e in entries)
    if config == "tp2-declared":
        assert any(e["layout"]["tp"]["kind"] == "split" for e in entries)
    if config == "dp2-recipe":
        assert recorded["recipe"] == "bf16" and recorded["dp_loss"] == "auto"
        assert any(e.get("guessed") == ["dp"] for e in entries)


def _one_tensor_step(directory: Any, layout_tp: dict, key: str = "x|fwd.output.0",
                     file: str = "rank0.safetensors") -> int:
    entry = {"id": "x|fwd.output.0", "rank": 0, "file": "rank0.safetensors", "key": key,
             "dtype": "f32", "layout": {"dp": {"kind": "replicate"},
                                        "cp": {"kind": "replicate"}, "tp": layout_tp}}
    manifest = {"mesh": {"tp": 1, "cp": 1, "dp": 1, "sp": False}, "tensors": [entry]}
    data = np.arange(4, dtype=np.float32).view(np.uint8)
    return _ttrace.write_step(str(directory), file, [("x|fwd.output.0", "f32", [4], data)],
                              {"rank": "0"}, "manifest.rank0.json", json.dumps(manifest), False)


def test_a_step_a_reader_would_refuse_is_never_written(tmp_path):
    ok = tmp_path / "ok"
    ok.mkdir()
    assert _one_tensor_step(ok, {"kind": "replicate"}) == 16
    assert sorted(p.name for p in ok.iterdir()) == ["manifest.rank0.json", "rank0.safetensors"]
    # A placement no mesh could use (dimension 99), on an axis of size 1: refused before any
    # byte is written.
    bad = tmp_path / "bad"
    bad.mkdir()
    with pytest.raises(TraceError) as e:
        _one_tensor_step(bad, {"kind": "split", "dim": 99, "groups": 1})
    assert e.value.kind == "File" and "dimension 99" in str(e.value)
    # An entry naming a key the step does not store, or a file that is not the step's.
    with pytest.raises(InvalidInputError) as e:
        _one_tensor_step(bad, {"kind": "replicate"}, key="missing")
    assert e.value.kind == "InvalidParameter" and "missing" in str(e.value)
    with pytest.raises(InvalidInputError) as e:
        _one_tensor_step(bad, {"kind": "replicate"}, file="../escape.safetensors")
    assert e.value.kind == "InvalidParameter"
    assert list(bad.iterdir()) == []


def test_fragments_merge_in_rank_order_and_must_agree(tmp_path, monkeypatch):
    for rank in (1, 0):
        handed: List[str] = []
        _traced_step(tmp_path, handed, monkeypatch, mesh=Mesh(tp=2), rank=rank,
                     layouts={"fc1": column_parallel(), "fc2": row_parallel()})
    step = tmp_path / "step0"
    ttrace.tracer.finish(step)
    merged = json.loads((step / "manifest.json").read_text())
    ranks = [e["rank"] for e in merged["tensors"]]
    assert ranks == sorted(ranks) and set(ranks) == {0, 1}
    per_rank = [json.loads((step / f"manifest.rank{r}.json").read_text())["tensors"]
                for r in (0, 1)]
    assert merged["tensors"] == per_rank[0] + per_rank[1]
    # A fragment that disagrees on the recipe: refused, the merged manifest left as it was.
    before = (step / "manifest.json").read_bytes()
    frag = json.loads((step / "manifest.rank1.json").read_text())
    frag["recipe"] = "bf16"
    (step / "manifest.rank1.json").write_text(json.dumps(frag))
    with pytest.raises(TraceError) as e:
        ttrace.tracer.finish(step)
    assert e.value.kind == "File" and "disagrees" in str(e.value)
    assert (step / "manifest.json").read_bytes() == before
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TraceError):
        ttrace.tracer.finish(empty)


def test_equal_contents_are_stored_once(tmp_path):
    # Two ids with equal bytes, format and shape share one stored tensor; equal bytes in
    # another shape, or another format, are stored apart.
    def entry(tid: str, dtype: str) -> dict:
        return {"id": tid, "rank": 0, "file": "rank0.safetensors", "key": tid, "dtype": dtype,
                "layout": {"dp": {"kind": "replicate"}, "cp": {"kind": "replicate"},
                           "tp": {"kind": "replicate"}}}

    v = np.arange(6, dtype=np.float32)
    tensors = [("a|fwd.output.0", "f32", [6], v.view(np.uint8)),
               ("b|fwd.input.0", "f32", [6], v.copy().view(np.uint8)),
               ("c|fwd.input.0", "f32", [2, 3], v.copy().view(np.uint8)),
               ("d|fwd.input.0", "f16", [12], v.copy().view(np.uint8))]
    manifest = {"mesh": {"tp": 1, "cp": 1, "dp": 1, "sp": False},
                "tensors": [entry("a|fwd.output.0", "f32"), entry("b|fwd.input.0", "f32"),
                            entry("c|fwd.input.0", "f32"), entry("d|fwd.input.0", "f16")]}
    written = _ttrace.write_step(str(tmp_path), "rank0.safetensors", tensors, {},
                                 "manifest.json", json.dumps(manifest), False)
    assert written == 3 * 24
    keys = {e["id"]: e["key"] for e in json.loads((tmp_path / "manifest.json").read_text())
            ["tensors"]}
    assert keys == {"a|fwd.output.0": "a|fwd.output.0", "b|fwd.input.0": "a|fwd.output.0",
                    "c|fwd.input.0": "c|fwd.input.0", "d|fwd.input.0": "d|fwd.input.0"}
    values = ttrace.load_all(tmp_path)
    assert np.array_equal(values["b|fwd.input.0"], v) and values["c|fwd.input.0"].shape == (2, 3)
    assert np.array_equal(values["d|fwd.input.0"],
                          v.view(np.float16).astype(np.float64))


def test_placements_are_typed_values_and_accept_the_manifest_form():
    # Layouts are values (Placement, Layout), not dicts with magic keys; a declaration in the
    # manifest's form is still accepted and made typed.
    from ttrace.tracer import Layout, ModuleLayout, Placement, partial, replicate, split

    ml = ModuleLayout(inputs=[{"kind": "split", "dim": -1}],
                      params={"weight": {"kind": "split", "dim": 0, "groups": 2}})
    assert ml.inputs == [split(-1)] and ml.params["weight"] == split(0, 2)
    assert ml.pick("grad.input", 3) == split(-1)
    layout = Layout(dp=split(0), tp=partial()).with_guess("dp")
    assert layout.guessed == ("dp",) and layout.known().guessed == ()
    assert layout.partial_axes() == ["tp"]
    assert layout.grad() == Layout(dp=split(0), guessed=("dp",))
    assert layout.to_json() == {"dp": {"kind": "split", "dim": 0, "groups": 1},
                                "cp": {"kind": "replicate"}, "tp": {"kind": "partial"}}
    assert replicate() == Placement("replicate")
    with pytest.raises(ValueError):
        Placement("sharded")
    with pytest.raises(ValueError):
        layout.with_("pp", replicate())
    with pytest.raises(TypeError):
        ModuleLayout(inputs=["split"])  # type: ignore[list-item]
