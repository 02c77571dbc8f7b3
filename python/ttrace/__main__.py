"""``python -m ttrace check REFERENCE CANDIDATE [--json PATH] [--pricing auto|local]
[--rtol R] [--thresholds CHECK.json]``.

Mirrors the ``ttrace check`` command of the Rust CLI: prints the report, exits 0 when every
tensor is within its threshold, 1 when one is not, 2 on an error (unreadable or unmergeable
traces, bad arguments). Two summary traces (``Tracer(..., summaries=True)``) are compared from
their statistics: exit 1 when a difference is proven, 0 when none is (which is not a pass).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional, Union


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


if __name__ == "__main__":
    sys.exit(main())
