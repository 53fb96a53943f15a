"""What the CPU and GPU default rules share."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base.common_schedules import try_inline


def inlined_blocks(rule, func, target) -> tuple[s_tir.Schedule, list] | None:
    """For a dlight ``rule`` applied to ``func``: a schedule of ``func`` with its injective stages
    inlined, and the remaining blocks (dlight's block infos); None when ``func`` is not a PrimFunc,
    the rule does not serve ``target``, or dlight cannot normalize the function."""
    if not isinstance(func, tirx.PrimFunc) or not rule.is_target_available(target):
        return None
    sch = s_tir.Schedule(func)
    blocks = normalize_prim_func(sch)
    if blocks is None:
        return None
    if len(blocks) > 1:
        blocks = try_inline(sch, blocks)
    return sch, blocks


def root_blocks(sch: s_tir.Schedule) -> list:
    """The blocks directly under the root block; none for hand-written TIR without a root block
    (e.g. TOPI's scatter kernels)."""
    try:
        return list(sch.get_child_blocks(sch.get_sblock("root")))
    except s_tir.ScheduleError:
        return []
