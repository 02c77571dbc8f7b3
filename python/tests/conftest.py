"""Shared helpers: running a job of ``jobs.py`` on one or several ranks (gloo, CPU)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, Optional, Tuple

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import harness  # noqa: E402



def run_job(job: str, directory: Path, world: int = 1, bug: str = "",
            dtype: str = "float32", env: Optional[Dict[str, str]] = None) -> None:
    """:func:`harness.run_job`, failing the test when the job fails."""
    try:
        harness.run_job(job, directory, world, bug, dtype, env)
    except harness.JobFailed as e:
        pytest.fail(str(e))


@pytest.fixture(scope="session")
def traces(tmp_path_factory: pytest.TempPathFactory):
    """Trace directories made once per session: traces(job, world, bug, dtype, **env) -> step0
    (``env``: extra TTRACE_TEST_* settings of the job, e.g. ``TP="2"``)."""
    root = tmp_path_factory.mktemp("traces")
    made: Dict[Tuple, Path] = {}

    def get(job: str, world: int = 1, bug: str = "", dtype: str = "float32",
            **env: str) -> Path:
        key = (job, world, bug, dtype, tuple(sorted(env.items())))
        if key not in made:
            tag = "-".join(f"{k}{v}" for k, v in sorted(env.items()))
            d = root / f"{job}-{world}-{bug or 'clean'}-{dtype}-{tag}"
            run_job(job, d, world, bug, dtype, {f"TTRACE_TEST_{k}": v for k, v in env.items()})
            made[key] = d / "step0"
        return made[key]

    return get
