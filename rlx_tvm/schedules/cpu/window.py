"""Reductions over a small window (pooling's ``kh x kw`` taps): vectors along the outputs."""

from __future__ import annotations

from math import prod

from tvm import s_tir

from .analysis import SMALL_WINDOW, iter_extent, parallel, vector_width
from .block_rule import CPU, BlockRule, block_shape


class WindowReduction(BlockRule):
    """out[..., j] = reduce over at most ``SMALL_WINDOW`` taps, the innermost output axis static."""

    def schedule_block(self, sch: s_tir.Schedule, info, cpu: CPU) -> bool:
        shape = block_shape(sch, info)
        if shape is None or not shape.is_reduction:
            return False
        width = window_width(sch, info, cpu.lanes)
        if width is None:
            return False
        schedule_window(sch, shape.block, shape.lead, shape.reduced, width)
        return True


def window_width(sch, info, lanes: int) -> int | None:
    """For a reduction over a small window (pooling: ``kh x kw`` taps) whose innermost output
    axis is static: the vector width to compute that axis with; None otherwise."""
    kinds = info.dom_kind()
    n_lead = len(kinds) - len(kinds.lstrip("S"))
    if n_lead == 0 or kinds[n_lead:] != "R" * (len(kinds) - n_lead) or n_lead == len(kinds):
        return None
    extents = [iter_extent(it) for it in info.iters]
    if None in extents or prod(extents[n_lead:]) > SMALL_WINDOW:
        return None
    return vector_width(extents[n_lead - 1], lanes)


def schedule_window(sch, block, lead, reduced, width: int):
    """out[..., j] = reduce over a small window of in[..., s*j + t] (pooling): chunks of
    ``width`` outputs along the innermost axis, each a vector accumulated over the taps (a
    serial loop per output is a few dependent scalar steps with a branch each)."""
    chunks, vec = sch.split(lead[-1], factors=[None, width])
    sch.reorder(*lead[:-1], chunks, *reduced, vec)
    sch.vectorize(vec)
    if lead[:-1]:
        parallel(sch, lead[:-1])
    else:
        sch.parallel(chunks)
    init = sch.decompose_reduction(block, reduced[0])
    sch.vectorize(sch.get_loops(init)[-1])
