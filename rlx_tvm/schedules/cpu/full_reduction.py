"""Reductions over a whole tensor (a 0-d or all-unit output: fake-quantize's ``max|x|``): in parts,
one per parallel iteration, that one short serial loop combines."""

from __future__ import annotations

from tvm import s_tir

from ...ops.registry import static_int
from ..common import fuse_loops
from .analysis import parallel, product, static_product
from .block_rule import CPU, BlockRule, block_shape
from .row_reduction import vectorize_row_reduction


class FullReduction(BlockRule):
    """A reduction whose output loops multiply to one element."""

    def schedule_block(self, sch: s_tir.Schedule, info, cpu: CPU) -> bool:
        shape = block_shape(sch, info)
        if shape is None or not shape.is_reduction or static_product(sch, shape.lead) != 1:
            return False
        return schedule_full_reduction(sch, shape.block, shape.lead, cpu.lanes, cpu.cores)


FULL_REDUCTION_PARTS = 8  # parts per core of a reduction over a whole tensor
MIN_FULL_REDUCTION = 1 << 16  # elements below which a whole-tensor reduction stays one loop


def schedule_full_reduction(sch, block, lead, lanes: int, cores: int) -> bool:
    """out[] = reduce over a whole tensor (fake-quantize's absmax): the elements are split into
    ``FULL_REDUCTION_PARTS`` parts per core (rfactor), each part reduced by one thread in
    vectors (as a row), then the parts in one short serial loop. Unscheduled, it was one serial
    scalar loop (fake-quantize backward's absmax at 8M elements on AVX2, one thread: 4.8 ->
    1.4 ms alone, the whole kernel 7.2 -> 5.5 ms; 2 threads, in two benchmark runs, 7.0 -> 4.4
    ms). False (nothing changed) for symbolic or small extents, or ones that no whole number of
    vectors per part divides."""
    reduced = sch.get_loops(block)[len(lead):]
    total = static_int(product([sch.get(loop).extent for loop in reduced]))
    if total is None or total < MIN_FULL_REDUCTION:
        return False
    parts = next((cores * k for k in (FULL_REDUCTION_PARTS, FULL_REDUCTION_PARTS // 2, 1)
                  if total % (cores * k * lanes) == 0), None)
    if parts is None:
        return False
    part, rest = sch.split(fuse_loops(sch, reduced), factors=[parts, None])
    try:
        partial = sch.rfactor(part, factor_axis=0)
    except s_tir.ScheduleError:
        return False
    rows = sch.get_loops(partial)[: len(lead) + 1]  # the parts are the rows
    if not vectorize_row_reduction(sch, partial, rows, lanes):
        parallel(sch, rows)
    return True
