"""``python -m ttrace check REFERENCE CANDIDATE [--json PATH] [--pricing auto|local]
[--rtol R] [--thresholds CHECK.json] [--distributed [--timeout S]]``.

Mirrors the ``ttrace check`` command of the Rust CLI: prints the report, exits 0 when every
tensor is within its threshold, 1 when one is not, 2 on an error (unreadable or unmergeable
traces, bad arguments). Two summary traces (``Tracer(..., summaries=True)``) are compared from
their statistics: exit 1 when a difference is proven, 0 when none is (which is not a pass).

``torchrun --nproc-per-node N -m ttrace check --distributed REFERENCE CANDIDATE`` shares the
check among N processes (gloo; any number, whatever the traced run's layout): each reads its
share of the tensors, rank 0 prints the report (and writes ``--json``) a single-machine check
prints, and every rank exits with the same code. A rank that dies or does not answer within
``--timeout`` seconds (default 1800) makes the others exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, List, Optional, Union


def _inside(report: str, dirs: List[str]) -> Optional[str]:
    """Why the report must not be written at ``report``: inside a trace directory it could
    replace one of the trace's files (as the CLI refuses too)."""
    parent = os.path.dirname(report) or "."
    if not os.path.isdir(parent):
        return None  # fails when written, with its own message
    target = os.path.join(os.path.realpath(parent), os.path.basename(report))
    for d in dirs:
        real = os.path.realpath(d)
        if os.path.isdir(real) and os.path.commonpath([target, real]) == real:
            return (f"{report}: refusing to write the report inside the trace directory {d} "
                    "(it could replace one of its files); write it elsewhere")
    return None


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ttrace")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="compare a candidate trace directory with a reference")
    c.add_argument("reference", help="the reference trace directory")
    c.add_argument("candidate", help="the candidate trace directory")
    c.add_argument("--json", help="also write the report as JSON to this path")
    c.add_argument("--pricing", choices=["auto", "local"], default="auto")
    c.add_argument("--rtol", type=float, default=None,
                   help="summary traces only: the relative threshold for every tensor")
    c.add_argument("--thresholds", default=None,
                   help="summary traces only: per-tensor thresholds from a full check's JSON "
                        "report")
    c.add_argument("--distributed", action="store_true",
                   help="share the check among the processes torchrun started (gloo)")
    c.add_argument("--timeout", type=float, default=None,
                   help="with --distributed: seconds to wait for the other ranks")
    args = parser.parse_args(argv)

    from . import _ttrace
    from .errors import TtraceError
    from .report import CheckReport, check
    from .summaries import SummaryReport, check_summaries

    def error(message: str) -> int:
        # As the Rust CLI: on one line, escaped for the terminal; exit code 2.
        try:
            print(f"ttrace: error: {_ttrace.sanitize(message)}", file=sys.stderr, flush=True)
        except OSError:
            pass
        return 2

    if args.json:
        problem = _inside(args.json, [args.reference, args.candidate])
        if problem:
            return error(problem)
    summaries = [_ttrace.is_summary_dir(d) for d in (args.reference, args.candidate)]
    if any(summaries) and not all(summaries):
        one, other = ((args.reference, args.candidate) if summaries[0]
                      else (args.candidate, args.reference))
        return error(f"{one} is a summary trace and {other} is not: summaries compare only "
                     "with summaries")
    if not any(summaries) and (args.rtol is not None or args.thresholds is not None):
        return error("--rtol and --thresholds apply to summary traces only (a full trace's "
                     "thresholds are priced from its data)")
    if args.timeout is not None and not args.distributed:
        return error("--timeout applies to --distributed only")
    if args.distributed:
        if all(summaries):
            return error("--distributed checks full traces (summary traces are small: "
                         "check them on one process)")
        return _distributed(args, error)
    try:
        report: Union[CheckReport, SummaryReport]
        if all(summaries):
            report = check_summaries(args.reference, args.candidate, rtol=args.rtol,
                                     thresholds=args.thresholds)
        else:
            report = check(args.reference, args.candidate, pricing=args.pricing)
        if args.json:
            text = (report.to_json(indent=1) if isinstance(report, CheckReport)
                    else json.dumps(report.raw, indent=1))
            _ttrace.write_atomic(args.json, text.encode())
        header = (f"ttrace check: {'summaries of ' if all(summaries) else ''}"
                  f"{_ttrace.sanitize(args.candidate)} against "
                  f"{_ttrace.sanitize(args.reference)}\n")
        # The report's text is the Rust CLI's, escaped there; what cannot be written (a full
        # disk, a closed pipe) is an error, not a verdict.
        sys.stdout.write(header + str(report))
        sys.stdout.flush()
    except TtraceError as e:
        return error(str(e))
    except (OSError, ValueError) as e:
        if isinstance(e, OSError) and e.filename is None:
            return error(f"standard output: {e.strerror or e}")
        return error(str(e))
    return 0 if bool(report) else 1


def _distributed(args: argparse.Namespace, error: Callable[[str], int]) -> int:
    """``--distributed``: this process is one rank of a gloo group torchrun set up."""
    import datetime

    from . import _ttrace
    from ._distributed import DEFAULT_TIMEOUT
    from .errors import TtraceError
    from .report import check

    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if v not in os.environ]
    if missing:
        return error(f"--distributed runs under torchrun (or with {', '.join(missing)} set): "
                     "torchrun --nproc-per-node N -m ttrace check --distributed REF CAND")
    timeout = args.timeout if args.timeout is not None else DEFAULT_TIMEOUT
    if not timeout > 0:
        return error(f"--timeout must be positive seconds, not {timeout}")
    try:
        import torch.distributed as dist
    except ImportError as e:
        return error(f"--distributed needs torch: {e}")
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    except Exception as e:  # the rendezvous' own error types vary by version
        return error(f"--distributed: cannot join the process group: {e}")
    try:
        first = dist.get_rank() == 0
        report = check(args.reference, args.candidate, pricing=args.pricing,
                       group=dist.group.WORLD)
        if first:
            if args.json:
                _ttrace.write_atomic(args.json, report.to_json(indent=1).encode())
            sys.stdout.write(f"ttrace check: {_ttrace.sanitize(args.candidate)} against "
                             f"{_ttrace.sanitize(args.reference)}\n" + str(report))
            sys.stdout.flush()
        return 0 if bool(report) else 1
    except TtraceError as e:
        return error(str(e))
    except (OSError, ValueError) as e:
        return error(str(e))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # a group broken by a dead rank
            pass


if __name__ == "__main__":
    sys.exit(main())
