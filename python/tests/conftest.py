"""Shared helpers: running a job of ``jobs.py`` on one or several ranks (gloo, CPU)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import harness  # noqa: E402

#: Tests marked ``full`` belong to the heavy sweep: more dtypes, worlds, families and planted
#: bugs of a case the quick slice already runs once. They run with ``--full`` (or
#: ``TTRACE_FULL_TESTS=1``; ``scripts/test.sh --full``), and are reported as skipped without it.
FULL_ENV = "TTRACE_FULL_TESTS"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true",
                     help="run the heavy sweep too (the tests marked `full`)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "full: part of the heavy sweep, run with --full or TTRACE_FULL_TESTS=1")


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    if config.getoption("--full") or os.environ.get(FULL_ENV) == "1":
        return
    skip = pytest.mark.skip(reason="heavy sweep: run with --full (scripts/test.sh --full)")
    for item in items:
        if item.get_closest_marker("full") is not None:
            item.add_marker(skip)



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
