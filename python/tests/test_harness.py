"""The tests' rank processes forked by the zygote server behave as fresh interpreters.

Oracle: the same programs started as fresh interpreters (``TTRACE_TEST_FORK=0``, plain
``subprocess``): exit codes, standard output and error, ``sys.argv``, the environment, the
threads joined and the ``atexit`` functions run at exit, an uncaught exception's exit code.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import List, Tuple

import pytest

import harness
import zygote

SCRIPT = '''
import atexit, os, sys, threading, time
import torch
atexit.register(lambda: print("atexit", flush=True))
def late():
    time.sleep(0.2)
    print("thread done", flush=True)
threading.Thread(target=late).start()
print("argv", sys.argv[1:], "rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"],
      "extra", os.environ.get("EXTRA"), "threads", torch.get_num_threads())
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
'''


def _both(monkeypatch: pytest.MonkeyPatch, argv, world: int = 2,
          env=None) -> "Tuple[List[Tuple[int, str, str]], List[Tuple[int, str, str]]]":
    monkeypatch.setenv("TTRACE_TEST_FORK", "0")
    fresh = harness.run_ranks(argv, world, timeout=120, env=env)
    monkeypatch.setenv("TTRACE_TEST_FORK", "1")
    forked = harness.run_ranks(argv, world, timeout=120, env=env)
    assert zygote._server is not None and zygote._server.alive()  # the ranks were forked
    return fresh, forked


def test_a_forked_script_exits_prints_and_reads_its_environment_as_a_fresh_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    fresh, forked = _both(monkeypatch, lambda r: [str(script), str(3 + r), "x"],
                          env={"EXTRA": "yes", "OMP_NUM_THREADS": "2"})
    assert forked == fresh
    assert fresh[1][0] == 4
    assert fresh[0][1].splitlines() == ["argv ['3', 'x'] rank 0 of 2 extra yes threads 2",
                                        "thread done", "atexit"]
    assert fresh[0][2] == "to stderr\n"


def test_code_modules_and_uncaught_exceptions_run_as_in_a_fresh_interpreter(
        monkeypatch: pytest.MonkeyPatch) -> None:
    code = "import sys; print(sys.argv); raise ValueError('boom')"
    fresh, forked = _both(monkeypatch, lambda r: ["-c", code, str(r)], world=1)
    want = [(1, "['-c', '0']\n")]
    assert [(c, o) for c, o, _ in forked] == [(c, o) for c, o, _ in fresh] == want
    assert fresh[0][2].rstrip().endswith("ValueError: boom")
    assert forked[0][2].rstrip().endswith("ValueError: boom")
    fresh, forked = _both(monkeypatch, lambda r: ["-m", "json.tool", "--help"], world=1)
    assert forked == fresh and fresh[0][0] == 0 and "usage:" in fresh[0][1]
    fresh, forked = _both(monkeypatch, lambda r: ["-c", "import os; os._exit(5)"], world=1)
    assert forked == fresh == [(5, "", "")]


def test_ranks_that_outlive_their_time_are_killed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TTRACE_TEST_FORK", "1")
    start = time.monotonic()
    with pytest.raises(harness.JobFailed, match="did not finish in 3 s"):
        harness.run_ranks(lambda r: ["-c", "import time; time.sleep(600)"], 2, timeout=3)
    assert time.monotonic() - start < 60
    # The server still serves.
    assert harness.run_ranks(lambda r: ["-c", "print('after')"], 1) == [(0, "after\n", "")]
