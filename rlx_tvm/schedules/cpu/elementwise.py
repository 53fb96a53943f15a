"""Blocks without a reduction (elementwise kernels, transposes, copies, gathers): the fused output
loops in parallel, the innermost one in vectors where it splits evenly."""

from __future__ import annotations

from tvm import s_tir, tirx

from ...ops.registry import static_int
from .analysis import parallel, static_product, vector_width
from .block_rule import CPU, BlockRule, block_shape

MIN_ROWS_PARALLEL = 256  # rows that alone make a parallel loop (a symbolic count is taken as enough)


class Elementwise(BlockRule):
    """A block of spatial loops only whose body is one store. A body that holds loops of its own (a
    serial scan per row) is left to the fallback: it stays scalar under the parallel loop."""

    def schedule_block(self, sch: s_tir.Schedule, info, cpu: CPU) -> bool:
        shape = block_shape(sch, info)
        if shape is None or not shape.is_spatial or not isinstance(sch.get(shape.block).body, tirx.BufferStore):
            return False
        lanes, lead = cpu.lanes, shape.lead
        inner_extent = static_int(sch.get(lead[-1]).extent) or 0
        width = vector_width(inner_extent, lanes)
        if width is not None and inner_extent >= width:  # rows of 56: half vectors
            outer, vec = sch.split(lead[-1], factors=[None, width])
            sch.vectorize(vec)
            lead[-1] = outer
        elif len(lead) > 1 and inner_extent >= lanes // 2 and static_product(sch, lead[:-1]) >= MIN_ROWS_PARALLEL:
            # Rows of no whole number of vectors (conv2d dx's padded 58-wide rows) stay a loop
            # of their own, which LLVM vectorizes with a remainder; fused into the parallel
            # loop, every element paid a division and a remainder per axis to find its indices
            # (conv2d dx at N8 C64 56x56: 25.1 -> 19.1 ms in one run at a busy hour).
            parallel(sch, lead[:-1])
            return True
        parallel(sch, lead)
        return True
