"""Row reductions: ``out[i] = sum_j f(in[i, j])`` over a contiguous innermost axis (norm statistics,
softmax sums), as vector partial sums under the rows' parallel loop."""

from __future__ import annotations

from math import prod

from tvm import s_tir

from ...ops.registry import static_int
from .analysis import is_row_reduction, parallel, vector_width
from .block_rule import CPU, BlockRule, block_shape


class RowReduction(BlockRule):
    """A reduction whose innermost reduced axis is the innermost index of one of its reads."""

    def schedule_block(self, sch: s_tir.Schedule, info, cpu: CPU) -> bool:
        shape = block_shape(sch, info)
        if shape is None or not shape.is_reduction or not is_row_reduction(sch, shape.block, shape.n_lead):
            return False
        return vectorize_row_reduction(sch, shape.block, shape.lead, cpu.lanes)


def vectorize_row_reduction(sch, block, lead, lanes: int) -> bool:
    """out[i] = sum_j f(in[i, j]) (norm statistics, softmax sums): the contiguous innermost
    reduction is split into ``lanes`` partial sums (rfactor) computed with vector adds under the
    output's parallel loop, then summed; a serial scalar loop would be one dependent add per
    element. False (nothing changed) when the reduction is not in the form rfactor takes."""
    reduced = sch.get_loops(block)[len(lead):]
    inner = reduced[-1]
    extents = [static_int(sch.get(loop).extent) for loop in reduced]
    if None in extents or prod(extents) < 16 * lanes:  # short rows: the extra sum costs more
        return False
    # The widest vector that divides the innermost extent: a reduction over several short
    # axes (group norm's channels-of-group x H x W, W = 56) takes half vectors.
    width = vector_width(extents[-1], lanes)
    if width is None:
        return False
    # The lanes become the partial sums' axis after the output's own: the parts of a whole-
    # tensor reduction (see full_reduction.py) have one under two loops (its unit loop
    # and the parts); a 0-d output is left alone (rfactor fails TVM's internal check on it).
    out_dims = len(sch.get(block).writes[0].source.shape)
    if out_dims == 0:
        return False
    rows, vec = sch.split(inner, factors=[None, width])
    try:
        partial = sch.rfactor(vec, factor_axis=min(len(lead), out_dims))
    except s_tir.ScheduleError:
        sch.fuse(rows, vec)  # undo the split
        return False
    sch.compute_at(partial, sch.get_loops(block)[len(lead) - 1])
    lane_loop, *reduced = sch.get_loops(partial)[len(lead):]  # regenerated in block-var order
    sch.reorder(*reduced, lane_loop)
    sch.vectorize(lane_loop)
    parallel(sch, sch.get_loops(block)[: len(lead)])
    return True
