"""A complete worked example: a 2-way tensor-parallel MLP emulated in one process, traced with
ttrace's Tracer (its hand-declared layouts: the emulation uses plain tensors) and checked.

    python python/examples/tp_demo.py --out /tmp/tp-demo
    python -m ttrace check /tmp/tp-demo/reference /tmp/tp-demo/candidate

The reference is LayerNorm -> Linear(d, 4d) -> GELU -> Linear(4d, d) -> bias -> MSE loss on one
device. The candidate splits the first linear by columns and the second by rows over `--tp`
ranks (Megatron's MLP): each rank's fc2 produces a partial sum, the all-reduce adds them in the
training dtype, and the gradient reaching the LayerNorm is all-reduced likewise. `--bug`
injects a silent bug: `double-bias` gives every rank's fc2 shard the bias (so the all-reduce
adds it tp times), `no-grad-allreduce` forgets the all-reduce of fc1's input gradient (each
rank's LayerNorm sees only its own partial gradient). `ttrace check` exits 0 on the clean run
and 1, naming the module, on a bug.
"""

import argparse
import os
import shutil

import torch
from torch import nn

import ttrace.tracer as td


class BiasAdd(nn.Module):
    """The row-parallel layer's bias, added after the all-reduce."""

    def __init__(self, d):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return x + self.bias


class Mlp(nn.Module):
    def __init__(self, d, hidden, fc2_bias=False):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, d, bias=fc2_bias)
        self.bias2 = BiasAdd(d)
        self.loss = nn.MSELoss()


class CopyToTensorParallel(torch.autograd.Function):
    """Identity forward to every rank; backward all-reduces the ranks' gradients (in order,
    in the tensor's dtype)."""

    @staticmethod
    def forward(ctx, reduce, *xs):
        ctx.reduce = reduce
        return tuple(x.clone() for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        if not ctx.reduce:
            return (None,) + tuple(grads)
        total = grads[0]
        for g in grads[1:]:
            total = total + g
        return (None,) + tuple(total.clone() for _ in grads)


class AllReduce(torch.autograd.Function):
    """Sum of the ranks' partial outputs (in order, in the tensor's dtype), one copy per rank;
    backward passes each rank's gradient to its own partial."""

    @staticmethod
    def forward(ctx, *parts):
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        return tuple(total.clone() for _ in parts)

    @staticmethod
    def backward(ctx, *grads):
        return grads


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/ttrace-tp-demo")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--bug", default="none", choices=["none", "double-bias", "no-grad-allreduce"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--d", type=int, default=64)
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    d, hidden, tp = args.d, 4 * args.d, args.tp
    shutil.rmtree(args.out, ignore_errors=True)

    # Consistent generation: one seed for the weights, one generator for the batch.
    td.seed_everything(args.seed)
    ref = Mlp(d, hidden)
    with torch.no_grad():
        ref.bias2.bias.normal_(0, 0.1)
    ref = ref.to(dtype)
    gen = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(2, args.tokens // 2, d, generator=gen).to(dtype)
    target = torch.randn(2, args.tokens // 2, d, generator=gen).to(dtype)

    # Reference run.
    kinds = {"bias2": "residual"}  # an elementwise add: not a type the tracer recognises
    tracer = td.Tracer(ref, kinds=kinds)
    h = ref.ln(x)
    y = ref.bias2(ref.fc2(ref.act(ref.fc1(h))))
    ref.loss(y, target).backward()
    tracer.write(os.path.join(args.out, "reference"), combine=True)

    # Candidate: tp ranks, emulated in one process.
    layouts = {
        "fc1": td.column_parallel(),
        "act": td.ModuleLayout(inputs=[td.split(-1)], outputs=[td.split(-1)]),
        "fc2": td.row_parallel(),
    }
    ranks = []
    for r in range(tp):
        m = Mlp(d, hidden // tp, fc2_bias=(args.bug == "double-bias")).to(dtype)
        td.copy_sharded(ref, m, layouts, r, tp, skip=("fc2.bias",))
        if args.bug == "double-bias":
            # The bias goes on every rank's partial output instead of after the all-reduce.
            with torch.no_grad():
                m.fc2.bias.copy_(ref.bias2.bias)
                m.bias2.bias.zero_()
        ranks.append(m)
    tracers = [td.Tracer(m, rank=r, mesh=td.Mesh(tp=tp), layouts=layouts, kinds=kinds) for r, m in enumerate(ranks)]
    hs = [m.ln(x) for m in ranks]
    hs = CopyToTensorParallel.apply(args.bug != "no-grad-allreduce", *hs)
    parts = [m.fc2(m.act(m.fc1(h))) for m, h in zip(ranks, hs)]
    ys = AllReduce.apply(*parts)
    losses = [m.loss(m.bias2(y), target) for m, y in zip(ranks, ys)]
    # Every rank back-propagates its own (identical) loss; the graphs meet only at the
    # emulated collectives, so each rank's gradients are its own.
    torch.stack(losses).sum().backward()
    cand = os.path.join(args.out, "candidate")
    for t in tracers:
        t.write(cand)
    td.finish(cand)
    print(f"wrote {args.out}/reference and {args.out}/candidate ({tp} ranks, {args.dtype}, bug: {args.bug})")
    print(f"check with: python -m ttrace check {args.out}/reference {args.out}/candidate")


if __name__ == "__main__":
    main()
