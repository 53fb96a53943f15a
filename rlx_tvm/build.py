"""``rlx_tvm.compile``: the project's build entry point."""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.s_tir import dlight as dl

from .schedules import default_cpu_rules

__all__ = ["compile", "lower"]


def _as_target(target) -> tvm.target.Target:
    return target if isinstance(target, tvm.target.Target) else tvm.target.Target(target)


def lower(mod: tvm.IRModule, target="llvm", schedule: bool = True) -> tvm.IRModule:
    """Legalize (fused rlx kernels included), fuse, and apply default schedules to every kernel
    that has none. Returns the Relax module with scheduled PrimFuncs, ready for ``tvm.compile``."""
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
    if schedule and target.kind.name == "llvm":
        with target:
            mod = dl.ApplyDefaultSchedule(*default_cpu_rules())(mod)
    return mod


def compile(mod: tvm.IRModule, target="llvm", schedule: bool = True):  # noqa: A001 - mirrors tvm.compile
    """Compile a Relax module that may use rlx ops. CPU kernels get the default schedules of
    :mod:`rlx_tvm.schedules` (TVM's own CPU pipeline leaves them as serial loops)."""
    target = _as_target(target)
    return tvm.compile(lower(mod, target, schedule), target=target)
