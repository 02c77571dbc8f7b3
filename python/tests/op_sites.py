"""Tensors priced through the registry's ops — attention cores' outputs, cross-entropy losses
and their logits' gradients — against the allowance they replace, on the real engines' clean
runs (``papers/checking.md`` §8).

    python python/tests/op_sites.py              # every engine with such sites
    python python/tests/op_sites.py --engine dtensor-llama --seeds 0

For every clean configuration of the engines whose attention is a traced call of
``scaled_dot_product_attention`` (``dtensor-llama``, ``torch-pipelining``, ``torch-ep``), in
FP32 and BF16 over the seeds, the candidate is checked against its reference twice: as traced
(each such tensor priced by its op: the exact op of both runs' inputs compared, plus the op's
threshold on both runs' roundings), and with the ``op`` field taken out of both manifests
(the local model: κ = 2 times the inputs' relative differences, a kernel term and the
output's flips). ``dtensor-llama`` runs with its cross-entropy traced as a loss site
(``losses=True``; priced by the op where the candidate's rows are not split over data ranks).
Printed per op and dtype: the tensors, those that differ, the median and the smallest
threshold / observed of both pricings over those, how often the op's threshold is the smaller,
and false alarms (there must be none)."""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).parent))
import harness  # noqa: E402
import matrix  # noqa: E402

import ttrace  # noqa: E402

ENGINES = ("dtensor-llama", "torch-pipelining", "torch-ep")


def _without_op(src: Path, dst: Path) -> Path:
    """A copy of a trace step whose manifests name no op (the local model prices it)."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    for m in dst.glob("manifest*.json"):
        doc = json.loads(m.read_text())

        def strip(x: Any) -> None:
            if isinstance(x, dict):
                x.pop("op", None)
                for v in x.values():
                    strip(v)
            elif isinstance(x, list):
                for v in x:
                    strip(v)
        strip(doc)
        m.write_text(json.dumps(doc))
    return dst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", action="append", help="only these engines")
    ap.add_argument("--seeds", default="0,1,2")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    root = Path(tempfile.mkdtemp(prefix="ttrace-op-sites-"))
    # Per (op, dtype): (op threshold / observed, allowance / observed) of tensors that differ.
    ratios: Dict[Tuple[str, str], List[Tuple[float, float]]] = {}
    sites: Dict[Tuple[str, str], int] = {}
    alarms: List[str] = []
    refs: Dict[Tuple, Path] = {}
    try:
        for e in matrix.ENGINES:
            if e.name not in (args.engine or ENGINES):
                continue
            for c in e.configs:
                for dtype in matrix.DTYPES:
                    for seed in seeds:
                        env = dict(c.env, TTRACE_TEST_SEED=str(seed))
                        if e.name == "dtensor-llama":
                            env["TTRACE_TEST_LOSSES"] = "1"
                        model = {k: v for k, v in env.items()
                                 if k in matrix.MODEL_SETTINGS + ("TTRACE_TEST_LOSSES",)}
                        key = (e.job, dtype, tuple(sorted(model.items())))
                        if key not in refs:
                            d = root / f"{e.name}-ref-{len(refs)}"
                            harness.run_job(e.job, d, 1, "", dtype, model)
                            refs[key] = d / "step0"
                        d = root / f"{e.name}-{c.name}-{dtype}-{seed}"
                        harness.run_job(e.job, d, c.world, "", dtype, env)
                        ref, cand = refs[key], d / "step0"
                        op = ttrace.check(ref, cand)
                        old = ttrace.check(_without_op(ref, root / "r"),
                                           _without_op(cand, root / "c"))
                        before = {r.id: r for r in old.rows}
                        tag = f"{e.name} {c.name} {dtype} s{seed}"
                        if not op.passed:
                            alarms.append(f"{tag}: {op.first_failure}")
                        for r in op.rows:
                            if r.pricing != "op":
                                continue
                            key = ("cross-entropy" if "cross_entropy" in r.id else "attention",
                                   dtype)
                            sites[key] = sites.get(key, 0) + 1
                            if r.error_eps > 0:
                                b = before[r.id]
                                ratios.setdefault(key, []).append(
                                    (r.threshold_eps / r.error_eps, b.threshold_eps / r.error_eps))
                        print(f"{tag}: {'PASS' if op.passed else 'FAIL'}", flush=True)
                        shutil.rmtree(d, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("\n| op | dtype | tensors | differing | op: median (min) threshold/observed | "
          "allowance: median (min) | op the tighter |")
    print("|---|---|---|---|---|---|---|")
    for (op, dtype), n in sorted(sites.items()):
        rs = ratios.get((op, dtype), [])
        if not rs:
            print(f"| {op} | {dtype} | {n} | 0 | – | – | – |")
            continue
        op_r, old_r = [a for a, _ in rs], [b for _, b in rs]
        tighter = sum(a < b for a, b in rs)
        print(f"| {op} | {dtype} | {n} | {len(rs)} | {statistics.median(op_r):.2f} "
              f"({min(op_r):.2f}) | {statistics.median(old_r):.2f} ({min(old_r):.2f}) | "
              f"{tighter} of {len(rs)} |")
    print(f"\nfalse alarms: {len(alarms)}")
    for a in alarms:
        print("  " + a)
    return 1 if alarms else 0


if __name__ == "__main__":
    sys.exit(main())
