"""torchtitan's mixture-of-experts model (torchtitan 0.3.0's Qwen3-MoE, shrunk) under its own
expert parallelism: the model built from torchtitan's model registry and parallelized by
torchtitan's ``parallelize_qwen3`` (expert parallelism over the data-parallel shard ranks,
FSDP2 on the dense and the expert parameters), tokens dispatched by its
``AllToAllTokenDispatcher``. Two adaptations for the CPU: the flex-attention core (which has no
backward on the CPU) computes the same causal attention by ``scaled_dot_product_attention``,
and the training loop is torchtitan's as far as the gradients go: FSDP's division of the
gradients turned off (``disable_fsdp_gradient_division``) and each rank's loss its tokens'
summed cross-entropy over the batch's token count."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Tuple

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

#: torchtitan 0.3.0 and what its model code imports, installed by scripts/test.sh beside the
#: environment.
_TITAN = Path(__file__).resolve().parents[2] / "target" / "titan030"
if not (_TITAN / "torchtitan").is_dir():
    raise SystemExit(f"torchtitan 0.3.0 is not installed at {_TITAN} (scripts/test.sh installs it)")
if str(_TITAN) not in sys.path:
    sys.path.insert(0, str(_TITAN))

VOCAB, DIM, SEQ, BATCH = 256, 64, 16, 4
EXPERTS, TOP_K, HEAD_DIM = 4, 2, 16


def _cpu() -> None:
    """torchtitan on the CPU: its device meshes on cpu, its flex attention core as sdpa."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.tools.utils as tools
    from torchtitan.models.common.attention import FlexAttention

    parallel_dims.device_type = "cpu"  # type: ignore[attr-defined]
    tools.device_type = "cpu"

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, score_mod: Any,
             block_mask: Any, scale: Any, enable_gqa: bool, return_aux: Any,
             kernel_options: Any) -> Tuple[torch.Tensor, None]:
        # One document per sequence (positions 0..L-1): the block mask is the causal one.
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=enable_gqa), None

    FlexAttention.compiled_flex_attn = staticmethod(sdpa)  # type: ignore[assignment]


def build(ep: int, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """The shrunk Qwen3-MoE (2 layers, 4 experts, top 2), weights from ``seed``; with ``ep`` > 1
    parallelized by torchtitan over the default process group (expert parallelism ``ep`` =
    the data-parallel shard degree)."""
    _cpu()
    from torchtitan.models.common.rope import CosSinRoPE
    from torchtitan.models.qwen3 import _build_qwen3_moe_layers, _qwen3_norm, model_registry

    cfg = model_registry("debugmodel_moe", attn_backend="flex").model
    layers = _build_qwen3_moe_layers(
        n_layers=2, dim=DIM, n_heads=4, n_kv_heads=2, head_dim=HEAD_DIM, moe_hidden_dim=32,
        num_experts=EXPERTS, top_k=TOP_K, attn_backend="flex", moe_comm_backend="standard",
        rope=CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=SEQ, theta=1e6))
    cfg = dataclasses.replace(
        cfg, vocab_size=VOCAB, dim=DIM, layers=layers, norm=_qwen3_norm(DIM),
        tok_embeddings=dataclasses.replace(cfg.tok_embeddings, num_embeddings=VOCAB,
                                           embedding_dim=DIM),
        lm_head=dataclasses.replace(cfg.lm_head, in_features=DIM, out_features=VOCAB))
    if ep > 1:
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

        set_qwen3_sharding_config(cfg, enable_sp=False, enable_ep=True)
    torch.manual_seed(seed)
    model = cfg.build()
    model.init_states()
    model.to(dtype)
    if ep > 1:
        import torchtitan.distributed.utils as titan_dist
        from torch.distributed.fsdp import FSDPModule
        from torchtitan.distributed.fsdp import disable_fsdp_gradient_division
        from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
        from torchtitan.distributed import ParallelDims
        from torchtitan.models.qwen3.parallelize import parallelize_qwen3

        titan_dist.set_spmd_backend("partial_dtensor")
        dims = ParallelDims(dp_replicate=1, dp_shard=ep, cp=1, tp=1, pp=1, ep=ep,
                            world_size=ep, spmd_backend="partial_dtensor")
        dims.build_mesh()
        name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
        parallelize_qwen3(
            model, parallel_dims=dims,
            training=TrainingConfig(mixed_precision_param=name, mixed_precision_reduce=name),
            parallelism=ParallelismConfig(expert_parallel_degree=ep,
                                          data_parallel_shard_degree=ep,
                                          spmd_backend="partial_dtensor"),
            compile_config=CompileConfig(), ac_config=None, dump_folder=os.devnull)
        disable_fsdp_gradient_division(model)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                # A factor of 1 is still a pre-multiplied sum, which gloo lacks: plain sums.
                m.set_force_sum_reduction_for_comms(True)
    return model


def plant(model: torch.nn.Module, bug: str, rank: int) -> None:
    """Plant ``bug`` in the expert-parallel model on this rank (modelled on MoE bugs met in
    expert-parallel engines):

    * ``unpermute-skipped``: the expert outputs sent back in the experts' order, the inverse
      of the dispatch's permutation forgotten (every rank);
    * ``permute-skipped``: the received tokens handed to the experts in source-rank order (the
      dispatch's permutation to expert order forgotten; every rank);
    * ``scores-not-applied``: rank 1 combines its experts' outputs without their routing
      weights;
    * ``experts-swapped``: rank 1's two experts hold each other's weights (an expert-sharded
      checkpoint loaded in the wrong order);
    * ``expert-grad-halved``: the experts' gradients divided by the expert-parallel degree
      (the wrong group's size) on top of the loss normalization (see :func:`settle`)."""
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher as A2A

    if bug == "unpermute-skipped":
        A2A._unpermute = lambda self, out, shape, idx: out  # type: ignore[method-assign]
    elif bug == "permute-skipped":
        permute = A2A._permute

        def unpermuted(self: Any, rows: torch.Tensor, counts: torch.Tensor) -> Any:
            shape, _, _, local = permute(self, rows, counts)
            return shape, rows, torch.arange(rows.shape[0]), local

        A2A._permute = unpermuted  # type: ignore[method-assign]
    elif bug == "scores-not-applied" and rank == 1:
        combine = A2A.combine

        def unweighted(self: Any, out: torch.Tensor, meta: Any, x: torch.Tensor) -> Any:
            # Weights of 1 still made from the scores: the router keeps its place in the
            # graph (FSDP reduces the same gradients on every rank).
            ones = meta.topk_scores_experts_sorted_N * 0 + 1
            return combine(self, out, dataclasses.replace(
                meta, topk_scores_experts_sorted_N=ones), x)

        A2A.combine = unweighted  # type: ignore[method-assign]
    elif bug == "experts-swapped" and rank == 1:
        with torch.no_grad():
            for layer in model.layers.values():  # type: ignore[operator]
                experts = layer.moe.routed_experts.inner_experts
                for p in experts.parameters():
                    local = getattr(p, "_local_tensor", p)
                    local.copy_(local.flip(0))
    elif bug and bug not in ("scores-not-applied", "experts-swapped", "expert-grad-halved"):
        raise SystemExit(f"unknown bug {bug!r}")


def settle(model: torch.nn.Module, bug: str) -> None:
    """After the backward: ``expert-grad-halved`` divides the experts' gradients by the
    expert-parallel degree (FSDP reduced them with the layer's other parameters)."""
    if bug != "expert-grad-halved":
        return
    with torch.no_grad():
        for layer in model.layers.values():  # type: ignore[operator]
            for p in layer.moe.routed_experts.inner_experts.parameters():
                p.grad.div_(2)


def batch(seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """The step's tokens and labels (from ``seed`` + 1)."""
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def loss(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The forward pass and the rank's loss as torchtitan's trainer forms it: the summed
    cross-entropy of its tokens over the whole batch's token count (FSDP then sums)."""
    positions = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)
    logits = model(tokens, positions, model.get_attention_masks(positions))
    summed = F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1),
                             reduction="sum")
    return summed / (BATCH * SEQ)
