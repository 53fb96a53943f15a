"""``rlx_tvm.compile``: the project's build entry point.

Kernels get, in order: the tuned schedule of a tuning log (MetaSchedule JSON database) where it has
a record for them, else the default schedules of :mod:`rlx_tvm.schedules`. The committed tuning
logs ship with the package (``rlx_tvm/tuning_logs/<target key>``, found through
:mod:`importlib.resources`; ``RLX_TVM_TUNING_LOGS`` names another directory of logs). Without a
target, everything is built for this CPU (:func:`rlx_tvm.target.cpu_target`).
"""

from __future__ import annotations

import importlib.resources
import os
import platform
import sys
from dataclasses import dataclass

import tvm
from tvm import relax
from tvm.s_tir import dlight as dl

from .passes import FuseSiblingBackwardOps
from .target import as_target, cpu_target, has_avx512, target_key, vector_bits
from .schedules import default_cpu_rules
from .schedules.gpu import schedule_gpu
from .schedules.prefetch import PrefetchNextRow
from .schedules.transcendentals import VectorizableTranscendentals

__all__ = ["Lowering", "TUNING_LOGS", "TuningLogError", "build_target", "compile", "default_schedule",
           "load_tuning_log", "lower", "lower_with_report", "target_key", "tuning_log_for"]

# Tuning logs, one MetaSchedule JSON database per target key (see :func:`target_key`): those
# shipped with the package, or the directory RLX_TVM_TUNING_LOGS names.
TUNING_LOGS = os.environ.get("RLX_TVM_TUNING_LOGS") or str(importlib.resources.files("rlx_tvm.tuning_logs"))

_generic_llvm_noted = False  # the note on a plain "llvm" target is printed once per process


def build_target(target=None) -> tvm.target.Target:
    """The target to build for: ``target`` as a :class:`tvm.target.Target`, or this CPU
    (:func:`~rlx_tvm.target.cpu_target`: explicit ``mcpu`` and cores) when None. A plain
    ``"llvm"`` (no ``mcpu``) on an x86 machine builds for a generic x86-64 CPU: the first time in
    a process, one line on stderr says what that loses and how to ask for this CPU."""
    global _generic_llvm_noted
    if target is None:
        return cpu_target()
    target = as_target(target)
    if (target.kind.name == "llvm" and not str(target.attrs.get("mcpu", "")) and not _generic_llvm_noted
            and platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")):
        _generic_llvm_noted = True
        host = cpu_target()
        isa = "AVX-512" if has_avx512(host) else "AVX2" if vector_bits(host) >= 256 else "SSE"
        print(f"rlx_tvm: target 'llvm' names no CPU, so kernels are built for a generic x86-64 CPU "
              f"({vector_bits(target)}-bit vectors, not the {vector_bits(host)}-bit {isa} ones of this "
              f"{host.attrs['mcpu']}) and no tuning log applies; omit the target or pass "
              f"rlx_tvm.target.cpu_target() to build for this CPU", file=sys.stderr)
    return target


class TuningLogError(ValueError):
    """A tuning log (MetaSchedule JSON database directory) that is missing or cannot be read."""


def tuning_log_for(target) -> str | None:
    """The tuning log for ``target`` in :data:`TUNING_LOGS` (``<dir>/<target_key>``), or None."""
    path = os.path.join(TUNING_LOGS, target_key(target))
    return path if os.path.isdir(path) else None


def _log_target_mismatch(records, target) -> str | None:
    tuned_for = {target_key(r.target) for r in records if r.target is not None}
    want = target_key(target)
    return None if not tuned_for or want in tuned_for else ", ".join(sorted(tuned_for))


def load_tuning_log(path: str):
    """Open a MetaSchedule JSON database directory, with a clear error when it is absent or corrupt."""
    from tvm.s_tir import meta_schedule as ms  # only where a log is read: import rlx_tvm needs no MetaSchedule

    files = [os.path.join(path, f) for f in ("database_workload.json", "database_tuning_record.json")]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise TuningLogError(f"tuning log {path!r}: expected a MetaSchedule JSON database, missing {missing}")
    try:
        return ms.database.JSONDatabase(path_workload=files[0], path_tuning_record=files[1], allow_missing=False)
    except Exception as err:  # TVM raises its own error types for unparsable JSON / records
        raise TuningLogError(f"tuning log {path!r} cannot be read ({type(err).__name__}: "
                             f"{str(err).strip().splitlines()[-1][:200]})") from err


def default_schedule(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """A single-kernel module (``main``) with the schedule :func:`compile` gives it without a log
    (what a tuned record must beat)."""
    mod = tvm.IRModule({"main": mod["main"]})  # a copy: dlight rewrites the module it is given
    if "gpu" in target.keys:
        return schedule_gpu(mod, target)[0]
    with target:
        return dl.ApplyDefaultSchedule(*default_cpu_rules())(mod)


def _scheduled(mod: tvm.IRModule) -> set[str]:
    return {gv.name_hint for gv, f in mod.functions.items()
            if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None and "tirx.is_scheduled" in f.attrs}


@dataclass
class Lowering:
    """What :func:`lower_with_report` did: the kernels, which got tuned schedules, and from where."""

    kernels: int
    tuned: list[str]
    tuning_log: str | None
    note: str | None  # the line printed when verbose


def lower(mod: tvm.IRModule, target=None, schedule: bool = True, tuning_log: str | None = "auto",
          verbose: bool = True) -> tvm.IRModule:
    """Legalize (fused rlx kernels included; on CPU, sibling backward ops such as attention's dq,
    dk and dv in one kernel) and fuse; then apply the tuned schedules of
    ``tuning_log`` (a MetaSchedule JSON database; ``"auto"``: the committed log of this target, if
    any; None: none) to the kernels it has records for, and default schedules to every other
    kernel. A log tuned for another target is not applied (and says so). ``target``: see
    :func:`build_target` (None: this CPU). Returns the Relax module, ready for ``tvm.compile``."""
    return lower_with_report(mod, target, schedule, tuning_log, verbose)[0]


def lower_with_report(mod: tvm.IRModule, target=None, schedule: bool = True, tuning_log: str | None = "auto",
                      verbose: bool = True) -> tuple[tvm.IRModule, Lowering]:
    """:func:`lower`, also returning a :class:`Lowering` report."""
    target = build_target(target)
    with target:  # fused kernels may pick a formulation per target (cumsum_backward, exp's scaling)
        if target.kind.name == "llvm":
            # Sibling backward ops (attention's dq/dk/dv) in one kernel each. CPU only: the
            # GPU rules have not been checked on the multi-output kernels.
            mod = FuseSiblingBackwardOps()(mod)
        mod = tvm.transform.Sequential(
            [
                relax.transform.LegalizeOps(),
                relax.transform.AnnotateTIROpPattern(),
                relax.transform.FoldConstant(),
                relax.transform.FuseOps(),
                relax.transform.FuseTIR(),
                relax.transform.DeadCodeElimination(),
            ]
        )(mod)
    kernels = sum(isinstance(f, tvm.tirx.PrimFunc) for f in mod.functions.values())
    tuned: list[str] = []
    note = None
    if tuning_log == "auto":
        tuning_log = tuning_log_for(target) if schedule else None
        if tuning_log is None and schedule:
            note = f"no tuning log for target {target_key(target)} in {TUNING_LOGS}: {kernels} kernels with default schedules"
    if tuning_log is not None:
        db = load_tuning_log(tuning_log)
        records = db.get_all_tuning_records()
        other = _log_target_mismatch(records, target)
        if other is not None:
            note = (f"tuning log {tuning_log} was tuned for {other}, not {target_key(target)}: "
                    f"not applied, {kernels} kernels with default schedules")
        else:
            before = _scheduled(mod)
            with target, db:
                mod = relax.transform.MetaScheduleApplyDatabase()(mod)
            tuned = sorted(_scheduled(mod) - before)
            note = (f"{len(tuned)} of {kernels} kernels tuned from {tuning_log}"
                    + ("" if len(tuned) == kernels else f", {kernels - len(tuned)} with default schedules "
                       + ("(the log holds no records)" if not records else
                          "(no record in the log matches them: another shape or dtype, a kernel changed "
                          "since tuning, or its record was not kept at export)")))
    if schedule and target.kind.name == "llvm":
        with target:
            mod = dl.ApplyDefaultSchedule(*default_cpu_rules())(mod)
        mod = PrefetchNextRow(mod)  # what the row kernels' schedules asked for (LLVM intrinsics)
        mod = VectorizableTranscendentals(mod)  # TVM's own kernels' exp & co. without libm calls
    elif schedule and "gpu" in target.keys:
        mod, _ = schedule_gpu(mod, target)
    if verbose and note is not None:
        print(f"rlx_tvm.compile: {note}", file=sys.stderr)
    return mod, Lowering(kernels, tuned, tuning_log, note)


def compile(mod: tvm.IRModule, target=None, schedule: bool = True, tuning_log: str | None = "auto",  # noqa: A001
            verbose: bool = True):
    """Compile a Relax module that may use rlx ops. Kernels with a record in ``tuning_log`` get
    their tuned schedule; CPU kernels without one get the default schedules of
    :mod:`rlx_tvm.schedules` (TVM's own CPU pipeline leaves them as serial loops). ``target``:
    see :func:`build_target` (None: this CPU)."""
    target = build_target(target)
    return tvm.compile(lower(mod, target, schedule, tuning_log, verbose), target=target)
