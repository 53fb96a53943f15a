"""``rlx-tvm demo``: a module of rlx backward ops, fused and decomposed, against NumPy."""

from __future__ import annotations

import argparse

from ..demo import run_demo
from .common import TARGET_HELP, host_target


def add_parser(sub) -> None:
    demo = sub.add_parser(
        "demo",
        help="build and run a module of rlx backward ops (fused and decomposed) and check it against NumPy",
        description=(
            "Builds one Relax module calling a representative set of rlx backward ops, compiles it twice "
            "(fused TensorIR kernels, and DecomposeBackwardOps into primitive Relax ops), runs both on the "
            "local CPU and prints each op's error against its NumPy reference and its run time."
        ),
    )
    demo.add_argument("--target", default="local", help=TARGET_HELP)
    demo.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="input dtype (default float32)")
    demo.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return run_demo(target=host_target(args.target), dtype=args.dtype)
