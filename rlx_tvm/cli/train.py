"""``rlx-tvm train``: the example transformer block trained with SGD, or (``--torch``) a PyTorch model
trained through :mod:`rlx_tvm.torch` beside PyTorch eager."""

from __future__ import annotations

import argparse

from ..examples.tiny_transformer import Config, train


def add_parser(sub) -> None:
    tr = sub.add_parser(
        "train",
        help="train the example transformer block with SGD through rlx_tvm",
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
    tr.add_argument("--target", default="local", help="TVM target (default: local, this CPU with the committed tuning log)")
    tr.add_argument("--torch", nargs=argparse.REMAINDER, metavar="ARGS",
                    help="instead, train a PyTorch character-level causal transformer through rlx_tvm.torch "
                         "(torch.export, from_exported_program, AdamW) beside PyTorch eager, checking that the "
                         "losses agree; every argument after --torch goes to that example "
                         "(rlx-tvm train --torch --help lists them)")
    tr.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.torch is not None:
        from ..examples import torch_train  # needs PyTorch, which the main job does not

        return torch_train.main(args.torch)
    c = Config(dtype=args.dtype, batch=args.batch, seq=args.seq)
    losses = train(steps=args.steps, lr=args.lr, report_every=args.report_every, target=args.target, c=c)
    return 0 if sum(losses[-10:]) / len(losses[-10:]) < losses[0] else 1
