"""The `instability-watch` command."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import List, Optional

from instability_watch import __version__


class _Parser(argparse.ArgumentParser):
    """argparse, with every error on one line (no usage block), like the command's other errors."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.splitlines())}\n")


def _int_in(low: int, high: Optional[int] = None, why: str = ""):
    """A ``type=`` for integers in ``[low, high]``; its errors say what is allowed and what was given."""
    allowed = "a positive integer" if (low, high) == (1, None) else f"an integer from {low} to {high}{why}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
        return value

    parse.__name__ = "integer"  # argparse names the type in errors that bypass the above
    return parse


_positive_int = _int_in(1)


def _device(text: str):
    """``--device``: a device the demo runs on and this machine has (see ``demo.resolve_device``)."""
    from instability_watch import demo

    try:
        return demo.resolve_device(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _out_dir(text: str) -> str:
    """``report --out``: a directory that exists or can be created, and that this user can write to.

    Checked before the report runs, so that a bad ``--out`` is a one-line error
    naming the option rather than a failure after the summary was printed.
    """
    allowed = "a directory that exists or can be created, and is writable"
    if not text:
        raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}, an existing file")
    base = path
    while not base.exists() and base != base.parent:  # the nearest existing ancestor: where mkdir starts
        base = base.parent
    if not base.is_dir():
        raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}, inside the file {str(base)!r}")
    # Try it rather than ask os.access: root passes access() where the filesystem still refuses (/sys, /proc).
    try:
        fd, probe = tempfile.mkstemp(dir=base, prefix=".instability-watch-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        where = "which" if base == path else f"to be created in {str(base)!r}, which"
        reason = exc.strerror or type(exc).__name__
        raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}, {where} is not writable ({reason})") from None
    return text


def build_parser() -> argparse.ArgumentParser:
    """The ``instability-watch`` argument parser: ``--version`` and the ``demo`` and ``report`` commands.

    Bad arguments end with one line on stderr and exit status 2 (argparse's convention).
    """
    from instability_watch import demo as demo_module

    parser = _Parser(
        prog="instability-watch",
        description="Catch and fix BF16 flash-attention training instabilities.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    # not required=True: argparse's message for a missing command would not name the commands (see main)
    sub = parser.add_subparsers(dest="command", metavar="{demo,report}")
    demo = sub.add_parser(
        "demo",
        help="show the near-tie rounding bias of BF16 flash attention and the stabilized fix",
    )
    demo.add_argument("--draws", type=_positive_int, default=demo_module.DEFAULT_DRAWS,
                      help=f"random draws per case (default {demo_module.DEFAULT_DRAWS})")
    seq_why = f" (room for the {demo_module.N_TIES} near-tied keys; the float64 reference grows as seq^2)"
    demo.add_argument("--seq", type=_int_in(demo_module.MIN_SEQ, demo_module.MAX_SEQ, seq_why),
                      default=demo_module.DEFAULT_SEQ,
                      help=f"sequence length, {demo_module.MIN_SEQ} to {demo_module.MAX_SEQ} "
                      f"(default {demo_module.DEFAULT_SEQ})")
    demo.add_argument("--device", type=_device, default="cpu",
                      help=f"where to run: {demo_module.DEVICES} (default cpu)")
    report = sub.add_parser(
        "report",
        help="summarise a run directory per head and plot its diagnostics",
        description="Print a per-head summary of a run directory written by RunWriter and write "
        "PNG plots of sigma(W_Q), multi-max frequency, sum(delta_lp - delta_hp), max logit and loss.",
    )
    report.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (holds metrics.csv)")
    report.add_argument("--out", metavar="DIR", type=_out_dir, default=None,
                        help="where to write the PNGs (default RUN_DIR/report/)")
    report.add_argument("--top", type=_positive_int, default=20,
                        help="heads shown in the table (default 20); each plot colours the 6 heads most extreme "
                        "in its metric, and heads that alerted or were switched")
    report.add_argument("--no-plots", action="store_true", help="print the summary only, write no PNGs")
    return parser


def _report(args: argparse.Namespace) -> int:
    """Run `instability-watch report`; a bad run directory is one line on stderr and status 2."""
    from instability_watch.outputs import report
    from instability_watch.outputs.rundir import RunDirError

    run_dir = Path(args.run_dir)
    inner = run_dir / "instability_watch"
    if not (run_dir / "meta.json").exists() and (inner / "meta.json").exists():
        # a trainer's log directory (Lightning's version_N, the HF Trainer's output_dir) holding the watch's run:
        # its own metrics.csv, if any, is the logger's
        print(f"instability-watch report: {run_dir} is not a run directory; reporting on the watch's run in "
              f"{inner}", file=sys.stderr)
        run_dir = inner
    elif not (run_dir / "meta.json").exists() and inner.is_dir():
        # Lightning without a logger: the watch's runs are inner/version_N
        runs = sorted(str(m.parent) for m in inner.glob("*/meta.json"))
        if runs:
            print(f"instability-watch report: error: {run_dir} is not a run directory; the watch's runs are in: "
                  f"{', '.join(runs)}", file=sys.stderr)
            return 2
    try:
        return report.main(run_dir, out_dir=args.out, top=args.top, plots=not args.no_plots)
    except (RunDirError, OSError) as exc:
        message = " ".join(str(exc).splitlines())
        print(f"instability-watch report: error: {message}", file=sys.stderr)
        return 2


def report_command(run_dir) -> str:
    """The shell command that reports on ``run_dir`` (the script beside this interpreter, if installed there)."""
    import shlex

    exe = os.path.join(os.path.dirname(sys.executable), "instability-watch")
    prog = shlex.quote(os.path.relpath(exe)) if os.path.exists(exe) else "instability-watch"
    return f"{prog} report {shlex.quote(str(run_dir))}"


def main(argv: Optional[List[str]] = None) -> int:
    """Run the ``instability-watch`` command on ``argv`` (default ``sys.argv[1:]``).

    Returns the exit status: 0 on success, 2 for a bad run directory; bad arguments and a
    missing command exit with status 2 through argparse.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        from instability_watch import demo

        return demo.main(draws=args.draws, seq=args.seq, device=args.device)
    if args.command == "report":
        return _report(args)
    parser.error("a command is required: 'demo' or 'report', got none")  # exits with status 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
