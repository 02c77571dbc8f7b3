"""What checking a step online costs, against writing it and checking the files, in one run.

    python python/benches/online_check.py --ranks 2 --tokens 4096 --d 1024 --dtype bf16

A DTensor tensor-parallel MLP (LayerNorm → column-parallel fc1 → GELU → row-parallel fc2,
``--blocks`` blocks, sequence parallel) on ``--ranks`` gloo processes of this machine; its
reference is the same model traced on one process. Each rank runs, on the same batch and
parameters (gradients cleared between): an untraced step; a step traced and written
(``Tracer(model, dir)``, timed to ``close()``: the bytes on disk); the same step checked online
(``Tracer(model, dir, online=REF)``, timed to ``close()``: the report written). Then the
written step is checked from the files by one process (``ttrace.check``) and by the ranks
together (``group=``). Prints the times, the bytes of the step and the ratio of the online
check to writing plus checking the files; the online report must equal the file check's
(else exit 1).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model(args: argparse.Namespace) -> Any:
    import torch
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(args.d)
            self.fc1 = nn.Linear(args.d, 4 * args.d)
            self.act = nn.GELU()
            self.fc2 = nn.Linear(4 * args.d, args.d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.fc2(self.act(self.fc1(self.norm(x))))

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(args.blocks)]).to(dtype)
    x = torch.randn(1, args.tokens, args.d, generator=torch.Generator().manual_seed(1)).to(dtype)
    return model, x


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import ttrace

    model, x = _model(args)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    out: Dict[str, Any] = {}
    if world == 1:
        tracer = ttrace.Tracer(model, args.work + "/ref")
        with tracer.step():
            model(x).float().pow(2).sum().backward()
        tracer.close()
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    for i in range(args.blocks):
        parallelize_module(model, mesh, {
            f"{i}.norm": SequenceParallel(),
            f"{i}.fc1": ColwiseParallel(input_layouts=Shard(1)),
            f"{i}.fc2": RowwiseParallel(output_layouts=Shard(1)),
        })
    r, n = dist.get_rank(), args.tokens // world
    x = x[:, r * n:(r + 1) * n].contiguous()

    def step() -> None:
        model.zero_grad()
        model(x).float().pow(2).sum().backward()

    def timed(f: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        f()
        dist.barrier()
        return time.perf_counter() - t0

    step()  # warm-up
    out["untraced"] = timed(step)

    def written() -> None:
        t = ttrace.Tracer(model, args.work + "/cand")
        with t.step():
            step()
        out["bytes"] = t.close()

    out["written"] = timed(written)
    on: List[Any] = []

    def online() -> None:
        t = ttrace.Tracer(model, args.work + "/online", online=args.work + "/ref")
        with t.step():
            step()
        t.close()
        on.append(t)

    out["online"] = timed(online)
    out["online_moved"] = on[0]._online.last
    out["shared_check"] = timed(lambda: ttrace.check(args.work + "/ref/step0",
                                                     args.work + "/cand/step0",
                                                     group=dist.group.WORLD))
    everything: List[Any] = [None] * world
    dist.all_gather_object(everything, out)
    if r == 0:
        print(json.dumps(everything))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    import ttrace

    work = tempfile.mkdtemp(prefix="ttrace-online-bench-")
    try:
        argv = [sys.executable, __file__, "--worker", "--work", work, "--tokens",
                str(args.tokens), "--d", str(args.d), "--blocks", str(args.blocks),
                "--dtype", args.dtype]
        base = dict(os.environ, MASTER_ADDR="127.0.0.1")
        subprocess.run(argv, env=dict(base, WORLD_SIZE="1", RANK="0"), check=True)
        # A port of its own (the reference's process may still hold the first one).
        base["MASTER_PORT"] = str(_free_port())
        procs = [subprocess.Popen(argv, env=dict(base, WORLD_SIZE=str(args.ranks), RANK=str(r),
                                                 LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                                  text=True) for r in range(args.ranks)]
        outs = [p.communicate()[0] for p in procs]
        if any(p.returncode for p in procs):
            sys.exit("a rank failed")
        ranks = json.loads(outs[0].strip().splitlines()[-1])
        t0 = time.perf_counter()
        files = ttrace.check(work + "/ref/step0", work + "/cand/step0")
        check_one = time.perf_counter() - t0
        online = json.loads(open(work + "/online/step0/report.json").read())
        same = online == files.raw
        first = ranks[0]
        write_then_check = first["written"] + check_one
        print(f"{args.ranks} ranks, {args.blocks} blocks, tokens {args.tokens}, d {args.d}, "
              f"{args.dtype}: step {first['bytes'] / 1e6:.0f} MB written per rank "
              f"({first['online_moved']['step_bytes'] / 1e6:.0f} MB in all)")
        print(f"  untraced step            {first['untraced']:.3f} s")
        print(f"  traced and written       {first['written']:.3f} s")
        print(f"  then checked, 1 process  {check_one:.3f} s   (shared by the ranks: "
              f"{first['shared_check']:.3f} s)")
        print(f"  online (traced, checked) {first['online']:.3f} s   = "
              f"{first['online'] / write_then_check:.2f} x writing then checking")
        for r, o in enumerate(ranks):
            m = o["online_moved"]
            print(f"  rank {r}: held {m['held_bytes'] / 1e6:.0f} MB of "
                  f"{m['step_bytes'] / 1e6:.0f} MB, set-up fetched {m['setup_tensors']} "
                  f"tensors in {m['setup_rounds']} rounds; seconds {m['seconds']}")
        print(f"  online report == the written step's check: {same}  ({files.failures} "
              "failures)")
        if not same:
            sys.exit(1)
    finally:
        if os.environ.get("KEEP") is None:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(work)


if __name__ == "__main__":
    main()
