"""Shared helpers: running a job of ``jobs.py`` on one or several ranks (gloo, CPU)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

JOBS = Path(__file__).with_name("jobs.py")
TIMEOUT = 240  # seconds for one job, all ranks


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_job(job: str, directory: Path, world: int = 1, bug: str = "",
            dtype: str = "float32") -> None:
    """Run ``jobs.py JOB DIRECTORY BUG`` on ``world`` processes; fail with their output if
    one fails or the job outlives TIMEOUT."""
    env = dict(os.environ)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world),
               TTRACE_TEST_DTYPE=dtype)
    env.setdefault("OMP_NUM_THREADS", "1")
    procs: List[subprocess.Popen] = []
    for r in range(world):
        env_r = dict(env, RANK=str(r), LOCAL_RANK=str(r))
        procs.append(
            subprocess.Popen(
                [sys.executable, str(JOBS), job, str(directory), bug],
                env=env_r,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=TIMEOUT)
            outputs.append(out)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"job {job} on {world} ranks did not finish in {TIMEOUT} s")
    failed = [(r, o) for r, (p, o) in enumerate(zip(procs, outputs)) if p.returncode != 0]
    if failed:
        r, out = failed[0]
        pytest.fail(f"job {job} rank {r} failed:\n{out[-4000:]}")


@pytest.fixture(scope="session")
def traces(tmp_path_factory: pytest.TempPathFactory):
    """Trace directories made once per session: traces(job, world, bug, dtype) -> step0."""
    root = tmp_path_factory.mktemp("traces")
    made = {}

    def get(job: str, world: int = 1, bug: str = "", dtype: str = "float32") -> Path:
        key = (job, world, bug, dtype)
        if key not in made:
            d = root / f"{job}-{world}-{bug or 'clean'}-{dtype}"
            run_job(job, d, world, bug, dtype)
            made[key] = d / "step0"
        return made[key]

    return get
