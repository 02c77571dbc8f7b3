"""Scaling of the check shared among torch.distributed ranks, against one rank and against
reading the same files, in the same run.

    python python/benches/distributed_check.py REFERENCE CANDIDATE --ranks 1,2,4,8
    python python/examples/tp_demo.py --out /tmp/tpd --tokens 8192 --d 1024   # a real pair

For each number of checker ranks N, N processes (gloo on this machine, each on ``--threads``
threads) run ``ttrace.check(reference, candidate, group=WORLD)``; the time is the slowest
rank's from a barrier to its report (process start and ``import torch`` excluded). Prints per
N: the time, the throughput (both traces' bytes / time), the speedup over N = 1 and its
efficiency (speedup / N, the issue's target ≥ 0.8), the largest share a rank reads and each
rank's peak memory growth during the check against that share; and the baseline: reading both
traces' files from the page cache (``cat``-like, one process). Every N's report must equal
N = 1's (else exit 1).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss_bytes() -> int:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(reference: str, candidate: str) -> None:
    """One checker rank: time the shared check from a barrier; rank 0 prints every rank's
    figures as one JSON line."""
    import torch.distributed as dist

    import ttrace

    dist.init_process_group("gloo")
    before = _rss_bytes()
    dist.barrier()
    t0 = time.perf_counter()
    report = ttrace.check(reference, candidate, group=dist.group.WORLD)
    seconds = time.perf_counter() - t0
    mine = {"seconds": seconds, "rss_growth": _rss_bytes() - before,
            "digest": hashlib.sha256(report.to_json().encode()).hexdigest()}
    everything: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everything, mine)
    if dist.get_rank() == 0:
        print(json.dumps(everything), flush=True)
    dist.destroy_process_group()


def run(reference: str, candidate: str, ranks: int, threads: int) -> List[Dict[str, Any]]:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               WORLD_SIZE=str(ranks), RAYON_NUM_THREADS=str(threads), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", reference, candidate],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(ranks)]
    outs = [p.communicate(timeout=1800) for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode != 0:
            raise SystemExit(f"a checker rank failed:\n{err[-3000:]}")
    result: List[Dict[str, Any]] = json.loads(outs[0][0].strip().splitlines()[-1])
    return result


def read_files(dirs: List[str]) -> "tuple[float, int]":
    """Seconds to read every file of the directories (page cache), and their bytes."""
    files = [p for d in dirs for p in sorted(Path(d).rglob("*")) if p.is_file()]
    total = 0
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as h:
            while True:
                b = h.read(8 << 20)
                if not b:
                    break
                total += len(b)
    return time.perf_counter() - t0, total


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reference")
    ap.add_argument("candidate")
    ap.add_argument("--ranks", default="1,2,4,8")
    ap.add_argument("--threads", type=int, default=1, help="threads per checker rank")
    ap.add_argument("--repeat", type=int, default=3, help="best of this many runs per N")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    from ttrace import _ttrace

    read_files([args.reference, args.candidate])  # warm the page cache
    read_s = min(read_files([args.reference, args.candidate])[0] for _ in range(3))
    _, total = read_files([args.reference, args.candidate])
    print(f"both traces: {total / 1e6:.0f} MB; read from the page cache in {read_s:.3f} s "
          f"({total / read_s / 1e9:.2f} GB/s)")
    rows = []
    base = None
    digest = None
    for n in [int(x) for x in args.ranks.split(",")]:
        best = None
        for _ in range(args.repeat):
            ranks = run(args.reference, args.candidate, n, args.threads)
            t = max(r["seconds"] for r in ranks)
            if best is None or t < best[0]:
                best = (t, ranks)
        assert best is not None
        t, ranks = best
        digests = {r["digest"] for r in ranks}
        if digest is None:
            digest = next(iter(digests))
        same = digests == {digest}
        share: Dict[int, int] = {}
        for _, owner, size in _ttrace.share_owners(args.reference, args.candidate, n):
            share[owner] = share.get(owner, 0) + size
        base = base or t
        row = {"ranks": n, "seconds": t, "gb_per_s": total / t / 1e9, "speedup": base / t,
               "efficiency": base / t / n, "largest_share_mb": max(share.values()) / 1e6,
               "rss_growth_mb": [r["rss_growth"] / 1e6 for r in ranks],
               "share_mb": [share.get(k, 0) / 1e6 for k in range(n)], "same_report": same}
        rows.append(row)
        print(f"{n} ranks: {t:.3f} s, {row['gb_per_s']:.2f} GB/s, speedup {row['speedup']:.2f}, "
              f"efficiency {row['efficiency']:.2f}; largest share {row['largest_share_mb']:.0f} "
              f"MB; memory growth per rank (MB) {[round(x) for x in row['rss_growth_mb']]} "
              f"for shares {[round(x) for x in row['share_mb']]}; "
              f"{'same report' if same else 'REPORT DIFFERS'}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"read_seconds": read_s, "bytes": total,
                                               "rows": rows}, indent=1))
    return 0 if all(r["same_report"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
