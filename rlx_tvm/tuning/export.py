"""From a tuning work database to the tuning log that :func:`rlx_tvm.compile` applies: the best
record per kernel, left out where it is stale or does not make its kernel, or the module the
kernel belongs to, faster than the default schedules.

The keep/drop rule acts on times; :class:`ExportTimer` is what takes them (on this CPU by
default), so the rule can also be applied to given times.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import tvm
import tvm_ffi
from tvm.s_tir import meta_schedule as ms

from ..build import compile as rlx_compile
from ..build import default_schedule, load_tuning_log, lower
from ..schedules.common import root_blocks
from ..timing import SETTLE_MS, calibrated_timer, vm_runner
from .device_round import device_defaults, workload_key
from .search import format_us

__all__ = ["MIN_SPEEDUP", "Export", "ExportRow", "ExportTimer", "ModuleCheck", "export_log", "faster_enough",
           "kernel_label", "kernel_workloads"]

# A record must beat the default schedule by this factor to enter a log: the two are timed on a
# noisy 2-core machine, and a record that ties (a copy kernel at 3.2 vs 3.2 us) only adds to the log.
MIN_SPEEDUP = 1.05


def faster_enough(tuned: float, default: float, min_speedup: float) -> bool:
    """The export rule: ``tuned`` at least ``min_speedup`` times faster than ``default``."""
    return tuned * min_speedup <= default


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


@dataclass
class Export:
    """What :func:`export_log` wrote: a row per best record, and the module-level checks."""

    rows: list[ExportRow]
    modules: list[ModuleCheck]

    @property
    def kept(self) -> int:
        return sum(r.kept for r in self.rows)


class ExportTimer:
    """What :func:`export_log` compares, timed on this CPU: a kernel with its tuned schedule and
    with the default one (microseconds, median of interleaved rounds), and a module built with a
    tuning log and without (milliseconds, median of rounds interleaved in alternating order)."""

    def kernel_us(self, tuned: tvm.IRModule, default: tvm.IRModule, target: tvm.target.Target,
                  rounds: int = 5) -> tuple[float, float]:
        args = random_tensors((i.shape, i.dtype) for i in ms.arg_info.ArgInfo.from_prim_func(tuned["main"]))
        timers = [tvm.compile(m, target=target).mod.time_evaluator("main", tvm.cpu(), number=1, repeat=1,
                                                                   min_repeat_ms=50) for m in (tuned, default)]
        samples = [[], []]
        for _ in range(rounds):
            for i, timer in enumerate(timers):
                samples[i].append(timer(*args).mean)
        return float(np.median(samples[0])) * 1e6, float(np.median(samples[1])) * 1e6

    def module_ms(self, mod: tvm.IRModule, target: tvm.target.Target, log_dir: str, rounds: int = 7,
                  min_ms: float = 50.0) -> tuple[float, float]:
        args = random_tensors((p.ty.shape.values, p.ty.dtype) for p in mod["main"].params)
        timers = [calibrated_timer(vm_runner(rlx_compile(mod, target, tuning_log=log, verbose=False), args), min_ms)
                  for log in (log_dir, None)]
        samples = [[], []]
        for r in range(rounds):
            for i in (0, 1) if r % 2 == 0 else (1, 0):
                time.sleep(SETTLE_MS / 1e3)
                samples[i].append(timers[i]())
        return float(np.median(samples[0])), float(np.median(samples[1]))


def random_tensors(specs) -> list:
    """Tensors of the given (shape, dtype)s, the same on every call: standard normal floats, zero
    integers (always in range as indices)."""
    rng = np.random.default_rng(0)
    out = []
    for shape, dtype in specs:
        shape, dtype = [int(d) for d in shape], str(dtype)
        data = rng.standard_normal(shape).astype(dtype) if "float" in dtype else np.zeros(shape, dtype)
        out.append(tvm.runtime.tensor(data))
    return out


def export_log(work_dir: str, log_dir: str, target: tvm.target.Target | None = None,
               compare_default: bool = True, verbose: bool = True,
               kernels: tvm.IRModule | list[tvm.IRModule] | dict[str, tvm.IRModule] | None = None,
               min_speedup: float = MIN_SPEEDUP, module_min_speedup: float = MIN_SPEEDUP,
               database: ms.database.Database | None = None, timer: ExportTimer | None = None) -> Export:
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
    kernels each won alone, yet its build with them read slower than without in some runs and
    faster in others, since together they save microseconds of a 50 ms kernel, so they do not
    earn a place. On a GPU target the first check compares a record's time on the device with
    the default schedule's time measured beside it (:mod:`rlx_tvm.tuning.device_round`).

    ``database``: ``work_dir``'s database already open (as :func:`~rlx_tvm.tuning.tune` takes it).
    ``timer``: what takes the times the checks compare (default: :class:`ExportTimer`)."""
    timer = timer or ExportTimer()
    src = database if database is not None else load_tuning_log(work_dir)
    with tempfile.TemporaryDirectory() as tmp:
        pruned = ms.database.JSONDatabase(work_dir=tmp)
        src.dump_pruned(pruned)
        records = pruned.get_all_tuning_records()
    units = _named_modules(kernels)
    # Lowered once per module, for the target the records were tuned for (as rlx_tvm.compile looks
    # them up): the stale check takes them all, the module check each module's own.
    lower_target = target or (records[0].target if records else None)
    unit_workloads = {} if units is None else {name: kernel_workloads(m, lower_target) for name, m in units.items()}
    current = None if units is None else [w for ws in unit_workloads.values() for w in ws]
    on_device = device_defaults(work_dir)  # default schedules' times measured on a device, by workload
    rows, kept = [], []  # kept: (record, row) pairs that passed the per-kernel check
    for i, rec in enumerate(records):
        row = _check_record(rec, target, current, compare_default, min_speedup, on_device, timer)
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
            tuned_ms, default_ms = timer.module_ms(mod, lower_target, log_dir)
            check = ModuleCheck(name, len(mine), tuned_ms, default_ms,
                                kept=faster_enough(tuned_ms, default_ms, module_min_speedup))
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
                  on_device: dict[str, float], timer: ExportTimer) -> ExportRow:
    """The per-kernel check of :func:`export_log`: stale, or timed against the default schedule
    here (CPU), or compared with the default's time measured beside it on the device
    (``on_device``: workload hash -> us, from :func:`~rlx_tvm.tuning.device_round.commit_round`)."""
    mod, rec_target = rec.workload.mod, target or rec.target
    if current is not None and not any(tvm_ffi.structural_equal(mod, k) for k in current):
        return ExportRow(kernel_label(mod), None, None, False, stale=True)
    tuned_us = default_us = None
    ran = bool(rec.run_secs) and float(rec.run_secs[0]) < 1e9
    if compare_default and ran and rec_target.kind.name == "llvm":
        sch = tvm.s_tir.Schedule(mod)
        rec.trace.apply_to_schedule(sch, remove_postproc=False)
        tuned_us, default_us = timer.kernel_us(sch.mod, default_schedule(mod, rec_target), rec_target)
    elif compare_default and ran and on_device:
        default_us = on_device.get(workload_key(mod))
        tuned_us = None if default_us is None else min(float(s) for s in rec.run_secs) * 1e6
    kept = tuned_us is None or faster_enough(tuned_us, default_us, min_speedup)
    return ExportRow(kernel_label(mod), tuned_us, default_us, kept)


def _export_line(row: ExportRow, min_speedup: float) -> str:
    if row.stale:
        return f"{row.kernel}: dropped (stale: no current kernel)"
    verdict = "kept" if row.kept else f"dropped (not {min_speedup:g}x faster than the default schedule)"
    return f"{row.kernel}: tuned {format_us(row.tuned_us)}, default {format_us(row.default_us)} -> {verdict}"


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


def kernel_label(mod: tvm.IRModule) -> str:
    """A kernel named by its stages (blocks), for export's table; long lists by their ends."""
    sch = tvm.s_tir.Schedule(mod)
    names = [sch.get(b).name_hint for b in root_blocks(sch)]
    if len("/".join(names)) > 80:  # e.g. blocked attention's concatenation of 40 slices
        names = [*names[:2], f"... {len(names) - 3} more ...", names[-1]]
    return "/".join(names) or "main"  # hand-written TIR: no blocks


def kernel_workloads(kernels, target) -> list[tvm.IRModule]:
    """The kernels of Relax modules as MetaSchedule workloads (what a database lookup compares),
    lowered for ``target`` (None: this CPU)."""
    workloads = []
    for mod in [kernels] if isinstance(kernels, tvm.IRModule) else kernels:
        lowered = lower(mod, target, schedule=False, tuning_log=None, verbose=False)
        workloads += [tvm.IRModule({"main": f.with_attr("global_symbol", "main")})
                      for f in lowered.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    return workloads
