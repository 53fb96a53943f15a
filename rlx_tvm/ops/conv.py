"""2-D convolution backward ops (NCHW data, OIHW weight), the adjoints of ``R.nn.conv2d``:

* ``conv2d_backward_input(dy[N,Co,Ho,Wo], w[Co,Ci/G,kh,kw]; input_size=(H,W), stride, padding,
  dilation, groups) -> dx[N,Ci,H,W]`` (the transposed convolution), and
* ``conv2d_backward_weight(x[N,Ci,H,W], dy[N,Co,Ho,Wo]; kernel_size=(kh,kw), stride, padding,
  dilation, groups) -> dw[Co,Ci/G,kh,kw]``.

With ``G = groups``, ``Cig = Ci/G``, ``Cog = Co/G`` and output channel ``co`` in group
``g = co // Cog``, the forward reads input row ``h = ho*s - p_top + i*d`` (zero outside the
input), so

    dx[n, g*Cig + c, h, w] = sum_{o<Cog, i, j: h = ho*s - p_top + i*d, ...} dy[n, g*Cog+o, ho, wo] * w[g*Cog+o, c, i, j]
    dw[co, c, i, j]        = sum_{n, ho, wo} dy[n, co, ho, wo] * x[n, g*Cig + c, ho*s - p_top + i*d, wo*s - p_left + j*d]

Input rows/columns that the forward's floor division drops (no window reaches them) get 0 in dx
and contribute nothing to dw.

Attributes: ``stride``/``dilation`` are an int or an (h, w) pair (>= 1); ``padding`` is an int, an
(h, w) pair or a Relax-style (top, left, bottom, right) 4-tuple (>= 0); it is stored as the
4-tuple. Spatial sizes (H, W, Ho, Wo, kh, kw) must be static; batch and channel dims may be
symbolic.

Paths: the fused kernels are gather-form ``te.compute`` reductions (race-free, any batch). The
decompositions are ``R.nn.conv2d_transpose`` (input gradient; ``output_padding`` restores the
dropped rows) and ``R.nn.conv2d`` with batch and channels swapped by ``permute_dims`` (weight
gradient); they are used when every non-batch dim is static and, for the weight gradient, x and
dy share the batch dim, else the op is kept for its fused kernel (docs/operators.md §7, ``keep_fused``).

Also registers the gradient of ``R.nn.conv2d`` (NCHW/OIHW) so that ``relax.transform.Gradient``
emits these two ops.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tvm import relax, te, tirx
from tvm.sym import Analyzer

from ..kernels import strategy
from ..kernels.annotations import KEEP_STAGE
from ..kernels.common import acc_dtype, tensor_dtype
from ..overrides import override_gradient

from .registry import Attr, check_int, check_int_tuple, define_op, op_error

# --------------------------------------------------------------------------------------------
# Attributes and window geometry (shared with pool.py)
# --------------------------------------------------------------------------------------------

check_pair = check_int_tuple(2, lo=1)


def check_padding(op: str, name: str, v: Any) -> tuple[int, int, int, int]:
    """An int, an (h, w) pair or a (top, left, bottom, right) 4-tuple of ints >= 0, as the
    4-tuple."""
    elem = check_int(lo=0)
    if not isinstance(v, (list, tuple)) and not hasattr(v, "__len__"):
        p = elem(op, name, v)
        return (p, p, p, p)
    v = tuple(v)
    if len(v) == 2:
        ph, pw = (elem(op, name, e) for e in v)
        return (ph, pw, ph, pw)
    if len(v) == 4:
        return tuple(elem(op, name, e) for e in v)
    raise op_error(op, name, "an int, an (h, w) pair or a (top, left, bottom, right) 4-tuple", repr(v))


def window_geometry(padding, stride, dilation, kernel):
    """Per spatial axis (h, then w): (pad_before, pad_after, stride, dilation, kernel)."""
    pt, pl, pb, pr = padding
    return ((pt, pb, stride[0], dilation[0], kernel[0]), (pl, pr, stride[1], dilation[1], kernel[1]))


def span(k: int, d: int) -> int:
    """Extent of a dilated kernel."""
    return d * (k - 1) + 1


def conv_out_size(size: int, before: int, after: int, s: int, d: int, k: int) -> int:
    return (size + before + after - span(k, d)) // s + 1


def static_dims(ty) -> list[int | None]:
    return [int(v.value) if isinstance(v, tirx.IntImm) else None for v in ty.shape.values]


def _static_spatial(ctx, t, what: str) -> tuple[int, int]:
    h, w = t.static_dim(2), t.static_dim(3)
    if h is None or w is None:
        raise ctx.error(t.name, f"static spatial dims ({what})", f"shape {[str(d) for d in t.shape]}")
    return h, w


def _check_divisible(ctx, t, axis: int, groups: int, what: str) -> None:
    c = t.static_dim(axis)
    if c is not None and c % groups != 0:
        raise ctx.error(t.name, f"dim {axis} ({what}) divisible by groups={groups}", c)


def check_window_fits(ctx, arg: str, axis: str, size: int, before: int, after: int, k: int, d: int) -> None:
    """The dilated kernel is no larger than the padded input along ``axis``."""
    if span(k, d) > size + before + after:
        raise ctx.error(
            arg,
            f"a kernel whose dilated extent fits the padded input along {axis} "
            f"({size} + {before} + {after} = {size + before + after})",
            f"kernel {k} with dilation {d} (extent {span(k, d)})",
        )


def _check_fits(ctx, arg: str, size_hw, padding, stride, dilation, kernel) -> tuple[int, int]:
    """The dilated kernel fits in the padded input; returns the forward's (Ho, Wo)."""
    out = []
    for axis, size, (before, after, s, d, k) in zip("hw", size_hw, window_geometry(padding, stride, dilation, kernel)):
        check_window_fits(ctx, arg, axis, size, before, after, k, d)
        out.append(conv_out_size(size, before, after, s, d, k))
    return tuple(out)


def _check_out_size(ctx, dy, expected_hw, why: str) -> None:
    for axis, want in zip((2, 3), expected_hw):
        got = dy.static_dim(axis)
        if got != want:
            raise ctx.error(dy.name, f"dim {axis} == {want} (the forward's output size for {why})",
                            f"{got} (shape {[str(d) for d in dy.shape]})")


_CONV_ATTRS = (
    Attr("stride", 1, check_pair),
    Attr("padding", 0, check_padding),
    Attr("dilation", 1, check_pair),
    Attr("groups", 1, check_int(lo=1)),
)


def _geometry_text(stride, padding, dilation, groups) -> str:
    return f"stride={stride}, padding={padding}, dilation={dilation}, groups={groups}"


# --------------------------------------------------------------------------------------------
# conv2d_backward_input
# --------------------------------------------------------------------------------------------

conv2d_backward_input = define_op(
    "conv2d_backward_input",
    inputs=("dy", "w"),
    attrs=(Attr("input_size", check=check_pair),) + _CONV_ATTRS,
    doc="Input gradient of conv2d (NCHW/OIHW): the transposed convolution of dy with w.",
)


@conv2d_backward_input.infer
def _bwd_input_infer(ctx):
    dy = ctx.tensor("dy", ndim=4)
    w = ctx.tensor("w", ndim=4)
    ctx.same_dtype(dy, w)
    a = ctx.attrs
    groups = a["groups"]
    if ctx.provably_different(dy.dim(1), w.dim(0)):
        raise ctx.error("dy", f"dim 1 == {w.dim(0)} (output channels, w's dim 0)", f"{dy.dim(1)}")
    _check_divisible(ctx, w, 0, groups, "output channels")
    kernel = _static_spatial(ctx, w, "kernel height and width")
    _static_spatial(ctx, dy, "output height and width")
    expected = _check_fits(ctx, "w", a["input_size"], a["padding"], a["stride"], a["dilation"], kernel)
    _check_out_size(ctx, dy, expected, f"input_size={a['input_size']}, kernel {kernel}, "
                    + _geometry_text(a["stride"], a["padding"], a["dilation"], groups))
    return ctx.out([dy.dim(0), w.dim(1) * groups, *a["input_size"]], dy.dtype)


@conv2d_backward_input.reference
def _bwd_input_ref(dy, w, **attrs):
    # Tests pass attributes as written (ints or pairs): normalize as the op builder does.
    a = conv2d_backward_input.normalize_attrs(attrs)
    input_size, stride, padding, dilation, groups = (
        a[k] for k in ("input_size", "stride", "padding", "dilation", "groups"))
    dy = np.asarray(dy, np.float64)
    w = np.asarray(w, np.float64)
    n, co, ho, wo = dy.shape
    _, cig, kh, kw = w.shape
    (sh, sw), (dh, dw) = stride, dilation
    pt, pl, pb, pr = padding
    h, wd = input_size
    dyg = dy.reshape(n, groups, co // groups, ho, wo)
    wg = w.reshape(groups, co // groups, cig, kh, kw)
    # Accumulate into the padded input frame, then crop the padding away.
    frame = np.zeros((n, groups, cig, h + pt + pb, wd + pl + pr))
    for i in range(kh):
        for j in range(kw):
            rows = slice(i * dh, i * dh + sh * (ho - 1) + 1, sh)
            cols = slice(j * dw, j * dw + sw * (wo - 1) + 1, sw)
            frame[:, :, :, rows, cols] += np.einsum("ngoyx,goc->ngcyx", dyg, wg[:, :, :, i, j])
    return frame[:, :, :, pt:pt + h, pl:pl + wd].reshape(n, groups * cig, h, wd)


def _input_grad_output_padding(input_size, out_hw, padding, stride, dilation, kernel):
    """Rows/columns the forward's floor division dropped: conv2d_transpose's output_padding."""
    return tuple(
        size - ((o - 1) * s - before - after + span(k, d))
        for size, o, (before, after, s, d, k) in zip(input_size, out_hw, window_geometry(padding, stride, dilation, kernel))
    )


def _cast(expr, src: str, dst: str):
    return expr if src == dst else relax.op.astype(expr, dst)


@conv2d_backward_input.decomposition
def _bwd_input_decompose(bb, dy, w, *, input_size, stride, padding, dilation, groups):
    dtype = tensor_dtype(dy)
    acc = acc_dtype(dtype)
    _, _, kh, kw = static_dims(w.ty)
    _, _, ho, wo = static_dims(dy.ty)
    output_padding = _input_grad_output_padding(input_size, (ho, wo), padding, stride, dilation, (kh, kw))
    # w[Co, Ci/G, kh, kw] is conv2d_transpose's IOHW kernel as it is.
    dx = relax.op.nn.conv2d_transpose(
        _cast(dy, dtype, acc), _cast(w, dtype, acc), strides=stride, padding=padding, output_padding=output_padding,
        dilation=dilation, groups=groups,
    )
    return _cast(dx, acc, dtype)


@conv2d_backward_input.fused
def _bwd_input_fused(bb, dy, w, *, input_size, stride, padding, dilation, groups):
    """Stride and dilation 1 on CPU: a direct convolution of the zero-padded dy with the flipped
    kernel (``_bwd_input_direct``); otherwise, and on GPUs, the gather form below."""
    return strategy.build(conv2d_backward_input.name, bb, dy, w, input_size=input_size, stride=stride, padding=padding,
                          dilation=dilation, groups=groups)


@strategy.register("conv2d_backward_input", "direct", strategy.on_cpu)
def _bwd_input_direct(target, bb, dy, w, *, input_size, stride, padding, dilation, groups):
    """Stride 1, dilation 1: output row oy reads input row y = oy - pt + i, so with dy padded by
    (kh - 1 - pt) rows on top (zero outside dy) and the taps flipped,

        dx[b, ci, y, x] = sum_{o, i, j} dy_pad[b, co, y + i, x + j] * w[co, ci % Cig, kh-1-i, kw-1-j]

    a plain correlation: x is contiguous in dx and in dy_pad and w does not depend on it, which
    the default CPU schedule turns into register-blocked vector FMAs (rows of ci share dy_pad)."""
    if not _unit_stride(stride, dilation):
        return None
    dtype = tensor_dtype(dy)
    acc = acc_dtype(dtype)
    pt, pl, _, _ = padding
    h_in, w_in = input_size

    def kernel(dyt: te.Tensor, wt: te.Tensor):
        n, co, ho, wo = dyt.shape
        _, cig, kh, kw = wt.shape
        cog = co // groups
        top, left = kh - 1 - pt, kw - 1 - pl

        def padded(b, c, yy, xx):
            oy, ox = yy - top, xx - left
            inside = tirx.all(oy >= 0, oy < ho, ox >= 0, ox < wo)
            return tirx.if_then_else(inside, dyt[b, c, oy, ox].astype(acc), tirx.const(0, acc))

        dy_pad = te.compute((n, co, h_in + kh - 1, w_in + kw - 1), padded, name="dy_pad", attrs=KEEP_STAGE)
        o = te.reduce_axis((0, cog), name="o")
        i = te.reduce_axis((0, kh), name="i")
        j = te.reduce_axis((0, kw), name="j")

        def body(b, ci, y, x):
            c_out = o if groups == 1 else (ci // cig) * cog + o
            c_in = ci if groups == 1 else ci % cig
            tap = wt[c_out, c_in, kh - 1 - i, kw - 1 - j].astype(acc)
            return te.sum(dy_pad[b, c_out, y + i, x + j] * tap, axis=[o, i, j])

        total = te.compute((n, cig * groups, h_in, w_in), body, name="conv2d_dx_acc")
        if acc == dtype:
            return total
        return te.compute(total.shape, lambda *idx: total(*idx).astype(dtype), name="conv2d_dx")

    return bb.call_te(kernel, dy, w, primfunc_name_hint="rlx_conv2d_backward_input")


@strategy.register("conv2d_backward_input", "gather", strategy.anywhere)
def _bwd_input_gather(target, bb, dy, w, *, input_size, stride, padding, dilation, groups):
    dtype = tensor_dtype(dy)
    acc = acc_dtype(dtype)
    (sh, sw), (dh, dw) = stride, dilation
    pt, pl, _, _ = padding
    h_in, w_in = input_size

    def kernel(dyt: te.Tensor, wt: te.Tensor):
        n, co, ho, wo = dyt.shape
        _, cig, kh, kw = wt.shape
        cog = co // groups
        o = te.reduce_axis((0, cog), name="o")
        i = te.reduce_axis((0, kh), name="i")
        j = te.reduce_axis((0, kw), name="j")

        def body(b, ci, y, x):
            # Output (oy, ox) reads (y, x) through kernel tap (i, j) iff y = oy*s - pt + i*d.
            ty, tx = y + pt - i * dh, x + pl - j * dw
            oy, ox = tirx.floordiv(ty, sh), tirx.floordiv(tx, sw)
            hit = tirx.all(
                tirx.floormod(ty, sh) == 0, tirx.floormod(tx, sw) == 0,
                ty >= 0, tx >= 0, oy < ho, ox < wo,
            )
            c_out = (ci // cig) * cog + o
            term = dyt[b, c_out, oy, ox].astype(acc) * wt[c_out, ci % cig, i, j].astype(acc)
            return te.sum(tirx.if_then_else(hit, term, tirx.const(0, acc)), axis=[o, i, j])

        total = te.compute((n, cig * groups, h_in, w_in), body, name="conv2d_dx_acc")
        if acc == dtype:
            return total
        return te.compute(total.shape, lambda *idx: total(*idx).astype(dtype), name="conv2d_dx")

    return bb.call_te(kernel, dy, w, primfunc_name_hint="rlx_conv2d_backward_input")


def same_dim(a_ty, b_ty, axis: int) -> bool:
    """The two tensor types provably share dim ``axis`` (the same static size or symbolic var)."""
    return bool(Analyzer().can_prove_equal(a_ty.shape.values[axis], b_ty.shape.values[axis]))


def _all_static_but_batch(*tys) -> bool:
    return all(None not in static_dims(t)[1:] for t in tys)


def _bwd_input_keep_fused(call: relax.Call) -> bool:
    dy, w = call.args
    return not (_all_static_but_batch(dy.ty) and None not in static_dims(w.ty))


conv2d_backward_input.extra["keep_fused"] = _bwd_input_keep_fused


# --------------------------------------------------------------------------------------------
# conv2d_backward_weight
# --------------------------------------------------------------------------------------------

conv2d_backward_weight = define_op(
    "conv2d_backward_weight",
    inputs=("x", "dy"),
    attrs=(Attr("kernel_size", check=check_pair),) + _CONV_ATTRS,
    doc="Weight gradient of conv2d (NCHW/OIHW): sum over batch and output positions of dy * x windows.",
)


@conv2d_backward_weight.infer
def _bwd_weight_infer(ctx):
    x = ctx.tensor("x", ndim=4)
    dy = ctx.tensor("dy", ndim=4)
    ctx.same_dtype(x, dy)
    a = ctx.attrs
    groups = a["groups"]
    ctx.dim_equals(dy, 0, x.dim(0), "batch, x's dim 0")
    _check_divisible(ctx, x, 1, groups, "input channels")
    _check_divisible(ctx, dy, 1, groups, "output channels")
    size = _static_spatial(ctx, x, "input height and width")
    _static_spatial(ctx, dy, "output height and width")
    expected = _check_fits(ctx, "kernel_size", size, a["padding"], a["stride"], a["dilation"], a["kernel_size"])
    _check_out_size(ctx, dy, expected, f"input {list(size)}, kernel_size={a['kernel_size']}, "
                    + _geometry_text(a["stride"], a["padding"], a["dilation"], groups))
    return ctx.out([dy.dim(1), x.dim(1) // groups, *a["kernel_size"]], x.dtype)


@conv2d_backward_weight.reference
def _bwd_weight_ref(x, dy, **attrs):
    a = conv2d_backward_weight.normalize_attrs(attrs)
    kernel_size, stride, padding, dilation, groups = (
        a[k] for k in ("kernel_size", "stride", "padding", "dilation", "groups"))
    x = np.asarray(x, np.float64)
    dy = np.asarray(dy, np.float64)
    n, ci, _, _ = x.shape
    _, co, ho, wo = dy.shape
    kh, kw = kernel_size
    (sh, sw), (dh, dw) = stride, dilation
    pt, pl, pb, pr = padding
    xp = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr))).reshape(n, groups, ci // groups, *(x.shape[2] + pt + pb, x.shape[3] + pl + pr))
    dyg = dy.reshape(n, groups, co // groups, ho, wo)
    dw_ = np.zeros((groups, co // groups, ci // groups, kh, kw))
    for i in range(kh):
        for j in range(kw):
            win = xp[:, :, :, i * dh: i * dh + sh * (ho - 1) + 1: sh, j * dw: j * dw + sw * (wo - 1) + 1: sw]
            dw_[:, :, :, i, j] = np.einsum("ngoyx,ngcyx->goc", dyg, win)
    return dw_.reshape(co, ci // groups, kh, kw)


def split_range(t, axis: int, begin: int, end: int, length: int):
    """``t[begin:end]`` along a static ``axis`` of extent ``length``, with ``split`` (which has a
    gradient, unlike strided_slice in TVM 0.27)."""
    if begin == 0 and end == length:
        return t
    cuts = [c for c in (begin, end) if 0 < c < length]
    return relax.TupleGetItem(relax.op.split(t, cuts, axis), 1 if begin > 0 else 0)


@conv2d_backward_weight.decomposition
def _bwd_weight_decompose(bb, x, dy, *, kernel_size, stride, padding, dilation, groups):
    dtype = tensor_dtype(x)
    acc = acc_dtype(dtype)
    n = x.ty.shape.values[0]
    _, ci, h, w = static_dims(x.ty)
    _, _, ho, wo = static_dims(dy.ty)
    cig = ci // groups
    x = _cast(x, dtype, acc)
    # The weight gradient is a convolution over the batch: batch <-> channels (a transpose, not a
    # reshape), dy as the kernel, stride and dilation trading places. Its padding after the input
    # is chosen so the output is exactly kh x kw; rows no window reaches are cropped off first.
    sizes, pads_after = [], []
    for axis, size, out, (before, _, s, d, k) in zip((2, 3), (h, w), (ho, wo),
                                                  window_geometry(padding, stride, dilation, kernel_size)):
        after = span(k, d) + s * (out - 1) - size - before
        if after < 0:
            x = split_range(x, axis, 0, size + after, size)
            size, after = size + after, 0
        sizes.append(size)
        pads_after.append(after)
    xg = relax.op.reshape(x, [n, groups, cig, *sizes])
    xt = relax.op.reshape(relax.op.permute_dims(xg, [2, 1, 0, 3, 4]), [cig, groups * n, *sizes])
    dyt = relax.op.permute_dims(_cast(dy, dtype, acc), [1, 0, 2, 3])
    pt, pl, _, _ = padding
    dwt = relax.op.nn.conv2d(
        xt, dyt, strides=dilation, padding=(pt, pl, pads_after[0], pads_after[1]), dilation=stride, groups=groups,
    )
    return _cast(relax.op.permute_dims(dwt, [1, 0, 2, 3]), acc, dtype)


def _unit_stride(stride, dilation) -> bool:
    """Stride and dilation 1: where the direct (correlation) forms apply."""
    return tuple(map(int, stride)) == (1, 1) and tuple(map(int, dilation)) == (1, 1)


@conv2d_backward_weight.fused
def _bwd_weight_fused(bb, x, dy, *, kernel_size, stride, padding, dilation, groups):
    """Stride and dilation 1 on CPU: a product over (n, ho, wo) against a channels-last copy of
    the padded x (``_bwd_weight_direct``); otherwise, and on GPUs, the gather form below."""
    return strategy.build(conv2d_backward_weight.name, bb, x, dy, kernel_size=kernel_size, stride=stride,
                          padding=padding, dilation=dilation, groups=groups)


@strategy.register("conv2d_backward_weight", "direct", strategy.on_cpu)
def _bwd_weight_direct(target, bb, x, dy, *, kernel_size, stride, padding, dilation, groups):
    """Stride 1, dilation 1, with x_t[b, Y, X, c] = x[b, c, Y - pt, X - pl] (zero outside x):

        acc[co, i, j, c] = sum_{b, oy, ox} dy[b, co, oy, ox] * x_t[b, oy + i, ox + j, g*Cig + c]

    then dw[co, c, i, j] = acc[co, i, j, c]. The channels run contiguously in x_t and in acc, and
    dy does not depend on them: the default CPU schedule's register-blocked product (rows of co
    share each x_t vector)."""
    if not _unit_stride(stride, dilation):
        return None
    dtype = tensor_dtype(x)
    acc = acc_dtype(dtype)
    pt, pl, _, _ = padding
    kh, kw = kernel_size

    def kernel(xt: te.Tensor, dyt: te.Tensor):
        n, ci, h, w = xt.shape
        _, co, ho, wo = dyt.shape
        cig, cog = ci // groups, co // groups

        def padded(b, yy, xx, c):
            y, xw = yy - pt, xx - pl
            inside = tirx.all(y >= 0, y < h, xw >= 0, xw < w)
            return tirx.if_then_else(inside, xt[b, c, y, xw].astype(acc), tirx.const(0, acc))

        x_t = te.compute((n, ho + kh - 1, wo + kw - 1, ci), padded, name="x_pad_nhwc", attrs=KEEP_STAGE)
        b = te.reduce_axis((0, n), name="b")
        oy = te.reduce_axis((0, ho), name="oy")
        ox = te.reduce_axis((0, wo), name="ox")

        def body(c_out, i, j, c):
            c_in = c if groups == 1 else (c_out // cog) * cig + c
            return te.sum(dyt[b, c_out, oy, ox].astype(acc) * x_t[b, oy + i, ox + j, c_in], axis=[b, oy, ox])

        total = te.compute((co, kh, kw, cig), body, name="conv2d_dw_acc")
        return te.compute((co, cig, kh, kw), lambda o, c, i, j: total[o, i, j, c].astype(dtype), name="conv2d_dw",
                          attrs=KEEP_STAGE)

    return bb.call_te(kernel, x, dy, primfunc_name_hint="rlx_conv2d_backward_weight")


@strategy.register("conv2d_backward_weight", "gather", strategy.anywhere)
def _bwd_weight_gather(target, bb, x, dy, *, kernel_size, stride, padding, dilation, groups):
    dtype = tensor_dtype(x)
    acc = acc_dtype(dtype)
    (sh, sw), (dh, dw) = stride, dilation
    pt, pl, _, _ = padding

    def kernel(xt: te.Tensor, dyt: te.Tensor):
        n, ci, h, w = xt.shape
        _, co, ho, wo = dyt.shape
        cig, cog = ci // groups, co // groups
        b = te.reduce_axis((0, n), name="b")
        oy = te.reduce_axis((0, ho), name="oy")
        ox = te.reduce_axis((0, wo), name="ox")

        def body(c_out, c, i, j):
            y, xx = oy * sh - pt + i * dh, ox * sw - pl + j * dw
            inside = tirx.all(y >= 0, y < h, xx >= 0, xx < w)
            term = dyt[b, c_out, oy, ox].astype(acc) * xt[b, (c_out // cog) * cig + c, y, xx].astype(acc)
            return te.sum(tirx.if_then_else(inside, term, tirx.const(0, acc)), axis=[b, oy, ox])

        total = te.compute((co, cig, *kernel_size), body, name="conv2d_dw_acc")
        if acc == dtype:
            return total
        return te.compute(total.shape, lambda *idx: total(*idx).astype(dtype), name="conv2d_dw")

    return bb.call_te(kernel, x, dy, primfunc_name_hint="rlx_conv2d_backward_weight")


def _bwd_weight_keep_fused(call: relax.Call) -> bool:
    x, dy = call.args
    return not (same_dim(x.ty, dy.ty, 0) and _all_static_but_batch(x.ty, dy.ty))


conv2d_backward_weight.extra["keep_fused"] = _bwd_weight_keep_fused


# --------------------------------------------------------------------------------------------
# Gradient of R.nn.conv2d: relax.transform.Gradient emits the two ops above
# --------------------------------------------------------------------------------------------

def _conv2d_gradient(orig_var, orig_call, output_grad, ctx):
    """d conv2d(x, w) -> (conv2d_backward_input, conv2d_backward_weight) for NCHW/OIHW with
    static spatial dims; anything else keeps TVM's own rule."""
    attrs = orig_call.attrs
    x, w = orig_call.args
    layouts = (attrs.data_layout, attrs.kernel_layout, attrs.out_layout)
    spatial = static_dims(x.ty)[2:] + static_dims(w.ty)[2:]
    if layouts != ("NCHW", "OIHW", "NCHW") or None in spatial:
        from tvm.relax.op._op_gradient import conv2d_grad

        return conv2d_grad(orig_var, orig_call, output_grad, ctx)
    geometry = dict(
        stride=tuple(int(v) for v in attrs.strides),
        padding=tuple(int(v) for v in attrs.padding),
        dilation=tuple(int(v) for v in attrs.dilation),
        groups=int(attrs.groups),
    )
    dtype = tensor_dtype(x)
    dy = output_grad if tensor_dtype(orig_var) == dtype else relax.op.astype(output_grad, dtype)
    h, wd, kh, kw = spatial
    return [
        conv2d_backward_input(dy, w, input_size=(h, wd), **geometry),
        conv2d_backward_weight(x, dy, kernel_size=(kh, kw), **geometry),
    ]


override_gradient("relax.nn.conv2d", _conv2d_gradient)
