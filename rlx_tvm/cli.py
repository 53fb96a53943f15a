"""The ``rlx-tvm`` command line."""

from __future__ import annotations

import argparse
import os
import sys
import time


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


def _target(arg: str | None):
    from .target import cpu_target

    if arg in (None, "local"):
        return cpu_target()
    import tvm

    return tvm.target.Target(arg)


def _kernel_names(arg: str | None) -> list[str] | None:
    from .schedules.suite import suite_kernel

    if not arg:
        return None
    names = [n.strip() for n in arg.split(",") if n.strip()]
    for n in names:
        try:
            suite_kernel(n)
        except KeyError as err:
            raise SystemExit(f"rlx-tvm: {err.args[0]}") from None
    return names


def _cmd_tune(args: argparse.Namespace) -> int:
    from tvm.s_tir import meta_schedule as ms

    from .build import TUNING_LOGS
    from .target import target_key
    from .schedules.suite import suite_kernels, suite_module
    from .schedules.tune import MIN_SPEEDUP, export_log, rpc_runner

    target, round_work_dir = _target(args.target), None
    if args.device_results:
        target, round_work_dir = _round_target(args, target)
    key = target_key(target)
    work_dir = args.work_dir or round_work_dir or os.path.join("tuning_work", key)
    log_dir = args.log_dir or os.path.join(TUNING_LOGS, key)
    kernels = suite_kernels(_kernel_names(args.kernels))
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
    task_head = ["suite kernel", "task", "records", "best us", "status"]
    export_head = ["kernel stages", "tuned us", "default us", "in the log"]
    export_rows = [(r.kernel, _us(r.tuned_us), _us(r.default_us), _export_verdict(r, faster)) for r in exported.rows]
    module_head = ["suite kernel", "records", "with them ms", "without ms", "records kept"]
    module_rows = [(m.name, m.records, f"{m.tuned_ms:.2f}", f"{m.default_ms:.2f}", "yes" if m.kept else f"no: not {faster}")
                   for m in exported.modules]
    print()
    _table(task_head, rows)
    print()
    _table(export_head, export_rows)
    if module_rows:
        print()
        _table(module_head, module_rows)
    record = os.path.join(log_dir, "TUNING.md")
    rows = _with_earlier_rows(record, rows, [k.name for k in kernels])
    budget = None if not args.device_results else (
        f"a tuning round measured on a device (`--device-results {args.device_results}`, pack `{args.pack}`): "
        "candidates of MetaSchedule's evolutionary search with the XGBoost cost model trained on the work "
        "database, built here and timed there beside each task's default schedule.")
    _write_tuning_record(record, key, target, args, faster, task_head, rows, export_head, export_rows,
                         module_head, module_rows, budget)
    print(f"\n{exported.kept} kernels written to {log_dir} (rlx_tvm.compile applies it for {key})")
    return 0 if all(not r[-1].startswith("failed") for r in rows) else 1


def _round_target(args, given):
    """With --device-results: the pack's target (a given --target must have its key: records tuned
    for a GPU must not land in a CPU's log) and the work database its round was searched with."""
    import json

    import tvm

    from .target import target_key

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
    from .schedules.suite import suite_ir_module
    from .schedules.tune import SKIPPED, short_task_name, tune

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
    import json

    from .schedules.device_round import commit_round
    from .schedules.tune import short_task_name

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
    return [("(device round)", short_task_name(name), n, _us(best), "measured on the device"
             + ("" if default is None else f", default {default:.1f} us")) for name, n, best, default in summary]


def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench import format_markdown, format_table, run_bench, write_json

    report = run_bench(_kernel_names(args.kernels), repeats=args.repeats, min_ms=args.min_ms, threads=args.threads,
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


def _cmd_compile(args: argparse.Namespace) -> int:
    import tvm

    from .build import compile as rlx_compile

    if args.source.startswith("suite:"):
        from .schedules.suite import suite_kernel, suite_module

        mod = suite_module(suite_kernel(args.source[len("suite:"):]), args.scale)
    else:
        with open(args.source) as f:
            mod = tvm.script.from_source(f.read())
        if not isinstance(mod, tvm.IRModule):
            raise SystemExit(f"rlx-tvm compile: {args.source} holds no IRModule (an @I.ir_module class)")
    ex = rlx_compile(mod, _target(args.target), tuning_log=args.tuning_log or "auto")
    ex.export_library(args.output)
    print(f"wrote {args.output} ({os.path.getsize(args.output)} bytes); load it with "
          f"tvm.runtime.load_module and run it with relax.VirtualMachine")
    return 0


def _cmd_device_pack(args: argparse.Namespace) -> int:
    from .device_pack import build_pack, pack_size

    target = _target(args.target)
    print(f"building the suite for {target} into {args.out}", flush=True)
    try:
        build_pack(args.out, target, _kernel_names(args.kernels), python_version=args.python, scale=args.scale,
                   tuning_log=args.tuning_log or "auto", progress=lambda m: print(m, flush=True),
                   tuning_round=args.tuning_round, work_dir=args.work_dir)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    size = pack_size(args.out)
    print(f"\n{args.out}: {size / 2**20:.1f} MiB. On the GPU machine: python3 {args.out}/device_time.py --out RESULTS.json")
    if args.tuning_round:
        print(f"then here: rlx-tvm tune --device-results RESULTS.json --pack {args.out}")
    if size > 60 * 2**20:
        print("warning: over 60 MiB; the lent device machines take 64 MiB with a run (--kernels for fewer)")
    return 0


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _export_verdict(row, faster: str) -> str:
    if row.kept:
        return "yes"
    if row.stale:
        return "no: stale (kernel changed)"
    if row.dropped_with_module:
        return f"no: {row.dropped_with_module} as a whole not {faster} with its records"
    return f"no: not {faster} than the default"


EARLIER = "earlier run: "  # status prefix of a task row carried over from an earlier TUNING.md


def _with_earlier_rows(path: str, rows: list, tuned_now: list[str]) -> list:
    """This run's task rows, plus the rows of the earlier TUNING.md at ``path`` (if any) for suite
    kernels this run did not take (``--kernels`` a subset), marked as from an earlier run; in the
    suite's order. (The log keeps every kernel's records; its record of them should too.)"""
    from .schedules.suite import SUITE

    earlier = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                cells = [c.strip() for c in line.strip().strip("|").split("|")]
                if len(cells) == 5 and line.startswith("| ") and cells[0] not in ("suite kernel", *tuned_now) \
                        and any(k.name == cells[0] for k in SUITE):
                    status = cells[4] if cells[4].startswith(EARLIER) else EARLIER + cells[4]
                    earlier.append((*cells[:4], status))
    order = {k.name: i for i, k in enumerate(SUITE)}
    return sorted([*rows, *earlier], key=lambda r: order.get(r[0], len(order)))  # stable within a kernel


def _write_tuning_record(path, key, target, args, faster, task_head, task_rows, export_head, export_rows,
                         module_head, module_rows, budget: str | None = None) -> None:
    """The budget and outcome of the run that wrote a tuning log, next to it: per task the records
    in the work database (every trial of every run that tuned it), per kernel whether the log
    keeps its best record, and per suite kernel the build with and without its records."""
    import datetime

    def md(head, rows):
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return lines + ["| " + " | ".join(str(c).replace("|", "/") for c in r) + " |" for r in rows]

    lines = [f"# Tuning log for {key}", "",
             f"Written by `rlx-tvm tune` on {datetime.date.today().isoformat()}, target `{target}`: "
             + (budget or f"up to {args.trials} measured candidates per kernel ({min(args.trials, args.copy_trials)} "
                "for kernels that only move data; kernels with a hand-written schedule are not searched), "
                f"MetaSchedule evolutionary search with the XGBoost cost model, seed {args.seed}.")
             + " Records: those in the work database for the task (every "
             "run that tuned it; fewer than asked where the search ran out of distinct candidates)."
             + ("" if args.time_budget is None else
                f" This run's time budget: {args.time_budget:g} s; a task it did not start says so, and its "
                "records come from earlier runs.")
             + (f" Rows marked `{EARLIER.strip()}` are kernels this run did not take (`--kernels`), as an "
                "earlier run left them." if any(r[4].startswith(EARLIER) for r in task_rows) else ""), "",
             *md(task_head, task_rows), "",
             "Each kernel's best record, kept without comparing it with the default schedule (--keep-all):"
             if args.keep_all else "Each kernel's best record, against its default schedule (re-measured at export "
             "on a CPU; on a GPU, as timed beside it on the device) "
             f"(kept only when at least {faster}):", "", *md(export_head, export_rows), ""]
    if module_rows:
        lines += ["Each suite kernel that kept records, built with them and without them and timed as a whole "
                  f"(median of 7 interleaved rounds); where it was not {faster} with them, they were dropped:", "",
                  *md(module_head, module_rows), ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def _table(head, rows) -> None:
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, ["-" * w for w in widths], *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())


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
    tr.add_argument("--target", default="local", help="TVM target (default: local, this CPU with the committed tuning log)")
    tr.set_defaults(func=_cmd_train)

    target_help = ("TVM target; 'local' (default) is this machine's CPU with explicit mcpu and core count, "
                   "which is what the committed tuning logs are keyed by")
    kernels_help = "comma-separated suite kernels (default: all; see rlx_tvm/schedules/suite.py)"

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
    tu.add_argument("--kernels", help=kernels_help)
    tu.add_argument("--target", help=target_help + " (with --device-results: the pack's)")
    tu.add_argument("--work-dir", help="database of all records (default tuning_work/<target key>)")
    tu.add_argument("--log-dir", help="pruned tuning log to write (default tuning_logs/<target key>)")
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
    tu.set_defaults(func=_cmd_tune)

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
    be.add_argument("--kernels", help=kernels_help)
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
    be.set_defaults(func=_cmd_bench)

    co = sub.add_parser(
        "compile", help="compile a Relax module (TVMScript file or suite kernel) to a shared library",
        description=(
            "Compiles SOURCE with rlx_tvm.compile (tuned schedules from the target's tuning log where they "
            "match, default schedules elsewhere, and says which) and writes it with export_library. SOURCE is "
            "a TVMScript file holding an @I.ir_module (R.rlx ops allowed) or suite:<kernel>."),
    )
    co.add_argument("source", help="TVMScript file, or suite:<kernel name>")
    co.add_argument("-o", "--output", required=True, help="shared library to write (.so)")
    co.add_argument("--target", default="local", help=target_help)
    co.add_argument("--tuning-log", help="tuning log directory (default: the committed log of the target)")
    co.add_argument("--scale", default="full", choices=["full", "small"], help="shapes of a suite: kernel")
    co.set_defaults(func=_cmd_compile)

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
    dp.set_defaults(func=_cmd_device_pack)

    ops = sub.add_parser("ops", help="list the registered rlx ops and their signatures",
                         description="Lists every relax.rlx.* operator with its inputs and attributes.")
    ops.set_defaults(func=_cmd_ops)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
