"""The ``rlx-tvm`` command line."""

from __future__ import annotations

import argparse
import sys


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(target=args.target, dtype=args.dtype)


def _cmd_train(args: argparse.Namespace) -> int:
    from .examples.tiny_transformer import Config, train

    c = Config(dtype=args.dtype, batch=args.batch, seq=args.seq)
    losses = train(steps=args.steps, lr=args.lr, report_every=args.report_every, target=args.target, c=c)
    return 0 if sum(losses[-10:]) / len(losses[-10:]) < losses[0] else 1


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

    tr = sub.add_parser(
        "train",
        help="train the example transformer block with SGD through rlx_tvm (the main job)",
        description=(
            "Builds a one-block causal transformer LM (take embedding, rms_norm, rope, causal attention, gelu MLP, "
            "softmax cross-entropy) as ordinary Relax, differentiates it with rlx_tvm.autodiff (the backward graph "
            "is made of rlx ops), compiles it with tvm.compile and trains it with SGD on synthetic next-token data, "
            "printing the loss curve and the time per step."
        ),
    )
    tr.add_argument("--steps", type=int, default=300, help="SGD steps (default 300)")
    tr.add_argument("--lr", type=float, default=0.5, help="learning rate (default 0.5)")
    tr.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    tr.add_argument("--seq", type=int, default=16, help="sequence length (default 16)")
    tr.add_argument("--report-every", type=int, default=25, help="print a table row every N steps (default 25)")
    tr.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="parameter dtype")
    tr.add_argument("--target", default="llvm", help="TVM target (default: llvm, the local CPU)")
    tr.set_defaults(func=_cmd_train)

    ops = sub.add_parser("ops", help="list the registered rlx ops and their signatures",
                         description="Lists every relax.rlx.* operator with its inputs and attributes.")
    ops.set_defaults(func=_cmd_ops)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
