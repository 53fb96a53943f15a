"""``rlx-tvm compile``: a Relax module (TVMScript file or suite kernel) to a shared library."""

from __future__ import annotations

import argparse
import os

import tvm

from ..bench.suite import suite_kernel, suite_module
from ..build import compile as rlx_compile
from .common import TARGET_HELP, host_target


def add_parser(sub) -> None:
    co = sub.add_parser(
        "compile", help="compile a Relax module (TVMScript file or suite kernel) to a shared library",
        description=(
            "Compiles SOURCE with rlx_tvm.compile (tuned schedules from the target's tuning log where they "
            "match, default schedules elsewhere, and says which) and writes it with export_library. SOURCE is "
            "a TVMScript file holding an @I.ir_module (R.rlx ops allowed) or suite:<kernel>."),
    )
    co.add_argument("source", help="TVMScript file, or suite:<kernel name>")
    co.add_argument("-o", "--output", required=True, help="shared library to write (.so)")
    co.add_argument("--target", default="local", help=TARGET_HELP)
    co.add_argument("--tuning-log", help="tuning log directory (default: the committed log of the target)")
    co.add_argument("--scale", default="full", choices=["full", "small"], help="shapes of a suite: kernel")
    co.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.source.startswith("suite:"):
        mod = suite_module(suite_kernel(args.source[len("suite:"):]), args.scale)
    else:
        with open(args.source) as f:
            mod = tvm.script.from_source(f.read())
        if not isinstance(mod, tvm.IRModule):
            raise SystemExit(f"rlx-tvm compile: {args.source} holds no IRModule (an @I.ir_module class)")
    ex = rlx_compile(mod, host_target(args.target), tuning_log=args.tuning_log or "auto")
    ex.export_library(args.output)
    print(f"wrote {args.output} ({os.path.getsize(args.output)} bytes); load it with "
          f"tvm.runtime.load_module and run it with relax.VirtualMachine")
    return 0


