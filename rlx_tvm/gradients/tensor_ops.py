"""Gradients of the tensor ops TVM's torch importer emits and TVM 0.27 leaves without one:
``tile`` (``repeat``), ``stack``, ``outer``, ``einsum``, ``prod``, ``std``, ``cumprod``,
``index_tensor`` / ``index_put`` (advanced indexing), ``slice_scatter`` and ``topk``.
"""

from __future__ import annotations

from tvm import relax, tirx
from tvm.relax.op.grad import no_grad

from ._rule import rule

op = relax.op


def _dims(expr) -> list:
    return [int(d) if isinstance(d, tirx.IntImm) else d for d in expr.ty.shape.values]


def _axes(attrs_axis, ndim: int) -> list[int]:
    return list(range(ndim)) if attrs_axis is None else sorted(int(a) % ndim for a in attrs_axis)


def _unreduce(g, orig_call, ndim: int):
    """Put reduced axes back (size 1) so a reduction's output gradient broadcasts over its input."""
    axes = _axes(orig_call.attrs.axis, ndim)
    if not orig_call.attrs.keepdims and axes:
        return op.expand_dims(g, axes)
    return g


@rule("relax.tile")
def _tile_grad(orig_var, orig_call, output_grad, ctx):
    """Each copy receives its slice of ``dy``: reshape every axis ``r * n`` to ``(r, n)`` and sum
    over the copies."""
    (x,) = orig_call.args
    reps = [int(r) for r in orig_call.attrs.repeats]
    dims = _dims(x)
    ndim = max(len(dims), len(reps))
    dims = [1] * (ndim - len(dims)) + dims
    reps = [1] * (ndim - len(reps)) + reps
    split_shape, copy_axes = [], []
    for i, (r, n) in enumerate(zip(reps, dims)):
        copy_axes.append(len(split_shape))
        split_shape += [r, n]
    g = op.sum(op.reshape(output_grad, split_shape), axis=copy_axes)
    return [op.reshape(g, x.ty.shape)]


@rule("relax.stack")
def _stack_grad(orig_var, orig_call, output_grad, ctx):
    (tensors,) = orig_call.args
    n = len(tensors.ty.fields)
    axis = int(orig_call.attrs.axis) % int(orig_var.ty.ndim)
    parts = op.split(output_grad, n, axis)
    return [relax.Tuple([op.squeeze(relax.TupleGetItem(parts, i), [axis]) for i in range(n)])]


@rule("relax.outer")
def _outer_grad(orig_var, orig_call, output_grad, ctx):
    a, b = orig_call.args
    return [op.matmul(output_grad, b), op.matmul(op.permute_dims(output_grad), a)]


@rule("relax.einsum")
def _einsum_grad(orig_var, orig_call, output_grad, ctx):
    """``d operand_i = einsum(dy, other operands -> labels of operand i)``: exact when no label
    repeats within one operand and every label of operand i appears in the output or another
    operand (the contractions the importer emits for matmul-like einsums)."""
    (operands,) = orig_call.args
    spec = str(orig_call.attrs.subscripts).replace(" ", "")
    if "..." in spec or "->" not in spec:
        raise ValueError(f"gradient of relax.einsum: explicit subscripts without '...' expected, got {spec!r}")
    ins, out = spec.split("->")
    ins = ins.split(",")
    if len(ins) == 1 and len(ins[0]) >= 2 and ins[0][-1] == ins[0][-2] and out == ins[0][:-1]:
        # A diagonal, "...zz->...z" (the importer's torch.diagonal): d x = dy on the diagonal.
        x = relax.TupleGetItem(operands, 0)
        n = x.ty.shape[-1]
        eye = op.eye(n, dtype=str(x.ty.dtype.dtype))
        return [relax.Tuple([op.expand_dims(output_grad, [-1]) * eye])]
    grads = []
    for i, sub in enumerate(ins):
        others = [s for j, s in enumerate(ins) if j != i]
        available = set(out).union(*others) if others else set(out)
        if len(set(sub)) != len(sub) or not set(sub) <= available:
            raise ValueError(f"gradient of relax.einsum: operand {i} of {spec!r} repeats or sums out a label alone")
        terms = [output_grad] + [relax.TupleGetItem(operands, j) for j in range(len(ins)) if j != i]
        g = op.einsum(terms, ",".join([out] + others) + "->" + sub)
        grads.append(g)
    return [relax.Tuple(grads)]


@rule("relax.prod")
def _prod_grad(orig_var, orig_call, output_grad, ctx):
    """``d x = dy * prod / x`` (inputs without zeros)."""
    (x,) = orig_call.args
    ndim = int(x.ty.ndim)
    return [_unreduce(output_grad, orig_call, ndim) * _unreduce(orig_var, orig_call, ndim) / x]


@rule("relax.std")
def _std_grad(orig_var, orig_call, output_grad, ctx):
    """Population standard deviation over ``axis``: ``d x = dy * (x - mean) / (n * std)``."""
    (x,) = orig_call.args
    ndim = int(x.ty.ndim)
    axes = _axes(orig_call.attrs.axis, ndim)
    dtype = str(x.ty.dtype.dtype)
    n = 1
    for a in axes:
        size = x.ty.shape[a]
        if not isinstance(size, tirx.IntImm):
            raise ValueError(f"gradient of relax.std: reduced axis {a} must be static, got {size}")
        n *= int(size)
    centered = x - op.mean(x, axis=axes, keepdims=True)
    denom = _unreduce(orig_var, orig_call, ndim) * relax.const(float(n), dtype)
    return [_unreduce(output_grad, orig_call, ndim) * centered / denom]


@rule("relax.cumprod")
def _cumprod_grad(orig_var, orig_call, output_grad, ctx):
    """``y_i = prod_{j<=i} x_j``: ``d x_j = (sum_{i>=j} dy_i y_i) / x_j`` (inputs without zeros);
    the reverse cumulative sum is flip-cumsum-flip."""
    (x,) = orig_call.args
    if bool(orig_call.attrs.exclusive):
        raise ValueError("gradient of relax.cumprod: exclusive=False expected, got True")
    axis = orig_call.attrs.axis
    if axis is None:
        flat = op.reshape(output_grad * orig_var, [-1])
        rev = op.flip(op.cumsum(op.flip(flat, 0), 0), 0)
        return [op.reshape(rev, x.ty.shape) / x]
    axis = int(axis)
    rev = op.flip(op.cumsum(op.flip(output_grad * orig_var, axis), axis), axis)
    return [rev / x]


@rule("relax.index_tensor")
def _index_tensor_grad(orig_var, orig_call, output_grad, ctx):
    """``y = x[i0, i1, ...]``: ``d x`` accumulates ``dy`` at the positions read."""
    x, indices = orig_call.args
    dx = op.index_put(op.zeros_like(x), indices, output_grad, accumulate=True)
    return [dx, no_grad(indices)]


@rule("relax.index_put")
def _index_put_grad(orig_var, orig_call, output_grad, ctx):
    """``accumulate``: ``y = x + scatter(v)``, so ``d x = dy``; otherwise the overwritten positions
    of ``x`` get no gradient. ``d v`` reads ``dy`` at the indices (summed where ``v`` broadcast)."""
    x, indices, values = orig_call.args
    if bool(orig_call.attrs.accumulate):
        dx = output_grad
    else:
        dx = op.index_put(output_grad, indices, op.zeros_like(values), accumulate=False)
    dv = op.index_tensor(output_grad, indices)
    return [dx, no_grad(indices), op.collapse_sum_to(dv, values.ty.shape)]


@rule("relax.slice_scatter")
def _slice_scatter_grad(orig_var, orig_call, output_grad, ctx):
    """``y = x`` with ``x[start:end:step]`` along ``axis`` replaced by ``src``."""
    x, src, start, end, step = orig_call.args
    axis = int(orig_call.attrs.axis)
    dx = op.slice_scatter(output_grad, op.zeros_like(src), start, end, step, axis)
    dsrc = op.strided_slice(output_grad, [axis], [start.value], [end.value], [step.value], assume_inbound=True)
    return [dx, dsrc, no_grad(start), no_grad(end), no_grad(step)]


@rule("relax.topk")
def _topk_grad(orig_var, orig_call, output_grad, ctx):
    """The values' gradient goes back to the positions they were taken from."""
    (x,) = orig_call.args
    if str(orig_call.attrs.ret_type) != "both":
        raise ValueError(f"gradient of relax.topk: ret_type 'both' expected, got {orig_call.attrs.ret_type!r}")
    axis = int(orig_call.attrs.axis)
    d_values = relax.TupleGetItem(output_grad, 0)
    indices = relax.TupleGetItem(orig_var, 1)
    dx = op.scatter_elements(op.zeros_like(x), indices, d_values, axis=axis, reduction="add")
    return [dx]


@rule("relax.matmul")
def _matmul_grad(orig_var, orig_call, output_grad, ctx):
    """TVM's rule, with the output gradient cast back to the operands' dtype first: the torch
    importer writes ``matmul(a, b, out_dtype="float32")`` for float64 operands too, and TVM's rule
    then multiplies a float32 gradient with float64 operands ("Binary operators must have the
    same datatype")."""
    from tvm.relax.op._op_gradient import matmul_grad

    dtype = str(orig_call.args[0].ty.dtype.dtype)
    if str(orig_var.ty.dtype.dtype) != dtype:
        output_grad = op.astype(output_grad, dtype)
    return matmul_grad(orig_var, orig_call, output_grad, ctx)


@rule("relax.median")
def _median_grad(orig_var, orig_call, output_grad, ctx):
    """Along an axis the median's gradient goes back to the position it was taken from (the
    op's index output); over the whole tensor to the elements equal to it (shared by ties)."""
    (x,) = orig_call.args
    ndim = int(x.ty.ndim)
    axis = orig_call.attrs.axis
    if axis is None or len(axis) == 0 or isinstance(orig_var.ty, relax.TensorType):
        hit = op.astype(op.equal(x, _unreduce(orig_var, orig_call, ndim)), str(x.ty.dtype.dtype))
        axes = _axes(axis if axis is not None and len(axis) else None, ndim)
        return [_unreduce(output_grad, orig_call, ndim) * hit / op.sum(hit, axis=axes, keepdims=True)]
    ax = int(axis[0]) % ndim
    d_values, indices = relax.TupleGetItem(output_grad, 0), relax.TupleGetItem(orig_var, 1)
    if not orig_call.attrs.keepdims:
        d_values, indices = op.expand_dims(d_values, [ax]), op.expand_dims(indices, [ax])
    return [op.scatter_elements(op.zeros_like(x), indices, d_values, axis=ax, reduction="add")]
