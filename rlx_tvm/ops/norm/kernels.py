"""The fused TE kernels of the norm backward ops (their FLegalize), and the index algebra they and
the forward legalizations share.

Statistics in two passes (mean first, then the centred variance), accumulated in float32 at least.
One kernel per family computes any subset of its gradients ("input", "gamma", "beta") from one
set of row (block) statistics: alone for each op, together for siblings (:mod:`.siblings`).
"""

from __future__ import annotations

from functools import reduce
from operator import mul

import tvm
from tvm import te, tirx

from ...kernels.annotations import KEEP_STAGE
from ...kernels.common import acc_dtype, tensor_dtype
from ..registry import static_int


class Rows:
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

    # The names the statistics helpers use for both views (rows here, blocks in Groups).
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


def loader(t, acc):
    return lambda i: t(*i).astype(acc)


def _rstd_stage(shape, sq_sum, count, eps, acc, keep=False):
    """(sum / count + eps)^(-1/2), elementwise over a stage of per-row (per-block) sums."""
    one, eps = tirx.const(1.0, acc), tirx.const(eps, acc)
    # ``keep`` (the backward kernels, which read r once per element several times): inlined, the
    # square root and division would run per element instead of per row. (The forward kernels
    # leave it to fusion: TVM's reverse_compute_inline fails an internal check on a kept stage.)
    return te.compute(shape, lambda *o: one / tirx.sqrt(sq_sum(*o) / count + eps), name="rstd",
                      **({"attrs": KEEP_STAGE} if keep else {}))


def te_layer_stats(view, x, eps, keep=True):
    """Two-pass mean and biased variance per row of a ``Rows`` (block of a ``Groups``)
    ``view``: ``xh(i)`` and ``r(i)`` on full indices."""
    mean = view.stat_mean("mean", x)
    var_sum = view.stat_sum("var_sum", lambda i: (x(i) - mean(i)) * (x(i) - mean(i)))
    r = view.at(_rstd_stage(view.stat_shape, var_sum, view.count, eps, view.acc, keep))
    return (lambda i: (x(i) - mean(i)) * r(i)), r


def te_rms_r(rows: Rows, x, eps, keep=True):
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


class Groups:
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


def call_te(bb, name, kernel, *args):
    return bb.call_te(kernel, *args, primfunc_name_hint=f"rlx_{name}")


def _in_order(outs: dict, roles):
    """A kernel's outputs in ``roles`` order (one tensor for one role)."""
    return outs[roles[0]] if len(roles) == 1 else [outs[r] for r in roles]


def _param_sum(view, name, f, dtype, partial):
    """dgamma / dbeta: the sum of ``f`` over everything but the parameter's axis, in ``dtype``;
    with ``partial``, partial sums in the accumulation dtype, summed by the caller: per chunk of
    ``partial`` row chunks (layer / RMS norm), or per sample (group norm, ``partial=True``)."""
    if partial is None:
        return _as_dtype(view.column_sum(name, f) if isinstance(view, Rows) else view.channel_sum(name, f), dtype)
    return view.chunk_sums(name, f, partial) if isinstance(view, Rows) else view.per_sample_sum(name, f)


def _kernel_operands(roles, x, gamma, dy):
    """What a family kernel reads for ``roles``: x (unless only dbeta), gamma (for dx), dy."""
    return [*([x] if roles != ("beta",) else []), *([gamma] if "input" in roles else []), dy]


def _split_operands(roles, operands) -> tuple:
    """(x, gamma, dy) of a family kernel's operands (:func:`_kernel_operands`), None where absent."""
    operands = list(operands)
    x = operands.pop(0) if roles != ("beta",) else None
    gamma = operands.pop(0) if "input" in roles else None
    return x, gamma, operands.pop(0)


def _ln_kernel(roles, x, axis, eps, partial=None):
    """TE kernel over :func:`_kernel_operands` for the layer-norm gradients in ``roles``
    ("input": dx, "gamma": dgamma), one set of row statistics for all of them; ``partial``: see
    :func:`_param_sum`."""
    dtype = tensor_dtype(x)
    acc = acc_dtype(dtype)
    a = axis % x.ty.ndim

    def kernel(*operands):
        xt, gt, dyt = _split_operands(roles, operands)
        rows = Rows(xt.shape, a, acc)
        xv, dyv = loader(xt, acc), loader(dyt, acc)
        xh, r = te_layer_stats(rows, xv, eps)
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


def _rms_kernel(roles, x, axis, eps, partial=None):
    """TE kernel over :func:`_kernel_operands` for the RMS-norm gradients in ``roles`` ("input",
    "gamma", "beta"), one set of row statistics for all of them; ``partial``: see :func:`_param_sum`."""
    dtype = tensor_dtype(x)
    acc = acc_dtype(dtype)
    a = axis % x.ty.ndim

    def kernel(*operands):
        xt, gt, dyt = _split_operands(roles, operands)
        if xt is None:  # dbeta alone: no statistics
            return _param_sum(Rows(dyt.shape, a, acc), "dbeta", loader(dyt, acc), dtype, partial)
        rows = Rows(xt.shape, a, acc)
        xv, dyv = loader(xt, acc), loader(dyt, acc)
        r = te_rms_r(rows, xv, eps)
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


def _gn_kernel(roles, x, num_groups, eps, partial=None):
    """TE kernel over :func:`_kernel_operands` for the group-norm gradients in ``roles`` ("input",
    "gamma", "beta"), one set of block statistics for all of them; ``partial``: see :func:`_param_sum`."""
    dtype = tensor_dtype(x)
    acc = acc_dtype(dtype)

    def kernel(*operands):
        xt, gt, dyt = _split_operands(roles, operands)
        if xt is None:  # dbeta alone: no statistics
            return _param_sum(Groups(dyt.shape, num_groups, acc), "dbeta", loader(dyt, acc), dtype, partial)
        groups = Groups(xt.shape, num_groups, acc)
        xv, dyv = loader(xt, acc), loader(dyt, acc)
        xh, r = te_layer_stats(groups, xv, eps)
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


_KERNELS = {"layer_norm": _ln_kernel, "rms_norm": _rms_kernel, "group_norm": _gn_kernel}


def fused_kernel(bb, family, roles, x, gamma, dy, partial=None, **attrs):
    kernel = _KERNELS[family](roles, x, partial=partial, **attrs)
    return call_te(bb, f"{family}_backward_{'_'.join(roles)}", kernel, *_kernel_operands(roles, x, gamma, dy))


def layer_norm_input(bb, x, gamma, dy, *, axis, eps):
    return fused_kernel(bb, "layer_norm", ("input",), x, gamma, dy, axis=axis, eps=eps)


def layer_norm_gamma(bb, x, dy, *, axis, eps):
    return fused_kernel(bb, "layer_norm", ("gamma",), x, None, dy, axis=axis, eps=eps)


def rms_norm_input(bb, x, gamma, beta, dy, *, axis, eps):
    # beta does not enter dx; it is not passed to the kernel.
    return fused_kernel(bb, "rms_norm", ("input",), x, gamma, dy, axis=axis, eps=eps)


def rms_norm_gamma(bb, x, gamma, beta, dy, *, axis, eps):
    return fused_kernel(bb, "rms_norm", ("gamma",), x, None, dy, axis=axis, eps=eps)


def rms_norm_beta(bb, x, gamma, beta, dy, *, axis, eps):
    return fused_kernel(bb, "rms_norm", ("beta",), x, None, dy, axis=axis, eps=eps)


def group_norm_input(bb, x, gamma, beta, dy, *, num_groups, eps):
    # beta does not enter dx; it is not passed to the kernel.
    return fused_kernel(bb, "group_norm", ("input",), x, gamma, dy, num_groups=num_groups, eps=eps)


def group_norm_gamma(bb, x, dy, *, num_groups, eps):
    return fused_kernel(bb, "group_norm", ("gamma",), x, None, dy, num_groups=num_groups, eps=eps)


def group_norm_beta(bb, x, dy, *, num_groups, eps):
    return fused_kernel(bb, "group_norm", ("beta",), x, None, dy, num_groups=num_groups, eps=eps)
