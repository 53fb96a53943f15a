"""MetaSchedule tuning of the kernels of a Relax module, made to work on the TVM 0.27 wheel.

What stock MetaSchedule trips over here (see TVM_NOTES), and what this module does instead:

* the default builder imports ``tvm.s_tir.tensor_intrin`` in every worker (about a minute, longer than
  the 30 s build timeout): :func:`build_candidate` builds fp32 CPU candidates without it;
* ``MultiLevelTiling`` with ``reuse_write`` fails on fused kernels with several reductions (norm
  backward): its llvm instance is replaced by one with ``reuse_write=None``;
* one task's design-space error aborts a whole ``tune_tasks``: each task is tuned on its own, and a
  failure is reported and skipped;
* XGBoost scores are random until ``num_warmup_samples`` measurements exist (default 100): lowered
  to 16 so that small budgets search with the model;
* TVM's CPU thread pool halves ``hardware_concurrency`` on x86 (it assumes hyper-threads): on a
  2-vCPU machine candidates would be measured on one thread. ``TVM_NUM_THREADS``, which the
  runner's workers inherit, is set by ``import rlx_tvm`` (:mod:`rlx_tvm.threads`), else here to
  the target's ``num-cores``;
* GPU targets (CUDA, Metal, Vulkan) need ``max_threads_per_block`` and shared-memory limits that
  plain targets lack: :func:`tuning_target` fills them in. Without a device here candidates are
  generated and built but not measured; :func:`rpc_runner` measures on remote devices, and
  :mod:`rlx_tvm.schedules.device_round` on a machine that no tracker can reach;
* the evolutionary search gives up on a space whose random samples mostly fail verification
  (GPU tiling spaces): :func:`search_strategy` asks for fewer valid samples and tries longer.

Records go to MetaSchedule's own ``JSONDatabase`` in ``work_dir``; running again with the same
``work_dir`` resumes: tasks that already hold ``trials`` records are skipped, the others continue.
:func:`export_log` writes the best record per kernel to a committed tuning log
(``tuning_logs/<target_key>``), which :func:`rlx_tvm.compile` applies.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import time
from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm.s_tir import meta_schedule as ms
from ..target import cpu_target  # noqa: F401 (re-exported: tuning targets are CPU targets with mcpu and cores)

__all__ = ["Export", "ExportRow", "ModuleCheck", "TaskResult", "build_candidate", "cpu_target", "default_schedule",
           "export_log", "rpc_runner", "search_strategy", "tune", "tuning_target"]


def build_candidate(mod: tvm.IRModule, target: tvm.target.Target, _params=None) -> tvm.runtime.Module:
    """MetaSchedule's default build minus the ``tensor_intrin`` import (fp32 LLVM tuning uses none)."""
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm.tirx.build(mod, target=target)


def tuning_target(target) -> tvm.target.Target:
    """``target`` with what MetaSchedule's GPU rules require filled in: ``max_threads_per_block``
    (from ``max_num_threads``) and ``max_shared_memory_per_block`` (48 KiB CUDA, 32 KiB Metal,
    16 KiB otherwise) when the target does not give them; and a host for device code."""
    from ..target import as_target as _as_target  # adds the llvm host

    target = _as_target(target)
    if "gpu" not in target.keys:
        return target
    config = dict(target.export())
    config.setdefault("max_threads_per_block", int(config.get("max_num_threads", 256)))
    config.setdefault("max_shared_memory_per_block", {"cuda": 49152, "metal": 32768}.get(target.kind.name, 16384))
    config.pop("host", None)
    return tvm.target.Target(config, host=target.host)


def _spaces(target: tvm.target.Target) -> list[tuple[str, ms.space_generator.PostOrderApply]]:
    """Design spaces to try in order: the target's rules, then the same without multi-level tiling,
    whose design-space generation fails on some fused multi-reduction kernels (e.g. GPU gamma
    gradients: ``Index 6 out of bounds 6``)."""
    kind = "cuda" if "gpu" in target.keys else "llvm"  # the GPU rules bind threads and verify limits

    def space(tiling: bool):
        rules = []
        for rule in ms.ScheduleRule.create(kind):
            if isinstance(rule, ms.schedule_rule.MultiLevelTiling):
                if not tiling:
                    continue
                if kind == "llvm":
                    rule = ms.schedule_rule.MultiLevelTiling(structure="SSRSRS", max_innermost_factor=64,
                                                             reuse_write=None)
            rules.append(rule)
        return ms.space_generator.PostOrderApply(
            sch_rules=rules, postprocs=ms.Postproc.create(kind), mutator_probs=ms.Mutator.create(kind))

    return [("", space(True)), (" without multi-level tiling", space(False))]


def default_schedule(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """A single-kernel module (``main``) with the schedule ``rlx_tvm.compile`` gives it without a log."""
    from .cpu import default_cpu_rules
    from .gpu import schedule_gpu

    mod = tvm.IRModule({"main": mod["main"]})  # a copy: dlight rewrites the module it is given
    if "gpu" in target.keys:
        return schedule_gpu(mod, target)[0]
    with target:
        return tvm.s_tir.dlight.ApplyDefaultSchedule(*default_cpu_rules())(mod)


def search_strategy() -> ms.search_strategy.EvolutionarySearch:
    """MetaSchedule's evolutionary search as rlx_tvm runs it. A search gives up when its first
    population holds fewer than ``init_min_unmeasured`` valid random samples after
    ``max_fail_count`` tries, and in the multi-level-tiling spaces of fused GPU gradient kernels
    most samples fail the GPU verification (shared memory over the limit). With MetaSchedule's
    defaults (50 samples, 5 tries) CUDA layer norm's dgamma at full shapes always fell back to the
    space without tiling; with 8 and 5 it did in one of two runs under load; with 8 and 20 in
    none of four. A space with no valid sample at all (attention's) costs about 35 s more."""
    return ms.search_strategy.EvolutionarySearch(population_size=128, genetic_num_iters=2, init_min_unmeasured=8,
                                                 max_fail_count=20)


def _evaluator() -> ms.runner.EvaluatorConfig:
    # number=1 with min_repeat_ms: fast kernels repeat until 50 ms have passed, slow ones (full-size
    # attention: seconds) run once instead of three times.
    return ms.runner.EvaluatorConfig(number=1, repeat=1, min_repeat_ms=50)


def rpc_runner(tracker: str, key: str, timeout_sec: int = 60) -> ms.runner.RPCRunner:
    """A MetaSchedule runner that measures on every RPC server registered under ``key`` with the
    tracker at ``tracker`` (``host:port``), one candidate per free server at a time."""
    from tvm import rpc

    host, _, port = tracker.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"tune: rpc tracker must be HOST:PORT, got {tracker!r}")
    try:  # probe first: connect_tracker retries for a minute before it gives up
        socket.create_connection((host, int(port)), timeout=5).close()
        summary = rpc.connect_tracker(host, int(port)).summary()
    except Exception as err:  # noqa: BLE001 - a clear message instead of a socket traceback
        raise ConnectionError(f"tune: cannot reach the RPC tracker at {tracker} ({err})") from err
    servers = sum(1 for s in summary.get("server_info", []) if str(s.get("key", "")).split(":")[-1] == key)
    if servers == 0:
        raise ConnectionError(f"tune: the RPC tracker at {tracker} has no server with key {key!r} "
                              f"(start one: python -m tvm.exec.rpc_server --tracker {tracker} --key {key})")
    config = ms.runner.RPCConfig(tracker_host=host, tracker_port=int(port), tracker_key=key,
                                 session_priority=1, session_timeout_sec=timeout_sec)
    return ms.runner.RPCRunner(rpc_config=config, evaluator_config=_evaluator(), max_workers=servers)


@dataclass
class TaskResult:
    name: str
    trials: int  # records in the database for this task after tuning
    best_us: float | None  # best measured latency, microseconds
    status: str  # "tuned", "resumed" (already complete), SKIPPED, HAND_SCHEDULED or "failed: <reason>"


def _records(db: ms.database.Database, mod: tvm.IRModule):
    """Every record of ``mod``, measured or not (a candidate that could not run is stored with 1e10 s)."""
    if not db.has_workload(mod):
        return []
    workload = db.commit_workload(mod)  # get_top_k would leave out the unmeasured ones
    return [r for r in db.get_all_tuning_records() if r.workload.same_as(workload)]


def _best_us(records) -> float | None:
    secs = [sum(float(s) for s in r.run_secs) / len(r.run_secs) for r in records if r.run_secs]
    secs = [s for s in secs if s < 1e9]  # failed runs are stored as 1e10
    return min(secs) * 1e6 if secs else None


SKIPPED = "skipped: time budget spent"  # the status of a task not started for lack of time
HAND_SCHEDULED = "skipped: scheduled by hand (vector code in its TIR)"


def tune(
    mod,
    target: tvm.target.Target | None = None,
    trials: int = 64,
    work_dir: str = "tuning_work",
    trials_per_iter: int = 32,
    seed: int = 0,
    verbose: bool = True,
    runner: ms.runner.Runner | None = None,
    time_budget: float | None = None,
    copy_trials: int | None = 32,
    run_timeout: float = 10.0,
    database: ms.database.Database | None = None,
) -> list[TaskResult]:
    """Tune every kernel of ``mod`` with ``trials`` measured candidates each, recording into
    ``work_dir``'s JSON database. ``mod`` is a Relax module (rlx ops allowed), or ``"suite"`` or a
    list of :class:`~rlx_tvm.schedules.suite.SuiteKernel` for the benchmark suite at full shapes.
    Candidates are measured locally, or by ``runner`` (e.g. :func:`rpc_runner`: remote devices
    through TVM's RPC tracker). With ``time_budget`` (seconds), no task starts once it is spent
    (a started one finishes): the rest are reported as skipped and a later call resumes them from
    the database. Kernels written with vector loops already are skipped (nothing to search).
    Kernels that only move data (no arithmetic: the slices, reshapes and
    concatenations around blocked attention) get at most ``copy_trials`` (``None``: ``trials``),
    since their schedule space is a loop order and a vector width. A local candidate still
    running after ``run_timeout`` seconds is recorded as failed (MetaSchedule's default, 30 s,
    let a third of the softmax-CE candidates cost 30 s each, where the default schedule takes 6
    ms). ``database``: the work database already open (reading a JSON database of a few thousand
    records takes about 20 s here; a caller tuning kernel by kernel opens it once). Prints one line
    per task."""
    from ..build import lower
    from .suite import SuiteKernel, suite_ir_module

    if isinstance(mod, str) and mod == "suite":
        mod = suite_ir_module()
    elif isinstance(mod, (list, tuple)) and all(isinstance(k, SuiteKernel) for k in mod):
        mod = suite_ir_module(list(mod))
    target = tuning_target(target or cpu_target())
    if "num-cores" in target.attrs:
        os.environ.setdefault("TVM_NUM_THREADS", str(int(target.attrs["num-cores"])))
    os.makedirs(work_dir, exist_ok=True)
    tasks = ms.relax_integration.extract_tasks(lower(mod, target, schedule=False), target)
    db = database if database is not None else ms.database.JSONDatabase(work_dir=work_dir)
    builder = None  # started with the first task that is searched (their worker pools take ~10 s)
    results = []
    deadline = None if time_budget is None else time.time() + time_budget
    for i, task in enumerate(tasks):
        task_mod = task.dispatched[0]
        if _hand_scheduled(task_mod):
            results.append(TaskResult(task.task_name, 0, None, HAND_SCHEDULED))
            if verbose:
                print(f"[{i + 1}/{len(tasks)}] {task.task_name}: {HAND_SCHEDULED}", flush=True)
            continue
        task_trials = _trials_for(task_mod, trials, copy_trials)
        done = _records(db, task_mod)
        label = f"[{i + 1}/{len(tasks)}] {task.task_name}"
        if len(done) >= task_trials or (deadline is not None and time.time() >= deadline):
            best = _best_us(done)
            status = "resumed" if len(done) >= task_trials else SKIPPED
            results.append(TaskResult(task.task_name, len(done), best, status))
            if verbose:
                print(f"{label}: {len(done)} records already, best {_fmt(best)}"
                      + ("" if status == "resumed" else f" ({status})"), flush=True)
            continue
        start = time.time()
        if builder is None:
            # Builds and runs alternate (a batch is built, then measured), so builds can use every core.
            builder = ms.builder.LocalBuilder(f_build=build_candidate, max_workers=os.cpu_count() or 1,
                                              timeout_sec=60)
            runner = runner or ms.runner.LocalRunner(timeout_sec=run_timeout, evaluator_config=_evaluator())
        _drop_unnamed_log_handlers()
        errors = []
        for how, space in _spaces(target):
            try:
                ms.tune_tir(
                    task_mod, target, work_dir, max_trials_global=task_trials - len(done),
                    num_trials_per_iter=min(trials_per_iter, task_trials - len(done)), builder=builder, runner=runner,
                    database=db, cost_model=ms.cost_model.XGBModel(num_warmup_samples=16), space=space,
                    strategy=search_strategy(),
                    num_tuning_cores=1, seed=seed,
                )
                status = "tuned" + how
                break
            except Exception as err:  # noqa: BLE001 - one bad task must not end the run
                errors.append(f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:120]}")
        else:
            status = "failed: " + errors[-1]
        done = _records(db, task_mod)
        best = _best_us(done)
        if status.startswith("tuned") and done and best is None:
            status += (", nothing measured (no device here? measure through --rpc)" if "gpu" in target.keys
                       else f", nothing measured: every candidate failed to build or run (see {work_dir}/logs)")
        results.append(TaskResult(task.task_name, len(done), best, status))
        if verbose:
            print(f"{label}: {status}, {len(done)} records, best {_fmt(best)} "
                  f"({time.time() - start:.0f} s)", flush=True)
    return results


def _hand_scheduled(mod: tvm.IRModule) -> bool:
    """A kernel written with vector loops or vector expressions already (max-pool's routing, the
    gather scatter, cumsum's scan): not a design space to search, and MetaSchedule's
    postprocessors break it (they vectorize inside the vector loops: "VectorizeLoop before
    LiftStorageAlloc" at build)."""
    found = []

    def vector_loop(loop):
        if loop.kind == tvm.tirx.ForKind.VECTORIZED:
            found.append(loop)

    for func in mod.functions.values():
        if isinstance(func, tvm.tirx.PrimFunc):
            tvm_ffi.structural_walk(func.body, [(tvm.tirx.For, vector_loop),
                                                ((tvm.tirx.Ramp, tvm.tirx.Shuffle), found.append)])
    return bool(found)


def _trials_for(mod: tvm.IRModule, trials: int, copy_trials: int | None) -> int:
    return trials if copy_trials is None or not _moves_data_only(mod) else min(trials, copy_trials)


def _moves_data_only(mod: tvm.IRModule) -> bool:
    """True for a kernel without arithmetic (TVM's flop estimate is 0); False where the estimate
    fails (hand-written TIR with vector shuffles)."""
    from tvm.s_tir.analysis import estimate_tir_flops

    try:
        return float(estimate_tir_flops(mod)) == 0.0
    except RuntimeError:  # tvm.error.InternalError: no flop rule for prim.Shuffle
        return False


@dataclass
class ExportRow:
    kernel: str  # the kernel's stage names
    tuned_us: float | None  # re-measured at export (None: not measurable here, e.g. a GPU target)
    default_us: float | None
    kept: bool
    stale: bool = False  # no current kernel has this workload any more
    dropped_with_module: str | None = None  # the module whose whole-build check dropped it


@dataclass
class ModuleCheck:
    """A module of ``export_log``'s ``kernels`` built with the log's records for its kernels and
    without (default schedules), timed side by side at export."""

    name: str
    records: int  # records of the log that apply to it
    tuned_ms: float
    default_ms: float
    kept: bool  # its records stay in the log (it was at least module_min_speedup times faster with them)


def _kernel_label(mod: tvm.IRModule) -> str:
    from .common import root_blocks

    sch = tvm.s_tir.Schedule(mod)
    names = [sch.get(b).name_hint for b in root_blocks(sch)]
    if len("/".join(names)) > 80:  # e.g. blocked attention's concatenation of 40 slices
        names = [*names[:2], f"... {len(names) - 3} more ...", names[-1]]
    return "/".join(names) or "main"  # hand-written TIR: no blocks


def short_task_name(name: str, width: int = 64) -> str:
    """A task name for tables: fused kernels are named after every operator they fuse (blocked
    attention's concatenation of 21 outputs runs to 400 characters), so long names keep their
    start and say how long they were."""
    return name if len(name) <= width else f"{name[:width - 20]}... ({len(name)} chars)"


def _time_us(mods: list[tvm.IRModule], target: tvm.target.Target, rounds: int = 5) -> list[float]:
    """Median latency of each PrimFunc module on the same random inputs, rounds interleaved."""
    import numpy as np

    args = _random_tensors((info.shape, info.dtype) for info in ms.arg_info.ArgInfo.from_prim_func(mods[0]["main"]))
    timers = [tvm.compile(m, target=target).mod.time_evaluator("main", tvm.cpu(), number=1, repeat=1, min_repeat_ms=50)
              for m in mods]
    samples = [[] for _ in mods]
    for _ in range(rounds):
        for i, timer in enumerate(timers):
            samples[i].append(timer(*args).mean)
    return [float(np.median(x)) * 1e6 for x in samples]


def _random_tensors(specs) -> list:
    """Tensors of the given (shape, dtype)s, the same on every call: standard normal floats, zero
    integers (always in range as indices)."""
    import numpy as np

    rng = np.random.default_rng(0)
    out = []
    for shape, dtype in specs:
        shape, dtype = [int(d) for d in shape], str(dtype)
        data = rng.standard_normal(shape).astype(dtype) if "float" in dtype else np.zeros(shape, dtype)
        out.append(tvm.runtime.tensor(data))
    return out


def _drop_unnamed_log_handlers() -> None:
    """``tune_tir`` re-lists the handlers of the ``tvm.s_tir.meta_schedule`` logger by name in a
    ``logging.config.dictConfig``; one added without a name (seen under pytest, after earlier
    tuning runs in the process) makes it fail with ``'NoneType' object has no attribute 'format'``."""
    logger = logging.getLogger("tvm.s_tir.meta_schedule")
    for handler in list(logger.handlers):
        if handler.get_name() is None:
            logger.removeHandler(handler)


# A record must beat the default schedule by this factor to enter a log: the two are timed on a
# noisy 2-core machine, and a record that ties (a copy kernel at 3.2 vs 3.2 us) only adds to the log.
MIN_SPEEDUP = 1.05


@dataclass
class Export:
    """What :func:`export_log` wrote: a row per best record, and the module-level checks."""

    rows: list[ExportRow]
    modules: list[ModuleCheck]

    @property
    def kept(self) -> int:
        return sum(r.kept for r in self.rows)


def export_log(work_dir: str, log_dir: str, target: tvm.target.Target | None = None,
               compare_default: bool = True, verbose: bool = True,
               kernels: tvm.IRModule | list[tvm.IRModule] | dict[str, tvm.IRModule] | None = None,
               min_speedup: float = MIN_SPEEDUP, module_min_speedup: float = MIN_SPEEDUP,
               database: ms.database.Database | None = None) -> Export:
    """Write the best record of every kernel in ``work_dir``'s database to ``log_dir`` (MetaSchedule's
    own pruning, ``Database.dump_pruned``): the tuning log that gets committed, while the full
    search history stays in ``work_dir``.

    With ``kernels`` (Relax modules, e.g. one per suite kernel and scale; a dict names them),
    records of workloads that are not among their kernels are left out: they are stale, tuned
    before the kernel's TensorIR changed, and can never match again.

    With ``compare_default`` on a CPU target, two checks keep the log from making anything slower
    than no log: each best record is re-measured against its kernel's default schedule (same
    inputs, interleaved) and kept only if it is at least ``min_speedup`` times faster (records
    that only tie add nothing); then each module of ``kernels`` that the kept records apply to is
    built with them and without them and timed as a whole, and unless it is at least
    ``module_min_speedup`` times faster with them, they are all dropped. The second check is there
    because kernels timed alone are not the module: blocked attention's 18 slice and concatenation
    kernels each won alone, yet its build with them read 5-20% slower than without in three
    benchmark runs, and 8% slower or 4% faster in two exports minutes apart: noise either way,
    since together they save microseconds of a 50 ms kernel, so they do not earn a place.

    ``database``: ``work_dir``'s database already open (as :func:`tune` takes it)."""
    from ..build import load_tuning_log

    src = database if database is not None else load_tuning_log(work_dir)
    with tempfile.TemporaryDirectory() as tmp:
        pruned = ms.database.JSONDatabase(work_dir=tmp)
        src.dump_pruned(pruned)
        records = pruned.get_all_tuning_records()
    units = _named_modules(kernels)
    # Lowered once per module, for the target the records were tuned for (as rlx_tvm.compile looks
    # them up): the stale check takes them all, the module check each module's own.
    lower_target = target or (records[0].target if records else None)
    unit_workloads = {} if units is None else {name: _kernel_workloads(m, lower_target) for name, m in units.items()}
    current = None if units is None else [w for ws in unit_workloads.values() for w in ws]
    from .device_round import device_defaults

    on_device = device_defaults(work_dir)  # default schedules' times measured on a device, by workload
    rows, kept = [], []  # kept: (record, row) pairs that passed the per-kernel check
    for i, rec in enumerate(records):
        row = _check_record(rec, target, current, compare_default, min_speedup, on_device)
        rows.append(row)
        if row.kept:
            kept.append((rec, row))
        if verbose:
            print(f"[{i + 1}/{len(records)}] {_export_line(row, min_speedup)}", flush=True)
    _write_log(log_dir, [rec for rec, _ in kept])
    modules = []
    if compare_default and units and kept and lower_target.kind.name == "llvm":
        for name, mod in units.items():
            mine = [(rec, row) for rec, row in kept
                    if row.kept and any(tvm_ffi.structural_equal(rec.workload.mod, w) for w in unit_workloads[name])]
            if not mine:
                continue
            tuned_ms, default_ms = _time_module_ms(mod, lower_target, log_dir)
            check = ModuleCheck(name, len(mine), tuned_ms, default_ms,
                                kept=tuned_ms * module_min_speedup <= default_ms)
            modules.append(check)
            if not check.kept:
                for _, row in mine:
                    row.kept, row.dropped_with_module = False, name
                _write_log(log_dir, [rec for rec, row in kept if row.kept])
            if verbose:
                print(f"module {name} with its {len(mine)} record(s): {tuned_ms:.2f} ms, without: {default_ms:.2f} ms"
                      f" -> {'kept' if check.kept else f'records dropped (not {module_min_speedup:g}x faster with them)'}",
                      flush=True)
    return Export(rows, modules)


def _named_modules(kernels) -> dict[str, tvm.IRModule] | None:
    if kernels is None or isinstance(kernels, dict):
        return kernels
    mods = [kernels] if isinstance(kernels, tvm.IRModule) else list(kernels)
    return {f"module {i}": m for i, m in enumerate(mods)}


def _check_record(rec, target, current, compare_default: bool, min_speedup: float,
                  on_device: dict[str, float] | None = None) -> ExportRow:
    """The per-kernel check of :func:`export_log`: stale, or re-measured against the default
    schedule here (CPU), or compared with the default's time measured beside it on the device
    (``on_device``: workload hash -> us, from :func:`~rlx_tvm.schedules.device_round.commit_round`)."""
    from .device_round import workload_key

    mod, rec_target = rec.workload.mod, target or rec.target
    if current is not None and not any(tvm_ffi.structural_equal(mod, k) for k in current):
        return ExportRow(_kernel_label(mod), None, None, False, stale=True)
    tuned_us = default_us = None
    ran = bool(rec.run_secs) and float(rec.run_secs[0]) < 1e9
    if compare_default and ran and rec_target.kind.name == "llvm":
        sch = tvm.s_tir.Schedule(mod)
        rec.trace.apply_to_schedule(sch, remove_postproc=False)
        tuned_us, default_us = _time_us([sch.mod, default_schedule(mod, rec_target)], rec_target)
    elif compare_default and ran and on_device:
        default_us = on_device.get(workload_key(mod))
        tuned_us = None if default_us is None else min(float(s) for s in rec.run_secs) * 1e6
    return ExportRow(_kernel_label(mod), tuned_us, default_us, tuned_us is None or tuned_us * min_speedup <= default_us)


def _export_line(row: ExportRow, min_speedup: float) -> str:
    if row.stale:
        return f"{row.kernel}: dropped (stale: no current kernel)"
    verdict = "kept" if row.kept else f"dropped (not {min_speedup:g}x faster than the default schedule)"
    return f"{row.kernel}: tuned {_fmt(row.tuned_us)}, default {_fmt(row.default_us)} -> {verdict}"


def _write_log(log_dir: str, records) -> None:
    """``records`` as the JSON database in ``log_dir``, replacing what was there."""
    os.makedirs(log_dir, exist_ok=True)
    for f in ("database_workload.json", "database_tuning_record.json"):
        if os.path.exists(os.path.join(log_dir, f)):
            os.remove(os.path.join(log_dir, f))
    dst = ms.database.JSONDatabase(work_dir=log_dir)
    for rec in records:
        dst.commit_tuning_record(ms.database.TuningRecord(
            rec.trace, dst.commit_workload(rec.workload.mod), rec.run_secs, rec.target, rec.args_info))


def _time_module_ms(mod: tvm.IRModule, target: tvm.target.Target, log_dir: str, rounds: int = 7,
                    min_ms: float = 50.0) -> tuple[float, float]:
    """Median milliseconds of ``mod``'s ``main`` built with the tuning log in ``log_dir`` and
    without it, on the same random inputs, interleaved in alternating order."""
    import numpy as np

    from ..bench import SETTLE_MS, calibrated_timer, vm_runner
    from ..build import compile as rlx_compile

    args = _random_tensors((p.ty.shape.values, p.ty.dtype) for p in mod["main"].params)
    timers = [calibrated_timer(vm_runner(rlx_compile(mod, target, tuning_log=log, verbose=False), args), min_ms)
              for log in (log_dir, None)]
    samples = [[], []]
    for r in range(rounds):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            time.sleep(SETTLE_MS / 1e3)
            samples[i].append(timers[i]())
    return float(np.median(samples[0])), float(np.median(samples[1]))


def _kernel_workloads(kernels, target) -> list[tvm.IRModule]:
    """The kernels of Relax modules as MetaSchedule workloads (what a database lookup compares)."""
    from ..build import lower

    workloads = []
    for mod in [kernels] if isinstance(kernels, tvm.IRModule) else kernels:
        lowered = lower(mod, target or "llvm", schedule=False, tuning_log=None, verbose=False)
        workloads += [tvm.IRModule({"main": f.with_attr("global_symbol", "main")})
                      for f in lowered.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    return workloads


def _fmt(us: float | None) -> str:
    return "-" if us is None else f"{us:.1f} us"
