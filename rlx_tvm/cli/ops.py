"""``rlx-tvm ops``: the registered rlx ops and their signatures."""

from __future__ import annotations

import argparse

from ..ops import all_ops


def add_parser(sub) -> None:
    ops = sub.add_parser("ops", help="list the registered rlx ops and their signatures",
                         description="Lists every relax.rlx.* operator with its inputs and attributes.")
    ops.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    rows = [(o.name, "backward" if o.backward else "forward", repr(o)[len("<rlx op "):-1]) for o in all_ops()]
    width = max(len(r[0]) for r in rows)
    print(f"{'op':<{width}}  kind      signature")
    print(f"{'-' * width}  --------  ---------")
    for name, kind, sig in rows:
        print(f"{name:<{width}}  {kind:<8}  {sig.split('(', 1)[1].rstrip(')') if '(' in sig else sig}")
    return 0


