"""The rule for whatever no other rule takes: every block of the kernel scheduled by the first
block rule that fits it, else its fused output loops in parallel.

Every output element is written by one thread only (a reduction is split across the parallel
loop only into parts of a buffer of their own): race-free by construction, also for the
gather-style scatter kernels.
"""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.cpu.base import CPUScheduleRule
from tvm.target import Target

from ..common import inlined_blocks
from .analysis import MIN_PARALLEL_EXTENT, parallel
from .block_rule import CPU, block_shape
from .column_reduction import ColumnReduction
from .elementwise import Elementwise
from .full_reduction import FullReduction
from .row_reduction import RowReduction
from .window import WindowReduction

# In priority order: a reduction over a whole tensor, along columns, over a small window, along
# rows; then blocks without a reduction. (Transpose takes kernels of one block only: the blocks of
# multi-block kernels, attention backward's among them, keep the schedules they were measured with.)
BLOCK_RULES = (FullReduction(), ColumnReduction(), WindowReduction(), RowReduction(), Elementwise())


class ParallelFallback(CPUScheduleRule):
    """Any kernel: inline injective stages, then per remaining block the first of
    :data:`BLOCK_RULES` that fits; a block that none fits gets its leading spatial loops fused into
    one parallel loop."""

    def __init__(self, min_parallel_extent: int = MIN_PARALLEL_EXTENT):
        self.min_parallel_extent = min_parallel_extent

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        found = inlined_blocks(self, func, target)
        if found is None:
            return None
        sch, blocks = found
        cpu = CPU.of(target)
        for info in blocks:
            for rule in BLOCK_RULES:
                trial = sch.copy()  # a rule that raises leaves no half-made change behind
                try:
                    done = rule.schedule_block(trial, info, cpu)
                except (s_tir.ScheduleError, tvm.error.InternalError):
                    # e.g. TVM 0.27's rfactor failing an internal check on a reduction fused
                    # with broadcasts (a causal decoder's gradient): the next rule takes the block.
                    continue
                sch = trial
                if done:
                    break
            else:
                shape = block_shape(sch, info)
                if shape is not None:
                    parallel(sch, shape.lead, self.min_parallel_extent)
        return sch
