"""A small Llama-style model (RMSNorm, rotary embeddings, grouped-query causal attention,
SwiGLU, untied output) and torchtitan's tensor-parallel plan with sequence parallelism:
vocabulary-split embedding, sequence-parallel norms, column-parallel q/k/v and w1/w3,
row-parallel wo and w2 reduce-scattered to sequence shards. Attention (rotary, the scaled
product, softmax) runs in functional code inside the attention module."""

from __future__ import annotations

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = ""  # set by the job: a planted bug (see the comments where it acts)

#: TTRACE_TEST_SIZE=large: the size study's model (hidden 128, 256 tokens), on which the scale
#: and bias tests apply (the default's 32 tokens are too few row clusters for them).
LARGE = os.environ.get("TTRACE_TEST_SIZE", "") == "large"
DIM, HEADS, KV, LAYERS, VOCAB, SEQ, BATCH = (
    (128, 8, 4, 2, 256, 64, 4) if LARGE else (64, 8, 4, 2, 128, 16, 2))
#: TTRACE_TEST_LAYERS, TTRACE_TEST_BATCH: other depths and batches (pipeline parallelism's
#: stages and microbatches need more of both).
LAYERS = int(os.environ.get("TTRACE_TEST_LAYERS", LAYERS))
BATCH = int(os.environ.get("TTRACE_TEST_BATCH", BATCH))
HD = DIM // HEADS

#: Context parallelism (set by the job): the cp process group, and the global positions of this
#: rank's tokens (torchtitan's head-tail load balancing: chunks c and 2·cp − 1 − c of 2·cp).
CP_GROUP = None
POSITIONS = None
#: The queries pass a traced module (``core``, an identity) — as DTensors on CP_MESH, the cp
#: device mesh, when it is set (TTRACE_TEST_CPDT=1).
CORE = False
CP_MESH = None
#: torchtitan's loss parallelism (set by the job): see ``parallelize``.
LOSS_PARALLEL = False


def head_tail(seq: int, cp: int, rank: int) -> torch.Tensor:
    """The positions rank ``rank`` of ``cp`` holds under head-tail load balancing."""
    c = seq // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])


class _Gather(torch.autograd.Function):
    """All-gather along ``dim`` over CP_GROUP; the gradient is the sum over the group of each
    rank's gradient, cut to this rank's part."""

    @staticmethod
    def forward(ctx, x, dim):
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(CP_GROUP))]
        dist.all_gather(parts, x.contiguous(), group=CP_GROUP)
        ctx.dim, ctx.n = dim, x.shape[dim]
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx, g):
        import torch.distributed as dist

        g = g.contiguous()
        dist.all_reduce(g, group=CP_GROUP)
        r = dist.get_rank(CP_GROUP)
        return g.narrow(ctx.dim, r * ctx.n, ctx.n), None


def rope(x, start=0):
    # x: [b, s, h, d]; rotary on pairs, at POSITIONS under context parallelism (BUG
    # "rope-positions-local": at the local positions 0..s), else start..start+s
    b, s, h, d = x.shape
    pos = torch.arange(start, start + s, dtype=torch.float32)
    if POSITIONS is not None and BUG != "rope-positions-local":
        pos = POSITIONS.to(torch.float32)
    if BUG == "rope-rank-5":
        # One process's rotary positions shifted by one (global rank 5).
        import torch.distributed as dist

        pos = pos + float(dist.get_rank() == 5)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = torch.outer(pos, inv)  # [s, d/2]
    cos, sin = ang.cos()[None, :, None, :].to(x.dtype), ang.sin()[None, :, None, :].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)

class Attention(nn.Module):
    def __init__(s):
        super().__init__()
        s.wq = nn.Linear(DIM, HEADS * HD, bias=False); s.wk = nn.Linear(DIM, KV * HD, bias=False)
        s.wv = nn.Linear(DIM, KV * HD, bias=False); s.wo = nn.Linear(HEADS * HD, DIM, bias=False)
        s.core = nn.Identity()  # traced: the queries as a DTensor under CP_MESH
    def forward(s, x):
        b, t, _ = x.shape
        q = s.wq(x).view(b, t, -1, HD); k = s.wk(x).view(b, t, -1, HD); v = s.wv(x).view(b, t, -1, HD)
        if CP_MESH is not None:
            # As torch's context parallelism hands them to attention: the queries a DTensor
            # sharded along the sequence on the cp mesh (Shard, whatever the token order).
            from torch.distributed.tensor import DTensor, Shard

            q = s.core(DTensor.from_local(q, CP_MESH, [Shard(1)], run_check=False)).to_local()
        elif CORE:
            q = s.core(q)
        q, k = rope(q), rope(k)
        rep = q.shape[2] // k.shape[2]
        k = k.repeat_interleave(rep, dim=2); v = v.repeat_interleave(rep, dim=2)
        mask, causal = None, True
        if CP_GROUP is not None:
            # Context parallelism as torch's CP does it for flex attention: every rank's keys
            # and values gathered (differentiably) and put back in sequence order; this rank's
            # queries attend causally by their global positions.
            pos = _Gather.apply(POSITIONS.to(torch.float32), 0)
            order = torch.argsort(pos)
            k = _Gather.apply(k, 1)[:, order]
            v = _Gather.apply(v, 1)[:, order]
            # BUG "cp-mask-local": the causal mask of a local sequence (query i sees keys 0..i).
            mine = (torch.arange(t) if BUG == "cp-mask-local" else POSITIONS)
            mask, causal = mine[:, None] >= torch.arange(k.shape[1])[None, :], False
        # BUG = "softmax-scale-local": the scale from the rank's local width (local heads x head
        # dim spread over all heads), as a port from a single-device code base might compute.
        scale = None
        if BUG == "softmax-scale-local":
            scale = 1.0 / math.sqrt(q.shape[2] * HD / HEADS)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
            is_causal=causal, scale=scale
        )
        return s.wo(o.transpose(1, 2).reshape(b, t, -1))

class FFN(nn.Module):
    def __init__(s):
        super().__init__(); s.w1 = nn.Linear(DIM, 4 * DIM, bias=False); s.w3 = nn.Linear(DIM, 4 * DIM, bias=False); s.w2 = nn.Linear(4 * DIM, DIM, bias=False)
    def forward(s, x): return s.w2(F.silu(s.w1(x)) * s.w3(x))

class Block(nn.Module):
    def __init__(s):
        super().__init__(); s.attention_norm = nn.RMSNorm(DIM); s.attention = Attention(); s.ffn_norm = nn.RMSNorm(DIM); s.feed_forward = FFN()
    def forward(s, x):
        h = x + s.attention(s.attention_norm(x)); return h + s.feed_forward(s.ffn_norm(h))

class Llama(nn.Module):
    def __init__(s):
        super().__init__(); s.tok_embeddings = nn.Embedding(VOCAB, DIM); s.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)}); s.norm = nn.RMSNorm(DIM); s.output = nn.Linear(DIM, VOCAB, bias=False)
    def forward(s, tokens):
        # A pipeline stage's part (torchtitan's split) lacks the modules of other stages.
        h = s.tok_embeddings(tokens) if s.tok_embeddings is not None else tokens
        for l in s.layers.values(): h = l(h)
        return s.output(s.norm(h)) if s.output is not None else h



def parallelize(model: Llama, mesh, bug: str = "") -> None:
    """torchtitan's plan. Bug ``norm-grad-not-reduced`` (the class of Megatron-LM issue #1446:
    sequence-parallel norm weights whose gradients are not all-reduced over the TP ranks):
    layer 1's ``ffn_norm`` is left as a plain module on the sequence shard, so each rank's
    weight gradient covers only its own tokens."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        # LOSS_PARALLEL (torchtitan's default under TP): the logits stay sharded over the
        # vocabulary as a DTensor, for a cross-entropy under loss_parallel().
        "output": (ColwiseParallel(input_layouts=Shard(1), use_local_output=False)
                   if LOSS_PARALLEL else
                   ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())),
    }
    # A pipeline stage's part lacks the modules of the other stages (as torchtitan skips them).
    parallelize_module(model, mesh, {k: v for k, v in top.items()
                                     if getattr(model, k) is not None})
    for index, blk in model.layers.items():
        seq_to_full = PrepareModuleInput(input_layouts=(Shard(1),),
                                         desired_input_layouts=(Replicate(),))
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": seq_to_full,
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        if bug == "norm-grad-not-reduced" and index == "1":
            del plan["ffn_norm"]
        parallelize_module(blk, mesh, plan)
