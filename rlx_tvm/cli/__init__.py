"""The ``rlx-tvm`` command line: one module per command, each with ``add_parser`` and ``run``."""

from __future__ import annotations

import argparse
import sys

from . import bench, compile, demo, device_pack, ops, train, tune

__all__ = ["build_parser", "main"]

COMMANDS = (demo, train, tune, bench, compile, device_pack, ops)  # in the order --help lists them


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlx-tvm",
        description="rlx_tvm: backward operators, decompositions and fused kernels for training with TVM Relax.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
