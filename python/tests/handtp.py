"""A hand-written Megatron-style engine: a Llama-style model (RMSNorm, rotary embeddings,
grouped-query causal attention, SwiGLU, biased output projections, a padded
vocabulary-parallel embedding, output layer and cross-entropy with label smoothing) whose
parallelism is written out with explicit collectives in autograd functions, as Megatron-LM
does it — no DTensor, no framework layers:

* tensor parallelism: column-parallel linears (input copied, gradient all-reduced; or with
  sequence parallelism all-gathered along the sequence, gradient reduce-scattered),
  row-parallel linears (partial sums all-reduced, or reduce-scattered to sequence shards;
  bias added once, after the reduction), heads split across ranks;
* sequence parallelism: norms and residuals on sequence shards, their weight gradients
  all-reduced over TP after the backward;
* context parallelism: each rank holds a contiguous chunk of the sequence; keys and values
  are all-gathered for attention (gradients reduce-scattered back), rotary positions and the
  causal mask offset by the chunk's start;
* data parallelism: FP32 main gradients — the linears accumulate their weight gradient into
  ``main_grad`` in FP32 (Megatron's fused gradient accumulation), the others add their
  gradient into it — all-reduced over DP in FP32; the loss normalized by the global count of
  loss tokens.

Activations are [batch, sequence, hidden]. Every tensor the tracer sees is a plain tensor:
their layouts are guesses the checker settles from the shapes. ``BUGS`` lists the bugs
:func:`step` can plant, each with the public report it is modelled on."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

DIM, HEADS, KV, FFN, LAYERS, VOCAB, SEQ, BATCH = 64, 8, 4, 128, 2, 120, 16, 2
HD = DIM // HEADS
PADDED_VOCAB = 128  # the vocabulary padded to a multiple of 32 (Megatron pads to 128·tp)
SMOOTHING = 0.1

BUGS = {
    "row-bias-every-rank": "a row-parallel bias added on every rank before the all-reduce "
                           "(layer 1's MLP output projection; text-generation-inference #1036, "
                           "MinivLLM #80, slapo #10)",
    "rope-offset-module": "rotary positions not offset for a context-parallel sequence chunk, "
                          "in the rotary module (Megatron-LM #560 asks exactly this of its "
                          "context-parallel RoPE)",
    "rope-offset-functional": "rotary positions not offset for a sequence chunk, in the "
                              "attention's functional code (the same, where no module is)",
    "ce-label-smoothing-local": "label smoothing in the vocabulary-parallel cross-entropy "
                                "averaged over the rank's vocabulary shard, not the whole "
                                "vocabulary (Megatron-LM #737, #7464)",
    "vocab-pad-mask-offset": "the padded-vocabulary mask of the vocabulary-parallel "
                             "cross-entropy compares local indices with the global size "
                             "(off by the shard start; Megatron-LM #1754's class)",
    "dp-grad-bf16": "data-parallel gradients all-reduced in BF16, not in the FP32 main "
                    "gradients (fused accumulation: the main gradients are FP32 sums)",
    "sp-grad-not-scattered": "a sequence-parallel all-gather whose backward returns a wrong "
                             "input gradient — twice this rank's shard (layer 0's attention "
                             "input; nanotron #46 / #172: a sequence-parallel linear's input "
                             "gradient wrong on every TP shard but one)",
}


@dataclass
class Parallel:
    """This rank's place: sizes, coordinates and process groups of each axis."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    sp: bool = False
    tp_rank: int = 0
    cp_rank: int = 0
    dp_rank: int = 0
    tp_group: Any = None
    cp_group: Any = None
    dp_group: Any = None
    bug: str = ""

    @staticmethod
    def init(tp: int, cp: int, sp: bool, bug: str) -> "Parallel":
        """Groups for ttrace's rank order r = (d·cp + c)·tp + t (every rank creates every
        group, in the same order, as torch.distributed requires)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world % (tp * cp):
            raise ValueError(f"world {world} is not a multiple of tp·cp = {tp * cp}")
        dp = world // (tp * cp)
        p = Parallel(tp, cp, dp, sp and tp > 1, bug=bug)
        if world == 1:
            return p
        r = dist.get_rank()
        p.tp_rank, p.cp_rank, p.dp_rank = r % tp, (r // tp) % cp, r // (tp * cp)

        def rank(d: int, c: int, t: int) -> int:
            return (d * cp + c) * tp + t

        for d in range(dp):
            for c in range(cp):
                g = dist.new_group([rank(d, c, t) for t in range(tp)])
                if (d, c) == (p.dp_rank, p.cp_rank):
                    p.tp_group = g
        for d in range(dp):
            for t in range(tp):
                g = dist.new_group([rank(d, c, t) for c in range(cp)])
                if (d, t) == (p.dp_rank, p.tp_rank):
                    p.cp_group = g
        for c in range(cp):
            for t in range(tp):
                g = dist.new_group([rank(d, c, t) for d in range(dp)])
                if (c, t) == (p.cp_rank, p.tp_rank):
                    p.dp_group = g
        return p


# --- collectives as autograd functions ---------------------------------------------------------

def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _all_gather(x: torch.Tensor, dim: int, group: Any, n: int) -> torch.Tensor:
    parts = [torch.empty_like(x.contiguous()) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group: Any, n: int, rank: int) -> torch.Tensor:
    summed = _all_reduce(x, group)  # gloo has no reduce_scatter on CPU: reduce, then cut
    return summed.chunk(n, dim=dim)[rank].contiguous()


class _Copy(torch.autograd.Function):
    """Identity forward, all-reduce backward (the input of a column-parallel linear)."""

    @staticmethod
    def forward(ctx, x, p):
        ctx.p = p
        return x

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.p.tp_group), None


class _Reduce(torch.autograd.Function):
    """All-reduce forward, identity backward (the output of a row-parallel linear)."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _Gather(torch.autograd.Function):
    """All-gather along `dim` forward, reduce-scatter backward (sequence or context shards
    gathered for a computation over the whole sequence)."""

    @staticmethod
    def forward(ctx, x, dim, group, n, rank, bug=False):
        ctx.args = (dim, group, n, rank, bug)
        return _all_gather(x, dim, group, n)

    @staticmethod
    def backward(ctx, g):
        dim, group, n, rank, bug = ctx.args
        out = _reduce_scatter(g, dim, group, n, rank)
        if bug:
            out = out * 2.0  # the whole sequence's sum kept, then this rank's cut of it twice
        return out, None, None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    """Reduce-scatter along `dim` forward, all-gather backward (a row-parallel output back to
    sequence shards)."""

    @staticmethod
    def forward(ctx, x, dim, group, n, rank):
        ctx.args = (dim, group, n)
        return _reduce_scatter(x, dim, group, n, rank)

    @staticmethod
    def backward(ctx, g):
        dim, group, n = ctx.args
        return _all_gather(g, dim, group, n), None, None, None, None


class _FusedLinear(torch.autograd.Function):
    """y = x·Wᵀ whose weight gradient is accumulated into ``W.main_grad`` in FP32 (the
    product of the low-precision operands computed and summed in FP32, Megatron's
    gradient_accumulation_fusion); no ``W.grad``."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return F.linear(x, w)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gw = g.reshape(-1, g.shape[-1]).float().t() @ x.reshape(-1, x.shape[-1]).float()
        if getattr(w, "main_grad", None) is None:
            w.main_grad = torch.zeros_like(w, dtype=torch.float32)
        w.main_grad += gw
        return g @ w, None


# --- layers --------------------------------------------------------------------------------------

class ColumnLinear(nn.Module):
    """Column-parallel linear: the output features split across TP ranks."""

    def __init__(self, p: Parallel, din: int, dout: int) -> None:
        super().__init__()
        self.p = p
        self.weight = nn.Parameter(torch.empty(dout // p.tp, din))
        self.gradient_accumulation_fusion = True

    def forward(self, x: torch.Tensor, sp_bug: bool = False) -> torch.Tensor:
        p = self.p
        if p.sp:
            x = _Gather.apply(x, 1, p.tp_group, p.tp, p.tp_rank, sp_bug)
        elif p.tp > 1:
            x = _Copy.apply(x, p)
        return _FusedLinear.apply(x, self.weight)


class RowLinear(nn.Module):
    """Row-parallel linear: the input features split across TP ranks, partial sums reduced
    (reduce-scattered to sequence shards with SP), then the bias added once."""

    def __init__(self, p: Parallel, din: int, dout: int, bias_bug: bool = False) -> None:
        super().__init__()
        self.p = p
        self.weight = nn.Parameter(torch.empty(dout, din // p.tp))
        self.bias = nn.Parameter(torch.empty(dout))
        # Added to sequence shards under SP: each rank's gradient covers its own tokens, and
        # is all-reduced over TP after the backward (as Megatron marks such parameters).
        self.bias.sequence_parallel = p.sp
        self.bias_bug = bias_bug
        self.gradient_accumulation_fusion = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.p
        y = _FusedLinear.apply(x, self.weight)
        if self.bias_bug:
            y = y + self.bias  # on every rank, before the reduction: tp times the bias
        if p.sp:
            y = _ReduceScatter.apply(y, 1, p.tp_group, p.tp, p.tp_rank)
        elif p.tp > 1:
            y = _Reduce.apply(y, p.tp_group)
        return y if self.bias_bug else y + self.bias


class VocabEmbedding(nn.Module):
    """Vocabulary-parallel embedding: each TP rank holds a contiguous range of the (padded)
    vocabulary, looks up the tokens in it, zeros the others, and the ranks' results are
    summed (reduce-scattered to sequence shards with SP)."""

    def __init__(self, p: Parallel) -> None:
        super().__init__()
        self.p = p
        self.weight = nn.Parameter(torch.empty(PADDED_VOCAB // p.tp, DIM))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        p = self.p
        n = PADDED_VOCAB // p.tp
        start = p.tp_rank * n
        outside = (tokens < start) | (tokens >= start + n)
        local = (tokens - start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside[..., None], 0.0)
        if p.sp:
            return _ReduceScatter.apply(out, 1, p.tp_group, p.tp, p.tp_rank)
        if p.tp > 1:
            return _Reduce.apply(out, p.tp_group)
        return out


class Rotary(nn.Module):
    """Rotary position embedding of [b, s, h, d] for positions ``offset … offset + s``."""

    def __init__(self, p: Parallel) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor, offset: int) -> torch.Tensor:
        if self.p.bug == "rope-offset-module":
            offset = 0
        return rope(x, torch.arange(offset, offset + x.shape[1]))


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = torch.outer(positions.float(), inv)
    cos = ang.cos()[None, :, None, :].to(x.dtype)
    sin = ang.sin()[None, :, None, :].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class CoreAttention(nn.Module):
    """Causal attention of local query chunks against the whole sequence's keys/values."""

    def __init__(self, p: Parallel) -> None:
        super().__init__()
        self.p = p
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [b, s_q, h, d] (a chunk starting at q_start); k, v: [b, s, h, d].
        s_q, s = q.shape[1], k.shape[1]
        q_start = self.p.cp_rank * s_q
        scale = 1.0 / math.sqrt(HD)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
        rows = torch.arange(q_start, q_start + s_q)[:, None]
        scores = scores.masked_fill(torch.arange(s)[None, :] > rows, float("-inf"))
        return torch.einsum("bhqk,bkhd->bqhd", self.softmax(scores), v)


class Attention(nn.Module):
    def __init__(self, p: Parallel, rope_in_module: bool) -> None:
        super().__init__()
        self.p = p
        self.wq = ColumnLinear(p, DIM, HEADS * HD)
        self.wk = ColumnLinear(p, DIM, KV * HD)
        self.wv = ColumnLinear(p, DIM, KV * HD)
        self.rotary = Rotary(p) if rope_in_module else None
        self.core = CoreAttention(p)
        self.wo = RowLinear(p, HEADS * HD, DIM)
        self.sp_bug = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.p
        b = x.shape[0]
        q = self.wq(x, self.sp_bug).view(b, -1, HEADS // p.tp, HD)
        k = self.wk(x, self.sp_bug).view(b, -1, KV // p.tp, HD)
        v = self.wv(x, self.sp_bug).view(b, -1, KV // p.tp, HD)
        offset = p.cp_rank * q.shape[1]
        if self.rotary is not None:
            q, k = self.rotary(q, offset), self.rotary(k, offset)
        else:
            if p.bug == "rope-offset-functional":
                offset = 0
            pos = torch.arange(offset, offset + q.shape[1])
            q, k = rope(q, pos), rope(k, pos)
        if p.cp > 1:
            k = _Gather.apply(k, 1, p.cp_group, p.cp, p.cp_rank)
            v = _Gather.apply(v, 1, p.cp_group, p.cp, p.cp_rank)
        rep = HEADS // KV
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        o = self.core(q, k, v)
        return self.wo(o.reshape(b, o.shape[1], -1))


class MLP(nn.Module):
    def __init__(self, p: Parallel, bias_bug: bool) -> None:
        super().__init__()
        self.w1 = ColumnLinear(p, DIM, FFN)
        self.w3 = ColumnLinear(p, DIM, FFN)
        self.w2 = RowLinear(p, FFN, DIM, bias_bug)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Layer(nn.Module):
    def __init__(self, p: Parallel, index: int, rope_in_module: bool) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.attention = Attention(p, rope_in_module)
        self.ffn_norm = nn.RMSNorm(DIM)
        self.mlp = MLP(p, bias_bug=p.bug == "row-bias-every-rank" and index == 1)
        self.attention.sp_bug = p.bug == "sp-grad-not-scattered" and index == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.mlp(self.ffn_norm(h))


class Model(nn.Module):
    def __init__(self, p: Parallel, rope_in_module: bool = True) -> None:
        super().__init__()
        self.p = p
        self.embedding = VocabEmbedding(p)
        self.layers = nn.ModuleList([Layer(p, i, rope_in_module) for i in range(LAYERS)])
        self.norm = nn.RMSNorm(DIM)
        self.output = ColumnLinear(p, DIM, PADDED_VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embedding(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))  # [b, s, vocab / tp]


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, p: Parallel) -> torch.Tensor:
    """Per-token loss of vocabulary-parallel logits [b, s, V/tp] (FP32), padded entries masked,
    with label smoothing over the real vocabulary — Megatron's vocab_parallel_cross_entropy
    written out (max, sum of exponentials and the target's logit reduced over TP)."""
    logits = logits.float()
    n = logits.shape[-1]
    start = p.tp_rank * n
    index = torch.arange(n)
    padded = (index + start >= VOCAB) if p.bug != "vocab-pad-mask-offset" else (index >= VOCAB)
    logits = logits.masked_fill(padded, float("-inf"))
    tp_sum = (lambda t: _Reduce.apply(t, p.tp_group)) if p.tp > 1 else (lambda t: t)
    m = logits.max(dim=-1, keepdim=True).values.detach()
    if p.tp > 1:
        m = m.clone()
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=p.tp_group)
    shifted = logits - m
    log_z = tp_sum(shifted.exp().sum(-1)).log()
    inside = (labels >= start) & (labels < start + n)
    picked = shifted.gather(-1, (labels - start).clamp(0, n - 1)[..., None])[..., 0]
    target = tp_sum(picked.masked_fill(~inside, 0.0))
    nll = log_z - target
    # Smoothing: the mean of -log p over the real vocabulary.
    real = shifted.masked_fill(padded, 0.0).sum(-1)
    count = VOCAB if p.bug != "ce-label-smoothing-local" else int((~padded).sum())
    mean_logp = tp_sum(real) / count - log_z
    return (1.0 - SMOOTHING) * nll - SMOOTHING * mean_logp


# --- weights, batch, one step --------------------------------------------------------------------

def _split(name: str, module: nn.Module) -> Optional[int]:
    """The dimension along which a parameter is split over TP (None: replicated)."""
    if isinstance(module, (ColumnLinear, VocabEmbedding)):
        return 0
    if isinstance(module, RowLinear) and name.endswith("weight"):
        return 1
    return None


def load_full_weights(model: Model, p: Parallel, seed: int, dtype: torch.dtype) -> None:
    """Every parameter's full value drawn from a generator seeded by its name; each rank keeps
    its TP shard: the same logical model at any size."""
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, prm in model.named_parameters():
            dim = _split(name, modules[name.rpartition(".")[0]])
            shape = list(prm.shape)
            if dim is not None:
                shape[dim] *= p.tp
            g = torch.Generator().manual_seed(seed * 1000003 + zlib.crc32(name.encode()))
            if "norm" in name:
                full = 1.0 + 0.1 * torch.randn(shape, generator=g)
            elif name.endswith("bias"):
                full = 0.1 * torch.randn(shape, generator=g)
            else:
                full = torch.randn(shape, generator=g) * (0.5 / shape[-1] ** 0.5)
            if dim is not None:
                full = full.chunk(p.tp, dim=dim)[p.tp_rank]
            prm.data = full.to(dtype).contiguous()


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(1 + seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    loss_mask = torch.ones(BATCH, SEQ)
    loss_mask[0, : SEQ // 4] = 0.0
    return tokens, labels, loss_mask


def finish_grads(model: Model, p: Parallel) -> None:
    """FP32 main gradients (the fused linears' already are), sequence-parallel norm weights
    all-reduced over TP, everything all-reduced over CP (each chunk's contribution) and DP."""
    for name, prm in model.named_parameters():
        if getattr(prm, "main_grad", None) is None:
            prm.main_grad = prm.grad.float() if prm.grad is not None else torch.zeros_like(
                prm, dtype=torch.float32)
        g = prm.main_grad
        if p.sp and ("norm" in name or getattr(prm, "sequence_parallel", False)):
            dist.all_reduce(g, group=p.tp_group)
        if p.cp > 1:
            dist.all_reduce(g, group=p.cp_group)
        if p.dp > 1:
            if p.bug == "dp-grad-bf16":
                low = g.to(torch.bfloat16)
                dist.all_reduce(low, group=p.dp_group)
                g.copy_(low)
            else:
                dist.all_reduce(g, group=p.dp_group)


def step(directory: str, tp: int, cp: int, sp: bool, dtype: torch.dtype, bug: str = "",
         seed: int = 0, rope_in_module: bool = True) -> None:
    """One traced training step of the engine on this rank."""
    import ttrace
    from ttrace.tracer import Mesh

    if sp and cp > 1:
        raise ValueError("sequence and context parallelism both split the sequence: pick one")
    p = Parallel.init(tp, cp, sp, bug)
    model = Model(p, rope_in_module)
    load_full_weights(model, p, seed, dtype)
    tokens, labels, loss_mask = batch(seed)
    rows = slice(p.dp_rank * BATCH // p.dp, (p.dp_rank + 1) * BATCH // p.dp)
    chunk = slice(p.cp_rank * SEQ // p.cp, (p.cp_rank + 1) * SEQ // p.cp)
    tokens, labels, loss_mask = (t[rows, chunk] for t in (tokens, labels, loss_mask))
    total = loss_mask.sum()
    for size, group in ((p.dp, p.dp_group), (p.cp, p.cp_group)):
        if size > 1:
            dist.all_reduce(total, group=group)
    # The labels of a sequence-parallel run are those of the whole sequence (the logits are).
    tracer = ttrace.Tracer(model, directory, mesh=Mesh(tp=p.tp, cp=p.cp, dp=p.dp, sp=p.sp),
                           local_mean_loss=False)
    with tracer.step():
        logits = model(tokens)
        loss = (cross_entropy(logits, labels, p) * loss_mask).sum() / total
        loss.backward()
        finish_grads(model, p)
    tracer.close()

