"""Samples of the layer / RMS / group norm backward ops (finite differences of independent NumPy
forwards), and the gradient rules of R.nn.layer_norm / rms_norm / group_norm with each
decomposition differentiated (second order of the norms)."""

from functools import partial

import numpy as np
from tvm import relax

from ...ops import get_op
from .. import Case, GradCase

RNG = np.random.default_rng(3)
op = relax.op


# -- independent NumPy forwards (float64) ---------------------------------------------------------


def layer_norm(x, gamma, beta=None, *, axis=-1, eps=1e-5):
    """y = (x - mean) / sqrt(var + eps) * gamma + beta along ``axis`` (biased variance)."""
    xt = np.moveaxis(x, axis, -1)
    mu = xt.mean(-1, keepdims=True)
    var = ((xt - mu) ** 2).mean(-1, keepdims=True)
    y = (xt - mu) / np.sqrt(var + eps) * gamma + (0.0 if beta is None else beta)
    return np.moveaxis(y, -1, axis)


def rms_norm(x, gamma, beta, *, axis=-1, eps=1e-6):
    """y = x / sqrt(mean(x^2) + eps) * gamma + beta along ``axis``."""
    xt = np.moveaxis(x, axis, -1)
    y = xt / np.sqrt((xt**2).mean(-1, keepdims=True) + eps) * gamma + beta
    return np.moveaxis(y, -1, axis)


def group_norm(x, gamma, beta=None, *, num_groups, eps=1e-5):
    """x [N, C, *spatial]: normalize each (n, group of C/G channels) block, then per channel."""
    n, c = x.shape[:2]
    blocks = x.reshape(n, num_groups, -1)
    mu = blocks.mean(-1, keepdims=True)
    var = ((blocks - mu) ** 2).mean(-1, keepdims=True)
    xh = ((blocks - mu) / np.sqrt(var + eps)).reshape(x.shape)
    per_channel = (1, c) + (1,) * (x.ndim - 2)
    y = xh * gamma.reshape(per_channel)
    return y if beta is None else y + beta.reshape(per_channel)


# -- cases ----------------------------------------------------------------------------------------


def normal(*shape):
    return RNG.standard_normal(shape)


def scales(n):
    return RNG.uniform(0.5, 1.5, n)


def _row_batch(x, axis):
    """Symbolic variant: the first axis that is not normalized (None for rank 1)."""
    others = [i for i in range(x.ndim) if i != axis % x.ndim]
    return {"x": others[0], "dy": others[0]} if others else None


def layer_cases(shape, label, which=("input", "gamma"), **attrs):
    axis = attrs.get("axis", -1)
    x, dy = normal(*shape), normal(*shape)
    gamma = scales(shape[axis])
    common = dict(attrs=attrs, batch=_row_batch(x, axis), forward=partial(layer_norm, **attrs))

    def case(o):
        if o == "input":
            return Case("layer_norm_backward_input", {"x": x, "gamma": gamma, "dy": dy}, wrt="x",
                        label=f"layer_input[{label}]", **common)
        return Case("layer_norm_backward_gamma", {"x": x, "dy": dy}, wrt="gamma", fd_extra={"gamma": gamma},
                    label=f"layer_gamma[{label}]", **common)

    return [case(o) for o in which]


def rms_cases(shape, label, which=("input", "gamma", "beta"), **attrs):
    axis = attrs.get("axis", -1)
    x, dy = normal(*shape), normal(*shape)
    ins = {"x": x, "gamma": scales(shape[axis]), "beta": normal(shape[axis]), "dy": dy}
    return [
        Case(f"rms_norm_backward_{o}", ins, attrs, batch=_row_batch(x, axis), label=f"rms_{o}[{label}]",
             forward=partial(rms_norm, **attrs), wrt="x" if o == "input" else o)
        for o in which
    ]


def group_cases(shape, label, which=("input", "gamma", "beta"), **attrs):
    x, dy = normal(*shape), normal(*shape)
    params = {"gamma": scales(shape[1]), "beta": normal(shape[1])}
    common = dict(attrs=attrs, batch={"x": 0, "dy": 0}, forward=partial(group_norm, **attrs))

    def case(o):
        if o == "input":
            return Case("group_norm_backward_input", {"x": x, **params, "dy": dy}, wrt="x",
                        label=f"group_input[{label}]", **common)
        return Case(f"group_norm_backward_{o}", {"x": x, "dy": dy}, wrt=o, fd_extra=params,
                    label=f"group_{o}[{label}]", **common)

    return [case(o) for o in which]


CASES = [
    *layer_cases((8, 8), "square 8x8"),
    *layer_cases((4, 4, 4), "cube, middle axis", axis=1, eps=1e-3),
    *layer_cases((5, 3), "axis 0", which=("input",), axis=0),
    *layer_cases((6,), "rank 1", axis=0),
    *rms_cases((8, 8), "square 8x8"),
    *rms_cases((4, 4, 4), "cube, axis -2", which=("input", "gamma"), axis=-2, eps=1e-2),
    *group_cases((3, 6), "N=3, no spatial", which=("input", "gamma"), num_groups=3),
    *group_cases((2, 4, 5), "N=2, 1d, one group", which=("input",), num_groups=1),
    *group_cases((3, 6, 3, 2), "N=3, 2d", num_groups=3, eps=1e-3),
    *group_cases((2, 4, 2, 3, 2), "N=2, 3d, instance-like", which=("input",), num_groups=4),
]
# operators.md §8 traps. Rows == features: gamma goes along the normalized axis (CASES has the [8, 8]
# last-axis and [4, 4, 4] middle-axis cases; these are the other axes).
SQUARE_CASES = [
    *layer_cases((8, 8), "square, axis 0", which=("input",), axis=0),
    *layer_cases((4, 4, 4), "cube, axis -1", which=("input", "gamma")),
    *rms_cases((8, 8), "square, axis 0", which=("input", "gamma"), axis=0),
    *rms_cases((4, 4, 4), "cube, axis -1", which=("input",)),
]
# N = 2 and 3: dgamma / dbeta sum over n too.
GROUP_BATCH_CASES = [
    *group_cases((2, 4, 3), "N=2", which=("gamma", "beta"), num_groups=2),
    *group_cases((3, 6, 2, 2), "N=3", which=("gamma", "beta"), num_groups=3),
]
SAMPLES = CASES + SQUARE_CASES + GROUP_BATCH_CASES


# -- Relax's own norms: NumPy definitions and cases of R.nn.layer_norm / rms_norm / group_norm --


def np_layer_norm(x, gamma, beta, *, axes, epsilon=1e-5, center=True, scale=True):
    """R.nn.layer_norm: gamma/beta have the normalized axes' extents in the order of ``axes``."""
    ax = [a % x.ndim for a in axes]
    mu = x.mean(axis=tuple(ax), keepdims=True)
    var = ((x - mu) ** 2).mean(axis=tuple(ax), keepdims=True)
    y = (x - mu) / np.sqrt(var + epsilon)
    if scale:
        y = y * _np_param(gamma, ax, x.ndim)
    if center:
        y = y + _np_param(beta, ax, x.ndim)
    return y


def _np_param(p, axes, ndim):
    """A parameter laid out in the order of ``axes``, broadcastable against the input."""
    p = np.transpose(p, np.argsort(axes))  # dims in increasing axis order
    shape = [1] * ndim
    for a, d in zip(sorted(axes), p.shape):
        shape[a] = d
    return p.reshape(shape)


def np_rms_norm(x, w, *, axes, epsilon=1e-5):
    ax = [a % x.ndim for a in axes]
    return x / np.sqrt((x * x).mean(axis=tuple(ax), keepdims=True) + epsilon) * _np_param(w, ax, x.ndim)


def np_group_norm(x, gamma, beta, *, num_groups, channel_axis, axes, epsilon=1e-5, center=True, scale=True):
    """Any layout: move the batch axes first, then the channel, then ``axes``; normalize each
    (batch index, group) block; scale and shift per channel; move back."""
    c = channel_axis % x.ndim
    red = sorted(a % x.ndim for a in axes)
    batch = [k for k in range(x.ndim) if k != c and k not in red]
    perm = batch + [c] + red
    xt = np.transpose(x, perm)
    nb, ch = len(batch), x.shape[c]
    blocks = xt.reshape(xt.shape[:nb] + (num_groups, ch // num_groups) + xt.shape[nb + 1:])
    bax = tuple(range(nb + 1, blocks.ndim))
    mu = blocks.mean(axis=bax, keepdims=True)
    var = ((blocks - mu) ** 2).mean(axis=bax, keepdims=True)
    y = ((blocks - mu) / np.sqrt(var + epsilon)).reshape(xt.shape)
    per_channel = [1] * x.ndim
    per_channel[nb] = ch
    if scale:
        y = y * gamma.reshape(per_channel)
    if center:
        y = y + beta.reshape(per_channel)
    return np.transpose(y, np.argsort(perm))


def relax_layer_norm_case(shape, label, axes, sym=None, offset=0.0, **attrs):
    ax = [a % len(shape) for a in axes]
    pshape = [shape[a] for a in ax]
    ins = {"x": normal(*shape) + offset, "g": scales(int(np.prod(pshape))).reshape(pshape), "b": normal(*pshape)}
    return (f"layer_norm {label}", lambda x, g, b: op.nn.layer_norm(x, g, b, axes=axes, **attrs),
            partial(np_layer_norm, axes=axes, **attrs), ins, sym)


def relax_rms_norm_case(shape, label, axes, sym=None, **attrs):
    pshape = [shape[a % len(shape)] for a in axes]
    ins = {"x": normal(*shape), "weight": scales(int(np.prod(pshape))).reshape(pshape)}
    return (f"rms_norm {label}", lambda x, w: op.nn.rms_norm(x, w, axes=axes, **attrs),
            partial(np_rms_norm, axes=axes, **attrs), ins, sym)


def relax_group_norm_case(shape, label, sym=None, offset=0.0, **attrs):
    ch = shape[attrs["channel_axis"] % len(shape)]
    ins = {"x": normal(*shape) + offset, "g": scales(ch), "b": normal(ch)}
    return (f"group_norm {label}", lambda x, g, b: op.nn.group_norm(x, g, b, **attrs),
            partial(np_group_norm, **attrs), ins, sym)


# -- gradient rules of Relax's own norms ----------------------------------------------------------


def rule_cases():
    """(label, forward Relax builder, inputs); each differentiated as sum(norm(...) * w)."""
    cases = [
        relax_layer_norm_case((2, 3, 4), "axes=[-1]", [-1]),
        relax_layer_norm_case((2, 3, 4), "axes=[1, 2]", [1, 2], epsilon=1e-3),
        relax_layer_norm_case((2, 3, 4), "axes=[2, 0]", [2, 0]),
        relax_layer_norm_case((2, 3, 4), "axes=[1] center=False", [1], center=False),
        relax_layer_norm_case((2, 3, 4), "axes=[-1] scale=False", [-1], scale=False),
        relax_rms_norm_case((2, 3, 4), "axes=[-1]", [-1], epsilon=1e-6),
        relax_rms_norm_case((2, 3, 4), "axes=[1, 2]", [1, 2], epsilon=1e-6),
        relax_rms_norm_case((2, 3, 4), "axes=[0]", [0]),
        relax_group_norm_case((2, 4, 3, 2), "NCHW", num_groups=2, channel_axis=1, axes=[2, 3]),
        relax_group_norm_case((2, 3, 2, 4), "NHWC", num_groups=2, channel_axis=-1, axes=[1, 2]),
        relax_group_norm_case((2, 2, 2, 4), "two batch axes, center=False", num_groups=2, channel_axis=3, axes=[2], center=False),
        relax_group_norm_case((2, 4, 3), "scale=False", num_groups=2, channel_axis=1, axes=[2], scale=False),
    ]
    return [(label, build, {**ins, "w": normal(*ins["x"].shape)}) for label, build, _, ins, _ in cases]


def _weighted(build):
    return lambda *args: op.sum(op.multiply(build(*args[:-1]), args[-1]))


def _decomposed(name, **attrs):
    """A builder that inlines the op's decomposition, so rlx autodiff differentiates it."""
    opdef = get_op(name)
    return lambda *args: op.sum(op.multiply(opdef.decompose_fn(None, *args[:-1], **attrs), args[-1]))


def _grad_cases():
    """For tests/test_gradients.py (float32, float64, Hessian-vector products): the gradient
    rules of R.nn.layer_norm/rms_norm/group_norm (their float64 forwards compile through the rlx
    legalizations, checked against NumPy by tests/test_norm.py), and each decomposition
    differentiated, i.e. second order of the norms."""
    x, dy, xg, dyg = normal(3, 4), normal(3, 4), normal(2, 4, 3), normal(2, 4, 3)
    g, b = scales(4), normal(4)
    cases = [
        *[GradCase(f"relax.nn.{label}", ins, _weighted(build)) for label, build, ins in rule_cases()],
        GradCase("decomposed layer_input", {"x": x, "gamma": g, "dy": dy, "w": normal(3, 4)},
                 _decomposed("layer_norm_backward_input", axis=-1, eps=1e-5)),
        GradCase("decomposed layer_gamma axis 0", {"x": x.T, "dy": dy.T, "w": normal(4)},
                 _decomposed("layer_norm_backward_gamma", axis=0, eps=1e-3)),
        *[
            GradCase(f"decomposed rms_{o}", {"x": x, "gamma": g, "beta": b, "dy": dy, "w": normal(*shape)},
                     _decomposed(f"rms_norm_backward_{o}", axis=-1, eps=1e-6))
            for o, shape in (("input", (3, 4)), ("gamma", (4,)), ("beta", (4,)))
        ],
        GradCase("decomposed group_input", {"x": xg, "gamma": g, "beta": b, "dy": dyg, "w": normal(2, 4, 3)},
                 _decomposed("group_norm_backward_input", num_groups=2, eps=1e-5)),
        *[
            GradCase(f"decomposed group_{o}", {"x": xg, "dy": dyg, "w": normal(4)},
                     _decomposed(f"group_norm_backward_{o}", num_groups=2, eps=1e-5))
            for o in ("gamma", "beta")
        ],
    ]
    for c in cases:
        c.wrt = [k for k in c.inputs if k != "w"]
    return cases


GRAD_CASES = _grad_cases()
