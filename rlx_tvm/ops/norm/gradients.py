"""Gradient rules of Relax's own norms: ``relax.transform.Gradient`` emits the norm backward ops
for ``relax.nn.layer_norm``, ``rms_norm`` and ``group_norm`` (several contiguous normalized axes
merged into one; group norm in other layouts transposed to [N, C, *spatial])."""

from __future__ import annotations

from functools import reduce
from operator import mul

from tvm import relax

from ...overrides import override_gradient
from .common import attr_axes, shape_of
from .declarations import (group_norm_backward_beta, group_norm_backward_gamma, group_norm_backward_input,
                           layer_norm_backward_gamma, layer_norm_backward_input, rms_norm_backward_gamma,
                           rms_norm_backward_input)
from .decomposition import sum_to_vector

_op = relax.op


def _identity(e):
    return e


def _rows_view(x, axes: list[int], *tensors):
    """View ``x``-shaped ``tensors`` with the normalized ``axes`` as one axis: contiguous axes are
    merged by a reshape, others first moved to the end (in increasing order) by a transpose.
    Returns (views, axis, the view's shape, a function mapping a view-shaped result back)."""
    shape = shape_of(x)
    ndim = len(shape)
    s = sorted(axes)
    back = _identity
    if s != list(range(s[0], s[-1] + 1)):
        perm = [k for k in range(ndim) if k not in s] + s
        inverse = [perm.index(k) for k in range(ndim)]
        tensors = [_op.permute_dims(t, perm) for t in tensors]
        shape = [shape[k] for k in perm]
        s = list(range(ndim - len(s), ndim))
        back = lambda e: _op.permute_dims(e, inverse)  # noqa: E731
    first, last = s[0], s[-1]
    if first == last:
        return list(tensors), first, shape, back
    merged = shape[:first] + [reduce(mul, shape[first:last + 1])] + shape[last + 1:]
    unpermuted = back
    return ([_op.reshape(t, merged) for t in tensors], first, merged,
            lambda e: unpermuted(_op.reshape(e, shape)))


def _param_order(axes: list[int]) -> list[int]:
    """Parameter dims (laid out in the order of ``axes``) sorted by their axis."""
    return sorted(range(len(axes)), key=lambda k: axes[k])


def _param_vector(p, axes):
    """A parameter of the normalized axes' shape (in the order of ``axes``) as the [H] vector
    along the view of :func:`_rows_view` (axes increasing)."""
    order = _param_order(axes)
    size = reduce(mul, shape_of(p))
    if order != sorted(order):
        p = _op.permute_dims(p, order)
    return _op.reshape(p, [size]) if len(axes) != 1 else p


def _param_like(v, p, axes):
    """The inverse of :func:`_param_vector`: an [H] vector laid out like the parameter ``p``."""
    order = _param_order(axes)
    pshape = shape_of(p)
    if len(axes) != 1:
        v = _op.reshape(v, [pshape[k] for k in order])
    if order != sorted(order):
        v = _op.permute_dims(v, [order.index(k) for k in range(len(order))])
    return v


def _layer_norm_gradient(orig_var, orig_call, output_grad, ctx):
    """R.nn.layer_norm(x, gamma, beta; axes, epsilon, center, scale), like its legalization
    above: ``scale=False`` normalizes with gamma = 1 (and gamma gets a zero gradient),
    ``center=False`` gives beta a zero gradient."""
    x, gamma, beta = orig_call.args
    attrs = orig_call.attrs
    eps = float(attrs.epsilon)
    axes = attr_axes(attrs.axes, x.ty.ndim)
    (xm, dym), a, view, back = _rows_view(x, axes, x, output_grad)
    g = _param_vector(gamma, axes)
    if not attrs.scale:
        g = _op.ones_like(g)
    dx = back(layer_norm_backward_input(xm, g, dym, axis=a, eps=eps))
    if attrs.scale:
        dgamma = _param_like(layer_norm_backward_gamma(xm, dym, axis=a, eps=eps), gamma, axes)
    else:
        dgamma = _op.zeros_like(gamma)
    if attrs.center:
        dbeta = _param_like(sum_to_vector(dym, view, a), beta, axes)
    else:
        dbeta = _op.zeros_like(beta)
    return [dx, dgamma, dbeta]


def _rms_norm_gradient(orig_var, orig_call, output_grad, ctx):
    """R.nn.rms_norm(x, weight; axes, epsilon) has no beta: the backward ops' beta slot (which
    enters none of their results) gets zeros."""
    x, weight = orig_call.args
    eps = float(orig_call.attrs.epsilon)
    axes = attr_axes(orig_call.attrs.axes, x.ty.ndim)
    (xm, dym), a, _, back = _rows_view(x, axes, x, output_grad)
    w = _param_vector(weight, axes)
    beta = _op.zeros_like(w)
    dx = rms_norm_backward_input(xm, w, beta, dym, axis=a, eps=eps)
    dweight = rms_norm_backward_gamma(xm, w, beta, dym, axis=a, eps=eps)
    return [back(dx), _param_like(dweight, weight, axes)]


def _group_norm_gradient(orig_var, orig_call, output_grad, ctx):
    """R.nn.group_norm(x, gamma, beta; num_groups, channel_axis, axes, epsilon, center, scale).
    The ops take [N, C, *spatial]: other layouts (e.g. NHWC) are transposed there and back, and
    the batch axes (none, one or several) merged into N. center/scale as for layer norm."""
    x, gamma, beta = orig_call.args
    attrs = orig_call.attrs
    shape = shape_of(x)
    ndim = len(shape)
    channel = int(attrs.channel_axis) % ndim
    reduced = sorted(attr_axes(attrs.axes, ndim))
    batch = [i for i in range(ndim) if i != channel and i not in reduced]
    perm = batch + [channel] + reduced
    kw = {"num_groups": int(attrs.num_groups), "eps": float(attrs.epsilon)}
    xp, dyp, back = x, output_grad, _identity
    if perm != list(range(ndim)):
        inverse = [perm.index(i) for i in range(ndim)]
        xp, dyp = _op.permute_dims(x, perm), _op.permute_dims(output_grad, perm)
        back = lambda e: _op.permute_dims(e, inverse)  # noqa: E731
    if len(batch) != 1:
        permuted = [shape[k] for k in perm]
        merged = [reduce(mul, permuted[:len(batch)], 1)] + permuted[len(batch):]
        xp, dyp = _op.reshape(xp, merged), _op.reshape(dyp, merged)
        unmerged = back
        back = lambda e: unmerged(_op.reshape(e, permuted))  # noqa: E731
    g = gamma if attrs.scale else _op.ones_like(gamma)
    dx = back(group_norm_backward_input(xp, g, beta, dyp, **kw))
    dgamma = group_norm_backward_gamma(xp, dyp, **kw) if attrs.scale else _op.zeros_like(gamma)
    dbeta = group_norm_backward_beta(xp, dyp, **kw) if attrs.center else _op.zeros_like(beta)
    return [dx, dgamma, dbeta]


override_gradient("relax.nn.layer_norm", _layer_norm_gradient)
override_gradient("relax.nn.rms_norm", _rms_norm_gradient)
override_gradient("relax.nn.group_norm", _group_norm_gradient)
