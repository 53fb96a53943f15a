"""What the CPU rules share: loop and block analysis, and the parallel loop every rule ends with."""

from __future__ import annotations

from math import prod

from tvm import s_tir, tirx
from tvm.sym import Analyzer

from ...ops.registry import static_int
from ..common import fuse_loops, uses

MIN_PARALLEL_EXTENT = 2  # a fused loop shorter than this stays serial
SMALL_WINDOW = 32  # taps of a window reduction (pooling) scheduled as vectors along its outputs


def static_product(sch: s_tir.Schedule, loops: list) -> float:
    """The product of the loops' extents; infinite when it is symbolic."""
    n = static_int(product([sch.get(loop).extent for loop in loops]))
    return float("inf") if n is None else n


def vector_width(extent: int | None, lanes: int) -> int | None:
    """The widest vector, a whole one or a half (rows of 56: 8 lanes of 16), that divides a static
    ``extent``; None for a symbolic extent or when neither divides it."""
    if not extent:
        return None
    return next((w for w in (lanes, lanes // 2) if w > 1 and extent % w == 0), None)


def iter_extent(it) -> int | None:
    """A dlight iter's static extent (it gives an int when static)."""
    return it.dom if isinstance(it.dom, int) else None


def is_row_reduction(sch: s_tir.Schedule, block, n_spatial: int) -> bool:
    """A reduction whose innermost reduced axis is the innermost index of one of its reads."""
    stmt = sch.get(block)
    last = stmt.iter_vars[-1].var
    return n_spatial < len(stmt.iter_vars) and any(r.region and uses(r.region[-1].min, last) for r in stmt.reads)


def depends_on(read, var) -> bool:
    return any(uses(rg.min, var) for rg in read.region)


def n_spatial(sch: s_tir.Schedule, block) -> int:
    return sum(iv.iter_type == tirx.IterVar.DataPar for iv in sch.get(block).iter_vars)


def reduced_size(sch: s_tir.Schedule, block) -> int | None:
    """The number of reduced elements per output of a block (0: no reduction; None: symbolic)."""
    extents = [static_int(iv.dom.extent) for iv in sch.get(block).iter_vars if iv.iter_type == tirx.IterVar.CommReduce]
    return None if None in extents else (prod(extents) if extents else 0)


def block_domain(sch: s_tir.Schedule, block) -> tirx.PrimExpr:
    """The number of iterations of a block (static or symbolic)."""
    return product([iv.dom.extent for iv in sch.get(block).iter_vars])


def work(sch: s_tir.Schedule, block) -> tirx.PrimExpr:
    """Iterations a block executes where it is now: the product of its enclosing loops."""
    return product([sch.get(loop).extent for loop in sch.get_loops(block)])


def product(extents: list) -> tirx.PrimExpr:
    """The product of loop or block extents, static or symbolic (simplified, int64)."""
    out = tirx.IntImm("int64", 1)
    for e in extents:
        out = out * tirx.Cast("int64", e)
    return Analyzer().simplify(out)


def parallel(sch: s_tir.Schedule, lead: list, min_extent: int = MIN_PARALLEL_EXTENT):
    """Fuse ``lead`` into one loop, parallel unless too short; returns it."""
    fused = fuse_loops(sch, lead)
    extent = static_int(sch.get(fused).extent)
    if extent is None or extent >= min_extent:
        sch.parallel(fused)
    return fused
