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
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from . import demo

        return demo.main(draws=args.draws, seq=args.seq, device=args.device)
    return 2  # unreachable: argparse requires a known command


if __name__ == "__main__":
    sys.exit(main())
