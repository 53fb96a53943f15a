"""Column reductions: ``out[..., j] = sum_r f(in[r, ..., j])`` with the inputs contiguous along the
output's innermost axis (gamma/beta gradients, sums over leading axes), and, where a read along
the columns is shared by the rows of another output axis, register-blocked products (matrix
products, convolution gradients): a tile of rows x vectors of accumulators kept in registers."""

from __future__ import annotations

from tvm import s_tir

from ...ops.registry import static_int
from ..common import is_column_reduction, uses
from .analysis import depends_on, parallel, static_product
from .block_rule import CPU, BlockRule, block_shape


class ColumnReduction(BlockRule):
    """A reduction contiguous along its innermost output axis (``common.is_column_reduction``)."""

    def schedule_block(self, sch: s_tir.Schedule, info, cpu: CPU) -> bool:
        shape = block_shape(sch, info)
        if shape is None or not shape.is_reduction or not is_column_reduction(sch, shape.block, shape.n_lead):
            return False
        schedule_column_reduction(sch, shape.block, shape.lead, shape.reduced, cpu.lanes, cpu.cores, cpu.registers)
        return True


ROW_TILE = 4  # a product's row axis is tiled when its extent is a multiple of this
TILE_ACCUMULATORS = 16  # vector registers a tile's accumulators may take
TILE_GROUP = 8  # tiles of rows that take turns on one block of the reduction (cache blocking)
REDUCTION_BLOCK = 16  # steps of the outer reduction loop per block
TILES_PER_CORE = 8  # parallel iterations per core that grouping tiles must leave


def product_tile(columns: int, rows: int | None, lanes: int, registers: int,
                 partner: int | None = None) -> tuple[int, int, int] | None:
    """(columns, rows, partners) of a register-blocked product tile ``acc[r, c] += a[r] * b[c]``
    over ``columns`` (a row of whole registers, or of half ones where the columns are no multiple
    of the vector: AVX-512's 56) and ``rows`` rows: the tile that does the most multiply-adds per
    load (``r*n / (r + n)`` for r rows of n registers) among those whose registers fit: r*n
    accumulators, the n loads of b that every row shares and a broadcast of a (LLVM keeps the
    shared loads in registers; beyond the target's registers the tile spills to the stack every
    step: AVX2's 16 with AVX-512's 4 x 4 tiles). Ties go to more accumulators (more independent
    chains), then to more rows (each row's b is loaded once per tile: conv2d dw at N8 C64 56x56
    on AVX2, one thread, 4 rows of 2 registers 30.6 ms, 2 rows of 4 45.0 ms). Where the best row
    is one register and an output axis of extent ``partner`` indexes b but not a (conv2d dx's
    output rows), the row takes ``partners`` of its indices (else 1). None when the columns are
    no whole number of (half) registers."""
    unit = lanes if columns % lanes == 0 else lanes // 2
    if unit < 1 or columns % unit:
        return None

    def best_tile(widths):
        best = None
        for v, f in widths:
            for r in (1, 2, 4, 8):
                n = v * f  # registers of b per row
                if rows is not None and rows % r or r * n > TILE_ACCUMULATORS or r * n + n + 1 > registers:
                    continue
                key = (r * n / (r + n), r * n, r)
                if best is None or key > best[0]:
                    best = (key, (v * unit, r, f))
        return None if best is None else best[1]

    n_units = columns // unit
    tile = best_tile([(v, 1) for v in range(1, n_units + 1) if n_units % v == 0])
    if tile is not None and tile[0] == unit and partner:
        tile = best_tile([(1, f) for f in (1, 2, 4) if partner % f == 0])
    return tile


def reads_by_column(stmt, n_spatial: int) -> tuple[list, list]:
    """A column reduction's reads (of at least one dim) along its columns (the last index runs
    with the innermost output axis) and across them (no index does: the row side, broadcast)."""
    column = stmt.iter_vars[n_spatial - 1].var
    reads = [r for r in stmt.reads if r.region]
    return [r for r in reads if uses(r.region[-1].min, column)], [r for r in reads if not depends_on(r, column)]


def reused_row_axis(sch: s_tir.Schedule, block, n_spatial: int, tile: int) -> int | None:
    """For a column reduction: the innermost other output axis (static, a multiple of ``tile``)
    that some read along the columns does not depend on, so that a tile of rows can share its
    loads; None when there is none (e.g. a plain sum over leading axes)."""
    stmt = sch.get(block)
    along, _ = reads_by_column(stmt, n_spatial)
    for axis in reversed(range(n_spatial - 1)):
        extent = static_int(stmt.iter_vars[axis].dom.extent)
        if extent is None or extent % tile or extent == tile:
            continue
        if any(not depends_on(r, stmt.iter_vars[axis].var) for r in along):
            return axis
    return None


def column_partner_axis(sch: s_tir.Schedule, block, n_spatial: int, tiled: int) -> int | None:
    """For a register-blocked product: the innermost other output axis (static) that the reads
    along the columns depend on and the others (the row side's, broadcast) do not, so that the
    tile may take several of its indices with each broadcast (conv2d dx: dy_pad's rows, not w's);
    None when there is none."""
    stmt = sch.get(block)
    # (The accumulator, read along the columns, depends on every output axis: it changes nothing.)
    along, broadcast = reads_by_column(stmt, n_spatial)
    for axis in reversed(range(n_spatial - 1)):
        var = stmt.iter_vars[axis].var
        if axis == tiled or static_int(stmt.iter_vars[axis].dom.extent) is None:
            continue
        if broadcast and all(depends_on(r, var) for r in along) and not any(depends_on(r, var) for r in broadcast):
            return axis
    return None


def reduction_blocking(sch: s_tir.Schedule, row_loop, tile_rows: int, reduction_loop,
                        parallel_work: float, min_parallel: int) -> tuple[int, int] | None:
    """(tiles per group, reduction block) for a register-blocked tile over ``row_loop``: groups
    of up to ``TILE_GROUP`` tiles and blocks of ``REDUCTION_BLOCK`` steps of the outer reduction
    loop, where both extents are static and divide, and the parallel loop keeps at least
    ``min_parallel`` iterations (``parallel_work`` of them without groups); None otherwise."""
    rows, steps = static_int(sch.get(row_loop).extent), static_int(sch.get(reduction_loop).extent)
    if rows is None or steps is None or steps % REDUCTION_BLOCK or steps == REDUCTION_BLOCK:
        return None
    group = next((g for g in (TILE_GROUP, TILE_GROUP // 2, TILE_GROUP // 4)
                  if rows % (g * tile_rows) == 0 and parallel_work / g >= min_parallel), None)
    return None if group is None or group == 1 else (group, REDUCTION_BLOCK)


def schedule_column_reduction(sch, block, lead, reduction_loops, lanes: int, cores: int,
                               registers: int) -> tuple:
    """out[..., j] = sum_r f(in[r, ..., j]) (gamma/beta gradients, sums over leading axes): the
    columns are split into chunks of whole vectors; each thread takes whole chunks and walks all
    the rows, so every read is a contiguous vector and no two threads write the same output.
    (A serial loop per column reads one element per row: a cache line per add.)

    When some read along the columns does not depend on another output axis (a matrix
    product's right operand, reused by every row of the left), ``ROW_TILE`` rows of that axis
    share each vector load: the tile of accumulators is a local buffer that LLVM keeps in
    registers across the reduction, a register-blocked GEMM micro-kernel.

    Returns the parallel loop and the block that writes a tile's accumulators back (None without
    a tile): where an epilogue may be computed a tile at a time."""
    columns = static_int(sch.get(lead[-1]).extent)
    tiled = reused_row_axis(sch, block, len(lead), ROW_TILE)
    partner = None if tiled is None else column_partner_axis(sch, block, len(lead), tiled)
    tile = None if tiled is None or columns is None else \
        product_tile(columns, static_int(sch.get(lead[tiled]).extent), lanes, registers,
                     None if partner is None else static_int(sch.get(lead[partner]).extent))
    if columns is None or (columns % lanes and tile is None):
        return parallel(sch, lead), None
    # Up to 4 vectors per chunk, but at least two chunks where the columns allow (two threads).
    width = next((lanes * k for k in (4, 2) if columns % (lanes * k) == 0 and columns // (lanes * k) >= 2), lanes)
    if tile is not None:  # the other output axes give the threads their work: whole rows
        width, tile_rows, partners = tile
    accumulate = sch.cache_write(block, 0, "local") if tile is not None else None
    chunks, vec = sch.split(lead[-1], factors=[None, width])
    outer, inner = list(lead[:-1]), []
    if tile is not None:
        parallel_work = static_product(sch, [*outer, chunks]) / tile_rows
        blocked = reduction_blocking(sch, lead[tiled], tile_rows, reduction_loops[0], parallel_work,
                                      TILES_PER_CORE * cores)
        if blocked is None:
            rows, row = sch.split(lead[tiled], factors=[None, tile_rows])
        else:
            # Cache blocking: a block of the outer reduction loop at a time, for a group of
            # tiles of rows in turn, so that the loads shared by the rows (conv2d dx's dy
            # rows) are reused from the L1 cache by every tile of the group, where each tile
            # walked the whole reduction alone and read them from L2 again (conv2d dx at N8
            # C64 56x56, with the padding change below: 13.7 -> 9.2 ms, faster than its
            # tuned record).
            group_size, steps = blocked
            rows, group, row = sch.split(lead[tiled], factors=[None, group_size, tile_rows])
            k_outer, k_inner = sch.split(reduction_loops[0], factors=[None, steps])
            reduction_loops = [k_outer, group, k_inner, *reduction_loops[1:]]
        outer[tiled], inner = rows, [row]
        if partners > 1:
            # One-register rows (conv2d dx's 56 columns on AVX2: 7 vectors, none of which
            # pairs up) take a few indices of the partner axis as well, sharing the row
            # side's broadcasts: conv2d dx at N8 C64 56x56 on AVX2, 4 channels x 2 output
            # rows of one vector against 8 channels of one, 26.2 -> 23.5 ms (one thread,
            # interleaved).
            outer[partner], partner_loop = sch.split(lead[partner], factors=[None, partners])
            inner.append(partner_loop)
    sch.reorder(*outer, chunks, *reduction_loops, *inner, vec)
    # Loop kinds first: once the init is split off, the update is no longer the only writer.
    unit = lanes if width % lanes == 0 else lanes // 2
    if (width // unit) & (width // unit - 1):  # e.g. 7 registers: LLVM splits a 56-lane op poorly
        per_register, vec = sch.split(vec, factors=[None, unit])
        sch.unroll(per_register)
    sch.vectorize(vec)
    for loop in inner:
        sch.unroll(loop)
    tile_loop = parallel(sch, [*outer, chunks])
    if accumulate is not None:
        sch.reverse_compute_at(accumulate, tile_loop)
        sch.vectorize(sch.get_loops(accumulate)[-1])
    init = sch.decompose_reduction(block, reduction_loops[0])
    sch.vectorize(sch.get_loops(init)[-1])
    return tile_loop, accumulate
