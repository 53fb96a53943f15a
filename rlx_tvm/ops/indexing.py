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
from tvm.sym import Analyzer

from ..kernels import strategy
from ..kernels.common import acc_dtype, tensor_dtype
from ..kernels.cpu import indexing as _cpu  # noqa: F401  (registers the CPU kernels)
from ..overrides import override_gradient
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
    """A serial scan per row on CPU (:mod:`rlx_tvm.kernels.cpu.indexing`); the blocked reductions
    below on GPUs, whose threads would each run a whole row serially."""
    return strategy.build(cumsum_backward.name, bb, dy, axis=axis, exclusive=exclusive)


@strategy.register("cumsum_backward", "te-blocked", strategy.on_gpu)
def cumsum_backward_blocked(target, bb, dy, *, axis, exclusive=False):
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


@gather_backward.fused
def _gather_backward_fused(bb, dy, indices, *, axis, dim_size):
    dtype = tensor_dtype(dy)
    acc = acc_dtype(dtype)
    axis, outer, inner, (n_outer, n_idx, n_inner) = _views(dy, indices, axis)
    func = strategy.build(gather_backward.name, dtype, acc, tensor_dtype(indices), n_outer, n_idx, n_inner, dim_size)
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
