"""``rlx_tvm.compile``: the project's build entry point."""

from __future__ import annotations

import os
import sys

import tvm
from tvm import relax
from tvm.s_tir import dlight as dl

from .schedules import default_cpu_rules

__all__ = ["TuningLogError", "compile", "lower"]


class TuningLogError(ValueError):
    """A tuning log (MetaSchedule JSON database directory) that is missing or cannot be read."""


def _as_target(target) -> tvm.target.Target:
    return target if isinstance(target, tvm.target.Target) else tvm.target.Target(target)


def load_tuning_log(path: str):
    """Open a MetaSchedule JSON database directory, with a clear error when it is absent or corrupt."""
    from tvm.s_tir import meta_schedule as ms

    files = [os.path.join(path, f) for f in ("database_workload.json", "database_tuning_record.json")]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise TuningLogError(f"tuning log {path!r}: expected a MetaSchedule JSON database, missing {missing}")
    try:
        return ms.database.JSONDatabase(path_workload=files[0], path_tuning_record=files[1], allow_missing=False)
    except Exception as err:  # TVM raises its own error types for unparsable JSON / records
        raise TuningLogError(f"tuning log {path!r} cannot be read ({type(err).__name__}: "
                             f"{str(err).strip().splitlines()[-1][:200]})") from err


def _scheduled(mod: tvm.IRModule) -> set[str]:
    return {gv.name_hint for gv, f in mod.functions.items()
            if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None and "tirx.is_scheduled" in f.attrs}


def lower(mod: tvm.IRModule, target="llvm", schedule: bool = True, tuning_log: str | None = None,
          verbose: bool = True) -> tvm.IRModule:
    """Legalize (fused rlx kernels included) and fuse; then apply the tuned schedules of
    ``tuning_log`` (a MetaSchedule JSON database) to the kernels it has records for, and default
    schedules to every other kernel. Returns the Relax module, ready for ``tvm.compile``."""
    target = _as_target(target)
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
    if tuning_log is not None:
        db = load_tuning_log(tuning_log)
        kernels = sum(isinstance(f, tvm.tirx.PrimFunc) for f in mod.functions.values())
        before = _scheduled(mod)
        with target, db:
            mod = relax.transform.MetaScheduleApplyDatabase()(mod)
        tuned = _scheduled(mod) - before
    if schedule and target.kind.name == "llvm":
        with target:
            mod = dl.ApplyDefaultSchedule(*default_cpu_rules())(mod)
    if verbose and tuning_log is not None:
        print(f"rlx_tvm.compile: {len(tuned)} of {kernels} kernels tuned from {tuning_log}"
              + ("" if len(tuned) == kernels else
                 f", {kernels - len(tuned)} with default schedules (no matching record: other shape or target)"),
              file=sys.stderr)
    return mod


def compile(mod: tvm.IRModule, target="llvm", schedule: bool = True, tuning_log: str | None = None,  # noqa: A001
            verbose: bool = True):
    """Compile a Relax module that may use rlx ops. Kernels with a record in ``tuning_log`` get
    their tuned schedule; CPU kernels without one get the default schedules of
    :mod:`rlx_tvm.schedules` (TVM's own CPU pipeline leaves them as serial loops)."""
    target = _as_target(target)
    return tvm.compile(lower(mod, target, schedule, tuning_log, verbose), target=target)
