"""Starting the tests' rank processes without importing torch in each: a server process that
has imported torch once forks a child per rank, which then runs ``python ARGV`` as a fresh
interpreter would (a script, ``-m module`` or ``-c code``), in the environment, working
directory and standard streams it is given.

Each fresh interpreter spends about 3 s of CPU importing torch before its job starts; a suite
that starts hundreds of ranks on two cores spends minutes on it. The server imports only what
every job imports first (torch, torch.distributed, NumPy) and does nothing else before it forks:
no thread, no process group, no parallel region (the OpenMP pool is made on first use, in the
child). What differs from a fresh interpreter, and why it does not matter here:

* the preloaded modules are imported once, with the server's environment: the harness gives the
  server the ranks' ``OMP_NUM_THREADS`` and a child asking for another count sets it with
  ``torch.set_num_threads``; every other variable a job reads (``TTRACE_TEST_*``, ``RANK``,
  ``MASTER_PORT`` ...) is read after the fork, from the child's own environment;
* the hash seed is the server's for every child (no test depends on set order);
* at exit the child does what the interpreter does — joins its non-daemon threads, runs the
  ``atexit`` functions, flushes its streams — then leaves with ``os._exit``.

Protocol (one JSON object per line): the harness writes ``{"argv", "env", "cwd", "out",
"err"}``; the server answers ``{"pid"}`` for each, and ``{"exit": pid, "code": c}`` when a child
ends (``c`` as :attr:`subprocess.Popen.returncode`: minus the signal that killed it). The
harness kills a child by its pid. ``TTRACE_TEST_FORK=0`` turns the server off (each rank a fresh
interpreter).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

#: The server's program, run as ``python -c SERVER``.
SERVER = r'''
import json, os, select, sys
import torch, torch.distributed, numpy  # noqa: F401  (the preload)

def run(req):
    import atexit, runpy, threading, traceback
    argv = req["argv"]
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and int(threads) != torch.get_num_threads():
        torch.set_num_threads(int(threads))
    code = 0
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        traceback.print_exc()
        code = code or 1
    os._exit(code & 0xFF)

def answer(obj):
    os.write(1, (json.dumps(obj) + "\n").encode())

pending = b""
live = set()
while True:
    ready, _, _ = select.select([0], [], [], 0.05)
    while live:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            break
        live.discard(pid)
        answer({"exit": pid, "code": os.waitstatus_to_exitcode(status)})
    if not ready:
        continue
    chunk = os.read(0, 1 << 16)
    if not chunk:
        break
    pending += chunk
    while b"\n" in pending:
        line, pending = pending.split(b"\n", 1)
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                for fd, path in ((1, req["out"]), (2, req["err"])):
                    f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                    os.dup2(f, fd)
                    os.close(f)
                run(req)
            finally:
                os._exit(1)
        live.add(pid)
        answer({"pid": pid})
'''


class Child:
    """A rank process the server forked: :meth:`wait`, :meth:`kill`, and its output once it
    has ended (the server writes its standard streams to files)."""

    def __init__(self, server: "Server", pid: int, out: Path, err: Path) -> None:
        self._server, self.pid, self._out, self._err = server, pid, out, err

    def wait(self, timeout: float) -> Optional[int]:
        """The exit code, or ``None`` if the child still runs after ``timeout`` seconds."""
        return self._server.wait(self.pid, timeout)

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def output(self) -> "tuple[str, str]":
        return (self._out.read_text(errors="replace"), self._err.read_text(errors="replace"))


class Server:
    """The forking server (one per test process, started on first use)."""

    def __init__(self, env: Dict[str, str]) -> None:
        self._proc = subprocess.Popen([sys.executable, "-c", SERVER], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._pids: List[int] = []
        self._codes: Dict[int, int] = {}
        self._dead = False
        threading.Thread(target=self._read, daemon=True, name="ttrace-zygote").start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            msg = json.loads(line)
            with self._cond:
                if "pid" in msg:
                    self._pids.append(int(msg["pid"]))
                else:
                    self._codes[int(msg["exit"])] = int(msg["code"])
                self._cond.notify_all()
        with self._cond:
            self._dead = True
            self._cond.notify_all()

    def alive(self) -> bool:
        return not self._dead and self._proc.poll() is None

    def spawn(self, argv: List[str], env: Dict[str, str], scratch: Path, name: str) -> Child:
        out, err = scratch / f"{name}.out", scratch / f"{name}.err"
        req = {"argv": argv, "env": env, "cwd": os.getcwd(), "out": str(out), "err": str(err)}
        assert self._proc.stdin is not None
        with self._lock:
            self._proc.stdin.write((json.dumps(req) + "\n").encode())
            self._proc.stdin.flush()
            with self._cond:
                if not self._cond.wait_for(lambda: self._pids or self._dead, timeout=60):
                    raise RuntimeError("the test harness's forking server did not answer")
                if not self._pids:
                    raise RuntimeError("the test harness's forking server died")
                pid = self._pids.pop(0)
        return Child(self, pid, out, err)

    def wait(self, pid: int, timeout: float) -> Optional[int]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while pid not in self._codes:
                left = deadline - time.monotonic()
                if left <= 0 or self._dead:
                    return None
                self._cond.wait(left)
            return self._codes.pop(pid)


_server: Optional[Server] = None


def server(env: Dict[str, str]) -> Optional[Server]:
    """The test process's server (started with ``env``: the variables the preload reads), or
    ``None`` where forking is off (``TTRACE_TEST_FORK=0``) or unavailable."""
    global _server
    if os.environ.get("TTRACE_TEST_FORK", "1") == "0" or not hasattr(os, "fork"):
        return None
    if _server is None or not _server.alive():
        _server = Server(env)
    return _server


def scratch() -> Path:
    """A fresh directory for one run's standard streams."""
    return Path(tempfile.mkdtemp(prefix="ttrace-ranks-"))
