"""Decompositions of the norm backward ops into primitive Relax ops that have gradients
(``mean``/``sum``/``sqrt``/``divide``; ``1 / sqrt``, not ``rsqrt``, whose gradient is an rlx op), so
that a decomposed backward can be differentiated again."""

from __future__ import annotations

from tvm import relax

from ...kernels.common import acc_dtype, tensor_dtype
from .common import cast, normalized_dx, rms_norm_dx, shape_of

_op = relax.op

# Reshape rather than expand_dims/squeeze and keepdims=True sums: expand_dims's gradient is a
# squeeze, which has no gradient, and the decompositions must stay differentiable at any order.


def _relax_along(v, shape, axis):
    """[shape[axis]] vector -> broadcastable against ``shape``: 1 everywhere but ``axis``."""
    if len(shape) == 1:
        return v
    return _op.reshape(v, [d if i == axis else 1 for i, d in enumerate(shape)])


def sum_to_vector(e, shape, keep: int):
    """Sum of ``e`` (of ``shape``) over every axis but ``keep``, as a [shape[keep]] vector."""
    others = [i for i in range(len(shape)) if i != keep]
    return _op.reshape(_op.sum(e, axis=others, keepdims=True), [shape[keep]]) if others else e


def _relax_mean(e, axes):
    return _op.mean(e, axis=axes, keepdims=True)


def _relax_rstd(mean_sq, eps, dtype):
    """(mean_sq + eps)^(-1/2) as 1 / sqrt(.): rsqrt's gradient is an rlx op, not a primitive."""
    return _op.divide(relax.const(1.0, dtype), _op.sqrt(mean_sq + relax.const(eps, dtype)))


def _relax_layer_stats(x, axes, eps, dtype):
    xc = x - _relax_mean(x, axes)
    r = _relax_rstd(_relax_mean(xc * xc, axes), eps, dtype)
    return xc * r, r


def _relax_group_stats(x, shape, groups, eps, dtype):
    """x of ``shape`` [N, C, *sp] -> (grouped shape [N, G, C/G, *sp], xh and r on it, the block
    axes). The shape is passed in: a cast ``x`` is a nested expression without a type yet."""
    grouped = [shape[0], groups, int(shape[1]) // groups, *shape[2:]]
    axes = list(range(2, len(grouped)))
    xh, r = _relax_layer_stats(_op.reshape(x, grouped), axes, eps, dtype)
    return grouped, xh, r, axes


def layer_norm_input(bb, x, gamma, dy, *, axis, eps):
    dtype = tensor_dtype(x)
    acc = acc_dtype(dtype)
    shape = shape_of(x)
    a = axis % len(shape)
    x, gamma, dy = (cast(t, dtype, acc) for t in (x, gamma, dy))
    xh, r = _relax_layer_stats(x, [a], eps, acc)
    g = dy * _relax_along(gamma, shape, a)
    return cast(normalized_dx(r, xh, g, lambda e: _relax_mean(e, [a])), acc, dtype)


def layer_norm_gamma(bb, x, dy, *, axis, eps):
    dtype = tensor_dtype(x)
    acc = acc_dtype(dtype)
    shape = shape_of(x)
    a = axis % len(shape)
    x, dy = cast(x, dtype, acc), cast(dy, dtype, acc)
    xh, _ = _relax_layer_stats(x, [a], eps, acc)
    return cast(sum_to_vector(dy * xh, shape, a), acc, dtype)


def rms_norm_input(bb, x, gamma, beta, dy, *, axis, eps):
    dtype = tensor_dtype(x)
    acc = acc_dtype(dtype)
    shape = shape_of(x)
    a = axis % len(shape)
    x, gamma, dy = (cast(t, dtype, acc) for t in (x, gamma, dy))
    r = _relax_rstd(_relax_mean(x * x, [a]), eps, acc)
    gdy = dy * _relax_along(gamma, shape, a)
    return cast(rms_norm_dx(r, x, gdy, lambda e: _relax_mean(e, [a])), acc, dtype)


def rms_norm_gamma(bb, x, gamma, beta, dy, *, axis, eps):
    dtype = tensor_dtype(x)
    acc = acc_dtype(dtype)
    shape = shape_of(x)
    a = axis % len(shape)
    x, dy = cast(x, dtype, acc), cast(dy, dtype, acc)
    r = _relax_rstd(_relax_mean(x * x, [a]), eps, acc)
    return cast(sum_to_vector(dy * x * r, shape, a), acc, dtype)


def rms_norm_beta(bb, x, gamma, beta, dy, *, axis, eps):
    dtype = tensor_dtype(dy)
    acc = acc_dtype(dtype)
    shape = shape_of(dy)
    return cast(sum_to_vector(cast(dy, dtype, acc), shape, axis % len(shape)), acc, dtype)


def group_norm_input(bb, x, gamma, beta, dy, *, num_groups, eps):
    dtype = tensor_dtype(x)
    acc = acc_dtype(dtype)
    shape = shape_of(x)
    x, gamma, dy = (cast(t, dtype, acc) for t in (x, gamma, dy))
    grouped, xh, r, axes = _relax_group_stats(x, shape, num_groups, eps, acc)
    s = _op.reshape(dy * _relax_along(gamma, shape, 1), grouped)
    return cast(_op.reshape(normalized_dx(r, xh, s, lambda e: _relax_mean(e, axes)), shape), acc, dtype)


def group_norm_gamma(bb, x, dy, *, num_groups, eps):
    dtype = tensor_dtype(x)
    acc = acc_dtype(dtype)
    shape = shape_of(x)
    x, dy = cast(x, dtype, acc), cast(dy, dtype, acc)
    _, xh, _, _ = _relax_group_stats(x, shape, num_groups, eps, acc)
    # Back to [N, C, *sp] first, then reduce over the batch too (docs/operators.md §8).
    return cast(sum_to_vector(dy * _op.reshape(xh, shape), shape, 1), acc, dtype)


def group_norm_beta(bb, x, dy, *, num_groups, eps):
    dtype = tensor_dtype(dy)
    acc = acc_dtype(dtype)
    return cast(sum_to_vector(cast(dy, dtype, acc), shape_of(dy), 1), acc, dtype)
