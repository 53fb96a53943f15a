"""``rlx-tvm tune``: MetaSchedule tuning of the benchmark suite, and the tuning log it leaves.

The log goes to ``--log-dir`` (default: the package's tuning logs, for this target's key), with
the run's record beside it (:mod:`rlx_tvm.tuning.report`: ``TUNING.json``, rendered as
``TUNING.md``)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import tvm
from tvm.s_tir import meta_schedule as ms

from ..bench.suite import SUITE, suite_ir_module, suite_kernels, suite_module
from ..build import TUNING_LOGS
from ..target import target_key
from ..tuning.device_round import commit_round
from ..tuning.export import MIN_SPEEDUP, export_log
from ..tuning.report import EXPORT_HEAD, MODULE_HEAD, TASK_HEAD, TuningReport, read_report, with_earlier_tasks, write_report
from ..tuning.search import SKIPPED, rpc_runner, short_task_name, tune
from .common import KERNELS_HELP, TARGET_HELP, host_target, kernel_names, print_table, us


def add_parser(sub) -> None:
    tu = sub.add_parser(
        "tune", help="tune the backward-kernel suite with MetaSchedule and write the tuning log",
        description=(
            "Tunes every kernel of the benchmark suite (or --kernels) at full shapes with MetaSchedule "
            "(evolutionary search, XGBoost cost model), recording every measured candidate in --work-dir "
            "(resumable: run again to continue), then writes the best record per kernel to --log-dir, "
            "the tuning log that rlx_tvm.compile applies for this target. Prints one line per kernel and "
            "a table at the end."),
    )
    tu.add_argument("--trials", type=int, default=200, help="measured candidates per kernel (default 200)")
    tu.add_argument("--copy-trials", type=int, default=32,
                    help="at most this many for kernels that only move data (slices, reshapes, "
                         "concatenations; no arithmetic), whose schedule space is small (default 32)")
    tu.add_argument("--kernels", help=KERNELS_HELP)
    tu.add_argument("--target", help=TARGET_HELP + " (with --device-results: the pack's)")
    tu.add_argument("--work-dir", help="database of all records (default tuning_work/<target key>)")
    tu.add_argument("--log-dir", help="pruned tuning log to write (default: the package's tuning_logs/<target key>)")
    tu.add_argument("--seed", type=int, default=0, help="search seed (default 0)")
    tu.add_argument("--time-budget", type=float, metavar="SECONDS",
                    help="start no kernel after this many seconds (a started one finishes); the rest are "
                         "skipped, and running the command again resumes them from the records")
    tu.add_argument("--rpc", metavar="HOST:PORT",
                    help="measure on remote devices through this TVM RPC tracker (python -m tvm.exec.rpc_tracker)")
    tu.add_argument("--key", help="with --rpc: the device key the RPC servers registered with (--key of rpc_server)")
    tu.add_argument("--keep-all", action="store_true",
                    help="put every kernel's best record in the log; by default a record is re-measured against "
                         "the kernel's default schedule and left out unless it is at least 5%% faster, and then "
                         "each suite kernel is timed with its records and without them, and its records are left "
                         "out unless it is at least 5%% faster with them")
    tu.add_argument("--scale", default="full", choices=["full", "small"],
                    help="suite shapes (default full, the benchmark's; small: a quick check)")
    tu.add_argument("--device-results", metavar="RESULTS.json",
                    help="instead of searching: store the tuning round that device_time.py measured on a device "
                         "(its --out file; the pack made with device-pack --tuning-round) in the work database the "
                         "round was searched with (or --work-dir), for the pack's target, then export the log as usual")
    tu.add_argument("--pack", default="device_pack",
                    help="with --device-results: the device pack the round came from (default device_pack)")
    tu.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    target, round_work_dir = host_target(args.target), None
    if args.device_results:
        target, round_work_dir = _round_target(args, target)
    key = target_key(target)
    work_dir = args.work_dir or round_work_dir or os.path.join("tuning_work", key)
    log_dir = args.log_dir or os.path.join(TUNING_LOGS, key)
    kernels = suite_kernels(kernel_names(args.kernels))
    runner = None
    if args.rpc:
        if not args.key:
            raise SystemExit("rlx-tvm tune: --rpc needs --key (the key the RPC servers registered with)")
        runner = rpc_runner(args.rpc, args.key)
        print(f"measuring on RPC servers with key {args.key!r} via the tracker at {args.rpc}", flush=True)
    os.makedirs(work_dir, exist_ok=True)
    print(f"reading the work database {work_dir}", flush=True)
    db = ms.database.JSONDatabase(work_dir=work_dir)  # once: thousands of records take ~20 s to read
    if args.device_results:
        rows = _commit_device_round(args, work_dir, db)
    else:
        rows = _search(args, target, key, work_dir, kernels, runner, db)
    print(f"\nexporting the best record per kernel to {log_dir}", flush=True)
    # Every suite kernel at both scales: records of no current kernel are stale, and each suite
    # kernel must run at least MIN_SPEEDUP times faster with its records than without them.
    exported = export_log(work_dir, log_dir, target, compare_default=not args.keep_all,
                          kernels={f"{k.name} ({scale})": suite_module(k, scale)
                                   for scale in ("full", "small") for k in suite_kernels()}, database=db)
    faster = f"{(MIN_SPEEDUP - 1) * 100:g}% faster"  # what export_log asks of a record to keep it
    export_rows = [(r.kernel, us(r.tuned_us), us(r.default_us), _export_verdict(r, faster)) for r in exported.rows]
    module_rows = [(m.name, m.records, f"{m.tuned_ms:.2f}", f"{m.default_ms:.2f}", "yes" if m.kept else f"no: not {faster}")
                   for m in exported.modules]
    print()
    print_table(TASK_HEAD, rows)
    print()
    print_table(EXPORT_HEAD, export_rows)
    if module_rows:
        print()
        print_table(MODULE_HEAD, module_rows)
    method = (f"up to {args.trials} measured candidates per kernel ({min(args.trials, args.copy_trials)} for kernels "
              "that only move data; kernels with a hand-written schedule are not searched), MetaSchedule "
              f"evolutionary search with the XGBoost cost model, seed {args.seed}.") if not args.device_results else (
        f"a tuning round measured on a device (`--device-results {args.device_results}`, pack `{args.pack}`): "
        "candidates of MetaSchedule's evolutionary search with the XGBoost cost model trained on the work "
        "database, built here and timed there beside each task's default schedule.")
    earlier = read_report(log_dir)
    rows = with_earlier_tasks(rows, earlier, [k.name for k in kernels], [k.name for k in SUITE])
    write_report(log_dir, TuningReport(
        key, str(target), datetime.date.today().isoformat(), method, faster, keep_all=args.keep_all,
        time_budget=args.time_budget, tasks=rows, export=[list(r) for r in export_rows],
        modules=[list(r) for r in module_rows]))
    print(f"\n{exported.kept} kernels written to {log_dir} (rlx_tvm.compile applies it for {key})")
    return 0 if all(not r[-1].startswith("failed") for r in rows) else 1


def _round_target(args, given):
    """With --device-results: the pack's target (a given --target must have its key: records tuned
    for a GPU must not land in a CPU's log) and the work database its round was searched with."""
    try:
        with open(os.path.join(args.pack, "spec.json")) as f:
            spec = json.load(f)
    except FileNotFoundError:
        raise SystemExit(f"rlx-tvm tune: {args.pack} is not a device pack (no spec.json); give it with --pack") from None
    if "round" not in spec:
        raise SystemExit(f"rlx-tvm tune: the device pack {args.pack} holds no tuning round (make it with --tuning-round)")
    target = tvm.target.Target(spec["target"])
    if args.target is not None and target_key(given) != target_key(target):
        raise SystemExit(f"rlx-tvm tune: --target is {target_key(given)}, but the pack {args.pack} was built for "
                         f"{target_key(target)}; leave --target out to take the pack's")
    return target, spec["round"]["work_dir"]


def _search(args, target, key: str, work_dir: str, kernels, runner, db) -> list[tuple]:
    """``rlx-tvm tune``'s search: each kernel in turn, measured here or through --rpc."""
    print(f"tuning {len(kernels)} suite kernel(s) for {key} ({target}), {args.trials} trials per kernel "
          f"({min(args.trials, args.copy_trials)} for data movement), records in {work_dir}", flush=True)
    rows = []
    deadline = None if args.time_budget is None else time.time() + args.time_budget
    for i, kernel in enumerate(kernels):
        print(f"== {kernel.name} ({i + 1}/{len(kernels)})", flush=True)
        mod = suite_ir_module([kernel], args.scale)
        budget = None if deadline is None else max(0.0, deadline - time.time())
        for r in tune(mod, target, trials=args.trials, work_dir=work_dir, seed=args.seed,
                      runner=runner, time_budget=budget, copy_trials=args.copy_trials, database=db):
            rows.append((kernel.name, short_task_name(r.name), r.trials, "-" if r.best_us is None else f"{r.best_us:.1f}", r.status))
    skipped = sum(r[-1] == SKIPPED for r in rows)
    if skipped:
        print(f"{skipped} task(s) skipped: the time budget is spent; run the command again to resume", flush=True)
    return rows


def _commit_device_round(args, work_dir: str, db) -> list[tuple]:
    """``rlx-tvm tune --device-results``: a round measured on a device (device_time.py's results)
    into the work database, a row per task for the table."""
    with open(args.device_results) as f:
        results = json.load(f)
    if "round" not in results:
        raise SystemExit(f"rlx-tvm tune: {args.device_results} holds no tuning round (was the pack made with "
                         "--tuning-round, and did device_time.py run without --no-round?)")
    round_dir = os.path.join(args.pack, "round")
    try:
        summary = commit_round(round_dir, results["round"], work_dir, database=db)
    except (ValueError, FileNotFoundError) as err:
        raise SystemExit(f"rlx-tvm tune: {err}") from None
    print(f"stored {sum(s[1] for s in summary)} measured candidates of {len(summary)} tasks "
          f"from {args.device_results} in {work_dir}", flush=True)
    return [("(device round)", short_task_name(name), n, us(best), "measured on the device"
             + ("" if default is None else f", default {default:.1f} us")) for name, n, best, default in summary]


def _export_verdict(row, faster: str) -> str:
    if row.kept:
        return "yes"
    if row.stale:
        return "no: stale (kernel changed)"
    if row.dropped_with_module:
        return f"no: {row.dropped_with_module} as a whole not {faster} with its records"
    return f"no: not {faster} than the default"


