"""A mixture-of-experts Llama under expert parallelism: the Llama of llama.py with each
layer's feed-forward replaced by a top-k routed MoE of SwiGLU experts — the router in FP32
(DeepSeek-V3's and Megatron-LM's ``moe_router_dtype``), softmax then top-k, the weights
renormalized (Mixtral), a switch-style load-balancing loss with global token fractions
(Megatron-LM's global auxiliary loss) — and the token dispatch of Megatron-LM and torchtitan:
the (token, slot) pairs sorted by expert, stably (each expert's rows its tokens in order),
sent to the experts' owners by an all-to-all, each owner's expert fed the rows of every
source rank in rank order, the outputs sent back by the inverse all-to-all and combined by
the routing weights.

Under expert parallelism the world's ranks are data parallel (each a contiguous share of the
batch) and the experts are divided among them, rank r owning experts r·E/W … (r+1)·E/W − 1;
every rank builds every expert (so the weights are the reference's) and runs only its own."""

from __future__ import annotations

import math
import os
from typing import List

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import llama as L

BUG = ""  # set by the job: a planted bug (see the comments where it acts)

#: TTRACE_TEST_EXPERTS=E,K: experts per layer and experts per token (default 4, 2).
EXPERTS, TOPK = (int(v) for v in os.environ.get("TTRACE_TEST_EXPERTS", "4,2").split(","))
#: The load-balancing loss's coefficient.
AUX = 0.01


class Expert(nn.Module):
    """A SwiGLU feed-forward of half the dense one's width."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(L.DIM, 2 * L.DIM, bias=False)
        self.w3 = nn.Linear(L.DIM, 2 * L.DIM, bias=False)
        self.w2 = nn.Linear(2 * L.DIM, L.DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _world() -> "tuple[int, int]":
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


class MoE(nn.Module):
    """Router (``gate``) and ``experts``; ``aux`` holds the last forward's load-balancing loss
    (this rank's part of it: the ranks' parts add to the reference's)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(L.DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList([Expert() for _ in range(EXPERTS)])
        self.aux = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        world, rank = _world()
        h = x.reshape(-1, x.shape[-1])
        logits = self.gate(h.float())
        probs = logits.softmax(-1)
        w, idx = probs.topk(TOPK, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        flat = idx.reshape(-1)
        counts = torch.bincount(flat, minlength=EXPERTS).to(torch.float64)
        tokens = torch.tensor([float(h.shape[0])], dtype=torch.float64)
        if world > 1:
            # Global token fractions: integer counts, summed exactly.
            dist.all_reduce(counts)
            dist.all_reduce(tokens)
        f = (counts / (tokens * TOPK)).float()
        share = probs.sum(0) / tokens.float()
        # Each rank's share of the global loss, times the data ranks its gradient is
        # averaged over (BUG "aux-loss-wrong-group": not — the class of torchtitan's and
        # Megatron-LM's load-balancing losses scaled by the wrong group's size).
        scale = 1 if BUG == "aux-loss-wrong-group" else world
        self.aux = EXPERTS * (f * share).sum() * scale
        key = flat
        if BUG == "dispatch-misrouted" and rank == 1:
            # The rows sorted by the wrong expert (two experts' tokens exchanged on the way
            # out): each expert's count is right, its rows are not.
            key = flat ^ 1
        order = torch.argsort(key, stable=True)
        token_of = order // TOPK
        rows = h[token_of]
        n_local = torch.bincount(flat, minlength=EXPERTS)
        if BUG == "capacity-drops" and world > 1:
            # A capacity of 3/4 of the mean load per rank and expert: rows beyond it dropped
            # (their weight lost), as a capacity factor below 1 does.
            cap = math.ceil(0.75 * h.shape[0] * TOPK / EXPERTS)
            kept = torch.clamp(n_local, max=cap)
            starts = torch.cumsum(n_local, 0) - n_local
            mask = torch.zeros(rows.shape[0], dtype=torch.bool)
            for e in range(EXPERTS):
                mask[int(starts[e]):int(starts[e]) + int(kept[e])] = True
            rows, token_of, order = rows[mask], token_of[mask], order[mask]
            n_local = kept
        out_rows = self._experts(rows, n_local, world, rank)
        weight = w.reshape(-1)[order]
        if BUG == "routing-weight-not-applied" and rank == 1:
            weight = torch.ones_like(weight)
        out = torch.zeros_like(h).index_add(0, token_of, out_rows * weight[:, None])
        return out.reshape(x.shape)

    def _experts(self, rows: torch.Tensor, n_local: torch.Tensor, world: int,
                 rank: int) -> torch.Tensor:
        """Each row through its expert: here, or at the expert's owner and back."""
        if world == 1:
            segments = rows.split(n_local.tolist())
            return torch.cat([e(s) for e, s in zip(self.experts, segments)])
        from torch.distributed.nn.functional import all_to_all_single

        per = EXPERTS // world
        send = n_local.reshape(world, per)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        in_splits = send.sum(1).tolist()
        out_splits = recv.sum(1).tolist()
        got = all_to_all_single(rows.new_empty(sum(out_splits), rows.shape[1]), rows,
                                out_splits, in_splits)
        # Received: source-major, each source's rows expert-major.
        chunks = got.split(recv.reshape(-1).tolist())
        outs: List[List[torch.Tensor]] = []
        for e in range(per):
            sizes = [int(recv[src, e]) for src in range(world)]
            inp = torch.cat([chunks[src * per + e] for src in range(world)])
            outs.append(list(self.experts[rank * per + e](inp).split(sizes)))
        if BUG == "wrong-permutation-back":
            # Sent back expert-major: rows reach the wrong sources (the inverse permutation
            # forgotten on the way back).
            back = torch.cat([outs[e][src] for e in range(per) for src in range(world)])
        else:
            back = torch.cat([outs[e][src] for src in range(world) for e in range(per)])
        return all_to_all_single(rows.new_empty(rows.shape), back, in_splits, out_splits)


def model_step() -> "tuple[L.Llama, torch.Tensor, torch.Tensor]":
    """The MoE Llama in TTRACE_TEST_DTYPE (its routers in FP32), its weights from
    TTRACE_TEST_SEED, and a batch of tokens and labels from the seed after it."""
    seed = int(os.environ.get("TTRACE_TEST_SEED", "0"))
    dtype = getattr(torch, os.environ.get("TTRACE_TEST_DTYPE", "float32"))
    torch.manual_seed(seed)
    model = L.Llama()
    for layer in model.layers.values():
        layer.feed_forward = MoE()
    model = model.to(dtype)
    for layer in model.layers.values():
        layer.feed_forward.gate.float()
    g = torch.Generator().manual_seed(1 + seed)
    tokens = torch.randint(0, L.VOCAB, (L.BATCH, L.SEQ), generator=g)
    labels = torch.randint(0, L.VOCAB, (L.BATCH, L.SEQ), generator=g)
    return model, tokens, labels


def aux_loss(model: L.Llama) -> torch.Tensor:
    """The layers' load-balancing losses, weighted."""
    return AUX * sum((layer.feed_forward.aux for layer in model.layers.values()),
                     torch.zeros(()))


def synchronize(model: L.Llama, world: int) -> None:
    """The gradients as an expert-parallel engine settles them (each rank's loss its own
    mean): the dense parameters' averaged over the ranks; an expert's, held by its owner
    alone, made of every rank's tokens' contributions, divided by the ranks. Bugs
    ``router-grad-not-reduced`` (the routers' gradients left out of the all-reduce: the class
    of torchtitan issue 2387) and ``expert-grad-not-scaled`` (the experts' never divided)."""
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if ".experts." in name:
            if BUG != "expert-grad-not-scaled":
                p.grad /= world
            continue
        if BUG == "router-grad-not-reduced" and name.endswith("gate.weight"):
            continue
        dist.all_reduce(p.grad)
        p.grad /= world

