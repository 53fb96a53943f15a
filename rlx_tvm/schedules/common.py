"""What the CPU and GPU default rules share."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base.common_schedules import try_inline


def inlined_blocks(func: tirx.PrimFunc) -> tuple[s_tir.Schedule, list] | None:
    """A schedule of ``func`` with its injective stages inlined, and the remaining blocks (dlight's
    block infos); None when dlight cannot normalize the function."""
    sch = s_tir.Schedule(func)
    blocks = normalize_prim_func(sch)
    if blocks is None:
        return None
    if len(blocks) > 1:
        blocks = try_inline(sch, blocks)
    return sch, blocks
