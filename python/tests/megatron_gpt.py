"""A Llama-style GPT built from Megatron-LM's own modules (megatron-core's ``GPTModel`` with
its local, Transformer-Engine-free layer spec: RMSNorm, rotary embeddings, grouped-query
attention, SwiGLU, untied vocabulary-parallel output and cross-entropy), run on CPU with gloo.

Megatron assumes CUDA in two places a CPU run reaches: the rotary embedding moves its
frequencies to ``torch.cuda.current_device()``, and the model-parallel RNG tracker forks CUDA
RNG states. :func:`cpu_only` points both at the CPU (dropout is off, so no RNG is drawn).

Weights: every parameter's full (world-size-1) value is drawn from a generator seeded by its
name, and each rank keeps its shard by Megatron's rules (column-parallel rows, the SwiGLU
projection's gate and up halves each split, row-parallel columns, vocabulary rows) — the same
logical model at any tensor-parallel size. (Megatron's own CPU initialization splits the fused
gate/up weight as one block, which makes a different model at each size.)"""

from __future__ import annotations

import contextlib
import math
import os
import zlib
from typing import Optional

import torch

#: TTRACE_TEST_SIZE=large: the size study's model (hidden 128, 256 tokens), on which the scale
#: and bias tests apply (the default's 32 tokens are too few row clusters for them).
LARGE = os.environ.get("TTRACE_TEST_SIZE", "") == "large"
#: TTRACE_TEST_BIAS=1: biases on every linear layer (TransformerConfig's default,
#: ``add_bias_linear=True``); off by default, like Llama.
BIAS = os.environ.get("TTRACE_TEST_BIAS", "0") == "1"
DIM, HEADS, GROUPS, FFN, LAYERS, VOCAB, SEQ, BATCH = (
    (128, 8, 4, 256, 2, 256, 64, 4) if LARGE else (64, 8, 4, 128, 2, 128, 16, 2))


def cpu_only() -> None:
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import torch_norm

    mrandom.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    # Megatron's torch-norm wrapper refuses sequence parallelism (its fused norms need apex);
    # a norm on a sequence shard is the same computation, and its weight is marked as
    # Megatron marks sequence-parallel weights (their gradients are all-reduced over TP).
    if not getattr(torch_norm.WrappedTorchNorm, "_ttrace_sp", False):
        plain_new = torch_norm.WrappedTorchNorm.__new__

        def new(cls, config, hidden_size, *args, **kwargs):
            sp = config.sequence_parallel
            config.sequence_parallel = False
            try:
                norm = plain_new(cls, config, hidden_size, *args, **kwargs)
            finally:
                config.sequence_parallel = sp
            for p in norm.parameters():
                p.sequence_parallel = sp
            return norm

        torch_norm.WrappedTorchNorm.__new__ = new
        torch_norm.WrappedTorchNorm._ttrace_sp = True


def build(tp: int, sp: bool, dtype: torch.dtype, seed: int = 0):
    """The model at tensor-parallel size ``tp`` (Megatron's parallel state initialized)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    cpu_only()
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=DIM, num_attention_heads=HEADS,
        num_query_groups=GROUPS, ffn_hidden_size=FFN, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=BIAS, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, sequence_parallel=sp and tp > 1,
        use_cpu_initialization=True, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        persist_layer_norm=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, bias_dropout_fusion=False,
    )
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    ).to(dtype)
    load_full_weights(model, tp, seed)
    return model


def _shard_rule(model: torch.nn.Module, pname: str) -> Optional[tuple]:
    """(dim, groups) of a parameter's tensor-parallel split, or None if replicated."""
    mname, _, leaf = pname.rpartition(".")
    module = model.get_submodule(mname)
    cls = type(module).__name__
    if cls == "ColumnParallelLinear":
        cfg = module.config
        glu = cfg.gated_linear_unit and module.output_size == 2 * cfg.ffn_hidden_size
        return (0, 2 if glu else 1)
    if cls == "RowParallelLinear" and leaf == "weight":
        return (1, 1)
    if cls == "VocabParallelEmbedding":
        return (0, 1)
    return None


def load_full_weights(model: torch.nn.Module, tp: int, seed: int) -> None:
    """Each parameter's full value from a generator seeded by its name; this rank keeps its
    shard (the SwiGLU projection's gate and up halves each split)."""
    from megatron.core import parallel_state

    rank = parallel_state.get_tensor_model_parallel_rank() if tp > 1 else 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            rule = _shard_rule(model, name)
            shape = list(p.shape)
            if rule is not None:
                shape[rule[0]] *= tp
            g = torch.Generator().manual_seed(seed * 1000003 + zlib.crc32(name.encode()))
            if "layernorm" in name:
                full = 1.0 + 0.1 * torch.randn(shape, generator=g)
            else:
                full = torch.randn(shape, generator=g) * (0.5 / shape[-1] ** 0.5)
            if rule is not None:
                dim, groups = rule
                n = shape[dim] // (groups * tp)
                pieces = full.split(n, dim=dim)
                full = torch.cat([pieces[gi * tp + rank] for gi in range(groups)], dim=dim)
            p.copy_(full.to(p.dtype))



def batch(seed: int = 0):
    """Tokens, positions, causal mask, labels and a loss mask that leaves unequal numbers of
    tokens in the batch's rows (so a loss normalized per data-parallel rank is wrong)."""
    g = torch.Generator().manual_seed(1 + seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    positions = torch.arange(SEQ)[None].expand(BATCH, SEQ)
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
    loss_mask = torch.ones(BATCH, SEQ)
    loss_mask[0, : SEQ // 4] = 0.0
    return tokens, positions, mask, labels, loss_mask


class _Only:
    """Runs a patched collective only while one module's forward runs."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.active = False
        module.register_forward_pre_hook(lambda *a: setattr(self, "active", True))
        module.register_forward_hook(lambda *a: setattr(self, "active", False))


def plant(model: torch.nn.Module, bug: str, tp: int) -> None:
    """Plant ``bug`` in this rank's model (see BUGS)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import layers

    if bug in ("row-not-reduced", "row-reduced-twice"):
        only = _Only(model.decoder.layers[1].self_attention.linear_proj)
        plain = layers.reduce_from_tensor_model_parallel_region

        def reduce(x, group=None):
            if not only.active:
                return plain(x, group=group)
            if bug == "row-not-reduced":
                return x
            return plain(plain(x, group=group), group=group)

        layers.reduce_from_tensor_model_parallel_region = reduce
        plain_rs = layers.reduce_scatter_to_sequence_parallel_region

        def reduce_scatter(x, *a, **k):
            if only.active and bug == "row-not-reduced":
                # Each rank keeps its own partial sum's sequence slice.
                r = ps.get_tensor_model_parallel_rank()
                n = x.shape[0] // tp
                return x[r * n:(r + 1) * n].clone()
            out = plain_rs(x, *a, **k)
            if only.active:
                out = plain(out, group=k.get("group"))
            return out

        layers.reduce_scatter_to_sequence_parallel_region = reduce_scatter
    elif bug == "softmax-scale-local":
        core = model.decoder.layers[0].self_attention.core_attention
        # 1/sqrt of the head width this rank would see if the width were split, not the heads.
        core.softmax_scale = 1.0 / math.sqrt(core.hidden_size_per_attention_head / tp)
    elif bug == "linear-scale-1e-3":
        # The scale acts on the product before its rounding to the training dtype (as a wrong
        # factor inside a fused kernel would): scaling the already rounded BF16 output by
        # 1 + 1e-3 rounds every element back to itself (1e-3 is below half an ulp of BF16).
        fc1 = model.decoder.layers[1].mlp.linear_fc1
        forward = fc1.forward

        def scaled(input_, *a, **k):
            out, bias = forward(input_.float(), *a, weight=fc1.weight.float(), **k)
            return (out * (1.0 + 1e-3)).to(input_.dtype), bias

        fc1.forward = scaled


def finish_grads(model: torch.nn.Module, sp: bool, bug: str) -> None:
    """What Megatron's DistributedDataParallel and ``finalize_model_grads`` do after the
    backward, on CPU: FP32 ``main_grad`` per parameter (the backward's gradient added into
    it; no fused accumulation on CPU), sequence-parallel norm gradients all-reduced over TP,
    then every gradient all-reduced over the data-parallel ranks (summed: the loss is already
    normalized by the global token count)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp_group, dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
    dp, tp = ps.get_data_parallel_world_size(), ps.get_tensor_model_parallel_world_size()
    skip_sp = {id(p) for p in model.decoder.layers[1].pre_mlp_layernorm.parameters()}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        p.main_grad = p.grad.float()
        if tp > 1 and getattr(p, "sequence_parallel", False):
            if not (bug == "sp-norm-grad-not-reduced" and id(p) in skip_sp):
                dist.all_reduce(p.main_grad, group=tp_group)
        if dp > 1:
            if bug == "dp-grad-bf16":
                low = p.main_grad.to(torch.bfloat16)
                dist.all_reduce(low, group=dp_group)
                p.main_grad.copy_(low)
            else:
                dist.all_reduce(p.main_grad, group=dp_group)
        if bug == "grad-corrupt-one-rank" and name.endswith("layers.0.mlp.linear_fc2.weight"):
            if dist.get_rank() == dist.get_world_size() - 1:
                # A few elements of one rank's reduced gradient are garbage (a faulty
                # collective or link): 4 of them doubled.
                p.main_grad.view(-1)[[3, 50, 200, 511]] *= 2.0


def step(directory: str, tp: int, sp: bool, dtype: torch.dtype, bug: str = "",
         seed: int = 0) -> None:
    """One traced training step of the model on this rank's share of the batch."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import ttrace

    model = build(tp, sp, dtype, seed)
    if bug:
        plant(model, bug, tp)
    tokens, positions, mask, labels, loss_mask = batch(seed)
    dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    n = BATCH // dp
    rows = slice(r * n, (r + 1) * n)
    tokens, positions, labels, loss_mask = (t[rows] for t in (tokens, positions, labels, loss_mask))
    # The loss is normalized by the global count of tokens (no gradient needs rescaling):
    # not stated, the checker settles it from the reference.
    tracer = ttrace.Tracer(model, directory)
    with tracer.step():
        per_token = model(tokens, positions, mask, labels=labels)
        local = loss_mask.sum()
        total = local.clone()
        if dp > 1:
            dist.all_reduce(total, group=ps.get_data_parallel_group())
        if bug == "loss-local-tokens":
            # Megatron-LM #7452's class: each rank divides by its own token count.
            total = local * dp
        loss = (per_token.float() * loss_mask).sum() / total
        loss.backward()
        finish_grads(model, sp, bug)
    tracer.close()


#: Bugs :func:`plant` and :func:`step` can plant, with the public report each is modelled on.
BUGS = {
    "row-not-reduced": "a row-parallel output's partial sums never all-reduced (layer 1's "
                       "attention projection; sglang #14811: reduce_results=False on a "
                       "row-parallel output projection)",
    "row-reduced-twice": "a row-parallel output all-reduced twice (layer 1's attention "
                         "projection; the same flag the other way: a layer that reduces and a "
                         "caller that reduces again)",
    "sp-norm-grad-not-reduced": "sequence-parallel norm-weight gradients not all-reduced over "
                                "TP (layer 1's pre-MLP norm; Megatron-LM #1446)",
    "dp-grad-bf16": "data-parallel gradients all-reduced in BF16, not in the FP32 main "
                    "gradients",
    "softmax-scale-local": "a softmax scale from the per-rank width (layer 0; the issue-20 "
                           "real-engine probe's first miss)",
    "loss-local-tokens": "the loss normalized by each rank's token count instead of the "
                         "global one (Megatron-LM #7452)",
    "grad-corrupt-one-rank": "4 elements of one rank's reduced gradient corrupted (layer 0's "
                             "fc2 weight; the NCCL #1950 class)",
    "linear-scale-1e-3": "layer 1's fc1 product scaled by 1 + 1e-3 before its rounding (a "
                         "wrong constant in a fused kernel; the issue-20 real-engine probe)",
}
