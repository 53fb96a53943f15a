"""A MetaSchedule tuning round whose candidates are measured on a machine without TVM's compiler.

A GPU machine may hold CUDA, PyTorch and NumPy but neither TVM's compiler (too big to carry there)
nor a network (no RPC tracker can reach it), so :func:`~rlx_tvm.tuning.tune` cannot measure on
it. A round splits one search step of :func:`tune` in two:

1. here, :func:`make_round` runs MetaSchedule's evolutionary search for each task (XGBoost cost
   model trained on what the work database already holds for that task, population seeded from
   its best records), builds the candidates it proposes and the task's default schedule into one
   library per task, and writes ``round.json`` beside them (each candidate's tuning record, not
   yet measured);
2. there, the pack's ``device_time.py`` times every function of each library with
   ``time_evaluator``, as MetaSchedule's runner would (same evaluator settings, random floats,
   zero integers), a child process per task;
3. here again, :func:`commit_round` stores the measured records in the work database (a
   MetaSchedule ``JSONDatabase``) and the default schedules' times in ``device_rounds.json``
   beside it, which :func:`~rlx_tvm.tuning.export_log` uses to keep a record only if it
   beat the default on the device.

Running rounds again continues the search: each round's model learns from every earlier one.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import tempfile
import time

import tvm
import tvm_ffi
from tvm.s_tir import meta_schedule as ms

from ..build import default_schedule, load_tuning_log, lower
from .search import (build_candidate, design_spaces, evaluator_config, is_hand_scheduled, search_strategy,
                     task_records, tuning_target)

__all__ = ["DEFAULT_FUNC", "ROUNDS_FILE", "ROUND_FILE", "commit_round", "device_defaults", "make_round", "round_candidates",
           "workload_key"]

ROUND_FILE = "round.json"
# In the work database's directory: the rounds stored there (ids) and, per workload hash, its
# default schedule's microseconds on the device.
ROUNDS_FILE = "device_rounds.json"
DEFAULT_FUNC = "default"  # the name of the default schedule's function in each task library


def workload_key(mod: tvm.IRModule) -> str:
    """The key of a kernel's default time in ``device_rounds.json``: its structural hash (what
    MetaSchedule's workload JSON also starts with), without serializing the module."""
    return str(tvm_ffi.structural_hash(mod))


def _train_on_database(model: ms.cost_model.XGBModel, ctx: ms.TuneContext, records) -> int:
    measured = [r for r in records if r.run_secs and float(r.run_secs[0]) < 1e9]
    if measured:
        model.update(ctx, [r.as_measure_candidate() for r in measured],
                     [ms.runner.RunnerResult([float(s) for s in r.run_secs], None) for r in measured])
    return len(measured)


def round_candidates(task_mod, target, name: str, trials: int, db, seed: int) -> tuple[list, str, int]:
    """One round of MetaSchedule's evolutionary search: up to ``trials`` new candidates, how they
    were found, and how many measured records the cost model learnt from."""
    records = task_records(db, task_mod)
    errors = []
    for how, space in design_spaces(target):
        try:  # design-space generation fails on some fused kernels with multi-level tiling
            ctx = ms.TuneContext(task_mod, target=target, space_generator=space, task_name=name, rand_state=seed,
                                 search_strategy=search_strategy(), num_threads=os.cpu_count() or 1)
            model = ms.cost_model.XGBModel(num_warmup_samples=16)
            learnt = _train_on_database(model, ctx, records)
            ctx.pre_tuning(max_trials=trials, num_trials_per_iter=trials, database=db, cost_model=model)
            found = ctx.generate_measure_candidates() or []
            ctx.post_tuning()
        except Exception as err:  # noqa: BLE001 - one bad task must not end the round
            errors.append(f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:120]}")
            continue
        if found:
            return found, how, learnt
        errors.append("no candidate sampled")
    return [], "failed: " + errors[-1], 0


def _build(funcs: dict[str, tvm.tirx.PrimFunc], target) -> tvm.runtime.Module:
    return build_candidate(tvm.IRModule({n: f.with_attr("global_symbol", n) for n, f in funcs.items()}), target)


def _build_task(funcs: dict[str, tvm.tirx.PrimFunc], target) -> tuple[tvm.runtime.Module, dict[str, str]]:
    """All functions in one library (one nvcc run per task); if that fails, each alone, and the
    ones that do not build are left out (returned: name -> the error's last line)."""
    try:
        return _build(funcs, target), {}
    except Exception:  # noqa: BLE001 - find the culprits below
        pass
    good, bad = {}, {}
    for n, f in funcs.items():
        try:
            _build({n: f}, target)
            good[n] = f
        except Exception as err:  # noqa: BLE001
            bad[n] = (str(err).strip().splitlines() or [type(err).__name__])[-1][:160]
    if not good:
        raise RuntimeError(f"no function of the task builds ({next(iter(bad.values()))})")
    return _build(good, target), bad


def _export_compressed(lib: tvm.runtime.Module, path: str) -> None:
    """``lib`` as a shared library, xz-compressed: a CUDA library holds each kernel's source text
    beside its cubin, and a round of the suite's 28 tasks would not fit in 64 MiB otherwise
    (softmax-CE's 32 candidates alone: 14.6 MB, 0.4-0.6 MB compressed)."""
    with tempfile.TemporaryDirectory() as tmp:
        so = os.path.join(tmp, "lib.so")
        lib.export_library(so)
        with open(so, "rb") as src, lzma.open(path, "wb", preset=6) as dst:
            dst.write(src.read())


def _seed_from_log(db: ms.database.Database, log_dir: str) -> int:
    """Copy a committed tuning log's records (each measured on the device, the best of earlier
    rounds) into an empty work database, so that a round made where the git-ignored work database
    is not (a new clone) still starts from them. Returns how many."""
    records = load_tuning_log(log_dir).get_all_tuning_records()
    for rec in records:
        db.commit_tuning_record(ms.database.TuningRecord(rec.trace, db.commit_workload(rec.workload.mod),
                                                         rec.run_secs, rec.target, rec.args_info))
    return len(records)


def make_round(mod, target, work_dir: str, out_dir: str, trials: int = 32, seed: int = 0,
               database: ms.database.Database | None = None, progress=print, seed_log: str | None = None) -> dict:
    """Write a round of up to ``trials`` new candidates per task of ``mod`` (a Relax module, rlx
    ops allowed) into ``out_dir``: ``task_<i>.so.xz`` and ``round.json``, which holds per task its
    name, library, workload (MetaSchedule's JSON), args ([shape, dtype] each) and candidates
    (function name and unmeasured tuning record each). Hand-scheduled kernels (vector code) are
    left out, as :func:`tune` leaves them. ``seed_log``: a tuning log whose records an empty work
    database starts from. Returns what ``round.json`` holds."""
    target = tuning_target(target)
    os.makedirs(work_dir, exist_ok=True)
    os.makedirs(out_dir, exist_ok=True)
    db = database if database is not None else ms.database.JSONDatabase(work_dir=work_dir)
    if seed_log is not None and len(db) == 0:
        progress(f"the work database {work_dir} is empty: starting from the {_seed_from_log(db, seed_log)} "
                 f"records of {seed_log}")
    tasks = ms.relax_integration.extract_tasks(lower(mod, target, schedule=False), target)
    config = evaluator_config()  # what tune's runners measure with
    evaluator = {"number": config.number, "repeat": config.repeat, "min_repeat_ms": config.min_repeat_ms}
    device = "cuda" if target.kind.name == "cuda" else "cpu" if target.kind.name == "llvm" else target.kind.name
    out = {"target": str(target), "device": device, "evaluator": evaluator, "tasks": []}
    for i, task in enumerate(tasks):
        start, label = time.time(), f"[{i + 1}/{len(tasks)}] {task.task_name}"
        task_mod = task.dispatched[0]
        if is_hand_scheduled(task_mod):
            progress(f"{label}: skipped (scheduled by hand)")
            continue
        found, how, learnt = round_candidates(task_mod, target, task.task_name, trials, db, seed)
        if not found:
            progress(f"{label}: {how}")
            continue
        funcs = {DEFAULT_FUNC: default_schedule(task_mod, target)["main"]}
        funcs.update({f"c{j}": c.sch.mod["main"] for j, c in enumerate(found)})
        library = f"task_{i}.so.xz"
        try:
            lib, unbuilt = _build_task(funcs, target)
        except RuntimeError as err:
            progress(f"{label}: {err}")
            continue
        built = [j for j in range(len(found)) if f"c{j}" not in unbuilt]
        if not built:  # at most the default built: nothing to measure
            progress(f"{label}: no candidate builds ({next(iter(unbuilt.values()))})")
            continue
        _export_compressed(lib, os.path.join(out_dir, library))
        workload = db.commit_workload(task_mod)
        args_info = found[0].args_info
        out["tasks"].append(dict(
            name=task.task_name, library=library, workload=workload.as_json(),
            args=[[[int(d) for d in a.shape], str(a.dtype)] for a in args_info],
            default=DEFAULT_FUNC if DEFAULT_FUNC not in unbuilt else None,
            candidates=[{"function": f"c{j}",
                         "record": ms.database.TuningRecord(c.sch.trace, workload, None, target,
                                                            c.args_info).as_json()}
                        for j, c in enumerate(found) if j in built]))
        size = os.path.getsize(os.path.join(out_dir, library)) // 1024
        progress(f"{label}: {len(built)} candidate(s){how}, model trained on {learnt} measured "
                 f"records, {library} {size} KiB ({time.time() - start:.0f} s)"
                 + (f"; {len(unbuilt)} did not build: {next(iter(unbuilt.values()))}" if unbuilt else ""))
    out["id"] = hashlib.sha256(json.dumps(out["tasks"], sort_keys=True).encode()).hexdigest()[:16]
    with open(os.path.join(out_dir, ROUND_FILE), "w") as f:
        json.dump(out, f)
    return out


def _stored_rounds(work_dir: str) -> dict:
    path = os.path.join(work_dir, ROUNDS_FILE)
    if not os.path.exists(path):
        return {"rounds": [], "default_us": {}}
    with open(path) as f:
        return json.load(f)


def device_defaults(work_dir: str) -> dict[str, float]:
    """Workload hash -> the default schedule's microseconds on the device (from stored rounds)."""
    return _stored_rounds(work_dir)["default_us"]


def commit_round(round_dir: str, results: dict, work_dir: str,
                 database: ms.database.Database | None = None) -> list[tuple[str, int, float | None, float | None]]:
    """Store a measured round in ``work_dir``: each measured candidate as a tuning record (one that
    failed on the device as MetaSchedule stores a failed run, 1e10 s), and the default schedules'
    times in ``device_rounds.json``; a round is stored once. ``results`` is the ``"round"`` part
    of ``device_time.py``'s output. Returns (task, records stored, best us, default us) per task."""
    with open(os.path.join(round_dir, ROUND_FILE)) as f:
        rnd = json.load(f)
    if results.get("id") != rnd["id"]:
        raise ValueError(f"commit_round: the results are of round {results.get('id')!r}, "
                         f"but {round_dir} holds round {rnd['id']!r}")
    stored_rounds = _stored_rounds(work_dir)
    if rnd["id"] in stored_rounds["rounds"]:
        raise ValueError(f"commit_round: round {rnd['id']} is already stored in {work_dir}")
    os.makedirs(work_dir, exist_ok=True)
    db = database if database is not None else ms.database.JSONDatabase(work_dir=work_dir)
    defaults = stored_rounds["default_us"]
    summary = []
    by_index = {r["task"]: r for r in results["tasks"]}
    for i, task in enumerate(rnd["tasks"]):
        measured = by_index.get(i)
        if measured is None:
            summary.append((task["name"], 0, None, None))
            continue
        workload = db.commit_workload(ms.database.Workload.from_json(task["workload"]).mod)
        secs = measured["secs"]
        stored, best = 0, None
        for cand in task["candidates"]:
            if cand["function"] not in secs:
                continue  # not reached on the device (time budget)
            run = secs[cand["function"]] or [1e10]  # None: it failed there
            rec = ms.database.TuningRecord.from_json(cand["record"], workload)
            db.commit_tuning_record(ms.database.TuningRecord(rec.trace, workload, [float(s) for s in run],
                                                             rec.target, rec.args_info))
            stored += 1
            if run[0] < 1e9:
                best = min(best or 1e30, min(run) * 1e6)
        default = secs.get(DEFAULT_FUNC)
        default_us = None if not default else min(default) * 1e6
        if default_us is not None:
            defaults[workload_key(workload.mod)] = default_us
        summary.append((task["name"], stored, best, default_us))
    stored_rounds["rounds"].append(rnd["id"])
    with open(os.path.join(work_dir, ROUNDS_FILE), "w") as f:
        json.dump(stored_rounds, f, indent=1)
    return summary
