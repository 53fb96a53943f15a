"""Legalizations of Relax's own forward norms (``relax.nn.layer_norm``, ``rms_norm``,
``group_norm``): float16/float32/float64, any axes."""

from __future__ import annotations

from tvm import te
from tvm.relax.transform.legalize_ops import nn as _tvm_legalize

from ...kernels.common import acc_dtype, tensor_dtype
from ...overrides import override_legalize
from .common import attr_axes
from .kernels import Groups, Rows, call_te, loader, te_layer_stats, te_rms_r

# On by default, replacing TVM 0.27's: its layer norm rejects float64 (which the gradient checks
# run in) and applies gamma and beta although ``scale``/``center`` say not to. These take the
# statistics the way the backward kernels do (two passes, accumulated in float32 at least), so
# a model's forward and its gradient see the same normalization. Other dtypes keep TVM's.
_LEGALIZED_DTYPES = ("float16", "float32", "float64")


def _legalize_layer_norm(bb, call):
    """y = (x - mean) * (var + eps)^(-1/2) [* gamma] [+ beta] over ``axes`` (any set, in any
    order: gamma and beta are laid out in the order of ``axes``); statistics in two passes, in
    float32 at least. ``scale`` / ``center`` False drop gamma / beta."""
    x, gamma, beta = call.args
    dtype = tensor_dtype(x)
    if dtype not in _LEGALIZED_DTYPES:
        return _tvm_legalize._nn_layer_norm(bb, call)
    acc = acc_dtype(dtype)
    attrs = call.attrs
    axes = attr_axes(attrs.axes, x.ty.ndim)
    eps, scale, center = float(attrs.epsilon), bool(attrs.scale), bool(attrs.center)

    def kernel(xt, *params):
        rows = Rows(xt.shape, axes, acc)
        xh, _ = te_layer_stats(rows, loader(xt, acc), eps, keep=False)
        gt = params[0] if scale else None
        bt = params[-1] if center else None

        def y(*i):
            p = [i[a] for a in axes]
            v = xh(i)
            if gt is not None:
                v = v * gt(*p).astype(acc)
            if bt is not None:
                v = v + bt(*p).astype(acc)
            return v.astype(dtype)

        return te.compute(xt.shape, y, name="y")

    params = [gamma] * scale + [beta] * center
    return call_te(bb, "layer_norm", kernel, x, *params)


def _legalize_rms_norm(bb, call):
    """y = x * (mean(x^2) + eps)^(-1/2) * weight over ``axes`` (any set; weight in their order)."""
    x, weight = call.args
    dtype = tensor_dtype(x)
    if dtype not in _LEGALIZED_DTYPES:
        return _tvm_legalize._nn_rms_norm(bb, call)
    acc = acc_dtype(dtype)
    axes = attr_axes(call.attrs.axes, x.ty.ndim)
    eps = float(call.attrs.epsilon)

    def kernel(xt, wt):
        rows = Rows(xt.shape, axes, acc)
        xv = loader(xt, acc)
        r = te_rms_r(rows, xv, eps, keep=False)
        return te.compute(
            xt.shape, lambda *i: (xv(i) * r(i) * wt(*[i[a] for a in axes]).astype(acc)).astype(dtype), name="y"
        )

    return call_te(bb, "rms_norm", kernel, x, weight)


def _legalize_group_norm(bb, call):
    """Per (batch index, group) block of C/G channels times the reduced ``axes``: layer norm,
    then [* gamma_c] [+ beta_c]. Any layout (``channel_axis``, ``axes``; the other axes are
    batch axes, any number of them)."""
    x, gamma, beta = call.args
    dtype = tensor_dtype(x)
    if dtype not in _LEGALIZED_DTYPES:
        return _tvm_legalize._nn_group_norm(bb, call)
    acc = acc_dtype(dtype)
    attrs = call.attrs
    ndim = x.ty.ndim
    channel = int(attrs.channel_axis) % ndim
    axes = attr_axes(attrs.axes, ndim)
    groups, eps = int(attrs.num_groups), float(attrs.epsilon)
    scale, center = bool(attrs.scale), bool(attrs.center)

    def kernel(xt, *params):
        blocks = Groups(xt.shape, groups, acc, channel, axes)
        xh, _ = te_layer_stats(blocks, loader(xt, acc), eps, keep=False)
        gt = params[0] if scale else None
        bt = params[-1] if center else None

        def y(*i):
            v = xh(i)
            if gt is not None:
                v = v * gt[i[channel]].astype(acc)
            if bt is not None:
                v = v + bt[i[channel]].astype(acc)
            return v.astype(dtype)

        return te.compute(xt.shape, y, name="y")

    params = [gamma] * scale + [beta] * center
    return call_te(bb, "group_norm", kernel, x, *params)


override_legalize("relax.nn.layer_norm", _legalize_layer_norm)
override_legalize("relax.nn.rms_norm", _legalize_rms_norm)
override_legalize("relax.nn.group_norm", _legalize_group_norm)
