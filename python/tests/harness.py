"""Running the jobs of ``jobs.py`` as real multi-process ``torch.distributed`` runs (gloo on
CPU, one process per rank), bounded in time. Used by the pytest suite (``conftest.py``) and
by the bug matrix (``matrix.py``)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import zygote

JOBS = Path(__file__).with_name("jobs.py")
TIMEOUT = 240  # seconds for one job, all ranks


class JobFailed(RuntimeError):
    """A rank exited with an error, or the job outlived its time bound."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_job(job: str, directory: Path, world: int = 1, bug: str = "",
            dtype: str = "float32", env: Optional[Dict[str, str]] = None,
            timeout: float = TIMEOUT) -> None:
    """Run ``jobs.py JOB DIRECTORY BUG`` on ``world`` processes; raise :class:`JobFailed` with
    the failing rank's output if one fails or the job outlives ``timeout`` seconds."""
    try:
        ranks = run_ranks(lambda r: [str(JOBS), job, str(directory), bug], world, timeout,
                          dict(env or {}, TTRACE_TEST_DTYPE=dtype))
    except JobFailed:
        raise JobFailed(f"job {job} on {world} ranks did not finish in {timeout} s") from None
    failed = [(r, out + err) for r, (rc, out, err) in enumerate(ranks) if rc != 0]
    if failed:
        r, out = failed[0]
        raise JobFailed(f"job {job} rank {r} failed:\n{out[-4000:]}")


def run_ranks(argv: "Callable[[int], List[str]]", world: int, timeout: float = TIMEOUT,
              env: Optional[Dict[str, str]] = None) -> List[Tuple[int, str, str]]:
    """Run ``python ARGV(rank)`` on ``world`` processes with the environment torchrun gives
    (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); every rank's (exit code,
    standard output, standard error). Raise :class:`JobFailed` if they outlive ``timeout``
    seconds (all are killed). The ranks are forked by :mod:`zygote`'s server, which has
    imported torch once (``TTRACE_TEST_FORK=0``: each a fresh interpreter)."""
    base = dict(os.environ)
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world))
    base.update(env or {})
    base.setdefault("OMP_NUM_THREADS", "1")
    forks = zygote.server(dict(os.environ, OMP_NUM_THREADS="1"))
    if forks is not None:
        return _run_forked(forks, argv, world, timeout, base)
    procs = [
        subprocess.Popen([sys.executable, *argv(r)],
                         env=dict(base, RANK=str(r), LOCAL_RANK=str(r)),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(world)
    ]
    out: List[Tuple[int, str, str]] = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=timeout)
            out.append((p.returncode, o, e))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        for p in procs:
            p.communicate()
        raise JobFailed(f"{world} ranks did not finish in {timeout} s") from None
    return out


def _run_forked(forks: "zygote.Server", argv: "Callable[[int], List[str]]", world: int,
                timeout: float, base: Dict[str, str]) -> List[Tuple[int, str, str]]:
    """:func:`run_ranks` with the ranks forked by the zygote server (torch imported once)."""
    scratch = zygote.scratch()
    ranks: List[zygote.Child] = []

    def stop() -> None:
        for p in ranks:
            p.kill()
        for p in ranks:
            p.wait(30)

    try:
        try:
            for r in range(world):
                ranks.append(forks.spawn(argv(r), dict(base, RANK=str(r), LOCAL_RANK=str(r)),
                                         scratch, f"rank{r}"))
        except BaseException:
            stop()  # ranks already started would wait for the others for ever
            raise
        deadline = time.monotonic() + timeout
        codes = [p.wait(max(0.0, deadline - time.monotonic())) for p in ranks]
        if any(c is None for c in codes):
            stop()
            raise JobFailed(f"{world} ranks did not finish in {timeout} s")
        return [(int(c), *p.output()) for c, p in zip(codes, ranks)]  # type: ignore[arg-type]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def stored(step: Path, rank: int = 0) -> Dict[str, "object"]:
    """What rank ``rank`` stored in the trace directory ``step``, read with safetensors
    (independently of ttrace's reader): tensor id → NumPy array."""
    import json

    from safetensors.numpy import load_file

    out: Dict[str, object] = {}
    files: Dict[str, Dict[str, object]] = {}
    for f in sorted(step.glob("manifest*.json")):
        for e in json.loads(f.read_text())["tensors"]:
            if e["rank"] == rank:
                data = files.setdefault(e["file"], load_file(str(step / e["file"])))
                out[e["id"]] = data[e["key"]]
    return out


def load_script(path: Path, name: str) -> "object":
    """Import a script (an example, a bench) as a module, without running its ``main``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
