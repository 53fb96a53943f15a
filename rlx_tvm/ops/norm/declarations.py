"""The norm backward ops: signatures, attribute checks and type inference, with their reference,
decomposition and fused kernel attached."""

from __future__ import annotations

from ..registry import Attr, check_float, check_int, define_op, fmt_shape
from . import decomposition, kernels, reference
from .common import GROUP_EPS, LAYER_EPS, RMS_EPS

_AXIS = Attr("axis", -1, check_int())


_NUM_GROUPS = Attr("num_groups", check=check_int(lo=1))


def _eps(default: float) -> Attr:
    return Attr("eps", default, check_float(lo=0.0, lo_open=True))


def _check_extent(ctx, p, extent, what: str) -> None:
    """``p`` is a [extent] vector. (Like ``ctx.dim_equals``, with dims printed as plain ints.)"""
    if ctx.provably_different(p.dim(0), extent):
        raise ctx.error(p.name, f"shape {fmt_shape([extent])} ({what})", fmt_shape(p.shape))


def _infer_row(ctx, params: tuple[str, ...]):
    """x (rank >= 1), the [H] parameter vectors ``params`` and dy like x; returns (x, axis)."""
    x = ctx.tensor("x", min_ndim=1)
    a = ctx.axis("axis", x.ndim)
    for name in params:
        p = ctx.tensor(name, ndim=1)
        ctx.same_dtype(x, p)
        _check_extent(ctx, p, x.dim(a), f"the extent of x's normalized axis {a}")
    dy = ctx.tensor("dy")
    ctx.same_dtype(x, dy)
    ctx.same_shape(x, dy)
    return x, a


def _infer_group(ctx, params: tuple[str, ...]):
    """x [N, C, *spatial] with a static C divisible by num_groups, [C] vectors, dy like x."""
    x = ctx.tensor("x", min_ndim=2)
    channels = x.static_dim(1)
    if channels is None:
        raise ctx.error("x", "a static channel count (dim 1)", fmt_shape(x.shape))
    groups = ctx.attrs["num_groups"]
    if channels % groups:
        raise ctx.error("num_groups", f"a divisor of the channel count {channels}", groups)
    for name in params:
        p = ctx.tensor(name, ndim=1)
        ctx.same_dtype(x, p)
        _check_extent(ctx, p, channels, "the channel count, x's dim 1")
    dy = ctx.tensor("dy")
    ctx.same_dtype(x, dy)
    ctx.same_shape(x, dy)
    return x


def _infer_row_like_x(params):
    def fn(ctx):
        x, _ = _infer_row(ctx, params)
        return ctx.out(x.shape, x.dtype)

    return fn


def _infer_group_like_x(params):
    def fn(ctx):
        x = _infer_group(ctx, params)
        return ctx.out(x.shape, x.dtype)

    return fn


def _infer_row_vector(params):
    def fn(ctx):
        x, a = _infer_row(ctx, params)
        return ctx.out([x.dim(a)], x.dtype)

    return fn


def _infer_channel_vector(params):
    def fn(ctx):
        x = _infer_group(ctx, params)
        return ctx.out([x.dim(1)], x.dtype)

    return fn


layer_norm_backward_input = define_op(
    "layer_norm_backward_input",
    inputs=("x", "gamma", "dy"),
    attrs=(_AXIS, _eps(LAYER_EPS)),
    doc="d/dx of layer_norm(x) * gamma + beta over one axis: r * (g - mean(g) - xh * mean(g * xh)), g = dy * gamma.",
)
layer_norm_backward_input.infer(_infer_row_like_x(("gamma",)))
layer_norm_backward_input.reference(reference.layer_norm_input)
layer_norm_backward_input.decomposition(decomposition.layer_norm_input)
layer_norm_backward_input.fused(kernels.layer_norm_input)

layer_norm_backward_gamma = define_op(
    "layer_norm_backward_gamma",
    inputs=("x", "dy"),
    attrs=(_AXIS, _eps(LAYER_EPS)),
    doc="d/dgamma of layer_norm(x) * gamma + beta: sum over all other axes of dy * xh; shape [H].",
)
layer_norm_backward_gamma.infer(_infer_row_vector(()))
layer_norm_backward_gamma.reference(reference.layer_norm_gamma)
layer_norm_backward_gamma.decomposition(decomposition.layer_norm_gamma)
layer_norm_backward_gamma.fused(kernels.layer_norm_gamma)


_RMS_PARAMS = ("gamma", "beta")


_RMS_ATTRS = (_AXIS, _eps(RMS_EPS))

rms_norm_backward_input = define_op(
    "rms_norm_backward_input",
    inputs=("x", "gamma", "beta", "dy"),
    attrs=_RMS_ATTRS,
    doc="d/dx of x * r * gamma + beta, r = (mean(x^2) + eps)^(-1/2): r * (gamma*dy - r^2 * x * mean(x*gamma*dy)).",
)
rms_norm_backward_input.infer(_infer_row_like_x(_RMS_PARAMS))
rms_norm_backward_input.reference(reference.rms_norm_input)
rms_norm_backward_input.decomposition(decomposition.rms_norm_input)
rms_norm_backward_input.fused(kernels.rms_norm_input)

rms_norm_backward_gamma = define_op(
    "rms_norm_backward_gamma",
    inputs=("x", "gamma", "beta", "dy"),
    attrs=_RMS_ATTRS,
    doc="d/dgamma of x * r * gamma + beta: sum over all other axes of dy * x * r; shape [H].",
)
rms_norm_backward_gamma.infer(_infer_row_vector(_RMS_PARAMS))
rms_norm_backward_gamma.reference(reference.rms_norm_gamma)
rms_norm_backward_gamma.decomposition(decomposition.rms_norm_gamma)
rms_norm_backward_gamma.fused(kernels.rms_norm_gamma)

rms_norm_backward_beta = define_op(
    "rms_norm_backward_beta",
    inputs=("x", "gamma", "beta", "dy"),
    attrs=_RMS_ATTRS,
    doc="d/dbeta of x * r * gamma + beta: sum over all other axes of dy; shape [H].",
)
rms_norm_backward_beta.infer(_infer_row_vector(_RMS_PARAMS))
rms_norm_backward_beta.reference(reference.rms_norm_beta)
rms_norm_backward_beta.decomposition(decomposition.rms_norm_beta)
rms_norm_backward_beta.fused(kernels.rms_norm_beta)


_GN_ATTRS = (_NUM_GROUPS, _eps(GROUP_EPS))

group_norm_backward_input = define_op(
    "group_norm_backward_input",
    inputs=("x", "gamma", "beta", "dy"),
    attrs=_GN_ATTRS,
    doc="d/dx of group_norm(x[N, C, *spatial]) * gamma_c + beta_c: per (n, group) block, "
    "r * (s - mean(s) - xh * mean(s * xh)) with s = dy * gamma_c.",
)
group_norm_backward_input.infer(_infer_group_like_x(("gamma", "beta")))
group_norm_backward_input.reference(reference.group_norm_input)
group_norm_backward_input.decomposition(decomposition.group_norm_input)
group_norm_backward_input.fused(kernels.group_norm_input)

group_norm_backward_gamma = define_op(
    "group_norm_backward_gamma",
    inputs=("x", "dy"),
    attrs=_GN_ATTRS,
    doc="d/dgamma of group_norm(x) * gamma_c + beta_c: sum over n and spatial of dy * xh; shape [C].",
)
group_norm_backward_gamma.infer(_infer_channel_vector(()))
group_norm_backward_gamma.reference(reference.group_norm_gamma)
group_norm_backward_gamma.decomposition(decomposition.group_norm_gamma)
group_norm_backward_gamma.fused(kernels.group_norm_gamma)

group_norm_backward_beta = define_op(
    "group_norm_backward_beta",
    inputs=("x", "dy"),
    attrs=_GN_ATTRS,
    doc="d/dbeta of group_norm(x) * gamma_c + beta_c: sum over n and spatial of dy; shape [C].",
)
group_norm_backward_beta.infer(_infer_channel_vector(()))
group_norm_backward_beta.reference(reference.group_norm_beta)
group_norm_backward_beta.decomposition(decomposition.group_norm_beta)
group_norm_backward_beta.fused(kernels.group_norm_beta)
