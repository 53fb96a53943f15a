"""Row kernels: a kernel of row statistics and stages that read them per row (norm and softmax-CE
backward, softmax, norm forwards) runs all its stages in one parallel loop over the rows, so that
a row is read from memory once and its later passes hit the cache."""

from __future__ import annotations

from math import prod

from tvm import s_tir, tirx
from tvm.s_tir.dlight.cpu.base import CPUScheduleRule
from tvm.sym import Analyzer
from tvm.target import Target

from ...ops.registry import static_int
from ..common import fuse_loops, inlined_blocks, uses, vector_lanes
from ..prefetch import ANNOTATION as PREFETCH_NEXT_ROW
from .analysis import (SMALL_WINDOW, block_domain, is_row_reduction, n_spatial, parallel, product, reduced_size,
                       vector_width, work)
from .product import is_product


class RowKernel(CPUScheduleRule):
    """A kernel of several blocks (after inlining) whose stages all run over the rows of its last
    stage (:func:`fuse_rows`), or over the rows and chunks of rows of several outputs
    (:func:`merge_row_stages`); declines every other kernel."""

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        found = inlined_blocks(self, func, target)
        if found is None or len(found[1]) < 2:
            return None
        sch, blocks = found
        if any(is_product(sch, info.block_rv) for info in blocks):
            return None  # a matrix product's or convolution's outputs are no rows of statistics
        lanes = vector_lanes(target)
        return fuse_rows(sch.copy(), blocks, lanes) or merge_row_stages(sch.copy(), blocks, lanes)


def fuse_rows(sch: s_tir.Schedule, blocks: list, lanes: int) -> s_tir.Schedule | None:
    """Multi-stage row kernels (norm backward: mean, variance, rstd, two more sums, then dx;
    softmax-CE: max, sum, then the gradient): every stage computed inside one parallel loop
    over the rows of the last stage, so that a row is read from memory once and its later
    passes hit the cache (a pass of its own per stage streams the whole tensor each time).

    Applied only when every earlier stage lands in the row loop without recomputation (its
    work under the loop equals its own domain, proven for symbolic row counts too: until
    2026-12-05 a symbolic batch left softmax-CE backward as four passes over memory, 11.0 vs
    6.5 ms at 2048 x 8192); None otherwise (``sch`` is then a spoiled copy, to be dropped)."""
    out = blocks[-1].block_rv
    producers = [info.block_rv for info in blocks[:-1]]
    # Only for stages that re-read long rows; small windows (pooling) are not row kernels.
    reduced = [reduced_size(sch, p) for p in producers]
    if not any(n is not None and n >= 16 * lanes for n in reduced) \
            or any(n is not None and 0 < n <= SMALL_WINDOW for n in reduced):
        return None
    plan = _row_axis(sch, out, producers)
    if plan is None:
        return None
    axis, group = plan
    try:
        # rfactor first: it takes only a block that is alone in its loop nest.
        partials = {}
        for block in [*producers, out]:
            partial = _vector_partial_sums(sch, block, lanes)
            if partial is not None:
                partials[block] = partial
        loops = sch.get_loops(out)
        row = loops[axis]
        if group > 1:
            if (static_int(sch.get(row).extent) or 1) % group:
                return None
            row, _ = sch.split(row, factors=[None, group])
        stages = []  # in program order: each producer after its partial sums
        for block in [*producers, out]:
            if block in partials:
                stages.append(partials[block][0])
            if block is not out:
                stages.append(block)
        sizes = [block_domain(sch, st) for st in stages]
        for stage in reversed(stages):
            sch.compute_at(stage, row)
        analyzer = Analyzer()
        if not all(analyzer.can_prove_equal(work(sch, st), size) for st, size in zip(stages, sizes)):
            return None  # some stage would be recomputed per row
        fused = parallel(sch, [*loops[:axis], row])
        if axis == 0 and group == 1:  # the row loop is the kernel's outermost: see prefetch.py
            sch.annotate(fused, PREFETCH_NEXT_ROW, 1)
        depth = 1  # the fused row loop
        for partial, chains, width in partials.values():
            # Regenerated in block-var order, rfactor's lane axis first (unit loops dropped).
            lane_loop, *rest = sch.get_loops(partial)[depth:]
            sch.reorder(*rest, lane_loop)
            fused_sum = _sum_where_produced(sch.copy(), partial, depth)
            if fused_sum is not None:
                sch, lane_loop = fused_sum
            _partial_sums_in_registers(sch, partial, lane_loop, chains, width)
        for stage in [*producers, out]:  # the last stage and kept elementwise ones
            _vectorize_inner(sch, stage, depth, lanes)
    except s_tir.ScheduleError:
        return None
    return sch


def merge_row_stages(sch: s_tir.Schedule, blocks: list, lanes: int) -> s_tir.Schedule | None:
    """A row kernel (as in :func:`fuse_rows`) with more than one output: the gradients of one
    norm computed together (statistics, dx, and dgamma / dbeta as partial sums per chunk of
    rows, or per sample and channel for group norm). Its outputs rule out ``compute_at``, so
    every stage's loop over the rows (group norm: over (n, group), the channel loop split by
    the group size) is cut into the chunks of the partial sums and all are merged (``merge``)
    into one parallel loop over the chunks around one loop over a chunk's rows: per row the
    statistics, dx and the partial sums run back to back while the row is in cache, and x and
    dy are read from memory once.

    ``merge`` does not check what the stages read. Applied only when every stage is such a row
    stage and reads the others' results only as one value per row, at its own row
    (``_reads_only_own_row``); None otherwise (``sch`` is then a spoiled copy)."""
    first = sch.get(blocks[0].block_rv)
    if not first.writes:  # e.g. a sort's extern stage
        return None
    n_row = len(_row_region(first.writes[0]))
    if n_row == 0 or len(first.iter_vars) < n_row:
        return None
    row_extents = [iv.dom.extent for iv in first.iter_vars[:n_row]]
    n_rows = product(row_extents)
    # The first stage is a row statistic over a long row (not a pooling window).
    if (reduced_size(sch, blocks[0].block_rv) or 0) <= SMALL_WINDOW:
        return None
    analyzer = Analyzer()
    stages, chunk_sums, chunks = [], [], None  # (block, group); blocks
    row_buffers, written = [], []  # outputs of the stages: one value per row; all
    for info in blocks:
        block, stmt = info.block_rv, sch.get(info.block_rv)
        ivs = stmt.iter_vars
        group = _row_group(stmt, row_extents)
        if group is not None:
            row = [iv.var for iv in ivs[:n_row]]
            expected = [*row[:-1], row[-1] // group if group > 1 else row[-1]]
            stages.append((block, group))
        elif n_row == 1 and [iv.iter_type for iv in ivs] == [tirx.IterVar.DataPar] * 2 + [tirx.IterVar.CommReduce]:
            # a sum per chunk of rows: [chunk, column], over the chunk's ceil(rows / chunks)
            # rows (a short last chunk guards its reads itself, see norm.py's chunk_sums)
            count, per = static_int(ivs[0].dom.extent), ivs[2].dom.extent
            if count is None or chunks not in (None, count) or not analyzer.can_prove_equal(
                    per, tirx.floordiv(n_rows + count - 1, count)):
                return None
            chunks = count
            expected = [ivs[0].var * per + ivs[2].var]
            chunk_sums.append(block)
        else:
            return None
        if not _reads_only_own_row(stmt, expected, row_buffers, written):
            return None
        if len(_row_region(stmt.writes[0])) == n_row and group is not None:
            row_buffers.append((stmt.writes[0].source, group))
        written.append(stmt.writes[0].source)
    if len(stages) < 2:
        return None
    # The elementwise stage (dx) is the one to vectorize: a row statistic has as large a
    # domain (rows x reduced row) and comes first.
    elementwise = [b for b, _ in stages if reduced_size(sch, b) == 0]
    per_row = {b: static_int(analyzer.simplify(tirx.floordiv(block_domain(sch, b), n_rows))) for b, _ in stages}
    out = max(elementwise or [b for b, _ in stages], key=lambda b: per_row[b] or 0)
    try:
        partials = {}
        for block, _ in stages:
            partial = _vector_partial_sums(sch, block, lanes)
            if partial is not None:
                partials[block] = partial
        row_stages = []  # in program order; each row stage after its lane partial sums
        for block, group in stages:
            if block in partials:
                row_stages.append((partials[block][0], group))
            row_stages.append((block, group))
        chunk_loops = []
        for stage, group in row_stages:  # the row loops, fused into one, split into chunks
            loops = sch.get_loops(stage)[:n_row]
            if group > 1:
                loops[-1], _ = sch.split(loops[-1], factors=[None, group])
            row = fuse_loops(sch, loops)
            # without chunk sums every row is a chunk (a unit loop over its rows)
            chunk_loops.append(sch.split(row, factors=[chunks, None] if chunks else [None, 1])[0])
        for block in chunk_sums:  # (chunk, column, row in chunk) -> (chunk, row in chunk, column)
            chunk, column, row = sch.get_loops(block)
            sch.reorder(row, column)
            chunk_loops.append(chunk)
        everything = [*(st for st, _ in row_stages), *chunk_sums]
        chunk_loop = sch.merge(*chunk_loops)
        sch.merge(*[sch.get_loops(st)[1] for st in everything])
        sch.parallel(chunk_loop)
        depth = 2  # the chunk and row-in-chunk loops
        for partial, chains, width in partials.values():
            # Not moved by compute_at: rfactor left the loops as they were, the lanes innermost.
            _partial_sums_in_registers(sch, partial, sch.get_loops(partial)[-1], chains, width)
        _vectorize_inner(sch, out, depth, lanes)
        for block in chunk_sums:
            _vectorize_column_partial(sch, block, depth, lanes)
        _merge_independent_passes(sch, sch.get_loops(out)[depth - 1], depth)
        # rows are chunk * rows per chunk + row in chunk: the two loops (prefetch.py)
        sch.annotate(sch.get_loops(out)[depth - 1], PREFETCH_NEXT_ROW, 2)
    except s_tir.ScheduleError:
        return None
    return sch


def _vectorize_column_partial(sch: s_tir.Schedule, block, depth: int, lanes: int) -> None:
    """A chunk's partial column sums under ``depth`` row loops: the columns in vectors (the
    initialization split off at the chunk loop, before the rows)."""
    (column,) = sch.get_loops(block)[depth:]
    width = vector_width(static_int(sch.get(column).extent), lanes)
    if width is not None:
        sch.vectorize(sch.split(column, factors=[None, width])[1])
    init = sch.decompose_reduction(block, sch.get_loops(block)[1])
    if width is not None:
        sch.vectorize(sch.get_loops(init)[-1])


def _vector_partial_sums(sch: s_tir.Schedule, block, lanes: int) -> tuple | None:
    """For a reduction over a contiguous innermost axis: split it into vectors and ``rfactor``
    the lanes out, as ``chains`` independent vector accumulators for a long reduction (one
    accumulator is a chain of dependent adds, one add latency per vector). Returns the
    partial-sum block, the number of chains and the vector width; None (nothing changed) for
    other blocks."""
    stmt = sch.get(block)
    n_lead = n_spatial(sch, block)
    loops = sch.get_loops(block)
    if n_lead == len(stmt.iter_vars) or len(loops) != len(stmt.iter_vars) \
            or not is_row_reduction(sch, block, n_lead):
        return None
    extents = [static_int(sch.get(loop).extent) for loop in loops[n_lead:]]
    if None in extents or prod(extents) < 16 * lanes:
        return None
    loops = [*loops[:n_lead], *_fuse_contiguous_tail(sch, block, loops[n_lead:], lanes)]
    extents = [static_int(sch.get(loop).extent) for loop in loops[n_lead:]]
    width = vector_width(extents[-1], lanes)
    if width is None:
        return None
    rows, vec = sch.split(loops[-1], factors=[None, width])
    outside = [*loops[n_lead:-1], rows]  # the reduction loops around the vector
    steps = prod(extents) // width
    # More chains cost as many more scalar adds when the lanes are summed: worth it only for
    # rows much longer than the accumulators (group norm's 6272, not layer norm's 768).
    chains = next((c for c in (4, 2) if steps >= 4 * c * width
                   and any((static_int(sch.get(lp).extent) or 0) % c == 0 for lp in outside)), 1)
    if chains > 1:
        k = max(i for i, lp in enumerate(outside) if static_int(sch.get(lp).extent) % chains == 0)
        _, chain = sch.split(outside[k], factors=[None, chains])
        sch.reorder(*outside[k + 1:], chain, vec)
        vec = sch.fuse(chain, vec)
    return sch.rfactor(vec, factor_axis=len(stmt.writes[0].region)), chains, width


def _vectorize_inner(sch: s_tir.Schedule, block, depth: int, lanes: int) -> None:
    """An elementwise stage under ``depth`` row loops: its innermost loop in vectors."""
    loops = sch.get_loops(block)[depth:]
    stmt = sch.get(block)
    if not loops or n_spatial(sch, block) != len(stmt.iter_vars) or not isinstance(stmt.body, tirx.BufferStore):
        return
    loops = _fuse_contiguous_tail(sch, block, loops, lanes)
    width = vector_width(static_int(sch.get(loops[-1]).extent), lanes)
    if width is not None:
        sch.vectorize(sch.split(loops[-1], factors=[None, width])[1])


def _merge_independent_passes(sch: s_tir.Schedule, row_loop, depth: int) -> None:
    """Under the loop over a kernel's rows: passes over a row with the same loop nest (extents from
    ``depth`` down) that do not touch what each other writes run as one loop nest (``merge``, each
    serial level), so that an element is loaded once for all of them: layer norm's two sums after
    its statistics, and dx with the partial sums of dgamma and dbeta (layer norm backward 3.1 ->
    2.2 ms at 8192 x 768).

    ``merge`` puts the merged loop where the last one was: a pass joins the nearest earlier one
    with its nest only when that one may move down past every pass between them."""
    while True:
        passes = _passes(sch, row_loop, depth)
        for j, (nest, blocks) in enumerate(passes):
            i = next((i for i in range(j - 1, -1, -1) if passes[i][0] == nest), None) if nest else None
            if i is None:
                continue
            moving = passes[i][1]
            first, last = moving[0], blocks[0]
            if any(sch.get(sch.get_loops(b)[depth]).kind != tirx.ForKind.SERIAL for b in (first, last)):
                continue  # nothing would merge (an unrolled or vector outer loop): not a pair to retry
            if all(_independent(sch, moving, b) for _, between in passes[i + 1:j + 1] for b in between):
                for level in range(depth, depth + len(nest)):
                    loops = [sch.get_loops(first)[level], sch.get_loops(last)[level]]
                    if any(sch.get(lp).kind != tirx.ForKind.SERIAL for lp in loops):
                        break  # vector and unrolled loops stay apart, side by side
                    sch.merge(*loops)
                break
        else:
            return


def _passes(sch: s_tir.Schedule, row_loop, depth: int) -> list:
    """The passes under ``row_loop`` in program order: (extents of the loop nest from ``depth``
    down, blocks); an empty nest for a block with no loop there (a per-row scalar)."""
    passes, last = [], None
    for block in sch.get_child_blocks(row_loop):
        loops = sch.get_loops(block)[depth:]
        if loops and last is not None and sch.get(last).same_as(sch.get(loops[0])):
            passes[-1][1].append(block)  # a block in the same pass (an initialization)
            continue
        passes.append(([static_int(sch.get(lp).extent) for lp in loops] if loops else [], [block]))
        last = loops[0] if loops else None
    return passes


def _independent(sch: s_tir.Schedule, blocks: list, block) -> bool:
    """``block`` neither reads nor writes what ``blocks`` write, nor writes what they read."""
    written = [w.source for b in blocks for w in sch.get(b).writes]
    read = [r.source for b in blocks for r in sch.get(b).reads]
    mine_written = [w.source for w in sch.get(block).writes]
    mine = [r.source for r in sch.get(block).reads] + mine_written
    return not any(x.same_as(w) for x in mine for w in written) and \
        not any(w.same_as(r) for w in mine_written for r in read)


def _sum_where_produced(sch: s_tir.Schedule, partial, depth: int) -> tuple | None:
    """The partial sums of an elementwise stage of the row (softmax-CE's ``exp(z - max)``, kept for
    the gradient) computed in the stage's own loop, a chunk of vectors at a time, instead of a
    pass of their own that reads the row back (softmax-CE backward, one thread, rows in cache: 4.8
    -> 4.4 us per row of 8192 before its label compare changed, 3.9 -> 3.8 after). Returns
    ``(sch, lane loop)``, or None where the partial sums do not read exactly one such stage along
    their one reduction loop (``sch`` is then a spoiled copy)."""
    *rest, lane_loop = sch.get_loops(partial)[depth:]
    producers = sch.get_producers(partial)
    if len(rest) != 1 or len(producers) != 1:
        return None
    stage = producers[0]
    stmt = sch.get(stage)
    stage_loops = sch.get_loops(stage)[depth:]
    chunks = static_int(sch.get(rest[0]).extent)
    if len(stage_loops) != 1 or n_spatial(sch, stage) != len(stmt.iter_vars) \
            or not isinstance(stmt.body, tirx.BufferStore) or chunks is None \
            or static_int(sch.get(stage_loops[0]).extent) != chunks * static_int(sch.get(lane_loop).extent):
        return None
    try:
        chunk, _ = sch.split(stage_loops[0], factors=[chunks, None])
        sch.reverse_compute_at(partial, chunk)
    except s_tir.ScheduleError:
        return None
    loops = sch.get_loops(partial)[depth:]
    if len(loops) != 2:  # the chunk loop and one loop over its lanes: nothing recomputed
        return None
    return sch, loops[1]


def _partial_sums_in_registers(sch: s_tir.Schedule, partial, lane_loop, chains: int, width: int) -> None:
    """A row's partial sums (``_vector_partial_sums``) in a local buffer, its lane loop as
    ``chains`` unrolled vectors: LLVM keeps them in registers (in the global scratch buffer every
    add is a store and a reload)."""
    sch.set_scope(partial, 0, "local")
    chain, vec = sch.split(lane_loop, factors=[chains, width])
    sch.unroll(chain)
    sch.vectorize(vec)


def _fuse_contiguous_tail(sch: s_tir.Schedule, block, loops: list, lanes: int) -> list:
    """A block's innermost ``loops`` with the last two fused into one when the last does not hold
    whole vectors of ``lanes`` but the two together run contiguously through every buffer the
    block touches: each access indexes its buffer's last two dims with the block's last two
    iterators (the loops' own, untransformed), the last of full extent, or does not depend on
    them (a per-row value). Group norm's 56 x 56 planes then run as 196 vectors of 16 instead of
    56 rows of 7 vectors of 8."""
    if len(loops) < 2:
        return loops
    extents = [static_int(sch.get(lp).extent) for lp in loops[-2:]]
    stmt = sch.get(block)
    ivs = stmt.iter_vars[-2:]
    if None in extents or extents[1] % lanes == 0 or len(stmt.iter_vars) < 2 \
            or [static_int(iv.dom.extent) for iv in ivs] != extents:
        return loops
    for access in (*stmt.reads, *stmt.writes):
        region, shape = access.region, access.source.shape
        if not any(uses(r.min, iv.var) for r in region for iv in ivs):
            continue  # a value per row (statistics, gamma): the same along the fused loop
        if len(region) < 2 or static_int(shape[-1]) != extents[1] or any(
                not r.min.same_as(iv.var) or static_int(r.extent) != 1 for r, iv in zip(region[-2:], ivs)) \
                or any(uses(r.min, iv.var) for r in region[:-2] for iv in ivs):
            return loops
    return [*loops[:-2], sch.fuse(*loops[-2:])]


def _row_group(stmt, row_extents: list) -> int | None:
    """For a block whose leading spatial axes run over the rows of a row kernel (extents
    ``row_extents``, e.g. [N, G], static or symbolic): how many of its last such index fall in one
    row (group norm's channels per group for a [N, C, ...] block, 1 for a [N, G] one); None when it
    has no such axes."""
    n_row = len(row_extents)
    ivs = stmt.iter_vars[:n_row]
    if len(ivs) < n_row or any(iv.iter_type != tirx.IterVar.DataPar for iv in ivs):
        return None
    analyzer = Analyzer()
    extents = [iv.dom.extent for iv in ivs]
    if not all(analyzer.can_prove_equal(e, r) for e, r in zip(extents[:-1], row_extents[:-1])):
        return None
    last, row = static_int(extents[-1]), static_int(row_extents[-1])
    if last is not None and row is not None:
        return None if last % row else last // row
    return 1 if analyzer.can_prove_equal(extents[-1], row_extents[-1]) else None


def _row_region(access) -> list:
    """The region of a buffer access without the buffer's unit dims (a batch of 1: the blocks'
    iterators, normalized, have none for it)."""
    return [r for r, n in zip(access.region, access.source.shape) if static_int(n) != 1]


def _reads_only_own_row(stmt, expected: list, row_buffers: list, written: list) -> bool:
    """Every read of a per-row result (``row_buffers``: (buffer, k), k values per row, e.g. group
    norm's per-channel sums) is one element of the row at the ``expected`` index (any of its k
    values); nothing else another stage writes (``written``) is read."""
    analyzer = Analyzer()
    for iv in stmt.iter_vars:
        analyzer.bind(iv.var, iv.dom)
    for read in stmt.reads:
        k = next((k for b, k in row_buffers if read.source.same_as(b)), None)
        if k is not None:
            region = _row_region(read)
            if len(region) != len(expected) or any(static_int(r.extent) != 1 for r in region) or not all(
                    analyzer.can_prove_equal(r.min, e) for r, e in zip(region[:-1], expected[:-1])) \
                    or not analyzer.can_prove_equal(tirx.floordiv(region[-1].min, k), expected[-1]):
                return False
        elif any(read.source.same_as(b) for b in written):
            return False
    return True


def _row_axis(sch: s_tir.Schedule, out, producers: list) -> tuple[int, int] | None:
    """Where the earlier stages' rows sit in the last stage ``out``: ``(axis, group)`` such that
    every read of a producer's output indexes it with ``out``'s spatial loop ``axis`` (or
    ``axis // group``, e.g. group norm's channel group ``c // (C/G)``) and outer ones; None when
    the reads do not name a row."""
    stmt = sch.get(out)
    if any(iv.iter_type not in (tirx.IterVar.DataPar, tirx.IterVar.CommReduce) for iv in stmt.iter_vars):
        return None
    spatial = [iv.var for iv in stmt.iter_vars if iv.iter_type == tirx.IterVar.DataPar]
    written = {sch.get(p).writes[0].source for p in producers if len(sch.get(p).writes) == 1}
    if len(written) != len(producers):
        return None
    deepest, group = -1, 1
    for read in stmt.reads:
        if not any(read.source.same_as(b) for b in written):
            continue
        if len(read.region) == len(spatial) and all(r.min.same_as(v) for r, v in zip(read.region, spatial)):
            continue  # an elementwise stage (softmax-CE's exp): read where it is written, no row of its own
        for rng in read.region:
            index = rng.min
            if isinstance(index, tirx.FloorDiv) and isinstance(index.b, tirx.IntImm):
                index, div = index.a, index.b.value
            else:
                div = 1
            axis = next((k for k, v in enumerate(spatial) if v.same_as(index)), None)
            if axis is None:
                if any(uses(rng.min, v) for v in spatial):
                    return None  # an index mixing output axes: no row of its own
                continue
            if axis > deepest:
                deepest, group = axis, div
            elif axis == deepest and div != group:
                return None
    return None if deepest < 0 else (deepest, group)
