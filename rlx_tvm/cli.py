"""The ``rlx-tvm`` command line."""

from __future__ import annotations

import argparse
import sys


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(target=args.target, dtype=args.dtype)


def _cmd_ops(args: argparse.Namespace) -> int:
    from .ops import all_ops

    rows = [(o.name, "backward" if o.backward else "forward", repr(o)[len("<rlx op "):-1]) for o in all_ops()]
    width = max(len(r[0]) for r in rows)
    print(f"{'op':<{width}}  kind      signature")
    print(f"{'-' * width}  --------  ---------")
    for name, kind, sig in rows:
        print(f"{name:<{width}}  {kind:<8}  {sig.split('(', 1)[1].rstrip(')') if '(' in sig else sig}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlx-tvm",
        description="rlx_tvm: backward operators, decompositions and fused kernels for training with TVM Relax.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="build and run a module of rlx backward ops (fused and decomposed) and check it against NumPy",
        description=(
            "Builds one Relax module calling a representative set of rlx backward ops, compiles it twice "
            "(fused TensorIR kernels, and DecomposeBackwardOps into primitive Relax ops), runs both on the "
            "local CPU and prints each op's error against its NumPy reference and its run time."
        ),
    )
    demo.add_argument("--target", default="llvm", help="TVM target to compile for (default: llvm, the local CPU)")
    demo.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="input dtype (default float32)")
    demo.set_defaults(func=_cmd_demo)

    ops = sub.add_parser("ops", help="list the registered rlx ops and their signatures",
                         description="Lists every relax.rlx.* operator with its inputs and attributes.")
    ops.set_defaults(func=_cmd_ops)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
