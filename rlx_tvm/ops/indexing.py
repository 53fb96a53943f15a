"""Indexing backward ops: ``cumsum_backward(dy; axis, exclusive=False)`` and
``gather_backward(dy, indices; axis, dim_size)``.

cumsum_backward
    ``dx_i = sum_{j >= i} dy_j`` along ``axis`` (``exclusive``: ``j > i``), the adjoint of
    ``cumsum(x, axis, exclusive)``. Any axis, any (also symbolic) length.

    * Fused kernel, CPU: one reverse scan per row (the rows are the parallel loop) with a float64
      running sum, so each output is rounded once; it reads dy once and writes dx once. Along the
      contiguous axis it goes a vector of 8 at a time (in-register shifted adds, then the carry);
      along another axis it is serial over the axis and vectorized over the elements after it.
    * Fused kernel, GPU targets (legalized in a GPU target's scope): a blocked reverse scan in plain
      ``te.compute`` reductions, no serial loop. With blocks of ``B`` elements, ``dx_i = (suffix of dy inside i's block) + (sum of the totals
      of the blocks after it)``: the in-block suffix is a masked ``B``-term reduction per element
      and the block suffix a masked reduction over the ``ceil(n/B)`` block totals, so a row costs
      ``O(n*B + (n/B)^2)`` and every output is a sum of at most ``B`` plus ``n/B`` partial sums:
      its float32 error is far below a sequential scan's (``~n`` roundings), let alone
      ``sum - cumsum + dy`` (which cancels catastrophically).
    * Decomposition: ``flip(cumsum(flip(dy)))`` (flip's gradient is in
      :mod:`rlx_tvm.gradients.scatter`; cumsum's gradient is this op again).

gather_backward
    The adjoint of ``take(x, indices, axis)`` for an ``x`` whose ``axis`` has extent
    ``dim_size``: ``dy.shape == x.shape[:axis] + indices.shape + x.shape[axis+1:]`` (any index
    rank, as ``take``), and the output has x's shape. Duplicate indices accumulate, negative
    indices count from the end; an index outside ``[-dim_size, dim_size)`` is an error when the
    indices are a constant and is dropped (never written) at run time.

    * Fused kernel: a TensorIR PrimFunc over the ``[outer, n_idx, inner]`` view: an init block,
      then the accumulation, race-free over the features, with cost ``O(outer * (dim_size + n_idx)
      * inner)`` (no dense one-hot). On CPU the accumulation is one block per (outer, chunk of up
      to 64 features) walking all the indices, each visit one vector loop over its chunk; on GPU
      targets one block per element whose index iterator is the reduction, so that threads bind
      to the features. Half types accumulate in a float32 buffer.
    * Decomposition: ``scatter_elements(zeros, indices, dy, reduction="add")`` on the same view,
      with the indices normalized and the invalid ones masked to a zero update.

Also registers the gradients of ``R.cumsum`` and ``R.take`` so that ``relax.transform.Gradient``
emits these ops (TVM's own: ``sum - cumsum + dy``, which loses precision and ignores
``exclusive``, and ``relax.grad.take_backward``, a serial extern loop without a gradient).
"""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax, te, tirx
from tvm.script import tirx as T
from tvm.sym import Analyzer

from ..kernels.llvm import has_llvm_intrinsics, zero_bytes
from ..overrides import override_gradient
from ..target import target_cores
from ._math import acc_dtype, tensor_dtype
from .registry import INT_DTYPES, Attr, check_bool, check_int, define_op, fmt_shape, static_int

# Block length of the fused reverse scan. Cost per row ~ n*B + (n/B)^2; 32 keeps the in-block
# work small while the block-total reduction stays cheap up to n ~ 10^4-10^5.
SCAN_BLOCK = 32


def _i64(v):
    return tirx.IntImm("int64", v) if isinstance(v, int) else v


def _prod(dims):
    """Product of shape dims (ints or PrimExprs), folded to an int when all are static."""
    out = _i64(1)
    for d in dims:
        out = out * _i64(d)
    return Analyzer().simplify(out)


def constant_array(ctx, name: str) -> np.ndarray | None:
    """The value of input ``name`` when it is a constant tensor (``relax.const``), for static
    range checks; None otherwise."""
    # InferContext exposes argument types, not expressions; TVM 0.27's relax.const makes an
    # ir.GenericConst whose value is a runtime tensor.
    expr = ctx._args.get(name)
    if isinstance(expr, tvm.ir.expr.GenericConst) and hasattr(expr.value, "numpy"):
        return expr.value.numpy()
    return None


def _replace(index, axis, value):
    return tuple(index[:axis]) + (value,) + tuple(index[axis + 1:])


# --------------------------------------------------------------------------------------------
# cumsum_backward
# --------------------------------------------------------------------------------------------

cumsum_backward = define_op(
    "cumsum_backward",
    inputs=("dy",),
    attrs=(Attr("axis", check=check_int()), Attr("exclusive", False, check_bool)),
    doc="Reverse cumulative sum of dy along axis (exclusive: strictly after): the gradient of cumsum.",
)


@cumsum_backward.infer
def _cumsum_backward_infer(ctx):
    dy = ctx.tensor("dy", min_ndim=1)
    ctx.axis("axis", dy.ndim)
    return ctx.out(dy.shape, dy.dtype)


@cumsum_backward.reference
def _cumsum_backward_ref(dy, *, axis, exclusive=False):
    dy = np.asarray(dy, dtype=np.float64)
    suffix = np.flip(np.cumsum(np.flip(dy, axis), axis), axis)
    return suffix - dy if exclusive else suffix


@cumsum_backward.decomposition
def _cumsum_backward_decompose(bb, dy, *, axis, exclusive=False):
    dtype = tensor_dtype(dy)
    acc = acc_dtype(dtype)
    g = dy if acc == dtype else relax.op.astype(dy, acc)
    axis = axis % dy.ty.ndim
    dx = relax.op.flip(relax.op.cumsum(relax.op.flip(g, axis), axis, exclusive=exclusive), axis)
    return dx if acc == dtype else relax.op.astype(dx, dtype)


@cumsum_backward.fused
def _cumsum_backward_fused(bb, dy, *, axis, exclusive=False):
    """A serial scan per row on CPU; the blocked reductions on GPUs (legalized in a GPU target's
    scope), whose threads would each run a whole row serially."""
    target = tvm.target.Target.current(allow_none=True)
    if target is not None and "gpu" in target.keys:
        return cumsum_backward_blocked(bb, dy, axis=axis, exclusive=exclusive)
    return cumsum_backward_serial(bb, dy, axis=axis, exclusive=exclusive)


# Vector length of the CPU scan along a contiguous axis (_suffix_sum_rows_kernel; 8 float64 =
# one AVX-512 register): a serial float64 chain is latency-bound at ~4 cycles per element.
SCAN_LANES = 8


def suffix_sum_kernel(dtype: str, outer, n, inner, exclusive: bool) -> tirx.PrimFunc:
    """``out[o, j, i] = sum_{k >= j} dy[o, k, i]`` (``k > j`` when exclusive) over the
    ``[outer, n, inner]`` view: one block per ``o`` (the parallel loop) walking ``j`` downwards
    with a float64 running sum per ``i`` (one rounding per output; the ``i`` loop is contiguous,
    so LLVM vectorizes it). Reads each input once: memory-bound, where the blocked form does
    ``O(B)`` work per element."""
    outer, n, inner = _fresh(outer, "outer"), _fresh(n, "n"), _fresh(inner, "inner")
    run_dtype = "float64"

    @T.prim_func(private=True, s_tir=True)
    def kernel(dy_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        dy = T.match_buffer(dy_h, (outer, n, inner), dtype)
        out = T.match_buffer(out_h, (outer, n, inner), dtype)
        for o in range(outer):
            with T.sblock("suffix_sum"):
                vo = T.axis.spatial(outer, o)
                T.reads(dy[vo, 0:n, 0:inner])
                T.writes(out[vo, 0:n, 0:inner])
                run = T.sblock_alloc_buffer((inner,), run_dtype)
                for i in range(inner):
                    run[i] = T.cast(0, run_dtype)
                for k in range(n):
                    for i in range(inner):
                        if exclusive:
                            out[vo, n - 1 - k, i] = T.cast(run[i], dtype)
                            run[i] = run[i] + T.cast(dy[vo, n - 1 - k, i], run_dtype)
                        else:
                            run[i] = run[i] + T.cast(dy[vo, n - 1 - k, i], run_dtype)
                            out[vo, n - 1 - k, i] = T.cast(run[i], dtype)

    return kernel


def _shifted_down(lanes: int, by: int) -> list[int]:
    """Shuffle indices taking lane ``l + by`` of a vector into lane ``l`` (lane ``lanes``, a zero
    of the second operand, past the end)."""
    return [min(l + by, lanes) for l in range(lanes)]


def _suffix_sum_rows_kernel(dtype: str, outer, n, exclusive: bool) -> tirx.PrimFunc:
    """The scan along a contiguous axis (``[outer, n]``), one block per row, ``SCAN_LANES``
    elements at a time from the end: a vector's own suffix sums by log2(lanes) shifted adds (lane
    shuffles), plus the carried total of the vectors after it, so the chain between vectors is
    one add (a serial scan has one per element and is latency-bound). The row's last ``n %
    SCAN_LANES`` elements run serially first. float64 throughout: one rounding per output."""
    lanes, run_dtype = SCAN_LANES, "float64"
    vec = f"{run_dtype}x{lanes}"
    assert lanes == 8, "three shifted adds below"
    by1, by2, by4 = (_shifted_down(lanes, s) for s in (1, 2, 4))
    outer, n = _fresh(outer, "outer"), _fresh(n, "n")
    zero = tirx.Broadcast(tirx.const(0, run_dtype), lanes)

    @T.prim_func(private=True, s_tir=True)
    def kernel(dy_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        dy = T.match_buffer(dy_h, (outer, n), dtype)
        out = T.match_buffer(out_h, (outer, n), dtype)
        for o in range(outer):
            with T.sblock("suffix_sum"):
                vo = T.axis.spatial(outer, o)
                T.reads(dy[vo, 0:n])
                T.writes(out[vo, 0:n])
                carry = T.sblock_alloc_buffer((1,), run_dtype)
                # One element of vector type (s_tir's buffer compaction mangles ramp indices).
                scan = T.sblock_alloc_buffer((1,), vec)
                # Flat views for the vector accesses (TVM 0.27's printer fails on a vector index
                # into a 2-d buffer).
                dy_flat = T.decl_buffer((outer * n,), dtype, data=dy.data)
                out_flat = T.decl_buffer((outer * n,), dtype, data=out.data)
                carry[0] = T.cast(0, run_dtype)
                for k in range(n % lanes):
                    if exclusive:
                        out[vo, n - 1 - k] = T.cast(carry[0], dtype)
                        carry[0] = carry[0] + T.cast(dy[vo, n - 1 - k], run_dtype)
                    else:
                        carry[0] = carry[0] + T.cast(dy[vo, n - 1 - k], run_dtype)
                        out[vo, n - 1 - k] = T.cast(carry[0], dtype)
                for b in range(n // lanes):
                    scan[0] = T.Cast(vec, dy_flat[T.Ramp(vo * n + (n // lanes - 1 - b) * lanes, 1, lanes)])
                    scan[0] = scan[0] + T.Shuffle([scan[0], zero], by1)
                    scan[0] = scan[0] + T.Shuffle([scan[0], zero], by2)
                    scan[0] = scan[0] + T.Shuffle([scan[0], zero], by4)
                    if exclusive:
                        out_flat[T.Ramp(vo * n + (n // lanes - 1 - b) * lanes, 1, lanes)] = T.Cast(
                            f"{dtype}x{lanes}", T.Shuffle([scan[0], zero], by1)
                            + T.Broadcast(carry[0], lanes))
                    else:
                        out_flat[T.Ramp(vo * n + (n // lanes - 1 - b) * lanes, 1, lanes)] = T.Cast(
                            f"{dtype}x{lanes}", scan[0] + T.Broadcast(carry[0], lanes))
                    carry[0] = carry[0] + T.Shuffle([scan[0]], [0])

    return kernel


def cumsum_backward_serial(bb, dy, *, axis, exclusive=False):
    """The CPU kernels: along the contiguous axis (``inner == 1``) :func:`_suffix_sum_rows_kernel`
    on dy's ``[outer, n]`` view, else :func:`suffix_sum_kernel` on its ``[outer, n, inner]`` view."""
    axis = axis % dy.ty.ndim
    dims = list(dy.ty.shape.values)
    outer, n, inner = _prod(dims[:axis]), dims[axis], _prod(dims[axis + 1:])
    if static_int(inner) == 1:
        view = [outer, n]
        func = _suffix_sum_rows_kernel(tensor_dtype(dy), outer, n, bool(exclusive))
    else:
        view = [outer, n, inner]
        func = suffix_sum_kernel(tensor_dtype(dy), outer, n, inner, bool(exclusive))
    gv = bb.add_func(func, "rlx_cumsum_backward")
    dy_view = bb.emit(relax.op.reshape(dy, view))
    out = bb.emit(relax.call_tir(gv, [dy_view], relax.TensorType(view, tensor_dtype(dy))))
    return relax.op.reshape(out, dims)


def cumsum_backward_blocked(bb, dy, *, axis, exclusive=False):
    """The GPU kernels: up to three, one reduction each (so that default schedules such as
    dlight's apply to every one): block totals, the sum of the totals after each block, and the
    in-block suffix plus that sum."""
    dtype = tensor_dtype(dy)
    acc = acc_dtype(dtype)
    axis = axis % dy.ty.ndim
    static_len = static_int(dy.ty.shape.values[axis])
    single_block = static_len is not None and static_len <= SCAN_BLOCK
    bsz = _i64(static_len if single_block else SCAN_BLOCK)
    zero = tirx.const(0.0, acc)

    def load(g, index, pos):
        # Positions past the end of the last (partial) block contribute nothing.
        return tirx.if_then_else(pos < g.shape[axis], g(*_replace(index, axis, pos)).astype(acc), zero)

    def block_totals(g: te.Tensor):
        n_blocks = tirx.indexdiv(g.shape[axis] + bsz - 1, bsz)
        k = te.reduce_axis((_i64(0), bsz), name="k")
        return te.compute(
            _replace(g.shape, axis, n_blocks),
            lambda *b: te.sum(load(g, b, b[axis] * bsz + k), axis=k),
            name="cumsum_backward_block_totals",
        )

    def later_blocks(totals: te.Tensor):
        """For each block, the sum of the totals of the blocks after it."""
        r = te.reduce_axis((_i64(0), totals.shape[axis]), name="r")
        return te.compute(
            totals.shape,
            lambda *b: te.sum(tirx.if_then_else(r > b[axis], totals(*_replace(b, axis, r)), zero), axis=r),
            name="cumsum_backward_later_blocks",
        )

    def finish(g: te.Tensor, later: te.Tensor | None = None):
        k = te.reduce_axis((_i64(0), bsz), name="k")

        def in_block(*i):  # dy's suffix inside i's own block
            start = tirx.indexdiv(i[axis], bsz) * bsz
            first = tirx.indexmod(i[axis], bsz) + (1 if exclusive else 0)
            return te.sum(tirx.if_then_else(k >= first, load(g, i, start + k), zero), axis=k)

        partial = te.compute(g.shape, in_block, name="cumsum_backward_in_block")

        def total(*i):
            value = partial(*i)
            if later is not None:
                value = value + later(*_replace(i, axis, tirx.indexdiv(i[axis], bsz)))
            return value.astype(dtype)

        return te.compute(g.shape, total, name="cumsum_backward")

    if single_block:  # nothing comes after the only block
        return bb.call_te(finish, dy, primfunc_name_hint="rlx_cumsum_backward")
    totals = bb.emit(bb.call_te(block_totals, dy, primfunc_name_hint="rlx_cumsum_backward_block_totals"))
    later = bb.emit(bb.call_te(later_blocks, totals, primfunc_name_hint="rlx_cumsum_backward_later_blocks"))
    return bb.call_te(finish, dy, later, primfunc_name_hint="rlx_cumsum_backward")


# --------------------------------------------------------------------------------------------
# gather_backward
# --------------------------------------------------------------------------------------------

gather_backward = define_op(
    "gather_backward",
    inputs=("dy", "indices"),
    attrs=(Attr("axis", check=check_int()), Attr("dim_size", check=check_int(lo=1))),
    doc="Adjoint of take(x, indices, axis) for x with extent dim_size on axis: scatter-add of dy.",
)


def _gather_geometry(dy_shape, idx_ndim: int, axis: int):
    """(outer dims, index dims, inner dims) of dy for a normalized output axis."""
    return list(dy_shape[:axis]), list(dy_shape[axis: axis + idx_ndim]), list(dy_shape[axis + idx_ndim:])


@gather_backward.infer
def _gather_backward_infer(ctx):
    dy = ctx.tensor("dy")
    idx = ctx.tensor("indices", dtypes=INT_DTYPES)
    out_ndim = dy.ndim - idx.ndim + 1
    if out_ndim < 1:
        raise ctx.error(
            "dy", f"rank >= {idx.ndim} (rank of 'indices') to hold the index dims",
            f"rank {dy.ndim} (shape {fmt_shape(dy.shape)})",
        )
    axis = ctx.axis("axis", out_ndim)
    dim_size = ctx.attrs["dim_size"]
    outer, index_dims, inner = _gather_geometry(dy.shape, idx.ndim, axis)
    if any(ctx.provably_different(a, b) for a, b in zip(index_dims, idx.shape)):
        raise ctx.error(
            "dy",
            f"dims {axis}..{axis + idx.ndim - 1} equal to the indices shape {fmt_shape(idx.shape)} "
            f"(dy = x.shape[:axis] + indices.shape + x.shape[axis+1:])",
            fmt_shape(dy.shape),
        )
    values = constant_array(ctx, "indices")
    if values is not None and values.size:
        bad = values[(values < -dim_size) | (values >= dim_size)]
        if bad.size:
            raise ctx.error(
                "indices", f"values in [{-dim_size}, {dim_size}) (dim_size {dim_size})", f"index {int(bad.flat[0])}"
            )
    return ctx.out(outer + [dim_size] + inner, dy.dtype)


@gather_backward.reference
def _gather_backward_ref(dy, indices, *, axis, dim_size):
    dy = np.asarray(dy, dtype=np.float64)
    indices = np.asarray(indices)
    axis = axis % (dy.ndim - indices.ndim + 1)
    outer, _, inner = _gather_geometry(dy.shape, indices.ndim, axis)
    flat_idx = indices.reshape(-1).astype(np.int64)
    dy3 = dy.reshape(math.prod(outer), flat_idx.size, math.prod(inner))
    out = np.zeros((dy3.shape[0], dim_size, dy3.shape[2]))
    keep = (flat_idx >= -dim_size) & (flat_idx < dim_size)
    np.add.at(out, (slice(None), flat_idx[keep] % dim_size, slice(None)), dy3[:, keep, :])
    return out.reshape(outer + [dim_size] + inner)


def _views(dy, indices, axis):
    """Shapes of the ``[outer, n_idx, inner]`` view of dy and of the output."""
    axis = axis % (dy.ty.ndim - indices.ty.ndim + 1)
    outer, index_dims, inner = _gather_geometry(list(dy.ty.shape.values), indices.ty.ndim, axis)
    return axis, outer, inner, (_prod(outer), _prod(index_dims), _prod(inner))


@gather_backward.decomposition
def _gather_backward_decompose(bb, dy, indices, *, axis, dim_size):
    dtype = tensor_dtype(dy)
    acc = acc_dtype(dtype)
    idx_dtype = tensor_dtype(indices)
    axis, outer, inner, (n_outer, n_idx, n_inner) = _views(dy, indices, axis)
    op = relax.op

    idx = op.reshape(indices, [n_idx])
    size = relax.const(dim_size, idx_dtype)
    valid = op.logical_and(op.greater_equal(idx, op.negative(size)), op.less(idx, size))
    wrapped = op.where(op.less(idx, relax.const(0, idx_dtype)), op.add(idx, size), idx)
    safe = op.where(valid, wrapped, op.zeros_like(idx))  # dropped updates go to row 0 as zeros

    g = op.reshape(dy if acc == dtype else op.astype(dy, acc), [n_outer, n_idx, n_inner])
    updates = op.where(op.reshape(valid, [1, n_idx, 1]), g, op.zeros_like(g))
    index3 = op.broadcast_to(op.reshape(safe, [1, n_idx, 1]), [n_outer, n_idx, n_inner])
    out = op.scatter_elements(op.zeros([n_outer, dim_size, n_inner], acc), index3, updates, axis=1, reduction="add")
    out = op.reshape(out, outer + [dim_size] + inner)
    return out if acc == dtype else op.astype(out, dtype)


def _fresh(dim, name):
    """A kernel-local shape var for a symbolic dim (the PrimFunc binds it from its buffer)."""
    s = static_int(dim)
    return _i64(s) if s is not None else tirx.Var(name, "int64")


# Features per block of the CPU form: 4 AVX-512 vectors of float32 (fewer when they do not divide).
FEATURE_CHUNK = 64


# Threads the GPU form aims for (one per block of output rows and feature column): enough to fill
# a GPU; each more compares every index once more.
GPU_THREADS_WANTED = 1 << 16


def scatter_add_kernel(dtype: str, acc: str, idx_dtype: str, outer, n_idx, inner, dim_size: int,
                       chunked: bool = True, clear_parts: int | None = None) -> tirx.PrimFunc:
    """``out[o, wrap(idx[j]), i] += dy[o, j, i]`` over ``[outer, n_idx, inner]`` (``out`` in the
    accumulation dtype ``acc``); indices outside ``[-dim_size, dim_size)`` are skipped. Race-free
    in both forms (no two threads write the same element):

    * ``chunked`` (CPU): one block per (outer, chunk of features), which walks all the indices and
      adds each dy row's chunk to its output row as one vector loop; the blocks are spatial, so the
      parallel loop over them is race-free (a chunk has one owner). (In the per-element form the
      index loop is outside the feature loop, and no CPU schedule can parallelize or vectorize
      it: TVM's parallel/vectorize ask for a complete or reduction block, and it has no init.)
    * row-blocked (GPU): the output rows are cut into blocks of ``rows`` rows; block (o, b, i)
      owns output column ``i`` of rows ``b*rows ..`` and walks all the indices, adding the dy
      elements whose index falls in its rows. It is a reduction block (its init zeroes what it
      owns; the index loop is its reduction iterator), so the spatial (o, b, i) loops bind to
      threads by schedule primitives: ``outer x blocks x inner`` threads, each comparing every
      index (cheap: the index is the same for every thread of a warp) and adding ``n_idx / blocks``
      rows on average. (A scatter with the rows written through a separate init block is neither
      complete nor a reduction block, and thread binding refuses it.)

    With ``clear_parts`` (the CPU form, for a target whose code generator is LLVM) the output is
    cleared by ``memset`` in that many parts of whole rows, one per core: a large enough part goes
    out as non-temporal stores (glibc's memset, past a threshold near the last-level cache size),
    which write whole lines without reading them first. Most rows of an embedding's gradient stay
    0: at 32000 x 768 on 2 cores (two 49 MB parts) 6.7-7.3 -> 4.9-6.0 ms in four runs side by side
    with the vector loop; parts of 25 MB or less were no faster than it."""
    static_inner = static_int(inner)
    chunk = next((c for c in (FEATURE_CHUNK, 32, 16, 8, 4, 2) if static_inner and static_inner % c == 0), 1)
    columns = (static_int(outer) or 1) * (static_inner or 256)
    blocks = max(1, min(dim_size, -(-GPU_THREADS_WANTED // columns)))
    rows = -(-dim_size // blocks)
    blocks = -(-dim_size // rows)  # no empty block
    outer, n_idx, inner = _fresh(outer, "outer"), _fresh(n_idx, "n_idx"), _fresh(inner, "inner")
    clear_by_memset = bool(chunked and clear_parts)  # (a plain bool: the TVMScript if needs one)
    part_rows = -(-dim_size // min(clear_parts or 1, dim_size))
    parts = -(-dim_size // part_rows)  # no empty part
    acc_bytes = tvm.DataType(acc).bits // 8
    dim, rows, blocks = _i64(dim_size), _i64(rows), _i64(blocks)
    part_rows, parts = _i64(part_rows), _i64(parts)

    @T.prim_func(private=True, s_tir=True)
    def kernel(dy_h: T.handle, idx_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        dy = T.match_buffer(dy_h, (outer, n_idx, inner), dtype)
        idx = T.match_buffer(idx_h, (n_idx,), idx_dtype)
        out = T.match_buffer(out_h, (outer, dim, inner), acc)
        if clear_by_memset:
            for o, part in T.grid(outer, parts):
                with T.sblock("init"):
                    vo, vp = T.axis.remap("SS", [o, part])
                    T.reads()
                    T.writes(out[vo, vp * part_rows:T.min(vp * part_rows + part_rows, dim), 0:inner])
                    T.evaluate(zero_bytes(T.address_of(out[vo, vp * part_rows, 0]),
                                          (T.min(vp * part_rows + part_rows, dim) - vp * part_rows) * inner * acc_bytes))
        elif chunked:
            for o, d, i in T.grid(outer, dim, inner):
                with T.sblock("init"):
                    vo, vd, vi = T.axis.remap("SSS", [o, d, i])
                    out[vo, vd, vi] = T.cast(0, acc)
        if chunked:
            for o, c in T.grid(outer, inner // chunk):
                with T.sblock("accumulate"):
                    vo, vc = T.axis.remap("SS", [o, c])
                    T.reads(idx[0:n_idx], dy[vo, 0:n_idx, vc * chunk:vc * chunk + chunk])
                    T.writes(out[vo, 0:dim, vc * chunk:vc * chunk + chunk])
                    for j in range(n_idx):
                        row: T.int64 = T.Cast("int64", idx[j]) + T.if_then_else(idx[j] < 0, dim, T.int64(0))
                        if 0 <= row and row < dim:
                            for f in T.vectorized(chunk):
                                out[vo, row, vc * chunk + f] = out[vo, row, vc * chunk + f] + T.Cast(acc, dy[vo, j, vc * chunk + f])
        else:
            for o, b, j, i in T.grid(outer, blocks, n_idx, inner):
                with T.sblock("accumulate"):
                    vo, vb, vj, vi = T.axis.remap("SSRS", [o, b, j, i])
                    T.reads(idx[vj], dy[vo, vj, vi])
                    T.writes(out[vo, vb * rows:T.min(vb * rows + rows, dim), vi])
                    with T.init():
                        for r in range(rows):
                            if vb * rows + r < dim:
                                out[vo, vb * rows + r, vi] = T.cast(0, acc)
                    row: T.int64 = T.Cast("int64", idx[vj]) + T.if_then_else(idx[vj] < 0, dim, T.int64(0))
                    if vb * rows <= row and row < vb * rows + rows and row < dim:
                        out[vo, row, vi] = out[vo, row, vi] + T.Cast(acc, dy[vo, vj, vi])

    return kernel


@gather_backward.fused
def _gather_backward_fused(bb, dy, indices, *, axis, dim_size):
    dtype = tensor_dtype(dy)
    acc = acc_dtype(dtype)
    axis, outer, inner, (n_outer, n_idx, n_inner) = _views(dy, indices, axis)
    target = tvm.target.Target.current(allow_none=True)
    on_gpu = target is not None and "gpu" in target.keys
    func = scatter_add_kernel(dtype, acc, tensor_dtype(indices), n_outer, n_idx, n_inner, dim_size, chunked=not on_gpu,
                              clear_parts=target_cores(target) if not on_gpu and has_llvm_intrinsics(target) else None)
    gv = bb.add_func(func, "rlx_gather_backward")
    dy3 = bb.emit(relax.op.reshape(dy, [n_outer, n_idx, n_inner]))
    idx1 = bb.emit(relax.op.reshape(indices, [n_idx]))
    out3 = bb.emit(relax.call_tir(gv, [dy3, idx1], relax.TensorType([n_outer, dim_size, n_inner], acc)))
    if acc != dtype:  # half types: accumulated in float32, rounded once at the end
        out3 = bb.emit(relax.op.astype(out3, dtype))
    return relax.op.reshape(out3, outer + [dim_size] + inner)


# --------------------------------------------------------------------------------------------
# Gradients of R.cumsum and R.take: relax.transform.Gradient emits the ops above
# --------------------------------------------------------------------------------------------

def _cumsum_gradient(orig_var, orig_call, output_grad, ctx):
    """d cumsum(x, axis, dtype, exclusive) = cumsum_backward(dy, axis, exclusive); axis None
    scans the flattened x."""
    (x,) = orig_call.args
    attrs = orig_call.attrs
    exclusive = bool(attrs.exclusive) if attrs.exclusive is not None else False
    x_dtype = tensor_dtype(x)
    dy = output_grad if tensor_dtype(orig_var) == x_dtype else relax.op.astype(output_grad, x_dtype)
    if attrs.axis is None:
        return [relax.op.reshape(cumsum_backward(dy, axis=0, exclusive=exclusive), x.ty.shape)]
    return [cumsum_backward(dy, axis=int(attrs.axis), exclusive=exclusive)]


def _take_gradient(orig_var, orig_call, output_grad, ctx):
    """d take(x, indices, axis) = gather_backward(dy, indices, axis, dim_size=x.shape[axis]).

    TVM's rule is kept where gather_backward's index semantics could differ from the forward's
    (``mode`` "clip"/"wrap" remap out-of-range indices) or where x's extent on axis is symbolic."""
    from tvm.relax.op._op_gradient import take_grad
    from tvm.relax.op.grad import no_grad

    x, indices = orig_call.args
    axis = 0 if orig_call.attrs.axis is None else int(orig_call.attrs.axis)
    dim_size = static_int(x.ty.shape.values[axis % x.ty.ndim])
    if orig_call.attrs.mode != "fast" or dim_size is None:
        return take_grad(orig_var, orig_call, output_grad, ctx)
    return [gather_backward(output_grad, indices, axis=axis, dim_size=dim_size), no_grad(indices)]


override_gradient("relax.cumsum", _cumsum_gradient)
override_gradient("relax.take", _take_gradient)
