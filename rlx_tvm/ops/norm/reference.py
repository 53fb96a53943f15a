"""NumPy references (float64) of the norm backward ops: what the tests compare with."""

from __future__ import annotations

import numpy as np

from .common import GROUP_EPS, LAYER_EPS, RMS_EPS, normalized_dx, rms_norm_dx


def _np(*arrays):
    return [np.asarray(a, dtype=np.float64) for a in arrays]


def _np_along(v, axis, ndim):
    """The [H] vector ``v`` shaped to broadcast along ``axis`` of a rank-``ndim`` array."""
    shape = [1] * ndim
    shape[axis] = -1
    return v.reshape(shape)


def _np_others(axis, ndim):
    return tuple(i for i in range(ndim) if i != axis)


def _np_layer_stats(x, axis, eps):
    mean = x.mean(axis=axis, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=axis, keepdims=True)
    r = 1.0 / np.sqrt(var + eps)
    return (x - mean) * r, r


def _np_rms_r(x, axis, eps):
    return 1.0 / np.sqrt((x * x).mean(axis=axis, keepdims=True) + eps)


def _np_grouped(x, groups):
    """[N, C, *sp] -> [N, G, C/G, *sp], and the axes of one block."""
    n, c = x.shape[:2]
    xg = x.reshape(n, groups, c // groups, *x.shape[2:])
    return xg, tuple(range(2, xg.ndim))


def layer_norm_input(x, gamma, dy, *, axis=-1, eps=LAYER_EPS):
    x, gamma, dy = _np(x, gamma, dy)
    xh, r = _np_layer_stats(x, axis, eps)
    g = dy * _np_along(gamma, axis, x.ndim)
    return normalized_dx(r, xh, g, lambda a: a.mean(axis=axis, keepdims=True))


def layer_norm_gamma(x, dy, *, axis=-1, eps=LAYER_EPS):
    x, dy = _np(x, dy)
    xh, _ = _np_layer_stats(x, axis, eps)
    return (dy * xh).sum(axis=_np_others(axis % x.ndim, x.ndim))


def rms_norm_input(x, gamma, beta, dy, *, axis=-1, eps=RMS_EPS):
    x, gamma, dy = _np(x, gamma, dy)
    r = _np_rms_r(x, axis, eps)
    gdy = dy * _np_along(gamma, axis, x.ndim)
    return rms_norm_dx(r, x, gdy, lambda a: a.mean(axis=axis, keepdims=True))


def rms_norm_gamma(x, gamma, beta, dy, *, axis=-1, eps=RMS_EPS):
    x, dy = _np(x, dy)
    return (dy * x * _np_rms_r(x, axis, eps)).sum(axis=_np_others(axis % x.ndim, x.ndim))


def rms_norm_beta(x, gamma, beta, dy, *, axis=-1, eps=RMS_EPS):
    (dy,) = _np(dy)
    return dy.sum(axis=_np_others(axis % dy.ndim, dy.ndim))


def group_norm_input(x, gamma, beta, dy, *, num_groups, eps=GROUP_EPS):
    x, gamma, dy = _np(x, gamma, dy)
    s = dy * _np_along(gamma, 1, x.ndim)
    xg, axes = _np_grouped(x, num_groups)
    sg, _ = _np_grouped(s, num_groups)
    xh, r = _np_layer_stats(xg, axes, eps)
    dx = normalized_dx(r, xh, sg, lambda a: a.mean(axis=axes, keepdims=True))
    return dx.reshape(x.shape)


def group_norm_gamma(x, dy, *, num_groups, eps=GROUP_EPS):
    x, dy = _np(x, dy)
    xg, axes = _np_grouped(x, num_groups)
    xh, _ = _np_layer_stats(xg, axes, eps)
    return (dy * xh.reshape(x.shape)).sum(axis=_np_others(1, x.ndim))


def group_norm_beta(x, dy, *, num_groups, eps=GROUP_EPS):
    (dy,) = _np(dy)
    return dy.sum(axis=_np_others(1, dy.ndim))
