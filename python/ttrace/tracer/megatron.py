"""Megatron-LM's tensor-parallel layers, recognized by class name without importing Megatron:
the layouts of their tensors."""

from __future__ import annotations

from typing import Optional

import torch

from .placements import ModuleLayout, column_parallel, partial, replicate, row_parallel, split

def _megatron_layout(module: torch.nn.Module, path: str = "") -> Optional[ModuleLayout]:
    """Layouts of Megatron-LM's tensor-parallel layers, recognized by class (Megatron itself is
    never imported). Their forward returns ``(output, bias)``; with ``skip_bias_add`` the bias
    is returned, not added."""
    cls = type(module)
    if not cls.__module__.startswith("megatron"):
        return None
    name = cls.__name__
    if name == "ColumnParallelLinear":
        # Input replicated (with sequence parallelism: split along the sequence, dim 0 of
        # Megatron's [s, b, h], and all-gathered inside); its gradient is all-reduced (or
        # reduce-scattered) inside, so it leaves replicated (split) — unless the layer was built
        # with disable_grad_reduce, which leaves each rank's partial sum to the caller.
        sp = bool(getattr(module, "sequence_parallel", False))
        gather = bool(getattr(module, "gather_output", False))
        layout = column_parallel(gather_output=gather)
        layout.inputs = [split(0) if sp else replicate()]
        if getattr(module, "disable_grad_reduce", False):
            layout.grad_inputs = [partial()]
        else:
            layout.grad_inputs = [split(0) if sp else replicate()]
        layout.outputs = layout.outputs + [split(0)]  # (output, bias shard when skipped)
        config = getattr(module, "config", None)
        ffn = getattr(config, "ffn_hidden_size", None)
        # The MLP's first projection (``linear_fc1``, also inside experts) by its place in the
        # model, not by its width: an output layer whose vocabulary happens to be twice the
        # FFN width is no fused projection.
        fc1 = path.rsplit(".", 1)[-1] == "linear_fc1" if path else True
        if (fc1 and getattr(config, "gated_linear_unit", False) and ffn
                and getattr(module, "output_size", None) == 2 * ffn and not gather):
            # The fused gate/up projection of a gated MLP (SwiGLU): each rank holds its slice
            # of the gate and its slice of the up projection, [gate_r; up_r] — two interleaved
            # groups of the reference's [gate; up].
            layout.outputs = [split(-1, groups=2), split(0, groups=2)]
            layout.params = {"weight": split(0, groups=2), "bias": split(0, groups=2)}
        return layout
    if name == "RowParallelLinear":
        sp = bool(getattr(module, "sequence_parallel", False))
        layout = row_parallel()
        # The output is all-reduced (or reduce-scattered along the sequence with SP) inside.
        # The bias it returns (``skip_bias_add``) is added by the caller to this rank's
        # sequence shard under SP, so its gradient is a partial sum over the shard's tokens
        # (summed over TP with the parameter's, in ``finalize_model_grads``).
        layout.outputs = [split(0) if sp else replicate(), replicate()]
        layout.grad_outputs = [split(0) if sp else replicate(), partial() if sp else replicate()]
        return layout
    if name == "VocabParallelEmbedding":
        # With sequence parallelism the output is reduce-scattered along the sequence (and
        # turned to [s, b, h]) inside; otherwise all-reduced.
        rs = bool(getattr(module, "reduce_scatter_embeddings", False))
        return ModuleLayout(
            inputs=[replicate()], outputs=[split(1) if rs else replicate()],
            params={"weight": split(0)}, swap_outputs=(0, 1) if rs else None,
        )
    return None
