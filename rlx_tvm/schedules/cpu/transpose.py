"""Transposes: a block without a reduction that reads a buffer along another axis than the one it
writes along (``permute_dims``, a weight's transpose for ``x @ W.T``): square tiles of
``TILE x TILE`` elements, so that the lines read across the rows of a tile stay in the L1 cache
while the tile is written (row by row over the whole output, each read line was evicted before
its next element was used)."""

from __future__ import annotations

from tvm import s_tir, tirx

from ...ops.registry import static_int
from ..common import uses
from .analysis import parallel
from .block_rule import CPU, BlockRule, block_shape

MIN_TRANSPOSE = 1 << 14  # elements below which a transpose stays one elementwise loop
# Rows of a tile: with power-of-two row lengths every line a tile reads falls in one L1 set, and 8
# fit an 8-way cache where 16 evicted each other.
TILE = 8


def transposed_axis(stmt, n_loops: int) -> int | None:
    """The output axis that indexes the innermost dim of some read while another axis is the
    written innermost one; None when every read runs along the written innermost axis."""
    ivs = [iv.var for iv in stmt.iter_vars]
    if len(ivs) != n_loops or len(stmt.writes) != 1 or not stmt.writes[0].region:
        return None
    inner = stmt.writes[0].region[-1].min
    if not inner.same_as(ivs[-1]):
        return None
    for read in stmt.reads:
        if not read.region:
            continue
        index = read.region[-1].min
        axis = next((k for k, v in enumerate(ivs[:-1]) if index.same_as(v)), None)
        if axis is not None and not any(uses(r.min, ivs[-1]) for r in read.region[-1:]):
            return axis
    return None


class Transpose(BlockRule):
    """out[..., i, ..., j] = f(in[..., j, ..., i]) with static extents that the tile divides."""

    def schedule_block(self, sch: s_tir.Schedule, info, cpu: CPU) -> bool:
        shape = block_shape(sch, info)
        if shape is None or not shape.is_spatial or not isinstance(sch.get(shape.block).body, tirx.BufferStore):
            return False
        stmt = sch.get(shape.block)
        axis = transposed_axis(stmt, len(shape.loops))
        if axis is None:
            return False
        tile = TILE
        extents = [static_int(sch.get(loop).extent) for loop in shape.loops]
        if extents[axis] is None or extents[-1] is None or extents[axis] % tile or extents[-1] % tile \
                or extents[axis] * extents[-1] < MIN_TRANSPOSE:
            return False
        loops = shape.loops
        i_outer, i_inner = sch.split(loops[axis], factors=[None, tile])
        j_outer, j_inner = sch.split(loops[-1], factors=[None, tile])
        outer = [*loops[:axis], i_outer, *loops[axis + 1:-1], j_outer]
        sch.reorder(*outer, i_inner, j_inner)
        parallel(sch, outer)
        sch.unroll(i_inner)
        sch.vectorize(j_inner)
        return True
