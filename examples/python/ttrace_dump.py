"""ttrace_dump: record a PyTorch training step as a ttrace trace directory.

Pure Python (torch, safetensors, numpy). Attach a `Tracer` to the model of every rank, run one
training step, call `tracer.write(dir)`; then `ttrace check REF_DIR CAND_DIR`.

What is recorded, under canonical ids (papers/trace-format.md):

* `{module}|fwd.input.{i}` and `{module}|fwd.output.{i}` — every floating-point tensor argument
  and output of each traced module (forward hooks);
* `{module}|grad.output.{i}` and `{module}|grad.input.{i}` — the gradients arriving at and
  leaving each module (full backward hooks);
* `{module}.{param}|param_grad` — every parameter gradient, after the backward pass.

Module names are `model.named_modules()` names, so the reference and the sharded model must
name corresponding modules alike (they do when the sharded model is the same class with
sharded layers). By default the leaf modules are traced; pass `modules=[...]` to choose.

Layouts: a tensor-parallel module's shards are declared with `column_parallel()`,
`row_parallel()` or a `ModuleLayout`; undeclared modules are replicated across the tensor-
parallel ranks. With data parallelism, activations are split along `dp_dim` (the batch).
The manifest records each tensor's module kind (linear, norm, attention, activation,
residual, embedding, loss), inferred from the module type or given in `kinds={name: kind}`,
so that `ttrace check` can price thresholds.

Several ranks in one process (an emulation such as tp_demo.py) share a directory: call
`write(dir)` on each tracer, then `finish(dir)` once (or give `combine=True` on the last).
Separate processes each write `manifest.rank{r}.json`, which `ttrace check` merges itself.

Consistent generation: `seed_everything(seed)` seeds Python, numpy and torch;
`copy_sharded(reference, sharded, layouts, rank, tp)` copies the reference model's parameters
into a rank's shards according to the declared layouts, so both runs start from identical
weights; build the batch from a `torch.Generator` seeded alike in both runs.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
from safetensors.torch import save_file

__all__ = [
    "Mesh",
    "ModuleLayout",
    "Tracer",
    "column_parallel",
    "copy_sharded",
    "finish",
    "partial",
    "replicate",
    "row_parallel",
    "seed_everything",
    "split",
]

VERSION = 1

_DTYPES = {
    torch.float64: "f64",
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
}
for _name, _code in (("float8_e4m3fn", "e4m3"), ("float8_e5m2", "e5m2")):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code


# --- placements ------------------------------------------------------------------------------

def replicate() -> dict:
    """Every rank of the axis holds the whole tensor."""
    return {"kind": "replicate"}


def split(dim: int, groups: int = 1) -> dict:
    """Split along `dim` (negative counts from the end); `groups` interleaved groups."""
    return {"kind": "split", "dim": dim, "groups": groups}


def partial() -> dict:
    """The logical tensor is the sum of the ranks' tensors (before an all-reduce)."""
    return {"kind": "partial"}


@dataclass
class Mesh:
    """The parallel mesh: global rank r = (d*cp + c)*tp + t."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    sp: bool = False

    def world(self) -> int:
        return self.tp * self.cp * self.dp

    def to_json(self) -> dict:
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "sp": self.sp}


@dataclass
class ModuleLayout:
    """Tensor-parallel placements of one module's tensors (along the `tp` axis).

    `inputs`/`outputs` are per-position placements (the last entry repeats); gradients take the
    placement of what they are the gradient of unless `grad_inputs`/`grad_outputs` say
    otherwise; `params` maps a parameter's local name to its placement."""

    inputs: List[dict] = field(default_factory=lambda: [replicate()])
    outputs: List[dict] = field(default_factory=lambda: [replicate()])
    grad_inputs: Optional[List[dict]] = None
    grad_outputs: Optional[List[dict]] = None
    params: Dict[str, dict] = field(default_factory=dict)

    def pick(self, role: str, i: int) -> dict:
        lists = {
            "fwd.input": self.inputs,
            "fwd.output": self.outputs,
            "grad.input": self.grad_inputs if self.grad_inputs is not None else self.inputs,
            "grad.output": self.grad_outputs if self.grad_outputs is not None else self.outputs,
        }[role]
        return lists[min(i, len(lists) - 1)] if lists else replicate()


def column_parallel(gather_output: bool = False) -> ModuleLayout:
    """Megatron's ColumnParallelLinear as seen by hooks on the local `nn.Linear`: input
    replicated, output split along its last dimension, weight split along dim 0 (and bias), and
    the input gradient a partial sum (its all-reduce happens outside the local linear)."""
    return ModuleLayout(
        inputs=[replicate()],
        outputs=[replicate() if gather_output else split(-1)],
        grad_inputs=[partial()],
        params={"weight": split(0), "bias": split(0)},
    )


def row_parallel() -> ModuleLayout:
    """Megatron's RowParallelLinear as seen by hooks on the local `nn.Linear` (without bias:
    the bias is added after the all-reduce): input split along its last dimension, output a
    partial sum, weight split along dim 1, the output gradient replicated."""
    return ModuleLayout(
        inputs=[split(-1)],
        outputs=[partial()],
        grad_outputs=[replicate()],
        params={"weight": split(1), "bias": replicate()},
    )


# --- module kinds ------------------------------------------------------------------------------

def _kind_of(module: torch.nn.Module) -> Optional[str]:
    nn = torch.nn
    table = [
        ((nn.Linear, nn.Bilinear), "linear"),
        ((nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()), "norm"),
        ((nn.Embedding, nn.EmbeddingBag), "embedding"),
        ((nn.MultiheadAttention,), "attention"),
        ((nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Softmax, nn.Dropout), "activation"),
        ((nn.CrossEntropyLoss, nn.MSELoss, nn.NLLLoss), "loss"),
    ]
    for types, kind in table:
        if isinstance(module, types):
            return kind
    return None


# --- the tracer --------------------------------------------------------------------------------

class Tracer:
    """Records one training step of `model` on global rank `rank` of `mesh`.

    `layouts` maps module names to `ModuleLayout`s (tensor-parallel shards); `kinds` overrides
    module kinds; `modules` lists the module names to trace (default: every leaf module);
    `dp_dim` is the batch dimension activations are split along when `mesh.dp > 1`;
    `formats` maps module names to {"quantize", "accumulate", "combine"} format names.
    `recipe` is written to the manifest only if given (use ttrace recipe names)."""

    def __init__(
        self,
        model: torch.nn.Module,
        rank: int = 0,
        mesh: Optional[Mesh] = None,
        layouts: Optional[Dict[str, ModuleLayout]] = None,
        kinds: Optional[Dict[str, str]] = None,
        modules: Optional[Sequence[str]] = None,
        dp_dim: int = 0,
        formats: Optional[Dict[str, dict]] = None,
        recipe: Optional[str] = None,
    ):
        self.model = model
        self.mesh = mesh or Mesh()
        if not 0 <= rank < self.mesh.world():
            raise ValueError(f"rank {rank} is outside the mesh ({self.mesh.world()} ranks)")
        if self.mesh.cp > 1:
            raise ValueError("context parallelism is not supported by this helper yet")
        self.rank = rank
        self.layouts = layouts or {}
        self.kinds = kinds or {}
        self.formats = formats or {}
        self.recipe = recipe
        self.dp_dim = dp_dim
        named = dict(model.named_modules())
        # Looked up once: recording a tensor must not walk the whole model again.
        self._named = named
        names = list(modules) if modules is not None else [
            n for n, m in named.items() if n and not any(True for _ in m.children())
        ]
        unknown = [n for n in list(self.layouts) + list(self.kinds) + names if n not in named]
        if unknown:
            raise ValueError(f"no module named {unknown[0]!r} in the model")
        self.names = names
        self.records: Dict[str, torch.Tensor] = {}
        self.meta: Dict[str, dict] = {}
        self.order: List[str] = []
        self.handles = []
        # A module whose inputs need no gradient (the first layer) still has its output
        # gradients recorded, and torch warns "Full backward hook is firing when gradients
        # are computed with respect to module outputs since no inputs require gradients".
        # The warning is harmless here; it is left to the caller to filter (the tracer
        # changes no process-wide state).
        for n in names:
            m = named[n]
            self.handles.append(m.register_forward_hook(self._forward_hook(n)))
            self.handles.append(m.register_full_backward_hook(self._backward_hook(n)))

    # layouts of one tensor
    def _layout(self, name: str, role: str, i: int, t: torch.Tensor, param: Optional[str] = None) -> dict:
        ml = self.layouts.get(name)
        if param is not None:
            tp = ml.params.get(param, replicate()) if ml else replicate()
        else:
            tp = ml.pick(role, i) if ml else replicate()
        tp = dict(tp)
        if tp.get("kind") == "split" and tp["dim"] < 0:
            tp["dim"] += t.dim()
        if tp.get("kind") == "split" and not 0 <= tp["dim"] < max(t.dim(), 1):
            raise ValueError(f"module {name!r}: split dim out of range for a {t.dim()}-d tensor")
        if self.mesh.tp == 1:
            tp = replicate()
        dp = replicate()
        if self.mesh.dp > 1 and param is None and t.dim() > self.dp_dim and role != "loss":
            dp = split(self.dp_dim)
        return {"dp": dp, "cp": replicate(), "tp": tp}

    def _record(self, name: str, role: str, i: int, t: torch.Tensor, param: Optional[str] = None):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return
        if t.dtype not in _DTYPES:
            raise ValueError(f"module {name!r}: dtype {t.dtype} cannot be stored")
        tid = f"{name}.{param}|param_grad" if param is not None else f"{name}|{role}.{i}"
        layout = self._layout(name, role, i, t, param)
        if t.dim() == 0:
            # A scalar (a loss) is the same on every rank of a tensor-parallel group; under
            # data parallelism record it after averaging over the data-parallel ranks.
            layout["dp"] = replicate()
        if tid not in self.records:
            self.order.append(tid)
        self.records[tid] = t.detach().to("cpu").clone().contiguous()
        self.meta[tid] = {"layout": layout, "module": self._module_info(name)}

    def _kind(self, name: str) -> Optional[str]:
        if name in self.kinds:
            return self.kinds[name]
        return _kind_of(self._named[name])

    def _module_info(self, name: str) -> Optional[dict]:
        kind = self._kind(name)
        if kind is None:
            return None
        info = {"kind": kind}
        info.update(self.formats.get(name, {}))
        return info

    def _forward_hook(self, name: str):
        def hook(module, args, output):
            for i, a in enumerate(args):
                self._record(name, "fwd.input", i, a)
            outs = output if isinstance(output, (tuple, list)) else (output,)
            for i, o in enumerate(outs):
                self._record(name, "fwd.output", i, o)
        return hook

    def _backward_hook(self, name: str):
        def hook(module, grad_input, grad_output):
            for i, g in enumerate(grad_output):
                if g is not None:
                    self._record(name, "grad.output", i, g)
            for i, g in enumerate(grad_input):
                if g is not None:
                    self._record(name, "grad.input", i, g)
            # Parameter gradients are read in write(); remember where they belong.
            self.order.append(("params", name))
        return hook

    def remove(self):
        """Detach the hooks."""
        for h in self.handles:
            h.remove()
        self.handles = []

    def write(self, directory: str, combine: bool = False) -> str:
        """Write `rank{r}.safetensors` and `manifest.rank{r}.json` into `directory` (created);
        with `combine=True` also merge every rank's fragment into `manifest.json`. Returns the
        directory. Parameter gradients are placed right after their module's backward
        tensors, so the manifest lists tensors in execution order."""
        os.makedirs(directory, exist_ok=True)
        named = self._named
        order, seen = [], set()
        for item in self.order:
            if isinstance(item, tuple):
                name = item[1]
                for pname, p in named[name].named_parameters(recurse=False):
                    if p.grad is not None:
                        self._record(name, "param", 0, p.grad, param=pname)
                        tid = f"{name}.{pname}|param_grad"
                        if tid not in seen:
                            seen.add(tid)
                            order.append(tid)
            elif item not in seen:
                seen.add(item)
                order.append(item)
        tensors, entries = {}, []
        fname = f"rank{self.rank}.safetensors"
        for tid in order:
            t = self.records[tid]
            tensors[tid] = t
            e = {"id": tid, "rank": self.rank, "file": fname, "key": tid,
                 "dtype": _DTYPES[t.dtype], "layout": self.meta[tid]["layout"]}
            if self.meta[tid]["module"] is not None:
                e["module"] = self.meta[tid]["module"]
            entries.append(e)
        save_file(tensors, os.path.join(directory, fname), metadata={"rank": str(self.rank)})
        manifest = {"format": "ttrace-trace", "version": VERSION, "mesh": self.mesh.to_json(),
                    "tensors": entries}
        if self.recipe:
            manifest["recipe"] = self.recipe
        _write_json(os.path.join(directory, f"manifest.rank{self.rank}.json"), manifest)
        if combine:
            finish(directory)
        return directory


def _write_json(path: str, obj: dict):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def finish(directory: str) -> str:
    """Merge every `manifest.rank*.json` of `directory` into `manifest.json` (rank order)."""
    parts = sorted(
        (int(n[len("manifest.rank"):-len(".json")]), n)
        for n in os.listdir(directory)
        if n.startswith("manifest.rank") and n.endswith(".json")
    )
    if not parts:
        raise FileNotFoundError(f"no manifest.rank*.json in {directory}")
    merged = None
    for _, n in parts:
        with open(os.path.join(directory, n)) as f:
            m = json.load(f)
        if merged is None:
            merged = m
        else:
            if m["mesh"] != merged["mesh"] or m.get("recipe") != merged.get("recipe"):
                raise ValueError(f"{n} disagrees with the first fragment on the mesh or recipe")
            merged["tensors"].extend(m["tensors"])
    _write_json(os.path.join(directory, "manifest.json"), merged)
    return directory


# --- consistent generation ---------------------------------------------------------------------

def seed_everything(seed: int):
    """Seed Python's, numpy's and torch's generators alike in the reference and sharded runs."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _shard(t: torch.Tensor, placement: dict, rank: int, parts: int) -> torch.Tensor:
    if placement.get("kind") != "split":
        return t
    dim = placement["dim"] % t.dim()
    groups = placement.get("groups", 1)
    n = t.shape[dim]
    if n % (groups * parts):
        raise ValueError(f"dimension {dim} of length {n} does not split into {groups}x{parts}")
    view = t.reshape(*t.shape[:dim], groups, parts, n // (groups * parts), *t.shape[dim + 1:])
    return view.select(dim + 1, rank).reshape(*t.shape[:dim], n // parts, *t.shape[dim + 1:])


@torch.no_grad()
def copy_sharded(reference: torch.nn.Module, sharded: torch.nn.Module,
                 layouts: Dict[str, ModuleLayout], tp_rank: int, tp: int,
                 skip: Sequence[str] = ()):
    """Copy every parameter of `reference` into `sharded` (same module names), taking rank
    `tp_rank`'s slice of the parameters the layouts declare split. Shapes must match;
    parameters named in `skip` are left alone."""
    ref = dict(reference.named_parameters())
    for name, p in sharded.named_parameters():
        if name in skip:
            continue
        if name not in ref:
            raise KeyError(f"parameter {name!r} of the sharded model is not in the reference")
        module, _, local = name.rpartition(".")
        ml = layouts.get(module)
        placement = ml.params.get(local, replicate()) if ml else replicate()
        src = _shard(ref[name], placement, tp_rank, tp) if tp > 1 else ref[name]
        if src.shape != p.shape:
            raise ValueError(f"parameter {name!r}: shard {tuple(src.shape)} vs {tuple(p.shape)}")
        p.copy_(src.to(p.dtype))
