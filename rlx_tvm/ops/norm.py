"""Normalization backward ops: layer norm, RMS norm and group norm (SPEC §2).

Notation, over the elements normalized together (one row along ``axis`` for layer/RMS norm, one
``(n, group)`` block of ``C/G * prod(spatial)`` elements for group norm): ``mean`` and the biased
variance ``var``, ``r = (var + eps)^(-1/2)`` (RMS norm: ``r = (mean(x^2) + eps)^(-1/2)``) and
``xh = (x - mean) * r``.

* layer norm, ``y = xh * gamma + beta``:
  ``dx = r * (g - mean(g) - xh * mean(g * xh))`` with ``g = dy * gamma``; ``dgamma = sum dy * xh``.
* RMS norm, ``y = x * r * gamma + beta``:
  ``dx = r * (gamma * dy - r^2 * x * mean(x * gamma * dy))``; ``dgamma = sum dy * x * r``;
  ``dbeta = sum dy``.
* group norm, ``y = xh * gamma_c + beta_c``: layer norm's formula per block with
  ``s = dy * gamma_c``; ``dgamma_c = sum_{n, spatial} dy * xh``, ``dbeta_c = sum_{n, spatial} dy``.

The parameter vectors are laid along the normalized axis (layer/RMS) or the channel axis (group),
never broadcast by trailing alignment alone: with a square ``[8, 8]`` input that would silently
scale the wrong axis (SPEC §8). Parameter gradients reduce over every other axis, the batch
included (SPEC §8: a reshape that keeps N is wrong for N > 1).

The fused kernels compute the statistics in two passes (mean first, then the centred variance)
and accumulate in float32 at least; the decompositions use ``mean``/``sum``/``sqrt``/``divide``
(``1 / sqrt``, not ``rsqrt``, whose gradient is an rlx op) so they can be differentiated again.

Importing the module also registers gradients for ``R.nn.layer_norm``, ``R.nn.rms_norm`` and
``R.nn.group_norm`` that emit these ops (several contiguous normalized axes are merged into one;
group norm in other layouts is transposed to [N, C, *spatial]).

Limits: group norm needs a static channel count (to check and split the groups). Symbolic dims
work everywhere in inference and both paths; differentiating a decomposition again needs the
normalized extent (and group block) static, since TVM's ``mean`` gradient reads it as an int.
"""

from __future__ import annotations

from functools import reduce
from operator import mul

import numpy as np
import tvm
from tvm import relax, te, tirx
from tvm.relax.transform.legalize_ops import nn as _tvm_legalize

from ..kernels.annotations import KEEP_STAGE
from ..overrides import override_gradient, override_legalize
from ._math import acc_dtype, tensor_dtype
from .registry import Attr, check_float, check_int, define_op, fmt_shape, fuse_siblings, static_int

_op = relax.op

_AXIS = Attr("axis", -1, check_int())
_NUM_GROUPS = Attr("num_groups", check=check_int(lo=1))


# Defaults, shared by the attributes and the references (``Case.reference`` passes only the
# attributes a case sets).
LAYER_EPS, RMS_EPS, GROUP_EPS = 1e-5, 1e-6, 1e-5


def _eps(default: float) -> Attr:
    return Attr("eps", default, check_float(lo=0.0, lo_open=True))


# --------------------------------------------------------------------------------------------
# Type inference
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# NumPy references (float64)
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Decomposition helpers (primitive Relax ops with gradients)
# --------------------------------------------------------------------------------------------


def _cast(e, src: str, dst: str):
    """``e`` (of dtype ``src``) as ``dst``; nested expressions carry no type yet, hence ``src``."""
    return e if src == dst else _op.astype(e, dst)


# Reshape rather than expand_dims/squeeze and keepdims=True sums: expand_dims's gradient is a
# squeeze, which has no gradient, and the decompositions must stay differentiable at any order.


def _relax_along(v, shape, axis):
    """[shape[axis]] vector -> broadcastable against ``shape``: 1 everywhere but ``axis``."""
    if len(shape) == 1:
        return v
    return _op.reshape(v, [d if i == axis else 1 for i, d in enumerate(shape)])


def _relax_sum_to_vector(e, shape, keep: int):
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


def _relax_normalized_dx(r, xh, g, axes):
    """r * (g - mean(g) - xh * mean(g * xh)): the backward of (x - mean) * r."""
    return r * (g - _relax_mean(g, axes) - xh * _relax_mean(g * xh, axes))


def _shape(e):
    return list(e.ty.shape.values)


# --------------------------------------------------------------------------------------------
# Fused-kernel helpers (TE)
# --------------------------------------------------------------------------------------------


class _Rows:
    """Index algebra for reductions along a set of axes of a TE tensor's shape (one axis for the
    backward ops, any set for the forward legalizations). Stages over the reduced ("row") shape,
    the normalized axes dropped, are read back on full indices with ``at``."""

    def __init__(self, shape, axes, acc: str):
        self.shape = list(shape)
        self.axes = sorted({axes} if isinstance(axes, int) else set(axes))
        self.acc = acc
        self.extents = [self.shape[k] for k in self.axes]
        self.count = reduce(mul, self.extents).astype(acc)
        self.row_shape = [d for k, d in enumerate(self.shape) if k not in self.axes]

    def _split(self, i):
        return tuple(v for k, v in enumerate(i) if k not in self.axes)

    def _join(self, outer, inner):
        """Full indices from row indices ``outer`` and normalized-axis indices ``inner``."""
        outer, inner = iter(outer), iter(inner)
        return tuple(next(inner) if k in self.axes else next(outer) for k in range(len(self.shape)))

    def at(self, t):
        """A row-shaped stage as a function of full indices (the normalized axes dropped)."""
        return lambda i: t(*self._split(i))

    def _reduce_axes(self, name, axes):
        if len(axes) == 1:
            return [te.reduce_axis((0, self.shape[axes[0]]), name=f"{name}_j")]
        return [te.reduce_axis((0, self.shape[k]), name=f"{name}_j{k}") for k in axes]

    def row_sum(self, name, f):
        """Row-shaped stage: sum of ``f`` (a function of full indices) over the normalized axes."""

        def body(*o):
            red = self._reduce_axes(name, self.axes)
            return te.sum(f(self._join(o, red)), axis=red)

        return te.compute(self.row_shape, body, name=name)

    def row_mean(self, name, f):
        total = self.at(self.row_sum(name, f))
        return lambda i: total(i) / self.count

    # The names the statistics helpers use for both views (rows here, blocks in _Groups).
    stat_sum, stat_mean = row_sum, row_mean
    stat_shape = property(lambda self: self.row_shape)

    def chunk_sums(self, name, f, chunks: int):
        """[chunks, *normalized] stage, for 2-D [rows, H] shapes (axis 1): per chunk of
        ``ceil(rows / chunks)`` consecutive rows, the sum of ``f`` over them (what
        :meth:`column_sum` then sums over the chunks). A row count that ``chunks`` may not divide
        (a symbolic one) leaves the last chunks short: rows past the end add nothing and are not
        read (``if_then_else`` evaluates the taken side only)."""
        rows = self.shape[0]
        if static_int(rows) is not None and static_int(rows) % chunks == 0:
            per, inside = rows // chunks, None
        else:
            per = tvm.sym.Analyzer().simplify(tirx.floordiv(rows + chunks - 1, chunks))
            inside = lambda row: row < rows  # noqa: E731
        r = te.reduce_axis((0, per), name=f"{name}_r")

        def body(t, h):
            row = t * per + r
            value = f((row, h))
            if inside is not None:
                value = tirx.if_then_else(inside(row), value, tirx.const(0, self.acc))
            return te.sum(value, axis=r)

        return te.compute((chunks, self.shape[1]), body, name=name)

    def column_sum(self, name, f):
        """Stage of the normalized axes' shape: sum of ``f`` over every other axis."""
        others = [k for k in range(len(self.shape)) if k not in self.axes]

        def body(*j):
            red = {k: te.reduce_axis((0, self.shape[k]), name=f"{name}_k{k}") for k in others}
            idx = self._join([red[k] for k in others], j)
            return te.sum(f(idx), axis=list(red.values())) if red else f(idx)

        return te.compute(self.extents, body, name=name)


def _loader(t, acc):
    return lambda i: t(*i).astype(acc)


def _rstd_stage(shape, sq_sum, count, eps, acc, keep=False):
    """(sum / count + eps)^(-1/2), elementwise over a stage of per-row (per-block) sums."""
    one, eps = tirx.const(1.0, acc), tirx.const(eps, acc)
    # ``keep`` (the backward kernels, which read r once per element several times): inlined, the
    # square root and division would run per element instead of per row. (The forward kernels
    # leave it to fusion: TVM's reverse_compute_inline fails an internal check on a kept stage.)
    return te.compute(shape, lambda *o: one / tirx.sqrt(sq_sum(*o) / count + eps), name="rstd",
                      **({"attrs": KEEP_STAGE} if keep else {}))


def _te_layer_stats(view, x, eps, keep=True):
    """Two-pass mean and biased variance per row of a ``_Rows`` (block of a ``_Groups``)
    ``view``: ``xh(i)`` and ``r(i)`` on full indices."""
    mean = view.stat_mean("mean", x)
    var_sum = view.stat_sum("var_sum", lambda i: (x(i) - mean(i)) * (x(i) - mean(i)))
    r = view.at(_rstd_stage(view.stat_shape, var_sum, view.count, eps, view.acc, keep))
    return (lambda i: (x(i) - mean(i)) * r(i)), r


def _te_rms_r(rows: _Rows, x, eps, keep=True):
    sq_sum = rows.row_sum("sq_sum", lambda i: x(i) * x(i))
    return rows.at(_rstd_stage(rows.row_shape, sq_sum, rows.count, eps, rows.acc, keep))


def _te_normalized_dx(view, g, xh, r, shape, dtype, names):
    """``r * (g - mean(g) - xh * mean(g * xh))`` per row (block) of ``view``: the input gradient of
    layer norm (and group norm's, whose kernel takes the two means from per-channel sums), with
    ``g`` = dy times gamma along its axis."""
    mean_g = view.stat_mean(names[0], g)
    mean_gxh = view.stat_mean(names[1], lambda i: g(i) * xh(i))
    return _te_dx_from_means(g, xh, r, mean_g, mean_gxh, shape, dtype)


def _te_dx_from_means(g, xh, r, mean_g, mean_gxh, shape, dtype):
    """``r * (g - mean_g - xh * mean_gxh)`` on full indices, cast to ``dtype``."""
    return te.compute(shape, lambda *i: (r(i) * (g(i) - mean_g(i) - xh(i) * mean_gxh(i))).astype(dtype), name="dx")


class _Groups:
    """Index algebra for group norm: block (batch index, g) holds channels ``g*D .. g*D + D - 1``
    (``D = C / G``) at every position of the reduced ``axes``; the remaining axes are batch axes.
    The default layout is [N, C, *spatial] (channel 1, every axis after it reduced)."""

    def __init__(self, shape, groups: int, acc: str, channel: int = 1, axes=None):
        self.shape = list(shape)
        ndim = len(self.shape)
        self.groups = groups
        self.acc = acc
        self.channel = channel
        self.axes = list(range(2, ndim)) if axes is None else sorted(axes)
        self.batch = [k for k in range(ndim) if k != channel and k not in self.axes]
        channels = self.shape[channel]
        if not isinstance(channels, (int, tirx.IntImm)):
            raise ValueError(f"rlx group norm kernels need a static channel count, got {channels}")
        self.per_group = int(channels) // groups
        self.spatial = [self.shape[k] for k in self.axes]
        self.block_shape = (*[self.shape[k] for k in self.batch], groups)
        self.count = reduce(mul, self.spatial, tirx.const(self.per_group, "int64")).astype(acc)

    def _names(self, name, axes, letter):
        return [f"{name}_{letter}" if len(axes) == 1 and letter == "n" else f"{name}_{letter}{j}"
                for j in range(len(axes))]

    def _full(self, parts):
        """Full indices from {axis: index}."""
        return tuple(parts[k] for k in range(len(self.shape)))

    def at(self, t):
        """A block-shaped stage as a function of full indices."""
        return lambda i: t(*[i[k] for k in self.batch], i[self.channel] // self.per_group)

    def block_sum(self, name, f):
        def body(*o):
            *b, g = o
            c = te.reduce_axis((0, self.per_group), name=f"{name}_c")
            sp = [te.reduce_axis((0, s), name=n) for s, n in zip(self.spatial, self._names(name, self.axes, "s"))]
            parts = {**dict(zip(self.batch, b)), self.channel: g * self.per_group + c, **dict(zip(self.axes, sp))}
            return te.sum(f(self._full(parts)), axis=[c, *sp])

        return te.compute(self.block_shape, body, name=name)

    def block_mean(self, name, f):
        total = self.at(self.block_sum(name, f))
        return lambda i: total(i) / self.count

    stat_sum, stat_mean = block_sum, block_mean
    stat_shape = property(lambda self: self.block_shape)

    def channel_sum(self, name, f):
        """[C] stage: sum of ``f`` over the batch and reduced axes."""

        def body(c):
            n = [te.reduce_axis((0, self.shape[k]), name=m) for k, m in zip(self.batch, self._names(name, self.batch, "n"))]
            sp = [te.reduce_axis((0, s), name=m) for s, m in zip(self.spatial, self._names(name, self.axes, "s"))]
            parts = {**dict(zip(self.batch, n)), self.channel: c, **dict(zip(self.axes, sp))}
            return te.sum(f(self._full(parts)), axis=[*n, *sp])

        return te.compute((self.shape[self.channel],), body, name=name)

    def over_group_channels(self, name, f):
        """Block-shaped stage: the sum of ``f(batch indices, channel)`` over the block's channels
        (per-channel results combined per group)."""

        def body(*o):
            *b, g = o
            c = te.reduce_axis((0, self.per_group), name=f"{name}_c")
            return te.sum(f(b, g * self.per_group + c), axis=c)

        return te.compute(self.block_shape, body, name=name)

    def per_sample_sum(self, name, f):
        """[*batch, C] stage: sum of ``f`` over the reduced axes only (what :meth:`channel_sum`
        then sums over the batch); a row reduction per sample and channel."""

        def body(*bc):
            *b, c = bc
            sp = [te.reduce_axis((0, s), name=m) for s, m in zip(self.spatial, self._names(name, self.axes, "s"))]
            value = f(self._full({**dict(zip(self.batch, b)), self.channel: c, **dict(zip(self.axes, sp))}))
            return te.sum(value, axis=sp) if sp else value

        return te.compute((*[self.shape[k] for k in self.batch], self.shape[self.channel]), body, name=name)


def _as_dtype(t, dtype):
    """Cast an accumulator stage to the output dtype (no copy stage when they agree)."""
    if str(t.dtype) == dtype:
        return t
    return te.compute(t.shape, lambda *i: t(*i).astype(dtype), name=f"{t.op.name}_{dtype}")


def _call_te(bb, name, kernel, *args):
    return bb.call_te(kernel, *args, primfunc_name_hint=f"rlx_{name}")


# --------------------------------------------------------------------------------------------
# layer_norm_backward_input / layer_norm_backward_gamma
# --------------------------------------------------------------------------------------------

layer_norm_backward_input = define_op(
    "layer_norm_backward_input",
    inputs=("x", "gamma", "dy"),
    attrs=(_AXIS, _eps(LAYER_EPS)),
    doc="d/dx of layer_norm(x) * gamma + beta over one axis: r * (g - mean(g) - xh * mean(g * xh)), g = dy * gamma.",
)
layer_norm_backward_input.infer(_infer_row_like_x(("gamma",)))


@layer_norm_backward_input.reference
def _ln_input_ref(x, gamma, dy, *, axis=-1, eps=LAYER_EPS):
    x, gamma, dy = _np(x, gamma, dy)
    xh, r = _np_layer_stats(x, axis, eps)
    g = dy * _np_along(gamma, axis, x.ndim)
    return r * (g - g.mean(axis=axis, keepdims=True) - xh * (g * xh).mean(axis=axis, keepdims=True))


@layer_norm_backward_input.decomposition
def _ln_input_decompose(bb, x, gamma, dy, *, axis, eps):
    dtype = tensor_dtype(x)
    acc = acc_dtype(dtype)
    shape = _shape(x)
    a = axis % len(shape)
    x, gamma, dy = (_cast(t, dtype, acc) for t in (x, gamma, dy))
    xh, r = _relax_layer_stats(x, [a], eps, acc)
    g = dy * _relax_along(gamma, shape, a)
    return _cast(_relax_normalized_dx(r, xh, g, [a]), acc, dtype)


@layer_norm_backward_input.fused
def _ln_input_fused(bb, x, gamma, dy, *, axis, eps):
    return _fused_alone(bb, "layer_norm", ("input",), x, gamma, dy, axis=axis, eps=eps)


def _ln_kernel(roles, x, axis, eps, partial=None):
    """TE kernel over :func:`_kernel_operands` for the layer-norm gradients in ``roles``
    ("input": dx, "gamma": dgamma), one set of row statistics for all of them; ``partial``: see
    :func:`_param_sum`."""
    dtype = tensor_dtype(x)
    acc = acc_dtype(dtype)
    a = axis % x.ty.ndim

    def kernel(*operands):
        xt, gt, dyt = _split_operands(roles, operands)
        rows = _Rows(xt.shape, a, acc)
        xv, dyv = _loader(xt, acc), _loader(dyt, acc)
        xh, r = _te_layer_stats(rows, xv, eps)
        outs = {}
        if "input" in roles:
            g = lambda i: dyv(i) * gt[i[a]].astype(acc)  # noqa: E731  (gamma along the normalized axis)
            outs["input"] = _te_normalized_dx(rows, g, xh, r, xt.shape, dtype, ("mean_g", "mean_gxh"))
        if "gamma" in roles:
            outs["gamma"] = _param_sum(rows, "dgamma", lambda i: dyv(i) * xh(i), dtype, partial)
        if "beta" in roles:  # (no op: a plain sum(dy) that FuseSiblingBackwardOps takes in)
            outs["beta"] = _param_sum(rows, "dbeta", dyv, dtype, partial)
        return _in_order(outs, roles)

    return kernel


layer_norm_backward_gamma = define_op(
    "layer_norm_backward_gamma",
    inputs=("x", "dy"),
    attrs=(_AXIS, _eps(LAYER_EPS)),
    doc="d/dgamma of layer_norm(x) * gamma + beta: sum over all other axes of dy * xh; shape [H].",
)
layer_norm_backward_gamma.infer(_infer_row_vector(()))


@layer_norm_backward_gamma.reference
def _ln_gamma_ref(x, dy, *, axis=-1, eps=LAYER_EPS):
    x, dy = _np(x, dy)
    xh, _ = _np_layer_stats(x, axis, eps)
    return (dy * xh).sum(axis=_np_others(axis % x.ndim, x.ndim))


@layer_norm_backward_gamma.decomposition
def _ln_gamma_decompose(bb, x, dy, *, axis, eps):
    dtype = tensor_dtype(x)
    acc = acc_dtype(dtype)
    shape = _shape(x)
    a = axis % len(shape)
    x, dy = _cast(x, dtype, acc), _cast(dy, dtype, acc)
    xh, _ = _relax_layer_stats(x, [a], eps, acc)
    return _cast(_relax_sum_to_vector(dy * xh, shape, a), acc, dtype)


@layer_norm_backward_gamma.fused
def _ln_gamma_fused(bb, x, dy, *, axis, eps):
    return _fused_alone(bb, "layer_norm", ("gamma",), x, None, dy, axis=axis, eps=eps)


# --------------------------------------------------------------------------------------------
# rms_norm_backward_input / _gamma / _beta
# --------------------------------------------------------------------------------------------

_RMS_PARAMS = ("gamma", "beta")
_RMS_ATTRS = (_AXIS, _eps(RMS_EPS))

rms_norm_backward_input = define_op(
    "rms_norm_backward_input",
    inputs=("x", "gamma", "beta", "dy"),
    attrs=_RMS_ATTRS,
    doc="d/dx of x * r * gamma + beta, r = (mean(x^2) + eps)^(-1/2): r * (gamma*dy - r^2 * x * mean(x*gamma*dy)).",
)
rms_norm_backward_input.infer(_infer_row_like_x(_RMS_PARAMS))


@rms_norm_backward_input.reference
def _rms_input_ref(x, gamma, beta, dy, *, axis=-1, eps=RMS_EPS):
    x, gamma, dy = _np(x, gamma, dy)
    r = _np_rms_r(x, axis, eps)
    gdy = dy * _np_along(gamma, axis, x.ndim)
    return r * (gdy - r * r * x * (x * gdy).mean(axis=axis, keepdims=True))


@rms_norm_backward_input.decomposition
def _rms_input_decompose(bb, x, gamma, beta, dy, *, axis, eps):
    dtype = tensor_dtype(x)
    acc = acc_dtype(dtype)
    shape = _shape(x)
    a = axis % len(shape)
    x, gamma, dy = (_cast(t, dtype, acc) for t in (x, gamma, dy))
    r = _relax_rstd(_relax_mean(x * x, [a]), eps, acc)
    gdy = dy * _relax_along(gamma, shape, a)
    return _cast(r * (gdy - r * r * x * _relax_mean(x * gdy, [a])), acc, dtype)


@rms_norm_backward_input.fused
def _rms_input_fused(bb, x, gamma, beta, dy, *, axis, eps):
    # beta does not enter dx; it is not passed to the kernel.
    return _fused_alone(bb, "rms_norm", ("input",), x, gamma, dy, axis=axis, eps=eps)


def _rms_kernel(roles, x, axis, eps, partial=None):
    """TE kernel over :func:`_kernel_operands` for the RMS-norm gradients in ``roles`` ("input",
    "gamma", "beta"), one set of row statistics for all of them; ``partial``: see :func:`_param_sum`."""
    dtype = tensor_dtype(x)
    acc = acc_dtype(dtype)
    a = axis % x.ty.ndim

    def kernel(*operands):
        xt, gt, dyt = _split_operands(roles, operands)
        if xt is None:  # dbeta alone: no statistics
            return _param_sum(_Rows(dyt.shape, a, acc), "dbeta", _loader(dyt, acc), dtype, partial)
        rows = _Rows(xt.shape, a, acc)
        xv, dyv = _loader(xt, acc), _loader(dyt, acc)
        r = _te_rms_r(rows, xv, eps)
        outs = {}
        if "input" in roles:
            gdy = lambda i: dyv(i) * gt[i[a]].astype(acc)  # noqa: E731
            mean_xgdy = rows.row_mean("mean_xgdy", lambda i: xv(i) * gdy(i))
            outs["input"] = te.compute(
                xt.shape,
                lambda *i: (r(i) * (gdy(i) - r(i) * r(i) * xv(i) * mean_xgdy(i))).astype(dtype),
                name="dx",
            )
        if "gamma" in roles:
            outs["gamma"] = _param_sum(rows, "dgamma", lambda i: dyv(i) * xv(i) * r(i), dtype, partial)
        if "beta" in roles:
            outs["beta"] = _param_sum(rows, "dbeta", dyv, dtype, partial)
        return _in_order(outs, roles)

    return kernel


rms_norm_backward_gamma = define_op(
    "rms_norm_backward_gamma",
    inputs=("x", "gamma", "beta", "dy"),
    attrs=_RMS_ATTRS,
    doc="d/dgamma of x * r * gamma + beta: sum over all other axes of dy * x * r; shape [H].",
)
rms_norm_backward_gamma.infer(_infer_row_vector(_RMS_PARAMS))


@rms_norm_backward_gamma.reference
def _rms_gamma_ref(x, gamma, beta, dy, *, axis=-1, eps=RMS_EPS):
    x, dy = _np(x, dy)
    return (dy * x * _np_rms_r(x, axis, eps)).sum(axis=_np_others(axis % x.ndim, x.ndim))


@rms_norm_backward_gamma.decomposition
def _rms_gamma_decompose(bb, x, gamma, beta, dy, *, axis, eps):
    dtype = tensor_dtype(x)
    acc = acc_dtype(dtype)
    shape = _shape(x)
    a = axis % len(shape)
    x, dy = _cast(x, dtype, acc), _cast(dy, dtype, acc)
    r = _relax_rstd(_relax_mean(x * x, [a]), eps, acc)
    return _cast(_relax_sum_to_vector(dy * x * r, shape, a), acc, dtype)


@rms_norm_backward_gamma.fused
def _rms_gamma_fused(bb, x, gamma, beta, dy, *, axis, eps):
    return _fused_alone(bb, "rms_norm", ("gamma",), x, None, dy, axis=axis, eps=eps)


rms_norm_backward_beta = define_op(
    "rms_norm_backward_beta",
    inputs=("x", "gamma", "beta", "dy"),
    attrs=_RMS_ATTRS,
    doc="d/dbeta of x * r * gamma + beta: sum over all other axes of dy; shape [H].",
)
rms_norm_backward_beta.infer(_infer_row_vector(_RMS_PARAMS))


@rms_norm_backward_beta.reference
def _rms_beta_ref(x, gamma, beta, dy, *, axis=-1, eps=RMS_EPS):
    (dy,) = _np(dy)
    return dy.sum(axis=_np_others(axis % dy.ndim, dy.ndim))


@rms_norm_backward_beta.decomposition
def _rms_beta_decompose(bb, x, gamma, beta, dy, *, axis, eps):
    dtype = tensor_dtype(dy)
    acc = acc_dtype(dtype)
    shape = _shape(dy)
    return _cast(_relax_sum_to_vector(_cast(dy, dtype, acc), shape, axis % len(shape)), acc, dtype)


@rms_norm_backward_beta.fused
def _rms_beta_fused(bb, x, gamma, beta, dy, *, axis, eps):
    return _fused_alone(bb, "rms_norm", ("beta",), x, None, dy, axis=axis, eps=eps)


# --------------------------------------------------------------------------------------------
# group_norm_backward_input / _gamma / _beta
# --------------------------------------------------------------------------------------------

_GN_ATTRS = (_NUM_GROUPS, _eps(GROUP_EPS))


def _relax_group_stats(x, shape, groups, eps, dtype):
    """x of ``shape`` [N, C, *sp] -> (grouped shape [N, G, C/G, *sp], xh and r on it, the block
    axes). The shape is passed in: a cast ``x`` is a nested expression without a type yet."""
    grouped = [shape[0], groups, int(shape[1]) // groups, *shape[2:]]
    axes = list(range(2, len(grouped)))
    xh, r = _relax_layer_stats(_op.reshape(x, grouped), axes, eps, dtype)
    return grouped, xh, r, axes


group_norm_backward_input = define_op(
    "group_norm_backward_input",
    inputs=("x", "gamma", "beta", "dy"),
    attrs=_GN_ATTRS,
    doc="d/dx of group_norm(x[N, C, *spatial]) * gamma_c + beta_c: per (n, group) block, "
    "r * (s - mean(s) - xh * mean(s * xh)) with s = dy * gamma_c.",
)
group_norm_backward_input.infer(_infer_group_like_x(("gamma", "beta")))


@group_norm_backward_input.reference
def _gn_input_ref(x, gamma, beta, dy, *, num_groups, eps=GROUP_EPS):
    x, gamma, dy = _np(x, gamma, dy)
    s = dy * _np_along(gamma, 1, x.ndim)
    xg, axes = _np_grouped(x, num_groups)
    sg, _ = _np_grouped(s, num_groups)
    xh, r = _np_layer_stats(xg, axes, eps)
    dx = r * (sg - sg.mean(axis=axes, keepdims=True) - xh * (sg * xh).mean(axis=axes, keepdims=True))
    return dx.reshape(x.shape)


@group_norm_backward_input.decomposition
def _gn_input_decompose(bb, x, gamma, beta, dy, *, num_groups, eps):
    dtype = tensor_dtype(x)
    acc = acc_dtype(dtype)
    shape = _shape(x)
    x, gamma, dy = (_cast(t, dtype, acc) for t in (x, gamma, dy))
    grouped, xh, r, axes = _relax_group_stats(x, shape, num_groups, eps, acc)
    s = _op.reshape(dy * _relax_along(gamma, shape, 1), grouped)
    return _cast(_op.reshape(_relax_normalized_dx(r, xh, s, axes), shape), acc, dtype)


@group_norm_backward_input.fused
def _gn_input_fused(bb, x, gamma, beta, dy, *, num_groups, eps):
    # beta does not enter dx; it is not passed to the kernel.
    return _fused_alone(bb, "group_norm", ("input",), x, gamma, dy, num_groups=num_groups, eps=eps)


def _gn_kernel(roles, x, num_groups, eps, partial=None):
    """TE kernel over :func:`_kernel_operands` for the group-norm gradients in ``roles`` ("input",
    "gamma", "beta"), one set of block statistics for all of them; ``partial``: see :func:`_param_sum`."""
    dtype = tensor_dtype(x)
    acc = acc_dtype(dtype)

    def kernel(*operands):
        xt, gt, dyt = _split_operands(roles, operands)
        if xt is None:  # dbeta alone: no statistics
            return _param_sum(_Groups(dyt.shape, num_groups, acc), "dbeta", _loader(dyt, acc), dtype, partial)
        groups = _Groups(xt.shape, num_groups, acc)
        xv, dyv = _loader(xt, acc), _loader(dyt, acc)
        xh, r = _te_layer_stats(groups, xv, eps)
        outs = {}
        if "gamma" in roles:
            outs["gamma"] = _param_sum(groups, "dgamma", lambda i: dyv(i) * xh(i), dtype, partial)
        if "beta" in roles:
            outs["beta"] = _param_sum(groups, "dbeta", dyv, dtype, partial)
        if "input" in roles:
            # dx's group means of dy * gamma and dy * gamma * xh from per-channel sums of dy and
            # dy * xh, which are dgamma's and dbeta's partial sums: one pass over x and dy for all.
            def per_channel(role, name, f):
                return outs[role] if partial is not None and role in outs else groups.per_sample_sum(name, f)

            sum_dy = per_channel("beta", "sum_dy", dyv)
            sum_dy_xh = per_channel("gamma", "sum_dy_xh", lambda i: dyv(i) * xh(i))
            gamma = lambda c: gt[c].astype(acc)  # noqa: E731
            sum_s = groups.at(groups.over_group_channels("mean_s", lambda b, c: gamma(c) * sum_dy(*b, c)))
            sum_sxh = groups.at(groups.over_group_channels("mean_sxh", lambda b, c: gamma(c) * sum_dy_xh(*b, c)))
            outs["input"] = _te_dx_from_means(
                lambda i: dyv(i) * gamma(i[1]), xh, r, lambda i: sum_s(i) / groups.count,
                lambda i: sum_sxh(i) / groups.count, xt.shape, dtype)
        return _in_order(outs, roles)

    return kernel


group_norm_backward_gamma = define_op(
    "group_norm_backward_gamma",
    inputs=("x", "dy"),
    attrs=_GN_ATTRS,
    doc="d/dgamma of group_norm(x) * gamma_c + beta_c: sum over n and spatial of dy * xh; shape [C].",
)
group_norm_backward_gamma.infer(_infer_channel_vector(()))


@group_norm_backward_gamma.reference
def _gn_gamma_ref(x, dy, *, num_groups, eps=GROUP_EPS):
    x, dy = _np(x, dy)
    xg, axes = _np_grouped(x, num_groups)
    xh, _ = _np_layer_stats(xg, axes, eps)
    return (dy * xh.reshape(x.shape)).sum(axis=_np_others(1, x.ndim))


@group_norm_backward_gamma.decomposition
def _gn_gamma_decompose(bb, x, dy, *, num_groups, eps):
    dtype = tensor_dtype(x)
    acc = acc_dtype(dtype)
    shape = _shape(x)
    x, dy = _cast(x, dtype, acc), _cast(dy, dtype, acc)
    _, xh, _, _ = _relax_group_stats(x, shape, num_groups, eps, acc)
    # Back to [N, C, *sp] first, then reduce over the batch too (SPEC §8).
    return _cast(_relax_sum_to_vector(dy * _op.reshape(xh, shape), shape, 1), acc, dtype)


@group_norm_backward_gamma.fused
def _gn_gamma_fused(bb, x, dy, *, num_groups, eps):
    return _fused_alone(bb, "group_norm", ("gamma",), x, None, dy, num_groups=num_groups, eps=eps)


group_norm_backward_beta = define_op(
    "group_norm_backward_beta",
    inputs=("x", "dy"),
    attrs=_GN_ATTRS,
    doc="d/dbeta of group_norm(x) * gamma_c + beta_c: sum over n and spatial of dy; shape [C].",
)
group_norm_backward_beta.infer(_infer_channel_vector(()))


@group_norm_backward_beta.reference
def _gn_beta_ref(x, dy, *, num_groups, eps=GROUP_EPS):
    (dy,) = _np(dy)
    return dy.sum(axis=_np_others(1, dy.ndim))


@group_norm_backward_beta.decomposition
def _gn_beta_decompose(bb, x, dy, *, num_groups, eps):
    dtype = tensor_dtype(dy)
    acc = acc_dtype(dtype)
    return _cast(_relax_sum_to_vector(_cast(dy, dtype, acc), _shape(dy), 1), acc, dtype)


@group_norm_backward_beta.fused
def _gn_beta_fused(bb, x, dy, *, num_groups, eps):
    return _fused_alone(bb, "group_norm", ("beta",), x, None, dy, num_groups=num_groups, eps=eps)


# --------------------------------------------------------------------------------------------
# Gradients of one norm computed together (FuseSiblingBackwardOps)
# --------------------------------------------------------------------------------------------

_ROLES = ("input", "gamma", "beta")  # output order of a family's kernel
# Chunks of rows for layer / RMS norm's partial dgamma / dbeta (the parallel loop of the CPU
# schedule): the most of these that divides the rows and leaves at least 4 rows per chunk.
ROW_CHUNKS = (64, 32, 16, 8, 4, 2)
_KERNELS = {"layer_norm": _ln_kernel, "rms_norm": _rms_kernel, "group_norm": _gn_kernel}


def _in_order(outs: dict, roles):
    """A kernel's outputs in ``roles`` order (one tensor for one role)."""
    return outs[roles[0]] if len(roles) == 1 else [outs[r] for r in roles]


def _param_sum(view, name, f, dtype, partial):
    """dgamma / dbeta: the sum of ``f`` over everything but the parameter's axis, in ``dtype``;
    with ``partial``, partial sums in the accumulation dtype, summed by the caller: per chunk of
    ``partial`` row chunks (layer / RMS norm), or per sample (group norm, ``partial=True``)."""
    if partial is None:
        return _as_dtype(view.column_sum(name, f) if isinstance(view, _Rows) else view.channel_sum(name, f), dtype)
    return view.chunk_sums(name, f, partial) if isinstance(view, _Rows) else view.per_sample_sum(name, f)


def _kernel_operands(roles, x, gamma, dy):
    """What a family kernel reads for ``roles``: x (unless only dbeta), gamma (for dx), dy."""
    return [*([x] if roles != ("beta",) else []), *([gamma] if "input" in roles else []), dy]


def _split_operands(roles, operands) -> tuple:
    """(x, gamma, dy) of a family kernel's operands (:func:`_kernel_operands`), None where absent."""
    operands = list(operands)
    x = operands.pop(0) if roles != ("beta",) else None
    gamma = operands.pop(0) if "input" in roles else None
    return x, gamma, operands.pop(0)


def _fused_alone(bb, family, roles, x, gamma, dy, partial=None, **attrs):
    kernel = _KERNELS[family](roles, x, partial=partial, **attrs)
    return _call_te(bb, f"{family}_backward_{'_'.join(roles)}", kernel, *_kernel_operands(roles, x, gamma, dy))


def _role(opdef) -> str:
    return "beta" if opdef is None else opdef.name.rsplit("_", 1)[1]  # None: an absorbed sum(dy)


def _absorbs_dbeta(opdef, call, other) -> bool:
    """``other`` is ``sum(dy)`` over every axis but the parameters' (a norm's dbeta without an
    op, as the layer-norm gradient rule and the suite write it) for the norm gradient ``call``."""
    if not (isinstance(other.op, tvm.ir.Op) and other.op.name == "relax.sum"):
        return False
    args = dict(zip(opdef.all_inputs, opdef.call_args(call)))
    dy, ndim = args["dy"], args["dy"].ty.ndim
    if not other.args[0].same_as(dy) or other.attrs.axis is None or other.attrs.keepdims or ndim < 1:
        return False
    kept = 1 if opdef.name.startswith("group_norm") else opdef.call_attrs(call)["axis"] % ndim
    return sorted(int(a) % ndim for a in other.attrs.axis) == [a for a in range(ndim) if a != kept]


def _norm_sibling_key(opdef, call):
    """The gradients of one norm: same x, dy and attributes."""
    args = dict(zip(opdef.all_inputs, opdef.call_args(call)))
    return (args["x"], args["dy"], *sorted((k, repr(v)) for k, v in opdef.call_attrs(call).items()))


def _fuse_norm_gradients(family, *opdefs):
    @fuse_siblings(*opdefs, key=_norm_sibling_key, absorb=_absorbs_dbeta)
    def together(bb, members):
        """dx, dgamma (and dbeta) of one norm in one kernel: the row (block) statistics, two
        passes over x, are computed once, and dgamma and dbeta come out as partial sums (per chunk
        of rows; per sample for group norm) that the CPU schedule computes in the row loop of dx,
        so that x and dy are read from memory once; their sum over the chunks (samples) follows.
        Layer and RMS norm: normalized axis last and of static size (else left apart); the row
        count may be symbolic."""
        calls = {}
        for opdef, call in members:
            first_op, first = calls.setdefault(_role(opdef), (opdef, call))
            if None not in (opdef, first_op) and (len(first.args) != len(call.args)
                                                  or not all(a.same_as(b) for a, b in zip(first.args, call.args))):
                return None  # two dx of one x and dy with different gammas: left apart
        roles = tuple(r for r in _ROLES if r in calls)
        if len(roles) == 1:
            return None
        opdef, call = next((o, c) for o, c in members if o is not None)
        attrs = opdef.call_attrs(call)
        args = dict(zip(opdef.all_inputs, opdef.call_args(call)))
        x, dy = args["x"], args["dy"]
        # gamma enters dx only: the dx call's (the RMS dgamma/dbeta calls take a gamma of their own)
        gamma = dict(zip(calls["input"][0].all_inputs, calls["input"][0].call_args(calls["input"][1])))["gamma"] \
            if "input" in calls else None
        full_shape = list(x.ty.shape.values)
        shape = [static_int(d) for d in full_shape]
        dtype = tensor_dtype(x)
        if family == "group_norm":
            partial, sum_axes, flat = True, [0], None
        else:
            if shape[-1] is None or attrs["axis"] % len(shape) != len(shape) - 1:
                return None
            if None in shape:  # symbolic rows: the most chunks, the last ones short or empty
                rows = reduce(mul, full_shape[:-1])
                partial = ROW_CHUNKS[0]
            else:
                rows = int(np.prod(shape[:-1]))
                partial = next((c for c in ROW_CHUNKS if rows % c == 0 and rows // c >= 4), 1)
            sum_axes, flat = [0], ([rows, shape[-1]] if len(shape) != 2 else None)
            if flat is not None:
                x, dy = bb.emit(_op.reshape(x, flat)), bb.emit(_op.reshape(dy, flat))
                attrs = {**attrs, "axis": -1}
        out = bb.emit(_fused_alone(bb, family, roles, x, gamma, dy, partial=partial, **attrs))
        results = {}
        for k, role in enumerate(roles):
            value = relax.TupleGetItem(out, k)
            if role == "input":
                results[role] = bb.emit(_op.reshape(value, full_shape) if flat is not None else value)
            else:
                results[role] = bb.emit(_cast(_op.sum(value, axis=sum_axes), acc_dtype(dtype), dtype))
        return [results[_role(opdef)] for opdef, _ in members]

    return together


_fuse_norm_gradients("layer_norm", layer_norm_backward_input, layer_norm_backward_gamma)
_fuse_norm_gradients("rms_norm", rms_norm_backward_input, rms_norm_backward_gamma, rms_norm_backward_beta)
_fuse_norm_gradients("group_norm", group_norm_backward_input, group_norm_backward_gamma, group_norm_backward_beta)


# --------------------------------------------------------------------------------------------
# Legalizations of Relax's own norms: float16/float32/float64, any axes
# --------------------------------------------------------------------------------------------

# On by default, replacing TVM 0.27's: its layer norm rejects float64 (which the gradient checks
# run in) and applies gamma and beta although ``scale``/``center`` say not to. These take the
# statistics the way the backward ops above do (two passes, accumulated in float32 at least), so
# a model's forward and its gradient see the same normalization. Other dtypes keep TVM's.
_LEGALIZED_DTYPES = ("float16", "float32", "float64")


def _attr_axes(axes, ndim: int) -> list[int]:
    return [int(a) % ndim for a in axes]


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
    axes = _attr_axes(attrs.axes, x.ty.ndim)
    eps, scale, center = float(attrs.epsilon), bool(attrs.scale), bool(attrs.center)

    def kernel(xt, *params):
        rows = _Rows(xt.shape, axes, acc)
        xh, _ = _te_layer_stats(rows, _loader(xt, acc), eps, keep=False)
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
    return _call_te(bb, "layer_norm", kernel, x, *params)


def _legalize_rms_norm(bb, call):
    """y = x * (mean(x^2) + eps)^(-1/2) * weight over ``axes`` (any set; weight in their order)."""
    x, weight = call.args
    dtype = tensor_dtype(x)
    if dtype not in _LEGALIZED_DTYPES:
        return _tvm_legalize._nn_rms_norm(bb, call)
    acc = acc_dtype(dtype)
    axes = _attr_axes(call.attrs.axes, x.ty.ndim)
    eps = float(call.attrs.epsilon)

    def kernel(xt, wt):
        rows = _Rows(xt.shape, axes, acc)
        xv = _loader(xt, acc)
        r = _te_rms_r(rows, xv, eps, keep=False)
        return te.compute(
            xt.shape, lambda *i: (xv(i) * r(i) * wt(*[i[a] for a in axes]).astype(acc)).astype(dtype), name="y"
        )

    return _call_te(bb, "rms_norm", kernel, x, weight)


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
    axes = _attr_axes(attrs.axes, ndim)
    groups, eps = int(attrs.num_groups), float(attrs.epsilon)
    scale, center = bool(attrs.scale), bool(attrs.center)

    def kernel(xt, *params):
        blocks = _Groups(xt.shape, groups, acc, channel, axes)
        xh, _ = _te_layer_stats(blocks, _loader(xt, acc), eps, keep=False)
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
    return _call_te(bb, "group_norm", kernel, x, *params)


override_legalize("relax.nn.layer_norm", _legalize_layer_norm)
override_legalize("relax.nn.rms_norm", _legalize_rms_norm)
override_legalize("relax.nn.group_norm", _legalize_group_norm)


# --------------------------------------------------------------------------------------------
# Gradient rules: relax.transform.Gradient emits the ops above for Relax's own norms
# --------------------------------------------------------------------------------------------

def _identity(e):
    return e


def _rows_view(x, axes: list[int], *tensors):
    """View ``x``-shaped ``tensors`` with the normalized ``axes`` as one axis: contiguous axes are
    merged by a reshape, others first moved to the end (in increasing order) by a transpose.
    Returns (views, axis, the view's shape, a function mapping a view-shaped result back)."""
    shape = _shape(x)
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
    size = reduce(mul, _shape(p))
    if order != sorted(order):
        p = _op.permute_dims(p, order)
    return _op.reshape(p, [size]) if len(axes) != 1 else p


def _param_like(v, p, axes):
    """The inverse of :func:`_param_vector`: an [H] vector laid out like the parameter ``p``."""
    order = _param_order(axes)
    pshape = _shape(p)
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
    axes = _attr_axes(attrs.axes, x.ty.ndim)
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
        dbeta = _param_like(_relax_sum_to_vector(dym, view, a), beta, axes)
    else:
        dbeta = _op.zeros_like(beta)
    return [dx, dgamma, dbeta]


def _rms_norm_gradient(orig_var, orig_call, output_grad, ctx):
    """R.nn.rms_norm(x, weight; axes, epsilon) has no beta: the backward ops' beta slot (which
    enters none of their results) gets zeros."""
    x, weight = orig_call.args
    eps = float(orig_call.attrs.epsilon)
    axes = _attr_axes(orig_call.attrs.axes, x.ty.ndim)
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
    shape = _shape(x)
    ndim = len(shape)
    channel = int(attrs.channel_axis) % ndim
    reduced = sorted(_attr_axes(attrs.axes, ndim))
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
