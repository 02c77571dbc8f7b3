"""The Tracer on modules real engines are made of: modules that modify their inputs in
place, attention cores that are not leaves, FP32 main gradients beside low-precision
parameters, and layouts it can only guess."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import harness
import ttrace
from fakes import FakeMesh
from ttrace.tracer import Mesh, replicate, split


class MaskedSoftmax(nn.Module):
    """Megatron's masked softmax: fills the masked scores of its input in place (or, for the
    oracle, out of place)."""

    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.inplace = inplace

    def forward(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.inplace:
            scores.masked_fill_(mask, -10000.0)
        else:
            scores = scores.masked_fill(mask, -10000.0)
        return torch.softmax(scores, dim=-1)


class Net(nn.Module):
    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.act = nn.ReLU(inplace=inplace)
        self.soft = MaskedSoftmax(inplace)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(x))
        return self.fc2(self.soft(h @ h.transpose(0, 1), mask) @ h)


def _grads_by_full_hooks(net: nn.Module, x, mask) -> dict:
    """The gradients leaving each module, taken with PyTorch's full backward hooks on a copy
    without in-place ops (the independent oracle)."""
    seen = {}
    for name in ("act", "soft", "fc2"):
        def bwd(mod, gin, gout, name=name):
            seen[name] = gin[0].detach().clone()
        getattr(net, name).register_full_backward_hook(bwd)
    net(x, mask).pow(2).sum().backward()
    return seen


def test_modules_that_modify_their_inputs_in_place_are_traced(tmp_path):
    torch.manual_seed(0)
    net = Net(inplace=True)
    oracle = Net(inplace=False)
    oracle.load_state_dict(net.state_dict())
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(6, 6, dtype=torch.bool).triu(1)
    # PyTorch's full backward hooks refuse in-place ops on a module's input.
    probe = Net(inplace=True)
    probe.soft.register_full_backward_hook(lambda *a: None)
    try:
        probe(x, mask).sum().backward()
        raise AssertionError("full backward hooks accepted an in-place op on an input")
    except RuntimeError as e:
        assert "inplace" in str(e) or "in-place" in str(e)
    tracer = ttrace.Tracer(net, tmp_path / "t", background=False)
    with tracer.step():
        net(x, mask).pow(2).sum().backward()
    tracer.close()
    data = harness.stored(tmp_path / "t/step0")
    want = _grads_by_full_hooks(oracle, x, mask)
    for name in ("act", "soft", "fc2"):
        got = data[f"{name}|grad.input.0"]
        assert torch.equal(torch.from_numpy(got), want[name]), name
    # The input is recorded as the module received it, before it was modified.
    with torch.no_grad():
        h = torch.relu(net.fc1(x))
    assert torch.equal(torch.from_numpy(data["soft|fwd.input.0"]), h @ h.T)


def test_an_output_changed_by_a_forward_hook_is_recorded_as_the_caller_receives_it(tmp_path):
    # Output hooks registered before the tracer (a planted bug, a clamp): one returns a new
    # tensor, one changes the output in place. The tracer's own hook runs first; the module's
    # recorded output must still be what its caller receives — else a difference born in the
    # hook is found only in the gap after the module.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4))
    net[0].register_forward_hook(lambda m, a, out: out * 1.5)

    def in_place(m, a, out):
        out.mul_(-2.0)

    net[1].register_forward_hook(in_place)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # the oracle: the same arithmetic without hooks or tracer
        h0 = torch.nn.functional.linear(x, net[0].weight, net[0].bias) * 1.5
        h1 = torch.nn.functional.linear(h0, net[1].weight, net[1].bias) * -2.0
        h2 = torch.nn.functional.linear(h1, net[2].weight, net[2].bias)
    tracer = ttrace.Tracer(net, tmp_path / "t", background=False)
    with tracer.step():
        net(x).sum().backward()
    tracer.close()
    data = harness.stored(tmp_path / "t/step0")
    for name, want in (("0", h0), ("1", h1), ("2", h2)):
        got = torch.from_numpy(data[f"{name}|fwd.output.0"])
        assert torch.equal(got, want), name


def test_attention_cores_are_traced_by_default(tmp_path):
    class DotProductAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.softmax = nn.Softmax(dim=-1)

        def forward(self, q, k, v):
            return self.softmax(q @ k.transpose(-1, -2) * 0.5) @ v

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(4, 12)
            self.core = DotProductAttention()

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            return self.core(q, k, v)

    block = Block()
    tracer = ttrace.Tracer(block, tmp_path / "t", background=False)
    assert tracer.names == ["qkv", "core", "core.softmax"]
    with tracer.step():
        block(torch.randn(3, 4)).sum().backward()
    tracer.close()
    entries = json.loads((tmp_path / "t/step0/manifest.rank0.json").read_text())["tensors"]
    kinds = {e["id"]: e.get("module", {}).get("kind") for e in entries}
    assert kinds["core|fwd.output.0"] == "attention"
    assert "core|grad.input.1" in kinds  # the key's gradient, judged where the core makes it


def test_fp32_main_gradients_are_recorded_and_priced_at_their_precision(tmp_path):
    lin = nn.Linear(8, 8).to(torch.bfloat16)
    fused = nn.Linear(8, 8).to(torch.bfloat16)
    fused.gradient_accumulation_fusion = True  # Megatron's attribute
    net = nn.Sequential(lin, fused)
    tracer = ttrace.Tracer(net, tmp_path / "t", background=False)
    with tracer.step():
        net(torch.randn(4, 8, dtype=torch.bfloat16)).float().sum().backward()
        for p in net.parameters():
            p.main_grad = p.grad.float() * 2  # what the optimizer will use
    tracer.close()
    entries = {e["id"]: e for e in json.loads(
        (tmp_path / "t/step0/manifest.rank0.json").read_text())["tensors"]}
    e = entries["0.weight|param_grad"]
    assert e["dtype"] == "f32"
    # Each rank's share was a BF16 gradient added into main_grad: combined at BF16 precision.
    assert e["module"]["combine"] == "bf16"
    # Fused accumulation into main_grad: combined in FP32 (the format's default).
    assert "combine" not in entries["1.weight|param_grad"]["module"]
    got = ttrace.load(tmp_path / "t/step0", "0.weight|param_grad")
    assert (got == (lin.weight.grad.double() * 2).numpy()).all()


def test_layouts_of_plain_tensors_are_marked_as_guesses(tmp_path):
    # Rank 0 of a 2-way tensor-parallel mesh, nothing declared: every tensor's tp placement
    # is a guess; under data parallelism the batch dimension is one too — not the parameters'.
    net = nn.Sequential(nn.Linear(4, 4), nn.GELU())
    for mesh, want, params in ((Mesh(tp=2), ["tp"], ["tp"]), (Mesh(dp=2), ["dp"], None)):
        d = tmp_path / f"tp{mesh.tp}-dp{mesh.dp}"
        tracer = ttrace.Tracer(net, d, mesh=mesh, rank=0, background=False)
        with tracer.step():
            net(torch.randn(2, 4)).sum().backward()
        tracer.close()
        entries = {e["id"]: e for e in json.loads(
            (d / "step0/manifest.rank0.json").read_text())["tensors"]}
        assert entries["1|fwd.output.0"]["guessed"] == want
        assert entries["1|grad.input.0"]["guessed"] == want
        assert entries["0.weight|param_grad"].get("guessed") == params


def test_a_module_called_twice_in_a_step_records_each_call(tmp_path):
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(4, 4)
            self.act = nn.GELU()  # one instance, two call sites
            self.fc2 = nn.Linear(4, 4)

        def forward(self, x):
            return self.act(self.fc2(self.act(self.fc1(x))))

    torch.manual_seed(0)
    net = Twice()
    x = torch.randn(3, 4)
    tracer = ttrace.Tracer(net, tmp_path / "t", background=False)
    with tracer.step():
        net(x).pow(2).sum().backward()
    tracer.close()
    step = tmp_path / "t/step0"
    ids = [e["id"] for e in json.loads((step / "manifest.rank0.json").read_text())["tensors"]]
    assert "act|fwd.output.0" in ids and "act#1|fwd.output.0" in ids
    assert "act#1|grad.input.0" in ids and "fc2.weight|param_grad" in ids
    with torch.no_grad():
        first = torch.nn.functional.gelu(net.fc1(x))
        second = torch.nn.functional.gelu(net.fc2(first))
    assert (ttrace.load(step, "act|fwd.output.0") == first.double().numpy()).all()
    assert (ttrace.load(step, "act#1|fwd.output.0") == second.double().numpy()).all()
    # Each call's gradient is its own: the second's output gradient is d(sum y²)/dy = 2y.
    assert (ttrace.load(step, "act#1|grad.output.0") == (2 * second).double().numpy()).all()
    # A copy of the run passes, every tensor compared; the run itself — the same directory,
    # or a link to it — is refused: a trace compared with itself proves nothing.
    import shutil

    from ttrace.errors import TraceError

    shutil.copytree(step, tmp_path / "copy")
    report = ttrace.check(step, tmp_path / "copy")
    assert report.passed and len(report.rows) == len(ids)
    (tmp_path / "link").symlink_to(step)
    for same in (step, tmp_path / "link"):
        with pytest.raises(TraceError, match="compared with itself") as e:
            ttrace.check(step, same)
        assert e.value.kind == "InvalidParameter"


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_records_the_same_tensors(tmp_path, reentrant):
    # The recomputation inside the backward pass is not a further call of the modules: the
    # trace has the same ids as without checkpointing (with the reentrant variant the
    # gradients come only from the recomputed graph), and the same values.
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.act, self.fc2 = nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)

        def forward(self, x):
            return self.fc2(self.act(self.fc1(x)))

    class Net(nn.Module):
        def __init__(self, ck: bool) -> None:
            super().__init__()
            self.block, self.ck = Block(), ck

        def forward(self, x):
            return checkpoint(self.block, x, use_reentrant=reentrant) if self.ck else self.block(x)

    steps = {}
    for ck in (False, True):
        torch.manual_seed(0)
        net = Net(ck)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        tracer = ttrace.Tracer(net, tmp_path / f"ck{ck}", background=False)
        with tracer.step():
            net(x).pow(2).sum().backward()
        tracer.close()
        steps[ck] = tmp_path / f"ck{ck}/step0"
    ids = {ck: [e["id"] for e in json.loads((d / "manifest.rank0.json").read_text())["tensors"]]
           for ck, d in steps.items()}
    assert sorted(ids[True]) == sorted(ids[False])
    assert "block.fc1|grad.output.0" in ids[True]
    for i in ids[False]:
        assert (ttrace.load(steps[True], i) == ttrace.load(steps[False], i)).all(), i


def test_meshes_as_engines_build_them():
    from torch.distributed.tensor import Replicate, Shard

    from ttrace.errors import UnsupportedLayoutError
    from ttrace.tracer.dtensor import _MeshMap, _placement_layout

    # transformers: (pp, dp_replicate, fsdp, tp), all of size 1 but tp.
    mm = _MeshMap(FakeMesh(("pp", "dp_replicate", "fsdp", "tp"), (1, 1, 1, 4), (0, 0, 0, 3)), {})
    assert mm.error is None and mm.sizes == {"tp": 4, "cp": 1, "dp": 1} and mm.coords["tp"] == 3
    # HSDP: two data-parallel dimensions form one dp axis, row-major.
    hsdp = FakeMesh(("dp_replicate", "dp_shard", "tp"), (2, 2, 2), (1, 0, 1))
    mm = _MeshMap(hsdp, {})
    assert mm.sizes == {"tp": 2, "cp": 1, "dp": 4} and mm.coords == {"tp": 1, "cp": 0, "dp": 2}
    shape = (8, 6)
    lay = _placement_layout("w", (Shard(0), Shard(0), Replicate()), hsdp, shape, mm)
    assert lay.dp == split(0) and lay.tp == replicate()
    with pytest.raises(UnsupportedLayoutError, match="place it differently"):
        _placement_layout("w", (Replicate(), Shard(0), Replicate()), hsdp, shape, mm)
    # A flattened torchtitan dimension (dp_shard_cp) is data parallel.
    assert _MeshMap(FakeMesh(("dp_shard_cp",), (2,), (1,)), {}).sizes["dp"] == 2
    # ... and holds the context-parallel ranks inside the data-parallel ones when the mesh it
    # was cut from has a cp dimension: FSDP2 over (dp_shard_cp, tp) of (dp_shard, cp, tp)
    # = (2, 2, 2), at coordinate 3 = d·cp + c with d = 1, c = 1.
    root = FakeMesh(("dp_replicate", "dp_shard", "cp", "tp"), (1, 2, 2, 2), (0, 1, 1, 0))
    flat = FakeMesh(("dp_shard_cp", "tp"), (4, 2), (3, 0))
    flat._get_root_mesh = lambda: root
    mm = _MeshMap(flat, {})
    assert mm.sizes == {"tp": 2, "cp": 2, "dp": 2} and mm.coords == {"tp": 0, "cp": 1, "dp": 1}
    lay = _placement_layout("w", (Shard(0), Replicate()), flat, (8, 6), mm)
    # dp cuts first, cp cuts what dp left: the flattened dimension's contiguous split.
    assert lay.dp == lay.cp == split(0)
    assert lay.tp == replicate()
    # Pipeline parallelism of size 2 places modules, not tensors: the stage is this rank's pp
    # coordinate, and tensors are placed on the other dimensions (one stage's mesh).
    pp = FakeMesh(("pp", "tp"), (2, 2), (1, 1))
    mm = _MeshMap(pp, {})
    assert mm.error is None and (mm.stages, mm.stage) == (2, 1)
    assert mm.sizes == {"tp": 2, "cp": 1, "dp": 1} and mm.coords["tp"] == 1
    lay = _placement_layout("x", (Replicate(), Shard(0)), pp, (4,), mm)
    assert lay.tp == split(0) and lay.dp == replicate()
    # Expert parallelism of size 2: not placeable — said per tensor, with the fix.
    ep = FakeMesh(("ep", "tp"), (2, 2), (0, 1))
    mm = _MeshMap(ep, {})
    assert mm.error is not None and "expert" in mm.error
    with pytest.raises(UnsupportedLayoutError, match="expert"):
        _placement_layout("x", (Replicate(), Replicate()), ep, (4,), mm)
    # An unknown name: the message's fix works.
    mm = _MeshMap(FakeMesh(("replicas", "tp"), (2, 2), (1, 0)), {})
    assert mm.error is not None and "axes={'dp': 'replicas'}" in mm.error
    fixed = _MeshMap(FakeMesh(("replicas", "tp"), (2, 2), (1, 0)), {"dp": "replicas"})
    assert fixed.error is None and fixed.sizes == {"tp": 2, "cp": 1, "dp": 2}


def test_mesh_and_tracer_are_exported_and_typed():
    import ttrace

    assert ttrace.Mesh(tp=2).world() == 2
    assert ttrace.Tracer is ttrace.tracer.Tracer
    assert ttrace.ModuleLayout is ttrace.tracer.ModuleLayout


def test_a_megatron_output_layer_twice_the_ffn_width_is_no_fused_projection():
    """Megatron's fused gate/up projection is recognized by its place (``linear_fc1``), not
    by its width: an output layer whose vocabulary is twice the FFN width stays a plain
    column-parallel layer (Megatron-core 0.19's GPT failed every TP run on this)."""
    from types import SimpleNamespace

    from ttrace.tracer.megatron import _megatron_layout

    class ColumnParallelLinear(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = SimpleNamespace(gated_linear_unit=True, ffn_hidden_size=64)
            self.output_size = 128
            self.gather_output = False

    ColumnParallelLinear.__module__ = "megatron.core.tensor_parallel.layers"
    m = ColumnParallelLinear()
    fused = _megatron_layout(m, "decoder.layers.0.mlp.linear_fc1")
    plain = _megatron_layout(m, "output_layer")
    assert fused is not None and plain is not None
    assert fused.params["weight"].groups == 2
    assert plain.params.get("weight", split(0)).groups == 1


class _SdpaBlock(nn.Module):
    """A projection and a functional attention core called by the block itself (recorded as
    the attention site ``sdpa``)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(4, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unsqueeze(0).chunk(3, dim=-1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def _mode_stack() -> list:
    # PyTorch's own record of the torch-function modes in force on this thread.
    from torch.overrides import _get_current_function_mode_stack
    return _get_current_function_mode_stack()


def test_tracers_never_leave_modes_behind_nor_pop_a_mode_they_did_not_push(tmp_path):
    from torch.overrides import TorchFunctionMode

    class UserMode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    before = len(_mode_stack())
    # Ranks emulated in one process: tracers attached together, closed in any order.
    tracers = [ttrace.Tracer(_SdpaBlock()) for _ in range(3)]
    assert len(_mode_stack()) == before + 1
    tracers[0].close()
    tracers[2].close()
    tracers[1].close()
    assert len(_mode_stack()) == before
    # Written and left open, many times over (a loop of runs): one mode, whatever their number.
    open_tracers = []
    for i in range(20):
        open_tracers.append(ttrace.Tracer(_SdpaBlock()))
        open_tracers[-1].write(tmp_path / f"w{i}")
    assert len(_mode_stack()) == before + 1
    for t in open_tracers:
        t.close()
    assert len(_mode_stack()) == before
    # A mode the user enters after a tracer attached is never popped by the tracer; ours
    # stays inert beneath it and serves the next tracer.
    attached = ttrace.Tracer(_SdpaBlock())
    user = UserMode()
    with user:
        attached.close()
        assert _mode_stack()[-1] is user and len(_mode_stack()) == before + 2
    ttrace.Tracer(_SdpaBlock()).close()
    assert len(_mode_stack()) == before


def test_an_attention_call_is_recorded_by_the_tracer_whose_module_runs_it(tmp_path):
    torch.manual_seed(0)
    blocks = [_SdpaBlock(), _SdpaBlock()]
    tracers = [ttrace.Tracer(b, rank=r, mesh=Mesh(dp=2)) for r, b in enumerate(blocks)]
    x = torch.randn(5, 4)
    for b in blocks:
        b(x).sum().backward()
    for r, t in enumerate(tracers):
        t.write(tmp_path / f"r{r}")
        t.close()
    for r, b in enumerate(blocks):
        entries = json.loads((tmp_path / f"r{r}/manifest.rank{r}.json").read_text())["tensors"]
        ids = {e["id"] for e in entries}
        # One call each, as its own block made it: no "sdpa#1" from the other rank's call.
        assert "sdpa|fwd.output.0" in ids and not any(i.startswith("sdpa#1") for i in ids)
        data = harness.stored(tmp_path / f"r{r}", rank=r)
        q, k, v = b.qkv(x).unsqueeze(0).chunk(3, dim=-1)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        assert torch.equal(torch.from_numpy(data["sdpa|fwd.output.0"]), want.detach())


class _Attn(nn.Module):
    """A projection and functional attention called once per keyword set given (one site,
    ``{name}.sdpa``, called that many times)."""

    def __init__(self, *calls: dict) -> None:
        super().__init__()
        self.qkv = nn.Linear(4, 12)
        self.calls = calls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unsqueeze(0).chunk(3, dim=-1)
        f = torch.nn.functional.scaled_dot_product_attention
        return sum(f(q, k, v, **kw) for kw in self.calls)


class _TwoSites(nn.Module):
    def __init__(self, a: dict, b: dict, b2: dict) -> None:
        super().__init__()
        self.a, self.b = _Attn(a), _Attn(b, b2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x)


@pytest.mark.parametrize("a, b, b2, want", [
    ({}, {"is_causal": True}, {"is_causal": True},
     ("attention", "attention:causal", "attention:causal")),
    # The default scale written out is the default; another scale, a mask or dropout is
    # another op; each call of a site names its own.
    ({"scale": 0.5}, {"scale": 0.3}, {}, ("attention", None, "attention")),
    ({"attn_mask": torch.ones(5, 5, dtype=torch.bool)}, {"dropout_p": 0.5}, {"is_causal": True},
     (None, None, "attention:causal")),
])
def test_an_attention_site_records_the_op_its_calls_compute(tmp_path, a, b, b2, want):
    torch.manual_seed(0)
    # Head dimension 4: the default scale is 1/2.
    model = _TwoSites(a, b, b2)
    t = ttrace.Tracer(model)
    model(torch.randn(5, 4)).sum().backward()
    t.write(tmp_path)
    t.close()
    ops: dict = {}
    for e in json.loads((tmp_path / "manifest.rank0.json").read_text())["tensors"]:
        if ".sdpa" in e["id"]:
            ops.setdefault(e["id"].split("|")[0], set()).add(e.get("module", {}).get("op"))
    assert ops == {"a.sdpa": {want[0]}, "b.sdpa": {want[1]}, "b.sdpa#1": {want[2]}}, ops


class _Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


@pytest.mark.parametrize("kwargs, want", [
    ({}, "cross_entropy"),
    ({"ignore_index": -1}, "cross_entropy"),
    # Class weights, label smoothing, another reduction, an ignore_index inside the classes:
    # another op than the registry's.
    ({"weight": torch.ones(6)}, None),
    ({"label_smoothing": 0.1}, None),
    ({"reduction": "sum"}, None),
    ({"ignore_index": 2}, None),
])
def test_a_loss_site_records_its_logits_targets_and_op(tmp_path, kwargs, want):
    torch.manual_seed(0)
    model = _Classifier()
    t = ttrace.Tracer(model, losses=True)
    x, y = torch.randn(5, 4), torch.tensor([0, 5, 2, 2, 1])
    loss = torch.nn.functional.cross_entropy(model(x), y, **kwargs)
    loss.backward()
    t.write(tmp_path)
    t.close()
    entries = json.loads((tmp_path / "manifest.rank0.json").read_text())["tensors"]
    site = {e["id"]: e for e in entries if e["id"].startswith("cross_entropy|")}
    assert set(site) == {f"cross_entropy|{r}" for r in
                         ("fwd.input.0", "fwd.input.1", "fwd.output.0", "grad.output.0",
                          "grad.input.0")}
    assert {e.get("module", {}).get("op") for e in site.values()} == {want}
    assert {e["module"]["kind"] for e in site.values()} == {"loss"}
    data = harness.stored(tmp_path)
    assert (data["cross_entropy|fwd.input.1"] == y.numpy()).all()
    assert float(data["cross_entropy|fwd.output.0"]) == float(loss.detach())


def test_loss_sites_are_off_by_default_and_refused_with_microbatches():
    model = _Classifier()
    t = ttrace.Tracer(model)
    torch.nn.functional.cross_entropy(model(torch.randn(3, 4)), torch.tensor([0, 1, 2]))
    assert not any("cross_entropy" in i for i in t._s.records)
    t.close()
    with pytest.raises(ttrace.InvalidInputError, match="losses=True with microbatches"):
        ttrace.Tracer(_Classifier(), losses=True, microbatches=2)



class GroupedExperts(nn.Module):
    """Grouped experts called as torchtitan's are — ``forward(x, tokens_per_expert)``: the
    rows of x grouped expert by expert — holding ``local`` of ``total`` experts."""

    def __init__(self, local: int, total: int) -> None:
        super().__init__()
        self.num_experts = total
        self.w = nn.Parameter(torch.randn(local, 3, 4))
        self.shift = nn.Parameter(torch.zeros(4))  # not stacked by expert

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        outs, start = [], 0
        for j, n in enumerate(counts.tolist()):
            outs.append((x[start:start + n] + self.shift) @ self.w[j].T)
            start += n
        return torch.cat(outs)


class _Routed(nn.Module):
    def __init__(self, local: int, total: int) -> None:
        super().__init__()
        self.experts = GroupedExperts(local, total)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self.experts(x, counts)


def test_grouped_experts_given_token_counts_are_recorded_expert_by_expert(tmp_path):
    torch.manual_seed(0)
    counts = torch.tensor([2, 0, 3])
    x = torch.randn(5, 4, requires_grad=True)
    # Rank 1 of two data ranks, each holding 3 of the 6 experts: its experts are 3, 4 and 5.
    for rank, mesh, first in ((0, None, 0), (1, Mesh(dp=2), 3)):
        model = _Routed(3, 6 if mesh is not None else 3)
        tracer = ttrace.Tracer(model, tmp_path / f"r{rank}", mesh=mesh, rank=rank,
                               background=False)
        with tracer.step():
            model(x, counts).pow(2).sum().backward()
        tracer.close()
        step = tmp_path / f"r{rank}/step0"
        entries = {e["id"]: e for e in json.loads(
            (step / f"manifest.rank{rank}.json").read_text())["tensors"]}
        data = harness.stored(step, rank=rank)
        # No tensor of the whole call: its rows are the experts' own, one id per expert.
        assert not any(i.startswith("experts|") or i.startswith("experts.w") for i in entries)
        w, rows = model.experts.w.detach(), [(0, 2), (2, 0), (2, 3)]
        for j, (start, n) in enumerate(rows):
            e = first + j
            want_in = x.detach()[start:start + n]
            assert torch.equal(torch.from_numpy(data[f"experts.{e}|fwd.input.0"]), want_in)
            assert torch.equal(torch.from_numpy(data[f"experts.{e}|fwd.output.0"]),
                               want_in @ w[j].T)
            grad = torch.from_numpy(data[f"experts.{e}.w|param_grad"])
            assert torch.allclose(grad, model.experts.w.grad[j])
            # Owned by this data rank under data parallelism; a one-rank trace owns nothing.
            owned = entries[f"experts.{e}|fwd.input.0"].get("owned")
            assert owned == ("dp" if mesh is not None else None)
        assert f"experts.{first}|grad.input.0" in entries
        # A parameter not stacked by expert: its gradient recorded whole.
        assert torch.allclose(torch.from_numpy(data["experts.shift|param_grad"]),
                              model.experts.shift.grad)


def test_grouped_experts_on_every_data_rank_are_refused_by_name(tmp_path):
    # Every expert on each of two data ranks (no expert parallelism): each rank's rows of an
    # expert are its own tokens', a split the trace cannot hold — refused, or skipped.
    x, counts = torch.randn(5, 4), torch.tensor([2, 0, 3])
    model = _Routed(3, 3)
    with ttrace.Tracer(model, tmp_path / "a", mesh=Mesh(dp=2), rank=0,
                       background=False) as tracer:
        with pytest.raises(ttrace.errors.UnsupportedLayoutError, match="'experts'.*expert "
                           "parallelism over the data ranks only"):
            with tracer.step():
                model(x, counts)
    tracer = ttrace.Tracer(model, tmp_path / "b", mesh=Mesh(dp=2), rank=0, background=False,
                           unsupported="skip")
    with tracer.step():
        model(x, counts)
    tracer.close()
    assert [n for n, _ in tracer.skipped] == ["experts"]
    assert not any(i.startswith("experts") for i in _ids(tmp_path / "b/step0"))
    # Counts that do not sum to the rows: not a call with token counts, recorded whole.
    with ttrace.Tracer(model, tmp_path / "c", background=False) as tracer:
        with tracer.step():
            model(x[:4], counts)
    assert "experts|fwd.input.0" in _ids(tmp_path / "c/step0")


def _ids(step):
    return {e["id"] for e in json.loads((step / "manifest.rank0.json").read_text())["tensors"]}
