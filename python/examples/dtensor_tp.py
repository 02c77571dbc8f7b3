"""A runnable multi-process example: tensor parallelism with DTensor (``parallelize_module``),
traced with no declarations on every rank and checked against a one-process reference.

    python python/examples/dtensor_tp.py --out /tmp/dtensor-tp            # clean: PASS
    python python/examples/dtensor_tp.py --out /tmp/dtensor-tp --bug wrong-shard

Spawns ``--tp`` processes (gloo on CPU; ``--device cuda`` with NCCL, one GPU per rank) on a
torchtitan/transformers-style mesh — one root mesh ``(dp_replicate, fsdp, tp)`` whose other
dimensions have size 1 — and parallelizes a two-block MLP: ``fc1`` column-parallel, ``fc2``
row-parallel. The reference runs the same seed and batch in this process. The four lines
that trace are the README's; ``--bug wrong-shard`` loads rank 1's ``block1.fc1`` shard from
rank 0's rows (a checkpoint loaded with shards in the wrong order).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import ttrace


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


def build(d: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(d), Block(d))


def batch(d: int) -> torch.Tensor:
    return torch.randn(4, 16, d, generator=torch.Generator().manual_seed(1))


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        if args.device == "cuda":
            torch.cuda.set_device(rank)
        model = build(args.d).to(args.device)
        full = model[1].fc1.weight.detach().clone()
        root = init_device_mesh(args.device, (1, 1, world),
                                mesh_dim_names=("dp_replicate", "fsdp", "tp"))
        for i in range(2):
            parallelize_module(model[i], root["tp"],
                               {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        if args.bug == "wrong-shard" and rank == 1:
            n = full.shape[0] // world
            with torch.no_grad():
                model[1].fc1.weight.to_local().copy_(full[:n])
        x = batch(args.d).to(args.device)
        tracer = ttrace.Tracer(model, os.path.join(args.out, "candidate"))
        with tracer.step():
            model(x).pow(2).mean().backward()
        tracer.close()
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/ttrace-dtensor-tp")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--bug", default="none", choices=["none", "wrong-shard"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)

    # The reference: one process, the same seed and batch.
    model = build(args.d)
    tracer = ttrace.Tracer(model, os.path.join(args.out, "reference"))
    with tracer.step():
        model(batch(args.d)).pow(2).mean().backward()
    tracer.close()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(args.tp, port, args), nprocs=args.tp, join=True)

    report = ttrace.check(os.path.join(args.out, "reference"),
                          os.path.join(args.out, "candidate"))
    print(report)
    raise SystemExit(0 if report.passed else 1)


if __name__ == "__main__":
    main()
