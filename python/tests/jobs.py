"""Training steps run by the multi-process tests, one process per rank (gloo on CPU).

``python jobs.py JOB DIRECTORY [BUG]``: runs JOB's reference (one process) or its parallel
version (when WORLD_SIZE > 1, with MASTER_ADDR/MASTER_PORT/RANK set by the test), traced into
DIRECTORY. BUG plants a bug in the parallel version.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import ttrace

#: TTRACE_TEST_MCORE=19: megatron-core 0.19.2 from target/mcore19 (scripts/test.sh installs it
#: there beside the environment's 0.16.1) instead of the environment's.
MCORE = os.environ.get("TTRACE_TEST_MCORE", "")
if MCORE:
    _side = Path(__file__).resolve().parents[2] / "target" / f"mcore{MCORE}"
    if not (_side / "megatron" / "core").is_dir():
        raise SystemExit(f"megatron-core {MCORE} is not installed at {_side} "
                         "(scripts/test.sh installs it)")
    sys.path.insert(0, str(_side))

#: TTRACE_TEST_MLP=H,F,S,B: other sizes (hidden, FFN, sequence, batch) for a larger step.
HIDDEN, FFN, SEQ, BATCH = (int(v) for v in os.environ.get("TTRACE_TEST_MLP", "32,64,8,4").split(","))


class Block(nn.Module):
    """LayerNorm → fc1 → GELU → fc2, the MLP half of a transformer block."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, FFN)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(self.norm(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block0 = Block()
        self.block1 = Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.block0(x)
        return h + self.block1(h)


def make() -> "tuple[Model, torch.Tensor]":
    """The model and batch, in the dtype named by TTRACE_TEST_DTYPE (default float32)."""
    dtype = getattr(torch, os.environ.get("TTRACE_TEST_DTYPE", "float32"))
    torch.manual_seed(0)
    model = Model().to(dtype)
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype)
    return model, x


def tp(directory: str, bug: str) -> None:
    """Tensor parallelism with sequence parallelism (DTensor): norms on sequence shards,
    fc1 column-parallel, fc2 row-parallel with a reduce-scatter back to sequence shards
    (TTRACE_TEST_SP=0: no sequence parallelism, fc2's output all-reduced).
    Bugs: ``wrong-shard``: block1.fc1's weight shards in the wrong rank order;
    ``fc2-partial`` (without SP): block0.fc2's output layout Partial(), never reduced."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    model, x = make()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    sp = os.environ.get("TTRACE_TEST_SP", "1") == "1"
    if world > 1:
        if os.environ.get("TTRACE_TEST_MESH") == "nd":
            # As transformers and torchtitan build it: one n-D root mesh, every dimension but
            # tp of size 1, the parameters on its tp sub-mesh.
            root = init_device_mesh("cpu", (1, 1, 1, world),
                                    mesh_dim_names=("pp", "dp_replicate", "fsdp", "tp"))
            mesh = root["tp"]
        else:
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        full = model.block1.fc1.weight.detach().clone()
        for name in ("block0", "block1"):
            plan = {
                f"{name}.norm": SequenceParallel(),
                f"{name}.fc1": ColwiseParallel(input_layouts=Shard(1)),
                f"{name}.fc2": RowwiseParallel(output_layouts=Shard(1)),
            }
            if not sp:
                plan = {f"{name}.fc1": ColwiseParallel(), f"{name}.fc2": RowwiseParallel()}
                if bug == "fc2-partial" and name == "block0":
                    # The reduction deferred (a Partial() output layout) and never done: the
                    # local partial product is handed on as a plain tensor.
                    plan[f"{name}.fc2"] = RowwiseParallel(output_layouts=Partial())
            parallelize_module(model, mesh, plan)
        if bug == "wrong-shard":
            # A checkpoint loaded with the shards in the wrong order: block1.fc1's rows on
            # rank r are those of rank r + 1.
            r, n = dist.get_rank(), FFN // world
            other = (r + 1) % world
            with torch.no_grad():
                model.block1.fc1.weight.to_local().copy_(full[other * n:(other + 1) * n])
        if sp:
            r, n = dist.get_rank(), SEQ // world
            x = x[:, r * n:(r + 1) * n].contiguous()
    if os.environ.get("TTRACE_TEST_SUMMARIES") == "1":
        # Summaries only, three steps of the same batch (gradients cleared between them).
        tracer = ttrace.Tracer(model, directory, summaries=True)
        for _ in range(3):
            model.zero_grad()
            with tracer.step():
                model(x).pow(2).sum().backward()
        tracer.close()
        return
    online(model, directory, lambda: model(x).pow(2).sum().backward())


def online(model: nn.Module, directory: str, step: "object") -> None:
    """One traced step of ``step()``: written into DIRECTORY, or with TTRACE_TEST_ONLINE=REF
    checked online against the reference REF (nothing written but the report; rank 0 prints
    the report's first line)."""
    ref = os.environ.get("TTRACE_TEST_ONLINE")
    timeout = float(os.environ.get("TTRACE_TEST_ONLINE_TIMEOUT", "0")) or None
    tracer = ttrace.Tracer(model, directory, online=ref, online_timeout=timeout,
                           losses=os.environ.get("TTRACE_TEST_LOSSES") == "1")
    with tracer.step():
        step()  # type: ignore[operator]
        if ref and os.environ.get("TTRACE_TEST_ONLINE_DIE") == str(dist.get_rank()):
            os._exit(3)  # this rank dies before the step's check
    tracer.close()
    if ref:
        assert tracer._online is not None
        with open(f"{directory}.rank{dist.get_rank()}.json", "w") as f:
            json.dump(tracer._online.last, f)


def fsdp(directory: str, bug: str) -> None:
    """FSDP2 data parallelism: each block and the root fully sharded over the dp ranks, each
    rank a contiguous part of the batch, loss averaged over the local batch.
    Bug ``grad-summed``: block1's gradients summed over the ranks, not averaged."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, x = make()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        for block in (model.block0, model.block1):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        r, n = dist.get_rank(), BATCH // world
        x = x[r * n:(r + 1) * n].contiguous()

    def step() -> None:
        model(x).pow(2).mean().backward()
        if bug == "grad-summed":
            # block1's gradients end up summed over the dp ranks instead of averaged (as a
            # reduce with the wrong divide factor leaves them).
            with torch.no_grad():
                for p in model.block1.parameters():
                    p.grad.mul_(world)

    online(model, directory, step)


def llama_step() -> "tuple[nn.Module, torch.Tensor, torch.Tensor]":
    """The Llama of llama.py in TTRACE_TEST_DTYPE, its weights from TTRACE_TEST_SEED, and a
    batch of tokens and labels from the seed after it."""
    import llama as L

    seed = int(os.environ.get("TTRACE_TEST_SEED", "0"))
    dtype = getattr(torch, os.environ.get("TTRACE_TEST_DTYPE", "float32"))
    torch.manual_seed(seed)
    model = L.Llama().to(dtype)
    g = torch.Generator().manual_seed(1 + seed)
    tokens = torch.randint(0, L.VOCAB, (L.BATCH, L.SEQ), generator=g)
    labels = torch.randint(0, L.VOCAB, (L.BATCH, L.SEQ), generator=g)
    return model, tokens, labels


def llama(directory: str, bug: str) -> None:
    """The Llama-style model of llama.py, cross-entropy loss in FP32 outside the model.
    TTRACE_TEST_TP: tensor-parallel size under torchtitan's TP + SP plan (default: the whole
    world); the rest of the world is data parallel with FSDP2 (``fully_shard`` on each layer
    and the root, over the dp dimension of a 2-D mesh); TTRACE_TEST_SEED: weights and batch."""
    import llama as L

    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp = int(os.environ.get("TTRACE_TEST_TP", str(world))) if world > 1 else 1
    dp = world // tp
    L.BUG = bug if world > 1 else ""
    model, tokens, labels = llama_step()
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        if tp > 1:
            L.parallelize(model, mesh["tp"], bug)
        if dp > 1:
            from torch.distributed.fsdp import fully_shard

            for layer in model.layers.values():
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
            r, n = mesh.get_local_rank("dp"), L.BATCH // dp
            tokens, labels = tokens[r * n:(r + 1) * n], labels[r * n:(r + 1) * n]
    def step() -> None:
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.float().view(-1, L.VOCAB), labels.view(-1)).backward()

    online(model, directory, step)


def titan(directory: str, bug: str) -> None:
    """The Llama of llama.py parallelized as torchtitan does on an n-D mesh: one root mesh
    ``(dp_replicate, dp_shard, cp, tp)`` (sizes TTRACE_TEST_DP_REPLICATE, TTRACE_TEST_DP_SHARD,
    TTRACE_TEST_CP, TTRACE_TEST_TP; default 1), the TP + SP plan on ``mesh["tp"]``, FSDP2 over
    the flattened ``dp_shard_cp`` (HSDP over ``(dp_replicate, dp_shard_cp)``), context parallelism on ``mesh["cp"]`` with head-tail load balancing (each cp
    rank holds sequence chunks c and 2·cp − 1 − c; keys and values all-gathered, as torch's CP
    does for flex attention), each rank's loss averaged over its own tokens — and the Tracer
    given nothing but the model (bug ``rope-rank-5``: global rank 5's rotary positions shifted
    by one). TTRACE_TEST_CPDT=1: the queries pass a traced module as
    DTensors sharded along the sequence on the cp mesh, as torch's CP hands them to attention. Bugs: those of llama.py (``rope-positions-local``,
    ``cp-mask-local``, ``softmax-scale-local``, ``norm-grad-not-reduced``)."""
    import llama as L

    world = int(os.environ.get("WORLD_SIZE", "1"))
    L.BUG = bug if world > 1 else ""
    L.CORE = os.environ.get("TTRACE_TEST_CPDT") == "1"
    L.LOSS_PARALLEL = os.environ.get("TTRACE_TEST_LOSS_PARALLEL") == "1"
    dtype = getattr(torch, os.environ.get("TTRACE_TEST_DTYPE", "float32"))
    torch.manual_seed(0)
    model = L.Llama().to(dtype)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, L.VOCAB, (L.BATCH, L.SEQ), generator=g)
    labels = torch.randint(0, L.VOCAB, (L.BATCH, L.SEQ), generator=g)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        sizes = {k: int(os.environ.get(f"TTRACE_TEST_{k.upper()}", "1"))
                 for k in ("dp_replicate", "dp_shard", "cp", "tp")}
        mesh = init_device_mesh("cpu", tuple(sizes.values()),
                                mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        if sizes["tp"] > 1:
            L.parallelize(model, mesh["tp"], bug)
        # HSDP (dp_replicate > 1): replicated over dp_replicate, sharded over dp_shard_cp.
        fsdp = (mesh["dp_replicate", "dp_shard_cp"] if sizes["dp_replicate"] > 1
                else mesh["dp_shard_cp"])
        for layer in model.layers.values():
            fully_shard(layer, mesh=fsdp)
        fully_shard(model, mesh=fsdp)
        dp = sizes["dp_replicate"] * sizes["dp_shard"]
        d = mesh.get_local_rank("dp_replicate") * sizes["dp_shard"] + mesh.get_local_rank(
            "dp_shard")
        n = L.BATCH // dp
        tokens, labels = tokens[d * n:(d + 1) * n], labels[d * n:(d + 1) * n]
        if sizes["cp"] > 1:
            L.CP_GROUP = mesh["cp"].get_group()
            if L.CORE:
                L.CP_MESH = mesh["cp"]
            L.POSITIONS = L.head_tail(L.SEQ, sizes["cp"], mesh.get_local_rank("cp"))
            tokens, labels = tokens[:, L.POSITIONS], labels[:, L.POSITIONS]
    import contextlib

    lp: "contextlib.AbstractContextManager[None]" = contextlib.nullcontext()
    if L.LOSS_PARALLEL and world > 1:
        from torch.distributed.tensor.parallel import loss_parallel

        lp = loss_parallel()
    tracer = ttrace.Tracer(model, directory, losses=os.environ.get("TTRACE_TEST_LOSSES") == "1")
    with tracer.step():
        logits = model(tokens)
        with lp:
            torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                              labels.reshape(-1)).backward()
    tracer.close()


def ddp(directory: str, bug: str) -> None:
    """DistributedDataParallel: each rank a contiguous part of the batch, gradients averaged
    by DDP's all-reduce. Bug ``unsynced-weight``: rank 1 starts with a block1.fc2 weight that
    was never broadcast (DDP broadcasts at construction, so the change comes after it).
    TTRACE_TEST_ACCUMULATE=M: gradient accumulation over M microbatches of the rank's share,
    each loss its own mean, DDP's synchronization skipped (``no_sync``) for all but the last,
    the gradients divided by M at the end; traced with ``microbatches=M``. Bug
    ``accumulate-never-synced``: every microbatch under ``no_sync`` (the last one's all-reduce
    skipped too — each rank keeps its own gradients)."""
    from torch.nn.parallel import DistributedDataParallel

    model, x = make()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    loss = os.environ.get("TTRACE_TEST_LOSS", "")
    if loss:
        # The loss inside the model, as a module of its own whose output is a scalar: the
        # mean over this rank's batch (``local``) or the sum over it divided by the global
        # count (``global``).
        model = WithLoss(model, global_count=BATCH * SEQ * HIDDEN if loss == "global" else 0)
    if world > 1:
        model = DistributedDataParallel(model)
        r, n = dist.get_rank(), BATCH // world
        x = x[r * n:(r + 1) * n].contiguous()
        if bug == "unsynced-weight" and r == 1:
            with torch.no_grad():
                inner = model.module.net if loss else model.module
                inner.block1.fc2.weight.mul_(1.01)
    accumulate = int(os.environ.get("TTRACE_TEST_ACCUMULATE", "1"))
    tracer = ttrace.Tracer(model, directory, microbatches=accumulate)
    with tracer.step():
        chunks = x.chunk(accumulate)
        for k, xb in enumerate(chunks):
            last = k == len(chunks) - 1 and bug != "accumulate-never-synced"
            sync = (model.no_sync() if world > 1 and not last
                    else contextlib.nullcontext())
            with sync:
                out = model(xb)
                (out if loss else out.pow(2).mean()).backward()
        if accumulate > 1:
            for p in model.parameters():
                p.grad /= accumulate
    tracer.close()


class SquareLoss(nn.Module):
    """The mean (or, with ``global_count``, the sum divided by that count) of the squares."""

    def __init__(self, global_count: int) -> None:
        super().__init__()
        self.global_count = global_count

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        if self.global_count:
            return y.pow(2).sum() / self.global_count
        return y.pow(2).mean()


class WithLoss(nn.Module):
    """A model with its loss as a module of its own."""

    def __init__(self, net: nn.Module, global_count: int) -> None:
        super().__init__()
        self.net = net
        self.loss = SquareLoss(global_count)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.loss(self.net(x))


def megatron(directory: str, bug: str) -> None:
    """Megatron-LM's tensor-parallel layers (megatron-core, CPU and gloo): LayerNorm →
    ColumnParallelLinear → GELU → RowParallelLinear on [s, b, h] activations, traced with no
    declarations; TTRACE_TEST_CP: context parallelism (the sequence in Megatron's load-balanced
    chunks). Bugs: ``no-grad-allreduce``: the column-parallel layer built with
    ``disable_grad_reduce`` (its input gradient is never all-reduced); ``cp-grad-not-reduced``:
    the parameter gradients not all-reduced over cp."""
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cp = int(os.environ.get("TTRACE_TEST_CP", "1")) if world > 1 else 1
    tp = world // cp
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             context_parallel_size=cp)
    dtype = getattr(torch, os.environ.get("TTRACE_TEST_DTYPE", "float32"))
    config = ModelParallelConfig(
        tensor_model_parallel_size=tp, context_parallel_size=cp, use_cpu_initialization=True,
        params_dtype=dtype
    )

    def init(w: torch.Tensor) -> torch.Tensor:
        return nn.init.normal_(w, 0.0, 0.05)

    class Mlp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(HIDDEN, dtype=dtype)
            self.fc1 = ColumnParallelLinear(
                HIDDEN, FFN, config=config, init_method=init, bias=True, gather_output=False,
                disable_grad_reduce=(bug == "no-grad-allreduce"),
            )
            self.act = nn.GELU()
            self.fc2 = RowParallelLinear(
                FFN, HIDDEN, config=config, init_method=init, bias=True, input_is_parallel=True,
                skip_bias_add=False,
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h, _ = self.fc1(self.norm(x))
            y, _ = self.fc2(self.act(h))
            return y

    torch.manual_seed(0)  # the full ("master") weights are drawn alike, then split
    model = Mlp()
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype)
    if cp > 1:
        # Megatron's get_batch_on_this_cp_rank: chunks c and 2·cp − 1 − c of 2·cp.
        c, n = parallel_state.get_context_parallel_rank(), SEQ // (2 * cp)
        x = torch.cat([x[c * n:(c + 1) * n], x[(2 * cp - 1 - c) * n:(2 * cp - c) * n]])
    x.requires_grad_(True)
    tracer = ttrace.Tracer(model, directory)
    with tracer.step():
        model(x).pow(2).sum().backward()
        if cp > 1 and bug != "cp-grad-not-reduced":
            # What Megatron's DDP does over dp × cp (the loss is a sum: summed).
            for p in model.parameters():
                dist.all_reduce(p.grad, group=parallel_state.get_context_parallel_group())
    tracer.close()
    parallel_state.destroy_model_parallel()


def mgpt(directory: str, bug: str) -> None:
    """The Llama-style GPT of megatron_gpt.py (megatron-core's GPTModel), one training step.
    TTRACE_TEST_TP: tensor-parallel size (the rest of the world is data parallel);
    TTRACE_TEST_SP=1: sequence parallelism; TTRACE_TEST_SEED: weights and batch."""
    import megatron_gpt as G
    from megatron.core import parallel_state

    import megatron.core

    if MCORE and not megatron.core.__version__.startswith(f"0.{MCORE}."):
        raise SystemExit(f"megatron-core {megatron.core.__version__} imported, not 0.{MCORE}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp = int(os.environ.get("TTRACE_TEST_TP", "1")) if world > 1 else 1
    sp = os.environ.get("TTRACE_TEST_SP", "0") == "1"
    seed = int(os.environ.get("TTRACE_TEST_SEED", "0"))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        dtype = getattr(torch, os.environ.get("TTRACE_TEST_DTYPE", "float32"))
        G.step(directory, tp, sp, dtype, bug if world > 1 else "", seed)
    finally:
        parallel_state.destroy_model_parallel()


def hand(directory: str, bug: str) -> None:
    """The hand-written Megatron-style engine of handtp.py, one training step.
    TTRACE_TEST_TP / TTRACE_TEST_CP: tensor- / context-parallel sizes (the rest of the world
    is data parallel); TTRACE_TEST_SP=1: sequence parallelism; TTRACE_TEST_ROPE=functional:
    rotary embeddings in the attention's functional code instead of a module."""
    import handtp

    import megatron.core

    if MCORE and not megatron.core.__version__.startswith(f"0.{MCORE}."):
        raise SystemExit(f"megatron-core {megatron.core.__version__} imported, not 0.{MCORE}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp = int(os.environ.get("TTRACE_TEST_TP", "1")) if world > 1 else 1
    cp = int(os.environ.get("TTRACE_TEST_CP", "1")) if world > 1 else 1
    handtp.step(
        directory, tp, cp, os.environ.get("TTRACE_TEST_SP", "0") == "1",
        getattr(torch, os.environ.get("TTRACE_TEST_DTYPE", "float32")),
        bug if world > 1 else "", int(os.environ.get("TTRACE_TEST_SEED", "0")),
        rope_in_module=os.environ.get("TTRACE_TEST_ROPE", "module") == "module",
    )


def unsupported(directory: str, bug: str) -> None:
    """A module whose output is a DTensor with a placement the trace format cannot express
    (``Partial("avg")``): the tracer raises, naming the tensor and the placement — or skips it
    with ``unsupported="skip"`` (``bug`` = ``skip``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),), mesh_dim_names=("tp",))

    class Averaged(nn.Module):
        def forward(self, x: torch.Tensor) -> "DTensor":
            return DTensor.from_local(x * 2, mesh, [Partial("avg")], run_check=False)

    model = nn.Sequential(nn.Linear(4, 4), Averaged())
    tracer = ttrace.Tracer(model, directory, mesh=mesh,
                           unsupported="skip" if bug == "skip" else "raise")
    x = torch.randn(2, 4)
    try:
        with tracer.step():
            model(x).to_local().sum().backward()
    except ttrace.UnsupportedLayoutError as e:
        assert bug != "skip"
        assert "'1|fwd.output.0'" in str(e) and "avg" in str(e), str(e)
        print("raised:", e)
        return
    tracer.close()
    assert bug == "skip", "no error for Partial('avg')"
    assert [i for i, _ in tracer.skipped] == ["1|fwd.output.0"], tracer.skipped


#: transformers' mixture-of-experts families the ``hf`` job runs under expert parallelism
#: besides Mixtral: family → (config class, model class, settings beyond the common ones).
MOE_FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, head_dim=8,
                       moe_intermediate_size=64, norm_topk_prob=True)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                       shared_expert_intermediate_size=64, norm_topk_prob=False)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(num_experts=4, num_experts_per_tok=2)),
}


def hf(directory: str, bug: str) -> None:
    """Hugging Face transformers' own tensor parallelism (``DistributedConfig(tp_size=N)``,
    its ``tp_plan``) on a tiny model of ``TTRACE_TEST_FAMILY`` (``llama`` or ``qwen3``): one
    training step, traced with no argument but the directory. The weights come from one seed,
    saved and loaded as a checkpoint (as ``from_pretrained`` loads them under TP). Bugs:
    ``rotary`` shifts rank 1's rotary positions by one (in the attention's functional core),
    ``scale-o`` scales rank 1's share of layer 0's ``o_proj`` output by 1 + 1e-2,
    ``no-allreduce-o`` skips layer 0's ``o_proj`` all-reduce (its partial product handed on).
    Family ``mixtral``: a tiny Mixtral (4 experts, top 2) under expert parallelism over the
    data ranks instead (``DistributedConfig(fsdp_size=N, ep_size=N,
    ep_implementation="all_to_all")``: its stacked experts sharded by expert, tokens dispatched
    by all-to-all; each rank its share of a batch of 4); the families of ``MOE_FAMILIES``
    (Qwen3-MoE, Qwen2-MoE with its shared expert, OLMoE) the same; bug ``experts-scaled`` scales rank 1's layer-0 experts output by
    1 + 2^-8."""
    import tempfile

    import transformers

    family = os.environ.get("TTRACE_TEST_FAMILY", "llama")
    dtype = getattr(torch, os.environ.get("TTRACE_TEST_DTYPE", "float32"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                  attn_implementation="sdpa", tie_word_embeddings=False)
    distributed = dict(tp_size=world)
    if family == "qwen3":
        config = transformers.Qwen3Config(head_dim=8, **common)
        cls = transformers.Qwen3ForCausalLM
    elif family == "mixtral":
        config = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common)
        cls = transformers.MixtralForCausalLM
        distributed = dict(fsdp_size=world, ep_size=world, ep_implementation="all_to_all")
    elif family in MOE_FAMILIES:
        make, cls_name, extra = MOE_FAMILIES[family]
        config = getattr(transformers, make)(**extra, **common)
        cls = getattr(transformers, cls_name)
        distributed = dict(fsdp_size=world, ep_size=world, ep_implementation="all_to_all")
    else:
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    base = cls(config)
    with tempfile.TemporaryDirectory() as ckpt:
        if world > 1:
            # One checkpoint for every rank: rank 0's (all ranks built the same from the seed).
            path = [ckpt]
            dist.broadcast_object_list(path, src=0)
            if dist.get_rank() == 0:
                base.save_pretrained(path[0])
            dist.barrier()
            model = cls.from_pretrained(path[0], dtype=dtype,
                                        distributed_config=transformers.DistributedConfig(
                                            **distributed))
            dist.barrier()
        else:
            base.save_pretrained(ckpt)
            model = cls.from_pretrained(ckpt, dtype=dtype)
    model.train()
    if bug == "rotary" and world > 1 and dist.get_rank() == 1:
        rope = model.model.rotary_emb
        forward = rope.forward
        rope.forward = lambda x, position_ids, **kw: forward(x, position_ids + 1, **kw)
    if bug == "scale-o" and world > 1 and dist.get_rank() == 1:
        model.model.layers[0].self_attn.o_proj.register_forward_hook(
            lambda m, a, out: out * (1 + 1e-2))
    if bug == "no-allreduce-o" and world > 1:
        # Layer 0's o_proj hands its caller the local partial product: the row-parallel
        # all-reduce is skipped (its Partial() output made local as is).
        from transformers.distributed import tensor_parallel as hf_tp

        target = model.model.layers[0].self_attn.o_proj
        post = hf_tp.RowwiseParallel.transform_output_post_forward

        def skip(self, module, output, mesh):  # type: ignore[no-untyped-def]
            if module is target:
                return output.to_local()
            return post(self, module, output, mesh)

        hf_tp.RowwiseParallel.transform_output_post_forward = skip
    if bug == "experts-scaled" and world > 1 and dist.get_rank() == 1:
        model.model.layers[0].mlp.experts.register_forward_hook(
            lambda m, a, out: out * (1 + 2.0 ** -8))
    gen = torch.Generator().manual_seed(1)
    moe = family == "mixtral" or family in MOE_FAMILIES
    ids = torch.randint(0, 128, (4 if moe else 2, 16), generator=gen)
    if moe and world > 1:
        n = len(ids) // world
        ids = ids[dist.get_rank() * n:(dist.get_rank() + 1) * n]
    tracer = ttrace.Tracer(model, directory)
    with tracer.step():
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    tracer.close()


def pp(directory: str, bug: str) -> None:
    """Pipeline parallelism with torch's own schedules (``torch.distributed.pipelining``, as
    torchtitan drives them): the Llama of llama.py (TTRACE_TEST_LAYERS layers, default 4, and
    TTRACE_TEST_BATCH sequences, default 4) cut as torchtitan cuts it — each model part a copy
    of the whole model with the other parts' layers deleted, the embedding on the first part,
    the final norm and output on the last — one part per pipeline rank (``gpipe``, ``1f1b``) or two
    (``interleaved``: virtual stages r and r + world), TTRACE_TEST_SCHEDULE; each step
    TTRACE_TEST_MICROBATCHES microbatches (default 4), each microbatch's loss its own mean and
    the accumulated gradients divided by the microbatches (``scale_grads``) — or, with
    TTRACE_TEST_RESCALE=1, torchtitan's loss rescaled by 1/microbatches and no division. The
    Tracer is given the rank's pipeline stages and the microbatches. TTRACE_TEST_TP: each stage
    also tensor parallel (torchtitan's TP + SP plan on the ``tp`` dimension of a ``(pp, dp,
    tp)`` device mesh; default 1); TTRACE_TEST_DP: each stage also data parallel (FSDP2 over
    ``dp``, each layer and the part, each dp rank its share of the batch; default 1). The
    parameter-gradient bugs act through hooks on the parameters, which FSDP2's sharded
    parameters do not run: they are planted without data parallelism.
    Bugs: ``microbatch-grad-dropped`` (the class of a schedule that loses one microbatch's
    weight gradient: layers.2's parameters keep none of microbatch 1's contribution),
    ``microbatch-grad-doubled`` (layers.2's parameters get microbatch 1's twice),
    ``grads-not-scaled`` (each microbatch's loss its own mean, the accumulated gradients never
    divided by the microbatches), ``stage-input-detached`` (the second stage's input detached:
    no gradient flows back to the first stage), ``stage-output-scaled`` (the first stage's
    output sent scaled by 1 + 2⁻⁶, as a wrong boundary buffer would), ``microbatch-order``
    (the last stage's targets in the wrong microbatch order)."""
    import copy

    import torch.nn.functional as F

    import llama as L
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    microbatches = int(os.environ.get("TTRACE_TEST_MICROBATCHES", "4"))
    kind = os.environ.get("TTRACE_TEST_SCHEDULE", "1f1b")
    rescale = os.environ.get("TTRACE_TEST_RESCALE") == "1"
    model, tokens, labels = llama_step()

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(logits.float().reshape(-1, L.VOCAB), target.reshape(-1))
        return loss / microbatches if rescale else loss

    if world == 1:
        tracer = ttrace.Tracer(model, directory)
        with tracer.step():
            F.cross_entropy(model(tokens).float().reshape(-1, L.VOCAB),
                            labels.reshape(-1)).backward()
        tracer.close()
        return
    tp = int(os.environ.get("TTRACE_TEST_TP", "1"))
    dp = int(os.environ.get("TTRACE_TEST_DP", "1"))
    stages_n = world // (tp * dp)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (stages_n, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    rank = mesh.get_local_rank("pp")
    if dp > 1:
        # Each data-parallel rank its contiguous share of the batch.
        d, n = mesh.get_local_rank("dp"), L.BATCH // dp
        tokens, labels = tokens[d * n:(d + 1) * n], labels[d * n:(d + 1) * n]
    virtual = 2 if kind == "interleaved" else 1
    chunks = stages_n * virtual
    per = L.LAYERS // chunks
    ids = [rank + v * stages_n for v in range(virtual)]
    parts = []
    for c in ids:
        part = copy.deepcopy(model)
        for i in range(L.LAYERS):
            if not c * per <= i < (c + 1) * per:
                del part.layers[str(i)]
        if c > 0:
            part.tok_embeddings = None
        if c < chunks - 1:
            part.norm = None
            part.output = None
        if tp > 1:
            L.parallelize(part, mesh["tp"])
        if dp > 1:
            from torch.distributed.fsdp import fully_shard

            # FSDP2 over the dp dimension, each layer and the part (as torchtitan does).
            for layer in part.layers.values():
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(part, mesh=mesh["dp"])
        parts.append(part)
    first = min(i for i in range(L.LAYERS) if str(i) in parts[0].layers)
    if bug in ("microbatch-grad-dropped", "microbatch-grad-doubled") and any(
            "2" in p.layers for p in parts):
        layer = next(p.layers["2"] for p in parts if "2" in p.layers)
        for prm in layer.parameters():
            seen = [0]

            def once(grad: torch.Tensor, seen: "list[int]" = seen) -> torch.Tensor:
                # Backward runs microbatch by microbatch: the second call is microbatch 1's.
                seen[0] += 1
                if seen[0] != 2:
                    return grad
                return grad * (0.0 if bug == "microbatch-grad-dropped" else 2.0)

            prm.register_hook(once)
    if bug == "stage-input-detached" and ids[0] == 1:
        parts[0].layers[str(first)].register_forward_pre_hook(
            lambda m, args: (args[0].detach(),) + tuple(args[1:]))
    if bug == "stage-output-scaled" and ids[0] == 0:
        last = max(int(k) for k in parts[0].layers)
        parts[0].layers[str(last)].register_forward_hook(
            lambda m, args, out: out * (1 + 2.0 ** -6))
    if bug == "microbatch-order" and chunks - 1 in ids:
        n = L.BATCH // microbatches
        labels = torch.cat([labels[n:2 * n], labels[:n], labels[2 * n:]])
    stages = [PipelineStage(p, c, chunks, torch.device("cpu"), group=mesh.get_group("pp"))
              for p, c in zip(parts, ids)]
    scale = not rescale and bug != "grads-not-scaled"
    if kind == "interleaved":
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=microbatches, loss_fn=loss_fn,
                                           scale_grads=scale)
    else:
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[kind]
        schedule = cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn,
                       scale_grads=scale)
    tracer = ttrace.Tracer(stages, directory, microbatches=microbatches)
    with tracer.step():
        if 0 in ids and chunks - 1 in ids:
            schedule.step(tokens, target=labels)
        elif 0 in ids:
            schedule.step(tokens)
        elif chunks - 1 in ids:
            schedule.step(target=labels)
        else:
            schedule.step()
    tracer.close()


def ep(directory: str, bug: str) -> None:
    """Expert parallelism: the MoE Llama of moe.py, each rank a contiguous share of the batch
    and its share of every layer's experts (tokens dispatched to their experts' owners by an
    all-to-all and back), each rank's loss the mean cross-entropy over its share plus the
    load-balancing loss, the gradients settled by hand as an expert-parallel engine does
    (``moe.synchronize``). Traced with ``experts=["layers.*.feed_forward.experts.*"]``.
    Bugs (see moe.py): ``router-grad-not-reduced``, ``aux-loss-wrong-group``,
    ``routing-weight-not-applied``, ``wrong-permutation-back``, ``dispatch-misrouted``,
    ``capacity-drops``, ``expert-grad-not-scaled``."""
    import torch.nn.functional as F

    import llama as L
    import moe

    moe.BUG = bug
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model, tokens, labels = moe.model_step()
    if world > 1:
        r, n = dist.get_rank(), L.BATCH // world
        tokens, labels = tokens[r * n:(r + 1) * n], labels[r * n:(r + 1) * n]
    tracer = ttrace.Tracer(model, directory, experts=["layers.*.feed_forward.experts.*"])
    with tracer.step():
        logits = model(tokens)
        loss = F.cross_entropy(logits.float().reshape(-1, L.VOCAB), labels.reshape(-1))
        (loss + moe.aux_loss(model)).backward()
        if world > 1:
            moe.synchronize(model, world)
    tracer.close()


def titan_moe(directory: str, bug: str) -> None:
    """torchtitan's own expert parallelism (titan_moe.py): its Qwen3-MoE parallelized by
    torchtitan with the experts sharded over the data ranks, each rank its share of the batch;
    the reference the same model on one process (weights and tokens from TTRACE_TEST_SEED).
    Traced with nothing but the directory. Bugs: see ``titan_moe.plant``."""
    import titan_moe as T

    world = int(os.environ.get("WORLD_SIZE", "1"))
    dtype = getattr(torch, os.environ.get("TTRACE_TEST_DTYPE", "float32"))
    seed = int(os.environ.get("TTRACE_TEST_SEED", "0"))
    model = T.build(world, dtype, seed)
    tokens, labels = T.batch(seed)
    if world > 1:
        T.plant(model, bug, dist.get_rank())
        r, n = dist.get_rank(), T.BATCH // world
        tokens, labels = tokens[r * n:(r + 1) * n], labels[r * n:(r + 1) * n]
    tracer = ttrace.Tracer(model, directory)
    with tracer.step():
        T.loss(model, tokens, labels).backward()
        if world > 1:
            T.settle(model, bug)
    tracer.close()


def main() -> None:
    job, directory = sys.argv[1], sys.argv[2]
    bug = sys.argv[3] if len(sys.argv) > 3 else ""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    distributed = world > 1 or job in ("unsupported", "megatron", "mgpt")
    if distributed:
        dist.init_process_group("gloo")
    try:
        jobs = {"tp": tp, "fsdp": fsdp, "ddp": ddp, "megatron": megatron, "llama": llama,
                "mgpt": mgpt, "hand": hand, "unsupported": unsupported, "hf": hf,
                "titan": titan, "pp": pp, "ep": ep, "titan_moe": titan_moe}
        jobs[job](directory, bug)
    finally:
        if distributed:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
