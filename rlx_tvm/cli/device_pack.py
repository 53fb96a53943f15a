"""``rlx-tvm device-pack``: the suite built for a GPU, to be timed where TVM's compiler is not."""

from __future__ import annotations

import argparse

from ..bench.device_pack import build_pack, pack_size
from .common import host_target, kernel_names


def add_parser(sub) -> None:
    dp = sub.add_parser(
        "device-pack",
        help="build the suite for a GPU into a directory that times it on a machine without TVM's compiler",
        description=(
            "Compiles every suite kernel (or --kernels) for --target here (CUDA through nvcc) to shared libraries "
            "and writes beside them their input specs, TVM's runtime without its compiler (and tvm_ffi for the "
            "device's Python), the PyTorch counterparts and device_time.py. On the machine with the GPU (which "
            "needs Python, NumPy and, for the comparison, PyTorch; nothing else): python3 OUT/device_time.py "
            "--out results.json times each TVM build against PyTorch eager and prints a table."
        ),
    )
    dp.add_argument("--target", default='{"kind": "cuda", "arch": "sm_90"}',
                    help="TVM target (default CUDA sm_90, the H100/H200; 'local' builds for this CPU, to try a pack here)")
    dp.add_argument("--out", default="device_pack",
                    help="directory to write: new, empty, or an earlier pack, which is replaced (default device_pack)")
    dp.add_argument("--kernels", help="comma-separated suite kernels (default: all)")
    dp.add_argument("--python", help="the device's Python version, e.g. 3.12 (default: this one's)")
    dp.add_argument("--scale", choices=["full", "small"], default="full", help="suite shapes (default full)")
    dp.add_argument("--tuning-log", help="tuning log directory (default: the committed log for the target, if any)")
    dp.add_argument("--tuning-round", type=int, default=0, metavar="N",
                    help="also a MetaSchedule tuning round: up to N new candidates per task, searched here with "
                         "the records of --work-dir, built into OUT/round; device_time.py measures them first, and "
                         "rlx-tvm tune --device-results RESULTS.json stores them here (default 0: no round)")
    dp.add_argument("--work-dir", help="with --tuning-round: the tuning database (default tuning_work/<target key>)")
    dp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    target = host_target(args.target)
    print(f"building the suite for {target} into {args.out}", flush=True)
    try:
        build_pack(args.out, target, kernel_names(args.kernels), python_version=args.python, scale=args.scale,
                   tuning_log=args.tuning_log or "auto", progress=lambda m: print(m, flush=True),
                   tuning_round=args.tuning_round, work_dir=args.work_dir)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    size = pack_size(args.out)
    print(f"\n{args.out}: {size / 2**20:.1f} MiB. On the GPU machine: python3 {args.out}/device_time.py --out RESULTS.json")
    if args.tuning_round:
        print(f"then here: rlx-tvm tune --device-results RESULTS.json --pack {args.out}")
    if size > 60 * 2**20:
        print("warning: over 60 MiB, more than a device machine may take with a run of 64 MiB (--kernels for fewer)")
    return 0


