"""Products with epilogues: a matrix product, batched matrix product or convolution followed by
the elementwise stages that ``FuseOps`` fused into it (bias add, activation, broadcast, reshape).

The product is register-blocked as :func:`~.column_reduction.schedule_column_reduction` does for
a product alone (the outer output loops parallel, a tile of rows x vectors of accumulators in
registers over the reduction); every epilogue stage is computed at the tile, reading the
accumulators right after the reduction, instead of in a pass of its own over the whole output
(or, as the row-kernel rule took these kernels for, a row reduction per output element).
"""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.cpu.base import CPUScheduleRule
from tvm.target import Target

from ...ops.registry import static_int
from ..common import inlined_blocks, is_column_reduction, is_kept, uses
from .analysis import vector_width
from .block_rule import CPU, block_shape
from .column_reduction import reused_row_axis, ROW_TILE, schedule_column_reduction
from .elementwise import Elementwise


def is_product(sch: s_tir.Schedule, block) -> bool:
    """A reduction that multiplies two operands indexed by different output axes: one read depends
    on an output axis that another does not, and the other on one that the first does not, both
    along a reduced axis (``A[i, k] * B[k, j]``, a convolution's data and weight). A row statistic
    (one operand, or one with per-row values) is none."""
    stmt = sch.get(block)
    spatial = [iv.var for iv in stmt.iter_vars if iv.iter_type == tirx.IterVar.DataPar]
    reduced = [iv.var for iv in stmt.iter_vars if iv.iter_type == tirx.IterVar.CommReduce]
    if not reduced or len(spatial) < 2:
        return False

    def axes(read):
        return {k for k, v in enumerate(spatial) if any(uses(r.min, v) for r in read.region)}

    operands = [axes(r) for r in stmt.reads
                if any(uses(rg.min, v) for rg in r.region for v in reduced)]
    return any(a - b and b - a for a in operands for b in operands)


def is_padding(sch: s_tir.Schedule, block) -> bool:
    """A block that stores ``if_then_else(in bounds, x[...], constant)``: padding (or a pad-like
    guard) whose inlining would put the bounds check into every use."""
    stmt = sch.get(block)
    body = stmt.body
    if not isinstance(body, tirx.BufferStore) or any(iv.iter_type != tirx.IterVar.DataPar for iv in stmt.iter_vars):
        return False
    value = body.value
    return isinstance(value, tvm.ir.expr.Call) and value.op.name == "prim.if_then_else" \
        and isinstance(value.args[2], (tirx.FloatImm, tirx.IntImm))


class Product(CPUScheduleRule):
    """A kernel whose first block (after inlining; padding kept, see :func:`is_padding`) is a
    product contiguous along its output's innermost axis with a reused row axis
    (``common.is_column_reduction``, ``reused_row_axis``) and whose other blocks are elementwise
    stages after it; declines every other kernel."""

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        found = inlined_blocks(self, func, target, keep=is_padding)
        if found is None or len(found[1]) < 2:
            return None
        sch, blocks = found
        if any(is_kept(sch, info.block_rv) for info in blocks):
            return None  # stages laid out by the kernel's author (rlx conv2d gradients): block by block
        # Padding stays a pass of its own: inlined, every tap of the product paid a bounds check
        # (conv2d forward at N32 C32 16x16: 5.7 GFLOP/s, its weight gradient 29 on a busy machine).
        prologues = []
        while blocks and is_padding(sch, blocks[0].block_rv):
            prologues.append(blocks.pop(0))
        if len(blocks) < 2:  # a product alone is ColumnReduction's (with its bounds checks inlined)
            return None
        shape = block_shape(sch, blocks[0])
        if shape is None or not shape.is_reduction or not is_product(sch, shape.block) \
                or not is_column_reduction(sch, shape.block, shape.n_lead) \
                or reused_row_axis(sch, shape.block, shape.n_lead, ROW_TILE) is None:
            return None
        epilogues = blocks[1:]
        if any(len(info.dom_kind()) == 0 or set(info.dom_kind()) != {"S"} for info in epilogues):
            return None
        cpu = CPU.of(target)
        try:
            for info in prologues:
                if not Elementwise().schedule_block(sch, info, cpu):
                    return None
            tile_loop, accumulate = schedule_column_reduction(sch, shape.block, shape.lead, shape.reduced, cpu.lanes,
                                                              cpu.cores, cpu.registers)
            for info in epilogues:
                try:
                    sch.reverse_compute_at(info.block_rv, tile_loop)
                except s_tir.ScheduleError:
                    Elementwise().schedule_block(sch, info, cpu)  # a pass of its own
                    continue
                _vectorize_innermost(sch, info.block_rv, tile_loop, cpu.lanes)
            if accumulate is not None:
                try:  # the epilogue reads the accumulators: no write-back to memory in between
                    sch.compute_inline(accumulate)
                except s_tir.ScheduleError:
                    pass
        except RuntimeError:  # TVM reports schedule errors (and its other errors) as RuntimeError
            return None
        return sch


def _vectorize_innermost(sch: s_tir.Schedule, block, outer, lanes: int) -> None:
    """The innermost of a block's own loops under the loop ``outer``, in vectors where it splits."""
    loops = sch.get_loops(block)
    depth = next(i for i, loop in enumerate(loops) if sch.get(loop).same_as(sch.get(outer))) + 1
    loops = loops[depth:]
    if not loops:
        return
    width = vector_width(static_int(sch.get(loops[-1]).extent), lanes)
    if width is not None and isinstance(sch.get(block).body, tirx.BufferStore):
        sch.vectorize(sch.split(loops[-1], factors=[None, width])[1])
