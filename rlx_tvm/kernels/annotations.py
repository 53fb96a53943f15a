"""Block annotations that kernels set and schedules honour."""

from __future__ import annotations

from tvm import s_tir

# A block annotation that keeps a stage materialized: MetaSchedule's AutoInline honours it, and
# so do the default rules (a stage whose inlining would recompute it many times, e.g. attention's
# probabilities, read Dv times each by the reduction that consumes them).
KEEP_STAGE = {"meta_schedule.inline_rule": "disable"}


def is_kept(sch: s_tir.Schedule, block_rv) -> bool:
    """Whether the block carries :data:`KEEP_STAGE`."""
    rule = sch.get(block_rv).annotations.get("meta_schedule.inline_rule")
    return rule is not None and str(rule) == "disable"
