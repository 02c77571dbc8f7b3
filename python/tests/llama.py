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
HD = DIM // HEADS

def rope(x, start=0):
    # x: [b, s, h, d]; rotary on pairs, positions start..start+s
    b, s, h, d = x.shape
    pos = torch.arange(start, start + s, dtype=torch.float32)
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
    def forward(s, x):
        b, t, _ = x.shape
        q = s.wq(x).view(b, t, -1, HD); k = s.wk(x).view(b, t, -1, HD); v = s.wv(x).view(b, t, -1, HD)
        q, k = rope(q), rope(k)
        rep = q.shape[2] // k.shape[2]
        k = k.repeat_interleave(rep, dim=2); v = v.repeat_interleave(rep, dim=2)
        # BUG = "softmax-scale-local": the scale from the rank's local width (local heads x head
        # dim spread over all heads), as a port from a single-device code base might compute.
        scale = None
        if BUG == "softmax-scale-local":
            scale = 1.0 / math.sqrt(q.shape[2] * HD / HEADS)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale
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
        h = s.tok_embeddings(tokens)
        for l in s.layers.values(): h = l(h)
        return s.output(s.norm(h))



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

    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
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
