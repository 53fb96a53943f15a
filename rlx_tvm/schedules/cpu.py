"""Default CPU schedules for kernels that have no tuning record.

TVM 0.27's CPU pipeline schedules nothing: every kernel runs as serial loops. ``default_cpu_rules``
is the rule list for ``dlight.ApplyDefaultSchedule``: dlight's GEMV rule where it fits and
:class:`ParallelFallback` for everything else (elementwise kernels, row reductions of norms and
softmax-CE, column reductions such as gamma/beta gradients, the gather formulations of
pooling/scatter backward, multi-stage fused kernels).
"""

from __future__ import annotations

from math import prod

import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.cpu.base import CPUScheduleRule
from tvm.sym import Analyzer
from tvm.target import Target

from ..ops.registry import static_int
from .common import (fuse_loops, inlined_blocks, is_column_reduction, target_cores, uses, vector_lanes,
                     vector_registers)
from .prefetch import ANNOTATION as PREFETCH_NEXT_ROW

__all__ = ["GEMV", "ParallelFallback", "default_cpu_rules"]


class ParallelFallback(CPUScheduleRule):
    """Any kernel: inline injective stages; a kernel of row statistics and a last stage that
    reads them per row (norm and softmax-CE backward) runs all its stages in one parallel loop over
    the rows; otherwise per remaining block parallelize the fused leading spatial loops and
    vectorize: a static innermost spatial loop; a long contiguous row reduction (as ``lanes``
    partial sums); a column reduction (along its columns); a reduction over a whole tensor (in
    parts, one per parallel iteration, whose results one serial loop combines).

    Every output element is written by one thread only (a reduction is split across the parallel
    loop only into parts of a buffer of their own): race-free by construction, also for the
    gather-style scatter kernels.
    """

    def __init__(self, min_parallel_extent: int = 2):
        self.min_parallel_extent = min_parallel_extent

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        found = inlined_blocks(self, func, target)
        if found is None:
            return None
        sch, blocks = found
        lanes, registers = vector_lanes(target), vector_registers(target)
        if len(blocks) > 1:
            fused = self._fuse_rows(sch.copy(), blocks, lanes) or self._merge_row_stages(sch.copy(), blocks, lanes)
            if fused is not None:
                return fused
        for info in blocks:
            self._schedule_block(sch, info, lanes, target_cores(target), registers)
        return sch

    def _fuse_rows(self, sch: s_tir.Schedule, blocks: list, lanes: int) -> s_tir.Schedule | None:
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
        reduced = [_reduced_size(sch, p) for p in producers]
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
                partial = self._vector_partial_sums(sch, block, lanes)
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
            sizes = [_block_domain(sch, st) for st in stages]
            for stage in reversed(stages):
                sch.compute_at(stage, row)
            analyzer = Analyzer()
            if not all(analyzer.can_prove_equal(_work(sch, st), size) for st, size in zip(stages, sizes)):
                return None  # some stage would be recomputed per row
            fused = self._parallel(sch, [*loops[:axis], row])
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
                self._vectorize_inner(sch, stage, depth, lanes)
        except s_tir.ScheduleError:
            return None
        return sch

    def _merge_row_stages(self, sch: s_tir.Schedule, blocks: list, lanes: int) -> s_tir.Schedule | None:
        """A row kernel (as in :meth:`_fuse_rows`) with more than one output: the gradients of one
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
        n_rows = _product(row_extents)
        # The first stage is a row statistic over a long row (not a pooling window).
        if (_reduced_size(sch, blocks[0].block_rv) or 0) <= SMALL_WINDOW:
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
        elementwise = [b for b, _ in stages if _reduced_size(sch, b) == 0]
        per_row = {b: static_int(analyzer.simplify(tirx.floordiv(_block_domain(sch, b), n_rows))) for b, _ in stages}
        out = max(elementwise or [b for b, _ in stages], key=lambda b: per_row[b] or 0)
        try:
            partials = {}
            for block, _ in stages:
                partial = self._vector_partial_sums(sch, block, lanes)
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
            self._vectorize_inner(sch, out, depth, lanes)
            for block in chunk_sums:
                self._vectorize_column_partial(sch, block, depth, lanes)
            _merge_independent_passes(sch, sch.get_loops(out)[depth - 1], depth)
            # rows are chunk * rows per chunk + row in chunk: the two loops (prefetch.py)
            sch.annotate(sch.get_loops(out)[depth - 1], PREFETCH_NEXT_ROW, 2)
        except s_tir.ScheduleError:
            return None
        return sch

    def _vectorize_column_partial(self, sch: s_tir.Schedule, block, depth: int, lanes: int) -> None:
        """A chunk's partial column sums under ``depth`` row loops: the columns in vectors (the
        initialization split off at the chunk loop, before the rows)."""
        (column,) = sch.get_loops(block)[depth:]
        width = _vector_width(static_int(sch.get(column).extent), lanes)
        if width is not None:
            sch.vectorize(sch.split(column, factors=[None, width])[1])
        init = sch.decompose_reduction(block, sch.get_loops(block)[1])
        if width is not None:
            sch.vectorize(sch.get_loops(init)[-1])

    def _vector_partial_sums(self, sch: s_tir.Schedule, block, lanes: int) -> tuple | None:
        """For a reduction over a contiguous innermost axis: split it into vectors and ``rfactor``
        the lanes out, as ``chains`` independent vector accumulators for a long reduction (one
        accumulator is a chain of dependent adds, one add latency per vector). Returns the
        partial-sum block, the number of chains and the vector width; None (nothing changed) for
        other blocks."""
        stmt = sch.get(block)
        n_spatial = _n_spatial(sch, block)
        loops = sch.get_loops(block)
        if n_spatial == len(stmt.iter_vars) or len(loops) != len(stmt.iter_vars) \
                or not _is_row_reduction(sch, block, n_spatial):
            return None
        extents = [static_int(sch.get(loop).extent) for loop in loops[n_spatial:]]
        if None in extents or prod(extents) < 16 * lanes:
            return None
        loops = [*loops[:n_spatial], *_fuse_contiguous_tail(sch, block, loops[n_spatial:], lanes)]
        extents = [static_int(sch.get(loop).extent) for loop in loops[n_spatial:]]
        width = _vector_width(extents[-1], lanes)
        if width is None:
            return None
        rows, vec = sch.split(loops[-1], factors=[None, width])
        outside = [*loops[n_spatial:-1], rows]  # the reduction loops around the vector
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

    def _vectorize_inner(self, sch: s_tir.Schedule, block, depth: int, lanes: int) -> None:
        """An elementwise stage under ``depth`` row loops: its innermost loop in vectors."""
        loops = sch.get_loops(block)[depth:]
        stmt = sch.get(block)
        if not loops or _n_spatial(sch, block) != len(stmt.iter_vars) or not isinstance(stmt.body, tirx.BufferStore):
            return
        loops = _fuse_contiguous_tail(sch, block, loops, lanes)
        width = _vector_width(static_int(sch.get(loops[-1]).extent), lanes)
        if width is not None:
            sch.vectorize(sch.split(loops[-1], factors=[None, width])[1])

    def _window_width(self, sch, info, lanes: int) -> int | None:
        """For a reduction over a small window (pooling: ``kh x kw`` taps) whose innermost output
        axis is static: the vector width to compute that axis with; None otherwise."""
        kinds = info.dom_kind()
        n_lead = len(kinds) - len(kinds.lstrip("S"))
        if n_lead == 0 or kinds[n_lead:] != "R" * (len(kinds) - n_lead) or n_lead == len(kinds):
            return None
        extents = [_iter_extent(it) for it in info.iters]
        if None in extents or prod(extents[n_lead:]) > SMALL_WINDOW:
            return None
        return _vector_width(extents[n_lead - 1], lanes)

    def _schedule_window(self, sch, block, lead, reduced, width: int):
        """out[..., j] = reduce over a small window of in[..., s*j + t] (pooling): chunks of
        ``width`` outputs along the innermost axis, each a vector accumulated over the taps (a
        serial loop per output is a few dependent scalar steps with a branch each)."""
        chunks, vec = sch.split(lead[-1], factors=[None, width])
        sch.reorder(*lead[:-1], chunks, *reduced, vec)
        sch.vectorize(vec)
        if lead[:-1]:
            self._parallel(sch, lead[:-1])
        else:
            sch.parallel(chunks)
        init = sch.decompose_reduction(block, reduced[0])
        sch.vectorize(sch.get_loops(init)[-1])

    def _schedule_block(self, sch: s_tir.Schedule, info, lanes: int, cores: int, registers: int) -> None:
        block = info.block_rv
        loops = sch.get_loops(block)
        kinds = info.dom_kind()
        n_lead = len(kinds) - len(kinds.lstrip("S"))
        if not loops or len(kinds) != len(loops) or n_lead == 0:
            return
        lead = list(loops[:n_lead])
        if kinds.strip("R") == "S" * n_lead:  # S...S R...R: a reduction
            if _static_product(sch, lead) == 1 and self._schedule_full_reduction(sch, block, lead, lanes, cores):
                return None
            if is_column_reduction(sch, block, n_lead):
                return self._schedule_column_reduction(sch, block, lead, list(loops[n_lead:]), lanes, cores,
                                                      registers)
            width = self._window_width(sch, info, lanes)
            if width is not None:
                return self._schedule_window(sch, block, lead, list(loops[n_lead:]), width)
            if _is_row_reduction(sch, block, n_lead) and self._vectorize_row_reduction(sch, block, lead, lanes):
                return None
        # All spatial: vectorize the innermost loop when it splits evenly, unless the block body
        # holds loops of its own (a serial scan per row): those stay scalar under the parallel loop.
        if n_lead == len(loops) and isinstance(sch.get(block).body, tirx.BufferStore):
            inner_extent = static_int(sch.get(lead[-1]).extent) or 0
            width = _vector_width(inner_extent, lanes)
            if width is not None and inner_extent >= width:  # rows of 56: half vectors
                outer, vec = sch.split(lead[-1], factors=[None, width])
                sch.vectorize(vec)
                lead[-1] = outer
            elif len(lead) > 1 and inner_extent >= lanes // 2 and _static_product(sch, lead[:-1]) >= MIN_ROWS_PARALLEL:
                # Rows of no whole number of vectors (conv2d dx's padded 58-wide rows) stay a loop
                # of their own, which LLVM vectorizes with a remainder; fused into the parallel
                # loop, every element paid a division and a remainder per axis to find its indices
                # (conv2d dx at N8 C64 56x56: 25.1 -> 19.1 ms in one run at a busy hour).
                return self._parallel(sch, lead[:-1])
        self._parallel(sch, lead)

    def _schedule_column_reduction(self, sch, block, lead, reduction_loops, lanes: int, cores: int,
                                   registers: int) -> None:
        """out[..., j] = sum_r f(in[r, ..., j]) (gamma/beta gradients, sums over leading axes): the
        columns are split into chunks of whole vectors; each thread takes whole chunks and walks all
        the rows, so every read is a contiguous vector and no two threads write the same output.
        (A serial loop per column reads one element per row: a cache line per add.)

        When some read along the columns does not depend on another output axis (a matrix
        product's right operand, reused by every row of the left), ``ROW_TILE`` rows of that axis
        share each vector load: the tile of accumulators is a local buffer that LLVM keeps in
        registers across the reduction, a register-blocked GEMM micro-kernel."""
        columns = static_int(sch.get(lead[-1]).extent)
        tiled = _reused_row_axis(sch, block, len(lead), ROW_TILE)
        partner = None if tiled is None else _column_partner_axis(sch, block, len(lead), tiled)
        tile = None if tiled is None or columns is None else \
            product_tile(columns, static_int(sch.get(lead[tiled]).extent), lanes, registers,
                         None if partner is None else static_int(sch.get(lead[partner]).extent))
        if columns is None or (columns % lanes and tile is None):
            return self._parallel(sch, lead)
        # Up to 4 vectors per chunk, but at least two chunks where the columns allow (two threads).
        width = next((lanes * k for k in (4, 2) if columns % (lanes * k) == 0 and columns // (lanes * k) >= 2), lanes)
        if tile is not None:  # the other output axes give the threads their work: whole rows
            width, tile_rows, partners = tile
        accumulate = sch.cache_write(block, 0, "local") if tile is not None else None
        chunks, vec = sch.split(lead[-1], factors=[None, width])
        outer, inner = list(lead[:-1]), []
        if tile is not None:
            parallel_work = _static_product(sch, [*outer, chunks]) / tile_rows
            blocked = _reduction_blocking(sch, lead[tiled], tile_rows, reduction_loops[0], parallel_work,
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
        tile_loop = self._parallel(sch, [*outer, chunks])
        if accumulate is not None:
            sch.reverse_compute_at(accumulate, tile_loop)
            sch.vectorize(sch.get_loops(accumulate)[-1])
        init = sch.decompose_reduction(block, reduction_loops[0])
        sch.vectorize(sch.get_loops(init)[-1])

    def _schedule_full_reduction(self, sch, block, lead, lanes: int, cores: int) -> bool:
        """out[] = reduce over a whole tensor (fake-quantize's absmax): the elements are split into
        ``FULL_REDUCTION_PARTS`` parts per core (rfactor), each part reduced by one thread in
        vectors (as a row), then the parts in one short serial loop. Unscheduled, it was one serial
        scalar loop (fake-quantize backward's absmax at 8M elements on AVX2, one thread: 4.8 ->
        1.4 ms alone, the whole kernel 7.2 -> 5.5 ms; 2 threads, in two benchmark runs, 7.0 -> 4.4
        ms). False (nothing changed) for symbolic or small extents, or ones that no whole number of
        vectors per part divides."""
        reduced = sch.get_loops(block)[len(lead):]
        total = static_int(_product([sch.get(loop).extent for loop in reduced]))
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
        if not self._vectorize_row_reduction(sch, partial, rows, lanes):
            self._parallel(sch, rows)
        return True

    def _vectorize_row_reduction(self, sch, block, lead, lanes: int) -> bool:
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
        width = _vector_width(extents[-1], lanes)
        if width is None:
            return False
        # The lanes become the partial sums' axis after the output's own: the parts of a whole-
        # tensor reduction (see _schedule_full_reduction) have one under two loops (its unit loop
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
        self._parallel(sch, sch.get_loops(block)[: len(lead)])
        return True

    def _parallel(self, sch: s_tir.Schedule, lead: list):
        """Fuse ``lead`` into one loop, parallel unless too short; returns it."""
        fused = fuse_loops(sch, lead)
        extent = static_int(sch.get(fused).extent)
        if extent is None or extent >= self.min_parallel_extent:
            sch.parallel(fused)
        return fused


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
    if len(stage_loops) != 1 or _n_spatial(sch, stage) != len(stmt.iter_vars) \
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


def _static_product(sch: s_tir.Schedule, loops: list) -> float:
    """The product of the loops' extents; infinite when it is symbolic."""
    n = static_int(_product([sch.get(loop).extent for loop in loops]))
    return float("inf") if n is None else n


def _vector_width(extent: int | None, lanes: int) -> int | None:
    """The widest vector, a whole one or a half (rows of 56: 8 lanes of 16), that divides a static
    ``extent``; None for a symbolic extent or when neither divides it."""
    if not extent:
        return None
    return next((w for w in (lanes, lanes // 2) if w > 1 and extent % w == 0), None)


def _iter_extent(it) -> int | None:
    """A dlight iter's static extent (it gives an int when static)."""
    return it.dom if isinstance(it.dom, int) else None


FULL_REDUCTION_PARTS = 8  # parts per core of a reduction over a whole tensor
MIN_FULL_REDUCTION = 1 << 16  # elements below which a whole-tensor reduction stays one loop
SMALL_WINDOW = 32  # taps of a window reduction (pooling) scheduled as vectors along its outputs

ROW_TILE = 4  # a product's row axis is tiled when its extent is a multiple of this
TILE_ACCUMULATORS = 16  # vector registers a tile's accumulators may take
MIN_ROWS_PARALLEL = 256  # rows that alone make a parallel loop (a symbolic count is taken as enough)
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


def _depends_on(read, var) -> bool:
    return any(uses(rg.min, var) for rg in read.region)


def _reads_by_column(stmt, n_spatial: int) -> tuple[list, list]:
    """A column reduction's reads (of at least one dim) along its columns (the last index runs
    with the innermost output axis) and across them (no index does: the row side, broadcast)."""
    column = stmt.iter_vars[n_spatial - 1].var
    reads = [r for r in stmt.reads if r.region]
    return [r for r in reads if uses(r.region[-1].min, column)], [r for r in reads if not _depends_on(r, column)]


def _reused_row_axis(sch: s_tir.Schedule, block, n_spatial: int, tile: int) -> int | None:
    """For a column reduction: the innermost other output axis (static, a multiple of ``tile``)
    that some read along the columns does not depend on, so that a tile of rows can share its
    loads; None when there is none (e.g. a plain sum over leading axes)."""
    stmt = sch.get(block)
    along, _ = _reads_by_column(stmt, n_spatial)
    for axis in reversed(range(n_spatial - 1)):
        extent = static_int(stmt.iter_vars[axis].dom.extent)
        if extent is None or extent % tile or extent == tile:
            continue
        if any(not _depends_on(r, stmt.iter_vars[axis].var) for r in along):
            return axis
    return None


def _column_partner_axis(sch: s_tir.Schedule, block, n_spatial: int, tiled: int) -> int | None:
    """For a register-blocked product: the innermost other output axis (static) that the reads
    along the columns depend on and the others (the row side's, broadcast) do not, so that the
    tile may take several of its indices with each broadcast (conv2d dx: dy_pad's rows, not w's);
    None when there is none."""
    stmt = sch.get(block)
    # (The accumulator, read along the columns, depends on every output axis: it changes nothing.)
    along, broadcast = _reads_by_column(stmt, n_spatial)
    for axis in reversed(range(n_spatial - 1)):
        var = stmt.iter_vars[axis].var
        if axis == tiled or static_int(stmt.iter_vars[axis].dom.extent) is None:
            continue
        if broadcast and all(_depends_on(r, var) for r in along) and not any(_depends_on(r, var) for r in broadcast):
            return axis
    return None


def _reduction_blocking(sch: s_tir.Schedule, row_loop, tile_rows: int, reduction_loop,
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


def _is_row_reduction(sch: s_tir.Schedule, block, n_spatial: int) -> bool:
    """A reduction whose innermost reduced axis is the innermost index of one of its reads."""
    stmt = sch.get(block)
    last = stmt.iter_vars[-1].var
    return n_spatial < len(stmt.iter_vars) and any(r.region and uses(r.region[-1].min, last) for r in stmt.reads)


class GEMV(dl.cpu.GEMV):
    """dlight's GEMV rule, minus kernels that access more than one element per buffer in a block
    (hand-written whole-row or whole-plane blocks: serial scans, scatters), on which its analysis
    fails an assertion instead of declining."""

    def apply(self, func, target, tunable):
        if isinstance(func, tirx.PrimFunc) and _has_region_access(func):
            return None
        try:
            return super().apply(func, target, tunable)
        except AssertionError:
            # dlight's GEMV analysis asserts instead of declining on reductions whose operand is
            # broadcast (``sum(x * c, axis=1)`` with c[n, 1]); a rule that does not fit declines.
            return None


def _has_region_access(func: tirx.PrimFunc) -> bool:
    found = []

    def visit(node):
        if isinstance(node, s_tir.SBlock) and node.name_hint != "root":
            regions = [r for access in (*node.reads, *node.writes) for r in access.region]
            found.extend(r for r in regions if not (isinstance(r.extent, tirx.IntImm) and r.extent.value == 1))

    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, visit), order="post")
    return bool(found)


def default_cpu_rules() -> list:
    """Rules in priority order: dlight's GEMV rule first, our fallback for everything else.

    dlight's ``cpu.Reduction`` is left out: it keeps every row reduction a serial loop of dependent
    scalar adds (softmax-CE backward took 58 ms at 2048 x 8192, 11 ms with the fallback's vector
    row reductions), and put fake-quantize's full reduction ``max|x|`` under the consumer's parallel
    row loop, recomputing it once per row."""
    return [GEMV(), ParallelFallback()]


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


def _n_spatial(sch: s_tir.Schedule, block) -> int:
    return sum(iv.iter_type == tirx.IterVar.DataPar for iv in sch.get(block).iter_vars)


def _reduced_size(sch: s_tir.Schedule, block) -> int | None:
    """The number of reduced elements per output of a block (0: no reduction; None: symbolic)."""
    extents = [static_int(iv.dom.extent) for iv in sch.get(block).iter_vars if iv.iter_type == tirx.IterVar.CommReduce]
    return None if None in extents else (prod(extents) if extents else 0)


def _block_domain(sch: s_tir.Schedule, block) -> tirx.PrimExpr:
    """The number of iterations of a block (static or symbolic)."""
    return _product([iv.dom.extent for iv in sch.get(block).iter_vars])


def _work(sch: s_tir.Schedule, block) -> tirx.PrimExpr:
    """Iterations a block executes where it is now: the product of its enclosing loops."""
    return _product([sch.get(loop).extent for loop in sch.get_loops(block)])


def _product(extents: list) -> tirx.PrimExpr:
    """The product of loop or block extents, static or symbolic (simplified, int64)."""
    out = tirx.IntImm("int64", 1)
    for e in extents:
        out = out * tirx.Cast("int64", e)
    return Analyzer().simplify(out)
