"""The real-engine bug matrix: clean runs and planted bugs of real multi-process PyTorch
engines (gloo on CPU), each checked by ttrace against its world-size-1 reference, with the
baselines' verdicts beside ttrace's.

    python python/tests/matrix.py                # the whole matrix (about 37 minutes on 2 cores)
    python python/tests/matrix.py --quick        # one clean run and one bug per engine
    python python/tests/matrix.py --json out.json --markdown out.md
    python python/tests/matrix.py --large        # the size study: 256 tokens (about 5 minutes)
    python python/tests/matrix.py --distributed 2,4,8   # also the check shared by 2, 4, 8 gloo
                                                        # ranks: its report must be identical

Engines (``jobs.py``): ``megatron-gpt`` — megatron-core's own ``GPTModel`` (Llama-style:
RMSNorm, rotary, GQA, SwiGLU, vocabulary-parallel embedding, output and cross-entropy) with
Megatron-style FP32 main gradients (``megatron_gpt.py``); ``dtensor-llama`` — a Llama-style
model under torchtitan's DTensor TP + SP plan, FSDP2, and both on a 2-D mesh (``llama.py``);
``hand-megatron`` — a hand-written Megatron-style engine with explicit collectives (TP, SP,
context parallelism, DP with fused FP32 main gradients; ``handtp.py``); ``torch-pipelining`` —
the Llama of ``llama.py`` (four layers) under torch's own pipeline schedules (GPipe, 1F1B,
interleaved 1F1B) on two stages with four microbatches, and each stage tensor parallel or
fully sharded (FSDP2) on a ``(pp, dp, tp)`` device mesh (``jobs.pp``); ``torch-ep`` — the
MoE Llama of ``moe.py`` (top-k routing, SwiGLU experts) under expert parallelism, tokens
dispatched by ``all_to_all`` to the experts' owners on two or four ranks (``jobs.ep``);
``torchtitan-ep`` — torchtitan's own Qwen3-MoE under its expert parallelism over the FSDP2
ranks (``titan_moe.py``, ``jobs.titan_moe``).

Baselines, judged on the same merged tensors: ``assert_close`` — ``torch.testing.assert_close``
with its default tolerances for the tensor's dtype, on every traced tensor; ``megatron`` — the
folklore ``‖cand − ref‖ ≤ 4·1.03^(L+1)·ε·‖ref‖`` with L the model's depth."""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).parent))
import harness  # noqa: E402

import numpy as np  # noqa: E402

import ttrace  # noqa: E402

DTYPES = ("float32", "bfloat16")
#: Job settings that define the model rather than its parallelism: the reference runs with them.
MODEL_SETTINGS = ("TTRACE_TEST_SEED", "TTRACE_TEST_ROPE", "TTRACE_TEST_SIZE", "TTRACE_TEST_LAYERS",
                  "TTRACE_TEST_BATCH", "TTRACE_TEST_EXPERTS")
#: The pipelined Llama: four layers over two stages, four microbatches of one sequence.
PP = dict(LAYERS="4", BATCH="4", MICROBATCHES="4")
SEEDS = (0, 1, 2)


@dataclass(frozen=True)
class Config:
    name: str
    world: int
    env: Dict[str, str]


@dataclass(frozen=True)
class Engine:
    name: str
    job: str
    depth: int  # transformer layers, for the folklore rule
    configs: Tuple[Config, ...]
    #: bug → (config name, public report it is modelled on / description)
    bugs: Dict[str, Tuple[str, str]]
    seeds: Tuple[int, ...] = SEEDS


def _cfg(name: str, world: int, **env: str) -> Config:
    return Config(name, world, {f"TTRACE_TEST_{k}": v for k, v in env.items()})


#: The engines, their configurations, and the bugs planted in each (bug → the configuration it
#: runs in and the public report it is modelled on; the full descriptions are in
#: megatron_gpt.BUGS, handtp.BUGS and llama.py).
ENGINES = [
    Engine(
        "megatron-gpt", "mgpt", 2,
        (_cfg("tp2", 2, TP="2"), _cfg("tp2-sp", 2, TP="2", SP="1"),
         _cfg("tp4-sp", 4, TP="4", SP="1"), _cfg("dp2", 2, TP="1"),
         _cfg("tp2-sp-dp2", 4, TP="2", SP="1")),
        {
            "row-not-reduced": ("tp2-sp", "row-parallel partial sums never all-reduced"),
            "row-reduced-twice": ("tp2", "row-parallel output all-reduced twice"),
            "sp-norm-grad-not-reduced": ("tp2-sp", "Megatron-LM #1446"),
            "dp-grad-bf16": ("dp2", "DP gradients all-reduced in BF16 (unfused main grads)"),
            "softmax-scale-local": ("tp2", "softmax scale from the per-rank width"),
            "loss-local-tokens": ("dp2", "Megatron-LM #7452"),
            "grad-corrupt-one-rank": ("tp2-sp-dp2", "NCCL #1950 class"),
            "linear-scale-1e-3": ("tp2-sp", "1e-3 relative scale of one linear's output"),
        },
    ),
    Engine(
        "dtensor-llama", "llama", 2,
        (_cfg("tp2", 2, TP="2"), _cfg("tp4", 4, TP="4"), _cfg("fsdp2-dp2", 2, TP="1"),
         _cfg("tp2-fsdp2-dp2", 4, TP="2")),
        {
            "softmax-scale-local": ("tp2", "softmax scale from the local width"),
            "norm-grad-not-reduced": ("tp2", "Megatron-LM #1446 (a norm left out of the SP plan)"),
        },
    ),
    Engine(
        "hand-megatron", "hand", 2,
        (_cfg("tp2-sp", 2, TP="2", SP="1"), _cfg("tp4-sp", 4, TP="4", SP="1"),
         _cfg("cp2", 2, CP="2"), _cfg("cp2-rope-functional", 2, CP="2", ROPE="functional"),
         _cfg("dp2", 2), _cfg("tp2-cp2", 4, TP="2", CP="2"),
         _cfg("tp2-sp-dp2", 4, TP="2", SP="1")),
        {
            "row-bias-every-rank": ("tp2-sp", "bias added on every rank before the reduction"),
            "rope-offset-module": ("cp2", "rotary positions not offset, in the module"),
            "rope-offset-functional": ("cp2-rope-functional",
                                       "rotary positions not offset, in functional code"),
            "ce-label-smoothing-local": ("tp2-sp", "label smoothing over the local vocabulary"),
            "vocab-pad-mask-offset": ("tp2-sp", "Megatron-LM #1754"),
            "dp-grad-bf16": ("dp2", "DP gradients all-reduced in BF16 (fused FP32 main grads)"),
            "sp-grad-not-scattered": ("tp2-sp", "SP all-gather whose backward all-reduces"),
        },
    ),
    Engine(
        "torch-pipelining", "pp", 4,
        (_cfg("pp2-1f1b", 2, SCHEDULE="1f1b", **PP), _cfg("pp2-gpipe", 2, SCHEDULE="gpipe", **PP),
         _cfg("pp2-interleaved", 2, SCHEDULE="interleaved", **PP),
         _cfg("pp2-1f1b-rescaled", 2, SCHEDULE="1f1b", RESCALE="1", **PP),
         _cfg("pp2-tp2-1f1b", 4, SCHEDULE="1f1b", TP="2", **PP),
         _cfg("pp2-fsdp2-1f1b", 4, SCHEDULE="1f1b", DP="2", **dict(PP, BATCH="8"))),
        {
            "microbatch-grad-dropped": ("pp2-1f1b", "one microbatch's weight gradient lost "
                                        "(a dW step skipped, a gradient overwritten)"),
            "microbatch-grad-doubled": ("pp2-interleaved", "one microbatch's gradient "
                                        "accumulated twice"),
            "grads-not-scaled": ("pp2-gpipe", "per-microbatch mean losses, gradients never "
                                 "divided by the microbatches"),
            "stage-input-detached": ("pp2-tp2-1f1b", "a stage boundary activation detached"),
            "stage-output-scaled": ("pp2-interleaved", "a stage's output sent scaled by "
                                    "1 + 2^-6 (a wrong boundary buffer)"),
            "microbatch-order": ("pp2-1f1b", "the last stage's targets in another microbatch "
                                 "order"),
        },
    ),
    Engine(
        "torch-ep", "ep", 2,
        (_cfg("ep2-e4k2", 2), _cfg("ep4-e8k2", 4, BATCH="4", EXPERTS="8,2"),
         _cfg("ep2-e8k1", 2, EXPERTS="8,1")),
        {
            "router-grad-not-reduced": ("ep2-e4k2", "torchtitan #2387: a router's gradient not "
                                        "reduced over the data ranks"),
            "aux-loss-wrong-group": ("ep2-e4k2", "the load-balancing loss scaled by the wrong "
                                     "group's size"),
            "routing-weight-not-applied": ("ep2-e4k2", "the experts' outputs combined without "
                                           "their routing weights on one rank"),
            "wrong-permutation-back": ("ep4-e8k2", "the experts' outputs sent back in the wrong "
                                       "order (the inverse permutation forgotten)"),
            "dispatch-misrouted": ("ep2-e4k2", "two experts' tokens exchanged on the way out"),
            "capacity-drops": ("ep2-e4k2", "tokens dropped at a per-rank capacity of 3/4 of "
                               "the mean load"),
            "expert-grad-not-scaled": ("ep4-e8k2", "the experts' gradients never divided by "
                                       "the data ranks"),
        },
    ),
    Engine(
        "torchtitan-ep", "titan_moe", 2,
        (_cfg("ep2-fsdp2", 2), _cfg("ep4-fsdp4", 4)),
        {
            "unpermute-skipped": ("ep2-fsdp2", "the experts' outputs sent back in expert order "
                                  "(the dispatch's inverse permutation forgotten)"),
            "permute-skipped": ("ep2-fsdp2", "the received tokens handed to the experts in "
                                "source-rank order (the permutation to expert order forgotten)"),
            "scores-not-applied": ("ep2-fsdp2", "the experts' outputs combined without their "
                                   "routing weights on one rank"),
            "experts-swapped": ("ep2-fsdp2", "an expert-sharded checkpoint loaded in the wrong "
                                "order on one rank"),
            "expert-grad-halved": ("ep4-fsdp4", "the experts' gradients divided by the wrong "
                                   "group's size"),
        },
    ),
]


#: Where each bug is born (the first tensor its change reaches), for the figure at birth.
BIRTH = {
    ("megatron-gpt", "linear-scale-1e-3"): "decoder.layers.1.mlp.linear_fc1|fwd.output.0",
    ("megatron-gpt", "dp-grad-bf16"): "decoder.layers.0.mlp.linear_fc1.weight|param_grad",
    ("hand-megatron", "dp-grad-bf16"): "layers.0.mlp.w1.weight|param_grad",
}


@dataclass
class Result:
    engine: str
    config: str
    dtype: str
    seed: int
    bug: str
    passed: bool = False
    failures: int = 0
    tensors: int = 0
    first_failure: Optional[str] = None
    ratio: float = 0.0  # error / threshold at the first failure (clean: the largest)
    error_eps: float = 0.0
    threshold_eps: float = 0.0
    localized: str = ""
    birth: str = ""  # the tensor where the bug is born, and its error / threshold there
    birth_ratio: float = 0.0
    assert_close_flags: int = 0
    megatron_flags: int = 0
    seconds: float = 0.0
    problem: str = ""
    #: The tests that fired at the first failure ("norm", "scale", "bias", "sparse").
    fired: List[str] = field(default_factory=list)
    #: Clean runs: the closest call of each test beyond the norm (largest statistic /
    #: threshold over the run's tensors).
    closest: Dict[str, float] = field(default_factory=dict)
    #: The largest ratio of each test at the bug's birth tensor.
    birth_tests: Dict[str, float] = field(default_factory=dict)
    #: ``--distributed``: per number of checker ranks, "same (…s)" or what differed.
    distributed: Dict[str, str] = field(default_factory=dict)


def _atol_rtol(dtype: str) -> Tuple[float, float]:
    # torch.testing.assert_close's defaults.
    return {"float32": (1e-5, 1.3e-6), "bfloat16": (1e-5, 1.6e-2),
            "float16": (1e-5, 1e-3)}[dtype]


def _baselines(ref: Path, cand: Path, report: ttrace.CheckReport, dtype: str,
               depth: int) -> Tuple[int, int]:
    """Tensors each baseline flags (on the merged tensors ttrace compared)."""
    atol, rtol = _atol_rtol(dtype)
    eps = report.eps
    close = folk = 0
    loss = report.loss_normalization or {}
    # The activation gradients as the checker read them: divided where each rank's (or
    # microbatch's) loss was settled to be its own mean.
    divisor = int(loss.get("divisor", 1))
    ids = [r.id for r in report.rows if not r.problem]
    refs = ttrace.load_all(ref, ids)
    try:
        cands = ttrace.load_all(cand, ids, reference=ref)
    except ttrace.TraceError:
        # Some tensor does not merge as laid out (partial sums the checker read as such):
        # one at a time, a tensor that does not merge is flagged by both baselines.
        cands = {}
        for i in ids:
            try:
                cands[i] = ttrace.load(cand, i, reference=ref)
            except ttrace.TraceError:
                pass
    for row in report.rows:
        if row.problem or row.id not in cands:
            close += 1
            folk += 1
            continue
        a, b = refs[row.id], cands[row.id]
        if divisor > 1 and "|grad." in row.id:
            b = b / divisor
        if a.shape != b.shape:
            close += 1
            folk += 1
            continue
        # Equal values (masked -inf scores too) differ by nothing, as assert_close counts them.
        with np.errstate(invalid="ignore"):
            diff = np.where(a == b, 0.0, b - a)
        if not np.all(np.abs(diff) <= atol + rtol * np.abs(np.where(np.isfinite(a), a, 0.0))):
            close += 1
        fin = np.isfinite(a)
        if not np.all(np.isfinite(diff)) or (np.linalg.norm(diff)
                                             > 4 * 1.03 ** (depth + 1) * eps
                                             * np.linalg.norm(a[fin])):
            folk += 1
    return close, folk


def distributed_same(ref: Path, cand: Path, report: ttrace.CheckReport, worlds: List[int],
                     root: Path) -> Dict[str, str]:
    """The check shared by each number of gloo ranks in ``worlds`` (``-m ttrace check
    --distributed``) against the single-machine ``report``: ``"same"`` when every rank exits
    as the single check would and rank 0's JSON report is identical, else what differs."""
    out: Dict[str, str] = {}
    for world in worlds:
        path = root / f"distributed-{world}.json"
        path.unlink(missing_ok=True)
        t0 = time.time()
        try:
            ranks = harness.run_ranks(
                lambda r: ["-m", "ttrace", "check", "--distributed", str(ref), str(cand),
                           "--json", str(path)], world)
        except harness.JobFailed as e:
            out[str(world)] = f"did not finish: {e}"
            continue
        want = 0 if report.passed else 1
        codes = [rc for rc, _, _ in ranks]
        if codes != [want] * world:
            out[str(world)] = f"exit codes {codes} (single check: {want}): {ranks[0][2][-300:]}"
        elif path.read_text() != report.to_json(indent=1):
            out[str(world)] = "the JSON reports differ"
        else:
            out[str(world)] = f"same ({time.time() - t0:.1f}s)"
    return out


def run_one(root: Path, engine: Engine, config: Config, dtype: str, seed: int, bug: str,
            refs: Dict[Tuple, Path], worlds: Optional[List[int]] = None) -> Result:
    res = Result(engine.name, config.name, dtype, seed, bug)
    t0 = time.time()
    env = dict(config.env, TTRACE_TEST_SEED=str(seed))
    # Settings that define the model (not its parallelism) are the reference's too.
    model_env = {k: v for k, v in env.items() if k in MODEL_SETTINGS}
    try:
        key = (engine.job, dtype, seed, tuple(sorted(model_env.items())))
        if key not in refs:
            tag = "-".join(f"{k[12:].lower()}{v}" for k, v in sorted(model_env.items()))
            d = root / f"{engine.name}-ref-{dtype}-{tag}"
            harness.run_job(engine.job, d, 1, "", dtype, model_env)
            refs[key] = d / "step0"
        d = root / f"{engine.name}-{config.name}-{bug or 'clean'}-{dtype}-{seed}"
        harness.run_job(engine.job, d, config.world, bug, dtype, env)
        ref, cand = refs[key], d / "step0"
        report = ttrace.check(ref, cand)
    except (harness.JobFailed, ttrace.TtraceError) as e:
        res.problem = str(e)[-600:]
        res.seconds = time.time() - t0
        return res
    res.passed, res.failures, res.tensors = report.passed, report.failures, len(report.rows)
    rows = [r for r in report.rows if not r.problem]
    for r in rows:
        for f in r.findings:
            name = str(f["detector"])
            ratio = float(f["ratio"]) if f["ratio"] is not None else math.inf
            res.closest[name] = max(res.closest.get(name, 0.0), ratio)
    if report.passed:
        worst = max(rows, key=lambda r: r.ratio)
        res.ratio, res.first_failure = worst.ratio, worst.id
        res.error_eps, res.threshold_eps = worst.error_eps, worst.threshold_eps
    else:
        first = next(r for r in report.rows if r.id == report.first_failure)
        res.first_failure = first.id
        res.fired = list(first.fired)
        res.ratio = first.ratio if not first.problem else math.inf
        res.error_eps, res.threshold_eps = first.error_eps, first.threshold_eps
        loc = report.localization or {}
        where = loc.get("module", "?")
        if loc.get("born_after"):
            where = f"between {loc['born_after']} and {where}"
        res.localized = f"{where} ({loc.get('pass', '?')})"
        if first.problem:
            res.problem = first.problem[:200]
    birth = BIRTH.get((engine.name, bug))
    row = next((r for r in report.rows if r.id == birth), None)
    if row is not None:
        res.birth, res.birth_ratio = row.id, row.ratio
        res.birth_tests = {str(f["detector"]): (float(f["ratio"]) if f["ratio"] is not None
                                                else math.inf) for f in row.findings}
    res.assert_close_flags, res.megatron_flags = _baselines(ref, cand, report, dtype, engine.depth)
    if worlds:
        res.distributed = distributed_same(ref, cand, report, worlds, root)
    res.seconds = time.time() - t0
    return res


#: The size study (``--large``): these engines' configurations on the larger model, clean, and
#: these bugs, each on its configuration.
LARGE_ENGINES = ("megatron-gpt", "dtensor-llama")
LARGE_BUGS = ("linear-scale-1e-3",)


def plan_large() -> List[Tuple[Engine, Config, str, int, str]]:
    """Seed 0 of every configuration of LARGE_ENGINES on the larger model in both dtypes, and
    LARGE_BUGS where they are planted."""
    out = []
    for e in ENGINES:
        if e.name not in LARGE_ENGINES:
            continue
        big = {c.name: Config(c.name, c.world, dict(c.env, TTRACE_TEST_SIZE="large"))
               for c in e.configs}
        for c in big.values():
            for dtype in DTYPES:
                out.append((e, c, dtype, 0, ""))
        for bug, (cname, _) in e.bugs.items():
            if bug in LARGE_BUGS:
                for dtype in DTYPES:
                    out.append((e, big[cname], dtype, 0, bug))
    return out


def plan(quick: bool) -> List[Tuple[Engine, Config, str, int, str]]:
    out = []
    for e in ENGINES:
        configs = {c.name: c for c in e.configs}
        if quick:
            out.append((e, e.configs[0], "float32", 0, ""))
            bug, (cname, _) = next(iter(e.bugs.items()))
            out.append((e, configs[cname], "bfloat16", 0, bug))
            continue
        for c in e.configs:
            for dtype in DTYPES:
                for seed in e.seeds:
                    out.append((e, c, dtype, seed, ""))
        for bug, (cname, _) in e.bugs.items():
            for dtype in DTYPES:
                out.append((e, configs[cname], dtype, 0, bug))
    return out


def markdown(results: List[Result]) -> str:
    lines = ["| engine | config | dtype | seed | bug | verdict | first failure (clean: closest) | "
             "error / threshold (ε) | ratio | localized | assert_close | megatron rule |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        verdict = "error: " + r.problem[:60] if r.problem and not r.first_failure else (
            "PASS" if r.passed else f"FAIL ({r.failures})")
        lines.append(
            f"| {r.engine} | {r.config} | {r.dtype} | {r.seed} | {r.bug or 'clean'} | {verdict} | "
            f"`{r.first_failure or '-'}` | {r.error_eps:.3g} / {r.threshold_eps:.3g} | "
            f"{r.ratio:.3g} | {r.localized or '-'} | {r.assert_close_flags} | "
            f"{r.megatron_flags} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    ap.add_argument("--engine", action="append", help="only these engines")
    ap.add_argument("--bugs-only", action="store_true")
    ap.add_argument("--keep", help="keep the traces in this directory")
    ap.add_argument("--large", action="store_true",
                    help="the size study: the larger model (256 tokens), clean runs and the "
                         "1e-3 scale bug")
    ap.add_argument("--distributed", default="",
                    help="also share each check among these numbers of gloo ranks (e.g. 2,4,8) "
                         "and require the single-machine report")
    args = ap.parse_args()
    worlds = [int(w) for w in args.distributed.split(",") if w]
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="ttrace-matrix-"))
    root.mkdir(parents=True, exist_ok=True)
    refs: Dict[Tuple, Path] = {}
    results = []
    try:
        for e, c, dtype, seed, bug in (plan_large() if args.large else plan(args.quick)):
            if args.engine and e.name not in args.engine:
                continue
            if args.bugs_only and not bug:
                continue
            r = run_one(root, e, c, dtype, seed, bug, refs, worlds)
            results.append(r)
            print(f"{r.engine:14} {r.config:11} {r.dtype:9} s{r.seed} {r.bug or 'clean':26} "
                  f"{'PASS' if r.passed else 'FAIL':4} ratio {r.ratio:9.3g} "
                  f"{r.localized or r.first_failure or ''} {r.problem[:200]} "
                  f"[ac {r.assert_close_flags}, meg {r.megatron_flags}] {r.seconds:.0f}s"
                  + (f" distributed {r.distributed}" if worlds else ""),
                  flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    if args.markdown:
        Path(args.markdown).write_text(markdown(results))
    clean = [r for r in results if not r.bug]
    bugs = [r for r in results if r.bug]
    fa = sum(1 for r in clean if not r.passed)
    missed = [r for r in bugs if r.passed or r.problem and not r.first_failure]
    print(f"clean runs: {len(clean)}, false alarms: {fa}; bugs: {len(bugs)}, missed: {len(missed)}")
    differ = [r for r in results for v in r.distributed.values() if not v.startswith("same")]
    if worlds:
        print(f"distributed checks on {worlds} ranks: {len(results) * len(worlds)}, "
              f"differing from the single-machine check: {len(differ)}")
    return 0 if fa == 0 and not missed and not differ else 1


if __name__ == "__main__":
    sys.exit(main())
