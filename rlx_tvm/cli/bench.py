"""``rlx-tvm bench``: the kernel suite, or (``--steps``) whole training steps of PyTorch models, timed
side by side with PyTorch eager."""

from __future__ import annotations

import argparse
import sys

from ..bench import format_markdown, format_table, run_bench, write_json
from ..bench import steps
from ..bench.steps import STEP_MODELS
from .common import KERNELS_HELP, kernel_names


def add_parser(sub) -> None:
    be = sub.add_parser(
        "bench", help="time the suite: tuned vs default schedules vs TVM untuned vs PyTorch eager",
        description=(
            "Times each suite kernel compiled four ways in one process: rlx_tvm with the tuning log, rlx_tvm "
            "with default schedules, TVM's own formulation (relax.op.grad ops, else the decomposition) with "
            "plain tvm.compile, and PyTorch eager backward (when installed); interleaved repeats in shuffled "
            "order with a pause before each timing, median, "
            "same thread count; GB/s against a copy kernel measured in the same run (GFLOP/s for conv and "
            "attention). Prints a table; --json writes the numbers."),
    )
    be.add_argument("--steps", nargs="*", metavar="MODEL", default=None,
                    help="instead of the kernel suite, time whole training steps (forward, loss, gradients, "
                         "SGD-momentum update) of PyTorch models compiled through rlx_tvm.torch against PyTorch "
                         f"eager, with a per-kernel profile of each step; MODELs: some of {', '.join(STEP_MODELS)} "
                         "(default: all). Needs PyTorch. --repeats, --min-ms, --json and --scale apply")
    be.add_argument("--top", type=int, default=10, help="with --steps: kernels shown per step profile (default 10)")
    be.add_argument("--kernels", help=KERNELS_HELP)
    be.add_argument("--repeats", type=int, default=7, help="interleaved repeats; the median is reported (default 7)")
    be.add_argument("--min-ms", type=float, default=50.0, help="each timing averages calls for at least this long")
    be.add_argument("--settle-ms", type=float, default=100.0,
                    help="pause before each timing at least this long, and then until the process's "
                         "threads have been idle for 20 ms (at most 1 s in all), so that the thread pool "
                         "of the variant timed before (TVM's spins for 150-180 ms, PyTorch's OpenMP for "
                         "about 10 ms) has stopped (default 100)")
    be.add_argument("--threads", type=int, default=None,
                    help="threads for TVM and torch (default: every CPU this process may run on)")
    be.add_argument("--tuning-log", help="tuning log directory (default: the committed log of this CPU)")
    be.add_argument("--no-torch", action="store_true", help="leave PyTorch out even when installed")
    be.add_argument("--scale", default="full", choices=["full", "small"], help="suite shapes (small: a quick check)")
    be.add_argument("--json", help="write the results as JSON to this file")
    be.add_argument("--markdown", help="write the table as Markdown to this file")
    be.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.steps is not None:
        return run_steps(args)
    report = run_bench(kernel_names(args.kernels), repeats=args.repeats, min_ms=args.min_ms, threads=args.threads,
                       tuning_log=args.tuning_log or "auto", use_torch=not args.no_torch, scale=args.scale,
                       settle_ms=args.settle_ms, progress=lambda m: print(m, flush=True))
    print()
    print(format_table(report))
    if args.json:
        write_json(report, args.json)
        print(f"\nresults written to {args.json}")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(format_markdown(report) + "\n")
        print(f"Markdown table written to {args.markdown}")
    return 0




def run_steps(args: argparse.Namespace) -> int:
    unknown = [m for m in args.steps if m not in STEP_MODELS]
    if unknown:
        print(f"rlx-tvm bench --steps: unknown model(s) {', '.join(unknown)}: expected some of "
              f"{', '.join(STEP_MODELS)}", file=sys.stderr)
        return 2
    if args.repeats < 1:
        print(f"rlx-tvm bench: --repeats expected a positive count, got {args.repeats}", file=sys.stderr)
        return 2
    results = steps.run(args.steps or list(STEP_MODELS), args.scale, args.repeats, args.min_ms, args.top)
    if args.json:
        steps.write_json(results, args.json)
        print(f"\nresults written to {args.json}")
    return 1 if any("error" in r for r in results) else 0
