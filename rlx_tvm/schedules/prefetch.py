"""Software prefetch of the next row in row kernels (CPU, LLVM targets).

A row kernel scheduled by :class:`~rlx_tvm.schedules.cpu.RowKernel` runs all its passes
over one row back to back inside a parallel loop over the rows (softmax-CE backward: the row max,
``exp(z - max)``, the row sum, the gradient). Only the first pass streams the row in from memory and
only the last streams it out; in between the core computes on cached data and issues no memory
traffic, and the hardware prefetcher, driven by demand misses, does not run ahead into the next
row. :data:`ANNOTATION` on the row loop asks :func:`prefetch_next_row` to fill that gap: inside
the pass over the row that computes the most (the ``exp`` pass) each step prefetches its share of the
next row's lines of every ``[rows, cols]`` buffer the row touches, for writing where the row
writes it (softmax-CE at (2048, 8192): 8.2-8.9 -> 6.7-6.9 ms, same machine and run).

The annotation's value is the number of loops whose fused index is the row: 1, the annotated loop
alone; 2, the loop and the one around it (the norms' merged kernels, a parallel loop over chunks
of rows around a loop over a chunk's rows: layer norm backward at (8192, 768) read 4.4-4.9 ms
without the prefetch on a machine where its rows in cache took 2.2 ms).

TVM 0.27 has no schedule primitive for a CPU prefetch (``tirx.prefetch`` fails in LLVM code
generation), so the scheduler annotates the loop and this pass, run on the scheduled module,
inserts ``llvm.prefetch`` calls; they touch no data, so results are unchanged.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.sym import Analyzer

from ..kernels.llvm import prefetch
from ..ops.registry import static_int
from .common import expression_nodes

__all__ = ["ANNOTATION", "PrefetchNextRow", "prefetch_next_row"]

ANNOTATION = "rlx.prefetch_next_row"

CACHE_LINE = 64  # bytes


def _allocated(func: tirx.PrimFunc) -> list:
    """The buffers the function allocates (intermediates; after buffer compaction, a row or less
    each, or registers: not to be prefetched)."""
    found: list = []

    def visit(block):
        found.extend(block.alloc_buffers)
        return None

    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, visit), order="post")
    return found


def _row_buffers(loop: tirx.For, row: tirx.PrimExpr, intermediates: list) -> dict:
    """The 2-d input and output buffers (of a static column count) that the blocks under ``loop``
    access at row ``row`` (their first index, with the blocks' bindings), mapped to whether they
    write them."""
    found: dict = {}

    def visit(realize):
        block, analyzer = realize.block, Analyzer()
        for iv, value in zip(block.iter_vars, realize.iter_values):
            analyzer.bind(iv.var, value)
        for access, writes in ((block.reads, False), (block.writes, True)):
            for region in access:
                buf = region.source
                if len(buf.shape) == 2 and static_int(buf.shape[1]) and not any(buf.same_as(b) for b in intermediates) \
                        and analyzer.can_prove_equal(region.region[0].min, row):
                    found[buf] = found.get(buf, False) or writes
        return None

    tvm_ffi.structural_walk(loop.body, (s_tir.SBlockRealize, visit), order="post")
    return found


def _arithmetic(stmt) -> int:
    """Arithmetic executed by ``stmt``: expression nodes stored, times the iterations around them
    (static loops; others count once)."""
    if isinstance(stmt, tirx.For):
        return (static_int(stmt.extent) or 1) * _arithmetic(stmt.body)
    if isinstance(stmt, tirx.SeqStmt):
        return sum(_arithmetic(s) for s in stmt.seq)
    if isinstance(stmt, s_tir.SBlockRealize):
        return _arithmetic(stmt.block.body)
    if isinstance(stmt, tirx.BufferStore):
        return expression_nodes(stmt.value)
    body = getattr(stmt, "body", None)
    return _arithmetic(body) if isinstance(body, tirx.Stmt) else 0


def _busiest_pass(row: tirx.For) -> tirx.For | None:
    """The pass over the row (a static serial loop right under the row loop) that does the most
    arithmetic: there the next row's lines arrive while the core is busy (softmax-CE: the
    ``exp`` pass, not the gradient's pass that streams the row out)."""
    body = row.body
    passes = [s for s in (body.seq if isinstance(body, tirx.SeqStmt) else [body])
              if isinstance(s, tirx.For) and s.kind == tirx.ForKind.SERIAL and static_int(s.extent)]
    return max(passes, key=_arithmetic, default=None)


def _prefetches(row: tirx.PrimExpr, step: tirx.For, buffers: dict) -> list:
    """Per iteration of ``step``: its share of the cache lines of each buffer's row after ``row``
    (the last row of the buffer after its last)."""
    steps = static_int(step.extent)
    out = []
    for buf, written in buffers.items():
        nxt = tirx.min(row + 1, buf.shape[0] - 1)
        cols = static_int(buf.shape[1])
        per_line = max(1, CACHE_LINE * 8 // tvm.DataType(buf.dtype).bits)  # elements
        lines = -(-cols // per_line)
        share = -(-lines // steps)  # lines per step
        for q in range(share):
            col = tirx.min((step.loop_var * share + q) * per_line, cols - 1)
            address = tirx.call_intrin("handle", "tirx.address_of", tirx.BufferLoad(buf, [nxt, col]))
            out.append(tirx.Evaluate(prefetch(address, write=written)))
    return out


def _with_prefetch(row: tirx.For, outer: list, intermediates: list) -> tirx.For:
    """``row`` with the prefetches; its row index is the fused index of ``outer`` (the loops
    around it that take part, outermost first) and its own loop variable."""
    first, *inner = [*outer, row]
    index = first.loop_var
    for loop in inner:
        index = index * loop.extent + loop.loop_var
    annotations = {k: v for k, v in row.annotations.items() if k != ANNOTATION}
    buffers = _row_buffers(row, index, intermediates)
    step = _busiest_pass(row)
    if not buffers or step is None:
        return tirx.For(row.loop_var, row.min, row.extent, row.kind, row.body, row.thread_binding, annotations)
    calls = _prefetches(index, step, buffers)

    def insert(node, mutator):
        if node.same_as(step):
            return tirx.For(node.loop_var, node.min, node.extent, node.kind, tirx.SeqStmt([*calls, node.body]),
                            node.thread_binding, node.annotations)
        return mutator.default_mutate(node)

    body = tvm_ffi.structural_mutate(row.body, (tirx.For, insert))
    return tirx.For(row.loop_var, row.min, row.extent, row.kind, body, row.thread_binding, annotations)


def prefetch_next_row(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with next-row prefetches in every loop annotated with :data:`ANNOTATION` (the
    annotation removed); unchanged when it has none."""
    marked: list = []

    def visit(node):
        if ANNOTATION in node.annotations:
            marked.append(node)
        return None

    tvm_ffi.structural_walk(func.body, (tirx.For, visit), order="post")
    if not marked:
        return func

    intermediates = _allocated(func)
    around: list = []  # the loops around the node being rewritten, outermost first

    def rewrite(node, mutator):
        if ANNOTATION in node.annotations:
            depth = int(node.annotations[ANNOTATION])
            if not 1 <= depth <= len(around) + 1:
                raise ValueError(f"{ANNOTATION}={depth}: the row index would take {depth} loops (the annotated "
                                 f"one and those around it), but only {len(around) + 1} are there")
            return _with_prefetch(node, around[len(around) + 1 - depth:], intermediates)
        around.append(node)
        try:
            return mutator.default_mutate(node)
        finally:
            around.pop()

    return func.with_body(tvm_ffi.structural_mutate(func.body, (tirx.For, rewrite)))


@tvm.tirx.transform.prim_func_pass(opt_level=0, name="rlx.PrefetchNextRow")
def PrefetchNextRow(func: tirx.PrimFunc, _mod, _ctx) -> tirx.PrimFunc:  # noqa: N802 - a TVM pass
    """:func:`prefetch_next_row` on every PrimFunc of a module."""
    return prefetch_next_row(func)
