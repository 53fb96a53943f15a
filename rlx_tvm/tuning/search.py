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
  :mod:`rlx_tvm.tuning.device_round` on a machine that no tracker can reach;
* the evolutionary search gives up on a space whose random samples mostly fail verification
  (GPU tiling spaces): :func:`search_strategy` asks for fewer valid samples and tries longer.

Records go to MetaSchedule's own ``JSONDatabase`` in ``work_dir``; running again with the same
``work_dir`` resumes: tasks that already hold ``trials`` records are skipped, the others continue.
:func:`rlx_tvm.tuning.export_log` writes the best record per kernel to a tuning log
(``rlx_tvm/tuning_logs/<target_key>`` for the committed ones), which :func:`rlx_tvm.compile` applies.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import rpc
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.analysis import estimate_tir_flops
from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

from ..build import lower
from ..target import as_target, cpu_target

__all__ = ["HAND_SCHEDULED", "SKIPPED", "TaskResult", "best_us", "build_candidate", "design_spaces",
           "drop_unnamed_log_handlers", "evaluator_config", "format_us", "is_hand_scheduled", "moves_data_only",
           "rpc_runner", "search_strategy", "short_task_name", "task_records", "trials_for", "tune", "tuning_target"]


def build_candidate(mod: tvm.IRModule, target: tvm.target.Target, _params=None) -> tvm.runtime.Module:
    """MetaSchedule's default build minus the ``tensor_intrin`` import (fp32 LLVM tuning uses none)."""
    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm.tirx.build(mod, target=target)


def tuning_target(target) -> tvm.target.Target:
    """``target`` with what MetaSchedule's GPU rules require filled in: ``max_threads_per_block``
    (from ``max_num_threads``) and ``max_shared_memory_per_block`` (48 KiB CUDA, 32 KiB Metal,
    16 KiB otherwise) when the target does not give them; and a host for device code."""
    target = as_target(target)  # with an llvm host for a GPU target
    if "gpu" not in target.keys:
        return target
    config = dict(target.export())
    config.setdefault("max_threads_per_block", int(config.get("max_num_threads", 256)))
    config.setdefault("max_shared_memory_per_block", {"cuda": 49152, "metal": 32768}.get(target.kind.name, 16384))
    config.pop("host", None)
    return tvm.target.Target(config, host=target.host)


def design_spaces(target: tvm.target.Target) -> list[tuple[str, ms.space_generator.PostOrderApply]]:
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


def evaluator_config() -> ms.runner.EvaluatorConfig:
    """How a candidate is measured, by every runner of rlx_tvm (local, RPC, device rounds)."""
    # number=1 with min_repeat_ms: fast kernels repeat until 50 ms have passed, slow ones (full-size
    # attention: seconds) run once instead of three times.
    return ms.runner.EvaluatorConfig(number=1, repeat=1, min_repeat_ms=50)


def rpc_runner(tracker: str, key: str, timeout_sec: int = 60) -> ms.runner.RPCRunner:
    """A MetaSchedule runner that measures on every RPC server registered under ``key`` with the
    tracker at ``tracker`` (``host:port``), one candidate per free server at a time."""
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
    return ms.runner.RPCRunner(rpc_config=config, evaluator_config=evaluator_config(), max_workers=servers)


@dataclass
class TaskResult:
    name: str
    trials: int  # records in the database for this task after tuning
    best_us: float | None  # best measured latency, microseconds
    status: str  # "tuned", "resumed" (already complete), SKIPPED, HAND_SCHEDULED or "failed: <reason>"


def task_records(db: ms.database.Database, mod: tvm.IRModule):
    """Every record of ``mod``, measured or not (a candidate that could not run is stored with 1e10 s)."""
    if not db.has_workload(mod):
        return []
    workload = db.commit_workload(mod)  # get_top_k would leave out the unmeasured ones
    return [r for r in db.get_all_tuning_records() if r.workload.same_as(workload)]


def best_us(records) -> float | None:
    """The best measured latency of ``records`` in microseconds (None: none ran)."""
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
    ``work_dir``'s JSON database. ``mod`` is a Relax module (rlx ops allowed; the benchmark suite:
    :func:`rlx_tvm.bench.suite.suite_ir_module`).
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
        if is_hand_scheduled(task_mod):
            results.append(TaskResult(task.task_name, 0, None, HAND_SCHEDULED))
            if verbose:
                print(f"[{i + 1}/{len(tasks)}] {task.task_name}: {HAND_SCHEDULED}", flush=True)
            continue
        task_trials = trials_for(task_mod, trials, copy_trials)
        done = task_records(db, task_mod)
        label = f"[{i + 1}/{len(tasks)}] {task.task_name}"
        if len(done) >= task_trials or (deadline is not None and time.time() >= deadline):
            best = best_us(done)
            status = "resumed" if len(done) >= task_trials else SKIPPED
            results.append(TaskResult(task.task_name, len(done), best, status))
            if verbose:
                print(f"{label}: {len(done)} records already, best {format_us(best)}"
                      + ("" if status == "resumed" else f" ({status})"), flush=True)
            continue
        start = time.time()
        if builder is None:
            # Builds and runs alternate (a batch is built, then measured), so builds can use every core.
            builder = ms.builder.LocalBuilder(f_build=build_candidate, max_workers=os.cpu_count() or 1,
                                              timeout_sec=60)
            runner = runner or ms.runner.LocalRunner(timeout_sec=run_timeout, evaluator_config=evaluator_config())
        drop_unnamed_log_handlers()
        errors = []
        for how, space in design_spaces(target):
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
        done = task_records(db, task_mod)
        best = best_us(done)
        if status.startswith("tuned") and done and best is None:
            status += (", nothing measured (no device here? measure through --rpc)" if "gpu" in target.keys
                       else f", nothing measured: every candidate failed to build or run (see {work_dir}/logs)")
        results.append(TaskResult(task.task_name, len(done), best, status))
        if verbose:
            print(f"{label}: {status}, {len(done)} records, best {format_us(best)} "
                  f"({time.time() - start:.0f} s)", flush=True)
    return results


def is_hand_scheduled(mod: tvm.IRModule) -> bool:
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


def trials_for(mod: tvm.IRModule, trials: int, copy_trials: int | None) -> int:
    """The trials a task gets: ``copy_trials`` at most for a kernel that only moves data."""
    return trials if copy_trials is None or not moves_data_only(mod) else min(trials, copy_trials)


def moves_data_only(mod: tvm.IRModule) -> bool:
    """True for a kernel without arithmetic (TVM's flop estimate is 0); False where the estimate
    fails (hand-written TIR with vector shuffles)."""
    try:
        return float(estimate_tir_flops(mod)) == 0.0
    except RuntimeError:  # tvm.error.InternalError: no flop rule for prim.Shuffle
        return False


def short_task_name(name: str, width: int = 64) -> str:
    """A task name for tables: fused kernels are named after every operator they fuse (blocked
    attention's concatenation of 21 outputs runs to 400 characters), so long names keep their
    start and say how long they were."""
    return name if len(name) <= width else f"{name[:width - 20]}... ({len(name)} chars)"


def drop_unnamed_log_handlers() -> None:
    """``tune_tir`` re-lists the handlers of the ``tvm.s_tir.meta_schedule`` logger by name in a
    ``logging.config.dictConfig``; one added without a name (seen under pytest, after earlier
    tuning runs in the process) makes it fail with ``'NoneType' object has no attribute 'format'``."""
    logger = logging.getLogger("tvm.s_tir.meta_schedule")
    for handler in list(logger.handlers):
        if handler.get_name() is None:
            logger.removeHandler(handler)


def format_us(us: float | None) -> str:
    """Microseconds for progress lines (``-``: none)."""
    return "-" if us is None else f"{us:.1f} us"
