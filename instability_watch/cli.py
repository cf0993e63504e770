"""The `instability-watch` command."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="instability-watch",
        description="Catch and fix BF16 flash-attention training instabilities.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="show the near-tie rounding bias of BF16 flash attention and the stabilized fix",
    )
    demo.add_argument("--draws", type=_positive_int, default=8, help="random draws per case (default 8)")
    demo.add_argument("--seq", type=_positive_int, default=256, help="sequence length (default 256)")
    demo.add_argument("--device", default="cpu", help="torch device to run on (default cpu)")
    report = sub.add_parser(
        "report",
        help="summarise a run directory per head and plot its diagnostics",
        description="Print a per-head summary of a run directory written by RunWriter and write "
        "PNG plots of sigma(W_Q), multi-max frequency, sum(delta_lp - delta_hp), max logit and loss.",
    )
    report.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (holds metrics.csv)")
    report.add_argument("--out", metavar="DIR", default=None,
                        help="where to write the PNGs (default RUN_DIR/report/)")
    report.add_argument("--top", type=_positive_int, default=20,
                        help="heads shown in the table (default 20); the plots colour the first 6 of them")
    report.add_argument("--no-plots", action="store_true", help="print the summary only, write no PNGs")
    return parser


def _report(args: argparse.Namespace) -> int:
    """Run `instability-watch report`; a bad run directory is one line on stderr and status 2."""
    from . import report
    from .export import RunDirError

    try:
        return report.main(args.run_dir, out_dir=args.out, top=args.top, plots=not args.no_plots)
    except (RunDirError, OSError) as exc:
        message = " ".join(str(exc).splitlines())
        print(f"instability-watch report: error: {message}", file=sys.stderr)
        return 2


def report_command(run_dir) -> str:
    """The shell command that reports on ``run_dir`` (the script beside this interpreter, if installed there)."""
    import os
    import shlex

    exe = os.path.join(os.path.dirname(sys.executable), "instability-watch")
    prog = shlex.quote(os.path.relpath(exe)) if os.path.exists(exe) else "instability-watch"
    return f"{prog} report {shlex.quote(str(run_dir))}"


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from . import demo

        return demo.main(draws=args.draws, seq=args.seq, device=args.device)
    if args.command == "report":
        return _report(args)
    return 2  # unreachable: argparse requires a known command


if __name__ == "__main__":
    sys.exit(main())
