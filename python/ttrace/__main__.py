"""``python -m ttrace check REFERENCE CANDIDATE [--json PATH] [--pricing auto|local]``.

Mirrors the ``ttrace check`` command of the Rust CLI: prints the report, exits 0 when every
tensor is within its threshold, 1 when one is not, 2 on an error (unreadable or unmergeable
traces, bad arguments).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional


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
    args = parser.parse_args(argv)

    from . import _ttrace
    from .errors import TtraceError
    from .report import check

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
    try:
        report = check(args.reference, args.candidate, pricing=args.pricing)
        if args.json:
            _ttrace.write_atomic(args.json, report.to_json(indent=1).encode())
        header = (f"ttrace check: {_ttrace.sanitize(args.candidate)} against "
                  f"{_ttrace.sanitize(args.reference)}\n")
        # The report's text is the Rust CLI's, escaped there; what cannot be written (a full
        # disk, a closed pipe) is an error, not a verdict.
        sys.stdout.write(header + str(report))
        sys.stdout.flush()
    except TtraceError as e:
        return error(str(e))
    except OSError as e:
        return error(f"standard output: {e.strerror or e}")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
