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
rank's LayerNorm sees only its own partial gradient), `scale` multiplies one rank's fc2
partial output by 1 + 1e-3 (in BF16 that product rounds back to every value — 1e-3 is
below half a unit in the last place, 2⁻⁹ — so the step is unchanged and passes), `grad-elements` multiplies 4 elements of rank 0's fc1 weight
gradient by 1.5 (a corrupted gradient communication, the NCCL #1950 class: 4 of
`4·d²/tp` elements, far below the norm's threshold in BF16), `bias-element` one element of rank
0's fc1 bias gradient likewise. `ttrace check` exits 0 on the clean run and 1, naming the module,
on a bug.

The arithmetic GPUs train with: `--autocast f16|bf16` runs both steps under `torch.autocast`
(FP32 parameters, `--dtype fp32`); `--tf32 both|candidate` makes FP32 matmuls round their
inputs to TF32 — on a GPU (`--device cuda`) by `torch.backends.cuda.matmul.allow_tf32`, on the
CPU by rounding every linear layer's operands to TF32 first (what the GPU's tensor cores do),
declared to the tracer as the GPU's setting would be recorded. The tracer records both
settings per module call; the checker prices them. `--fp8 fast|precise` runs fc1's and
fc2's forward products in FP8 (`torch._scaled_mm` on E4M3 operands, delayed scales shared by
the ranks, with or without fast accumulation), declared to the tracer as `quantize: e4m3`.
"""

import argparse
import contextlib
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


def round_tf32(t):
    """Round FP32 values to TF32 (10 fraction bits), to nearest with ties to even — what
    cuBLAS's TF32 GEMMs do to their operands."""
    b = t.contiguous().view(torch.int32)
    b = (b + 0xFFF + ((b >> 13) & 1)) & ~0x1FFF
    return b.view(torch.float32)


class Tf32Linear(torch.autograd.Function):
    """y = x·Wᵀ + b with TF32 operands in every product, forward and backward."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        y = torch.nn.functional.linear(round_tf32(x), round_tf32(w))
        return y if b is None else y + b

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy32 = round_tf32(dy)
        dx = dy32 @ round_tf32(w)
        dw = dy32.reshape(-1, dy.shape[-1]).t() @ round_tf32(x).reshape(-1, x.shape[-1])
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias else None
        return dx, dw, db


class Fp8Linear(torch.autograd.Function):
    """y = x·Wᵀ + b with E4M3 operands in the forward product (``torch._scaled_mm``: FP8
    tensor cores on a GPU), per-tensor scales given (delayed scaling, the same on every
    rank, as TransformerEngine reduces amaxes over the tensor-parallel group); the output in
    the input's dtype; the backward pass in the tensors' own dtype."""

    @staticmethod
    def forward(ctx, x, w, b, sx, sw, fast):
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        e4m3 = torch.float8_e4m3fn
        x2 = x.reshape(-1, x.shape[-1])
        xq = (x2.float() * sx).clamp(-448, 448).to(e4m3)
        wq = (w.float() * sw).clamp(-448, 448).to(e4m3)
        one = lambda v: torch.tensor(1.0 / v, device=x.device)  # noqa: E731
        y = torch._scaled_mm(xq, wq.t(), scale_a=one(sx), scale_b=one(sw),
                             out_dtype=x.dtype, use_fast_accum=fast)
        y = y.reshape(*x.shape[:-1], w.shape[0])
        return y if b is None else y + b

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = dy @ w
        dw = dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias else None
        return dx, dw, db, None, None, None


class EmulatedTf32(nn.Linear):
    """An nn.Linear whose products run on TF32 operands (CPU emulation of a TF32 GPU), or in
    FP8 (``fp8_scales``: the delayed scales of x and W)."""

    def forward(self, x):
        scales = getattr(self, "fp8_scales", None)
        if scales is not None:
            return Fp8Linear.apply(x, self.weight, self.bias, scales[0], scales[1],
                                   getattr(self, "fp8_fast", True))
        if not getattr(self, "tf32", False):
            return super().forward(x)
        return Tf32Linear.apply(x, self.weight, self.bias)


class Mlp(nn.Module):
    def __init__(self, d, hidden, fc2_bias=False):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = EmulatedTf32(d, hidden)
        self.act = nn.GELU()
        self.fc2 = EmulatedTf32(hidden, d, bias=fc2_bias)
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


BUGS = ["none", "double-bias", "no-grad-allreduce", "scale", "grad-elements", "bias-element"]


def _autocast(device, name):
    if name == "none":
        return contextlib.nullcontext()
    return torch.autocast(device, dtype=torch.float16 if name == "f16" else torch.bfloat16)


def _set_tf32(device, on):
    """TF32 for FP32 matmuls on a GPU (a process-wide setting, set by this script only)."""
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = on
        torch.backends.cudnn.allow_tf32 = on


def _use_tf32(model, device, on):
    """On the CPU: emulate TF32 in the model's linear layers."""
    for m in model.modules():
        if isinstance(m, EmulatedTf32):
            m.tf32 = on and device == "cpu"


def _declared(device, on, fp8=False):
    """Formats declared to the tracer: on the CPU the emulated TF32 is declared as the
    setting a GPU run records by itself; FP8 products are declared by their input format."""
    out = {}
    for name in ("fc1", "fc2"):
        if fp8:
            out[name] = {"quantize": "e4m3"}
        elif device == "cpu" and on:
            out[name] = {"fp32_matmul": "tf32"}
    return out


def _fp8_scales(model, x):
    """Delayed FP8 scales of fc1's and fc2's inputs and weights, from a forward pass of the
    reference (amax of each, scaled to E4M3's 448)."""
    scales = {}
    with torch.no_grad():
        h = model.ln(x)
        a = model.act(model.fc1(h))
        for name, inp in (("fc1", h), ("fc2", a)):
            w = getattr(model, name).weight
            scales[name] = (448.0 / float(inp.abs().max()), 448.0 / float(w.abs().max()))
    return scales


def _use_fp8(model, scales, fast):
    for name, (sx, sw) in scales.items():
        layer = getattr(model, name)
        layer.fp8_scales = (sx, sw)
        layer.fp8_fast = fast


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/ttrace-tp-demo")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--bug", default="none", choices=BUGS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--autocast", default="none", choices=["none", "f16", "bf16"])
    ap.add_argument("--tf32", default="none", choices=["none", "both", "candidate"])
    ap.add_argument("--fp8", default="none", choices=["none", "fast", "precise"],
                    help="fc1 and fc2 forward products in FP8 (torch._scaled_mm, E4M3, "
                         "delayed scales shared by the ranks), with or without fast accumulation")
    args = ap.parse_args(argv)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    d, hidden, tp = args.d, 4 * args.d, args.tp
    dev = args.device
    shutil.rmtree(args.out, ignore_errors=True)

    # Consistent generation: one seed for the weights, one generator for the batch.
    td.seed_everything(args.seed)
    ref = Mlp(d, hidden)
    with torch.no_grad():
        ref.bias2.bias.normal_(0, 0.1)
    ref = ref.to(dtype).to(dev)
    gen = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(2, args.tokens // 2, d, generator=gen).to(dtype).to(dev)
    target = torch.randn(2, args.tokens // 2, d, generator=gen).to(dtype).to(dev)

    # Reference run.
    kinds = {"bias2": "residual"}  # an elementwise add: not a type the tracer recognises
    ref_tf32 = args.tf32 == "both"
    fp8 = args.fp8 != "none"
    scales = _fp8_scales(ref, x) if fp8 else {}
    _use_fp8(ref, scales, args.fp8 == "fast")
    _set_tf32(dev, ref_tf32)
    _use_tf32(ref, dev, ref_tf32)
    tracer = td.Tracer(ref, kinds=kinds, formats=_declared(dev, ref_tf32, fp8))
    with _autocast(dev, args.autocast):
        h = ref.ln(x)
        y = ref.bias2(ref.fc2(ref.act(ref.fc1(h))))
        loss = ref.loss(y, target)
    loss.backward()
    tracer.write(os.path.join(args.out, "reference"), combine=True)
    tracer.close()

    # Candidate: tp ranks, emulated in one process.
    layouts = {
        "fc1": td.column_parallel(),
        "act": td.ModuleLayout(inputs=[td.split(-1)], outputs=[td.split(-1)]),
        "fc2": td.row_parallel(),
    }
    ranks = []
    cand_tf32 = args.tf32 != "none"
    _set_tf32(dev, cand_tf32)
    for r in range(tp):
        m = Mlp(d, hidden // tp, fc2_bias=(args.bug == "double-bias")).to(dtype).to(dev)
        td.copy_sharded(ref, m, layouts, r, tp, skip=("fc2.bias",))
        if args.bug == "double-bias":
            # The bias goes on every rank's partial output instead of after the all-reduce.
            with torch.no_grad():
                m.fc2.bias.copy_(ref.bias2.bias)
                m.bias2.bias.zero_()
        _use_tf32(m, dev, cand_tf32)
        _use_fp8(m, scales, args.fp8 == "fast")
        ranks.append(m)
    tracers = [td.Tracer(m, rank=r, mesh=td.Mesh(tp=tp), layouts=layouts, kinds=kinds,
                         formats=_declared(dev, cand_tf32, fp8))
               for r, m in enumerate(ranks)]
    with _autocast(dev, args.autocast):
        hs = [m.ln(x) for m in ranks]
        hs = CopyToTensorParallel.apply(args.bug != "no-grad-allreduce", *hs)
        parts = [m.fc2(m.act(m.fc1(h))) for m, h in zip(ranks, hs)]
        if args.bug == "scale":
            parts[0] = parts[0] * (1 + 1e-3)
        ys = AllReduce.apply(*parts)
        losses = [m.loss(m.bias2(y), target) for m, y in zip(ranks, ys)]
    if args.bug == "grad-elements":
        # Four elements of rank 0's fc1 weight gradient, at seeded places, scaled by 1.5 as
        # the gradient arrives (before the tracer records it).
        def corrupt(g):
            g = g.clone()
            flat = g.view(-1)
            at = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(1))[:4]
            flat[at.to(flat.device)] *= 1.5
            return g

        ranks[0].fc1.weight.register_hook(corrupt)
    if args.bug == "bias-element":
        # One element of rank 0's fc1 bias gradient, at a seeded place, scaled by 1.5.
        def corrupt_bias(g):
            g = g.clone()
            at = int(torch.randint(g.numel(), (1,), generator=torch.Generator().manual_seed(1)))
            g[at] *= 1.5
            return g

        ranks[0].fc1.bias.register_hook(corrupt_bias)
    # Every rank back-propagates its own (identical) loss; the graphs meet only at the
    # emulated collectives, so each rank's gradients are its own.
    torch.stack(losses).sum().backward()
    cand = os.path.join(args.out, "candidate")
    for t in tracers:
        t.write(cand)
        t.close()
    td.finish(cand)
    _set_tf32(dev, False)
    print(f"wrote {args.out}/reference and {args.out}/candidate ({tp} ranks, {args.dtype}, "
          f"autocast {args.autocast}, tf32 {args.tf32}, {dev}, bug: {args.bug})")
    print(f"check with: python -m ttrace check {args.out}/reference {args.out}/candidate")


if __name__ == "__main__":
    main()
