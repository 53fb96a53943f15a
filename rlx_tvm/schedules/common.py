"""What the CPU and GPU default rules share."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func

# A block annotation that keeps a stage materialized: MetaSchedule's AutoInline honours it, and
# so do the default rules (a stage whose inlining would recompute it many times, e.g. attention's
# probabilities, read Dv times each by the reduction that consumes them).
KEEP_STAGE = {"meta_schedule.inline_rule": "disable"}


def is_kept(sch: s_tir.Schedule, block_rv) -> bool:
    rule = sch.get(block_rv).annotations.get("meta_schedule.inline_rule")
    return rule is not None and str(rule) == "disable"


def try_inline(sch: s_tir.Schedule, blocks: list) -> list:
    """dlight's ``try_inline`` (inline, then reverse-inline, until nothing changes), leaving the
    blocks annotated with :data:`KEEP_STAGE` in place."""
    while True:
        for i, info in enumerate(blocks):
            if is_kept(sch, info.block_rv):
                continue
            try:
                sch.compute_inline(info.block_rv)
            except s_tir.ScheduleError:
                try:
                    sch.reverse_compute_inline(info.block_rv)
                except s_tir.ScheduleError:
                    continue
            blocks.pop(i)
            break
        else:
            return blocks


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
