"""Module kinds (linear, norm, attention, activation, …) from a module's type, for pricing its
thresholds."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

_ACTIVATION_NAMES = ("gelu", "silu", "swish", "relu", "mish", "tanh", "sigmoid", "softplus",
                     "elu", "quickgelu", "hardswish")

def _kind_of(module: torch.nn.Module) -> Optional[str]:
    nn = torch.nn
    norms: Tuple[type, ...] = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d)
    if hasattr(nn, "RMSNorm"):
        norms = norms + (nn.RMSNorm,)
    table = [
        ((nn.Linear, nn.Bilinear), "linear"),
        (norms, "norm"),
        ((nn.Embedding, nn.EmbeddingBag), "embedding"),
        ((nn.MultiheadAttention,), "attention"),
        ((nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Softmax, nn.Dropout), "activation"),
        ((nn.CrossEntropyLoss, nn.MSELoss, nn.NLLLoss), "loss"),
    ]
    for types, kind in table:
        if isinstance(module, types):
            return kind
    name = type(module).__name__
    if type(module).__module__.startswith("megatron"):
        if name in ("ColumnParallelLinear", "RowParallelLinear"):
            return "linear"
        if name == "VocabParallelEmbedding":
            return "embedding"
    if "RMSNorm" in name or "LayerNorm" in name or name.endswith(("Norm", "Norm2d")):
        return "norm"
    if _is_attention_core(module):
        return "attention"
    # By behaviour, across libraries (transformers' SiLUActivation, GELUActivation,
    # NewGELUActivation; timm's GELUTanh, Swish, Mish; torchtitan's and Megatron's wrappers):
    # a module without parameters named after an activation is elementwise.
    low = name.lower()
    if not any(True for _ in module.parameters(recurse=False)):
        if low.endswith("activation") or any(a in low for a in _ACTIVATION_NAMES):
            return "activation"
    # Rotary position embeddings (LlamaRotaryEmbedding, RotaryEmbedding, RoPE): a table of
    # cos / sin computed from positions alone, like an embedding lookup.
    if "rotary" in low or "rope" in low:
        return "embedding"
    # Hand-written engines' layers, by the name of their class and what they hold: a
    # ``ColumnParallelLinear``-like module with a 2-D weight, an embedding table.
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        if "Linear" in name:
            return "linear"
        if "Embedding" in name:
            return "embedding"
    return None

def _is_attention_core(module: torch.nn.Module) -> bool:
    """A module that computes attention from given queries, keys and values: its class
    name says attention and it holds no parameters (Megatron's and Transformer Engine's
    ``DotProductAttention``, a ``CoreAttention``) — unlike an attention block with its
    projections. Traced by default although it is not a leaf: a difference born in the scaled
    product is then judged where it is born, against the attention's own rounding."""
    return "Attention" in type(module).__name__ and next(module.parameters(), None) is None
