"""Gradients of the nn ops TVM's torch importer emits and TVM 0.27 leaves without one.

* 1-d convolution and pooling reuse the 2-d backward ops on a unit height (``conv1d`` ->
  ``rlx.conv2d_backward_input/weight``, ``max_pool1d`` -> ``rlx.max_pool2d_backward``,
  ``avg_pool1d`` -> ``relax.grad.avg_pool2d_backward``, ``conv1d_transpose`` -> the
  ``conv2d_transpose`` rule);
* adaptive average pooling is linear and separable: per pooled axis a constant averaging matrix
  ``P`` (out x in, PyTorch's windows), so ``d x = P^T dy`` along each axis;
* ``batch_norm`` (training: batch statistics; inference: running statistics) and
  ``instance_norm`` in primitives;
* ``pixel_shuffle`` is a reshape/transpose, its gradient the inverse one.
"""

from __future__ import annotations

import numpy as np
from tvm import relax, tirx
from tvm.relax.op.grad import no_grad

from ._rule import rule

op = relax.op


def _static(expr, what: str, name: str) -> list[int]:
    """The static shape of ``expr``; a clear error naming the op ``name`` and ``what`` otherwise."""
    dims = []
    for d in expr.ty.shape.values:
        if not isinstance(d, tirx.IntImm):
            raise ValueError(f"gradient of {name}: {what} must have a static shape, got {expr.ty}")
        dims.append(int(d))
    return dims


def _dtype(expr) -> str:
    return str(expr.ty.dtype.dtype)


def _unit_height(expr):
    return op.expand_dims(expr, 2)


def _pad2d(padding) -> tuple:
    left, right = (int(p) for p in padding)
    return (0, left, 0, right)


@rule("relax.nn.conv1d")
def _conv1d_grad(orig_var, orig_call, output_grad, ctx):
    from ..ops.conv import conv2d_backward_input, conv2d_backward_weight

    attrs = orig_call.attrs
    if (attrs.data_layout, attrs.kernel_layout, attrs.out_layout) != ("NCW", "OIW", "NCW"):
        raise ValueError(f"gradient of relax.nn.conv1d: NCW/OIW layouts expected, got {attrs.data_layout}/{attrs.kernel_layout}")
    x, w = orig_call.args
    length = _static(x, "x", "relax.nn.conv1d")[2]
    kernel = _static(w, "weight", "relax.nn.conv1d")[2]
    geometry = dict(
        stride=(1, int(attrs.strides[0])), padding=_pad2d(attrs.padding), dilation=(1, int(attrs.dilation[0])),
        groups=int(attrs.groups),
    )
    dy = output_grad if _dtype(orig_var) == _dtype(x) else op.astype(output_grad, _dtype(x))
    dy4 = _unit_height(dy)
    dx = conv2d_backward_input(dy4, _unit_height(w), input_size=(1, length), **geometry)
    dw = conv2d_backward_weight(_unit_height(x), dy4, kernel_size=(1, kernel), **geometry)
    return [op.squeeze(dx, [2]), op.squeeze(dw, [2])]


@rule("relax.nn.conv1d_transpose")
def _conv1d_transpose_grad(orig_var, orig_call, output_grad, ctx):
    from .nn import _conv2d_transpose_grad

    attrs = orig_call.attrs
    if (attrs.data_layout, attrs.kernel_layout, attrs.out_layout) != ("NCW", "IOW", "NCW"):
        raise ValueError(f"gradient of relax.nn.conv1d_transpose: NCW/IOW layouts expected, got {attrs.data_layout}/{attrs.kernel_layout}")
    x, w = orig_call.args
    call2d = ctx.normalize(op.nn.conv2d_transpose(
        _unit_height(x), _unit_height(w), strides=(1, int(attrs.strides[0])), padding=_pad2d(attrs.padding),
        output_padding=(0, int(attrs.output_padding[0])), dilation=(1, int(attrs.dilation[0])),
        groups=int(attrs.groups), out_dtype=attrs.out_dtype,
    ))
    dx, dw = _conv2d_transpose_grad(call2d, call2d, _unit_height(output_grad), ctx)
    return [op.squeeze(dx, [2]), op.squeeze(dw, [2])]


@rule("relax.nn.max_pool1d")
def _max_pool1d_grad(orig_var, orig_call, output_grad, ctx):
    from ..ops.pool import max_pool2d_backward

    attrs = orig_call.attrs
    (x,) = orig_call.args
    if (attrs.layout, attrs.out_layout) != ("NCW", "NCW"):
        raise ValueError(f"gradient of relax.nn.max_pool1d: NCW layout expected, got {attrs.layout}")
    dx = max_pool2d_backward(
        _unit_height(x), _unit_height(output_grad), kernel_size=(1, int(attrs.pool_size[0])),
        stride=(1, int(attrs.strides[0])), padding=_pad2d(attrs.padding), dilation=(1, int(attrs.dilation[0])),
        ceil_mode=bool(attrs.ceil_mode),
    )
    return [op.squeeze(dx, [2])]


@rule("relax.nn.avg_pool1d")
def _avg_pool1d_grad(orig_var, orig_call, output_grad, ctx):
    attrs = orig_call.attrs
    (x,) = orig_call.args
    if (attrs.layout, attrs.out_layout) != ("NCW", "NCW"):
        raise ValueError(f"gradient of relax.nn.avg_pool1d: NCW layout expected, got {attrs.layout}")
    dx = op.grad.avg_pool2d_backward(
        _unit_height(output_grad), _unit_height(x), (1, int(attrs.pool_size[0])), (1, int(attrs.strides[0])),
        _pad2d(attrs.padding), (1, int(attrs.dilation[0])), bool(attrs.ceil_mode), bool(attrs.count_include_pad),
    )
    return [op.squeeze(dx, [2])]


def _adaptive_matrix(n_in: int, n_out: int) -> np.ndarray:
    """PyTorch's adaptive average windows: out i averages ``[floor(i n/m), ceil((i+1) n/m))``."""
    p = np.zeros((n_out, n_in))
    for i in range(n_out):
        lo, hi = (i * n_in) // n_out, -((-(i + 1) * n_in) // n_out)
        p[i, lo:hi] = 1.0 / (hi - lo)
    return p


def _transpose_apply(dy, matrices: dict, dtype: str):
    """``d x`` of ``y = (P_axis applied along each axis) x``: multiply ``dy`` by each ``P`` (out x
    in) along its axis."""
    ndim = int(dy.ty.ndim)
    for axis, mat in matrices.items():
        const = relax.const(mat.astype(dtype), dtype)
        order = [a for a in range(ndim) if a != axis] + [axis]
        moved = op.permute_dims(dy, order) if axis != ndim - 1 else dy
        moved = op.matmul(moved, const)  # [..., out] x [out, in]
        inverse = [order.index(a) for a in range(ndim)]
        dy = op.permute_dims(moved, inverse) if axis != ndim - 1 else moved
    return dy


def _adaptive_pool_grad(name: str, layout: str):
    @rule(name)
    def _grad(orig_var, orig_call, output_grad, ctx):
        attrs = orig_call.attrs
        (x,) = orig_call.args
        if str(attrs.layout) != layout or str(attrs.out_layout) != layout:
            raise ValueError(f"gradient of {name}: {layout} layout expected, got {attrs.layout}")
        in_dims = _static(x, "x", name)
        out_dims = _static(orig_var, "the output", name)
        mats = {a: _adaptive_matrix(in_dims[a], out_dims[a]) for a in range(2, len(in_dims)) if in_dims[a] != out_dims[a]}
        return [_transpose_apply(ctx.normalize(output_grad), mats, _dtype(x))]

    return _grad


_adaptive_pool_grad("relax.nn.adaptive_avg_pool1d", "NCW")
_adaptive_pool_grad("relax.nn.adaptive_avg_pool2d", "NCHW")
_adaptive_pool_grad("relax.nn.adaptive_avg_pool3d", "NCDHW")


def _resize_matrix(n_in: int, n_out: int, method: str, mode: str, rounding: str) -> np.ndarray:
    """The (n_out x n_in) interpolation matrix of TOPI's 1-d resize (``topi.image.resize``'s
    coordinate transforms; nearest rounding and linear weights as it computes them)."""
    scale = np.float32(n_in) / np.float32(n_out)
    m = np.zeros((n_out, n_in))
    for o in range(n_out):
        if mode == "half_pixel":
            x = (o + 0.5) * scale - 0.5
        elif mode == "align_corners":
            x = (n_in - 1) / (n_out - 1) * o if n_out > 1 else 0.0
        elif mode == "asymmetric":
            x = scale * o
        elif mode == "pytorch_half_pixel":
            x = (o + 0.5) * scale - 0.5 if n_out > 1 else 0.0
        else:
            raise ValueError(f"gradient of relax.image.resize2d: coordinate_transformation_mode {mode!r} not supported")
        if method == "nearest_neighbor":
            rounding = rounding or ("round" if mode == "align_corners" else "floor")
            pick = {"round": np.rint, "floor": lambda v: np.floor(v + 1e-5), "ceil": lambda v: np.ceil(v - 1e-5),
                    "round_prefer_floor": lambda v: np.ceil(v - 0.5), "round_prefer_ceil": lambda v: np.floor(v + 0.5)}
            if rounding not in pick:
                raise ValueError(f"gradient of relax.image.resize2d: rounding_method {rounding!r} not supported")
            m[o, min(max(int(pick[rounding](x)), 0), n_in - 1)] = 1.0
        elif method == "linear":
            lo = int(np.floor(x))
            frac = x - lo
            m[o, min(max(lo, 0), n_in - 1)] += 1.0 - frac
            m[o, min(max(lo + 1, 0), n_in - 1)] += frac
        else:
            raise ValueError(f"gradient of relax.image.resize2d: method 'nearest_neighbor' or 'linear' expected, got {method!r}")
    return m


@rule("relax.image.resize2d")
def _resize2d_grad(orig_var, orig_call, output_grad, ctx):
    """Nearest and (bi)linear resizing are separable linear maps: one interpolation matrix per
    spatial axis, ``d x = R_h^T dy R_w``."""
    attrs = orig_call.attrs
    x = orig_call.args[0]
    if str(attrs.layout) != "NCHW":
        raise ValueError(f"gradient of relax.image.resize2d: NCHW layout expected, got {attrs.layout}")
    in_dims = _static(x, "x", "relax.image.resize2d")
    out_dims = _static(orig_var, "the output", "relax.image.resize2d")
    method, mode = str(attrs.method), str(attrs.coordinate_transformation_mode)
    mats = {a: _resize_matrix(in_dims[a], out_dims[a], method, mode, str(attrs.rounding_method)) for a in (2, 3)}
    return [_transpose_apply(ctx.normalize(output_grad), mats, _dtype(x))] + [
        no_grad(a) for a in orig_call.args[1:]
    ]


def _channel_view(v, ndim: int, axis: int):
    shape = [1] * ndim
    shape[axis] = -1
    return op.reshape(v, shape)


@rule("relax.nn.batch_norm")
def _batch_norm_grad(orig_var, orig_call, output_grad, ctx):
    """Gradient of the normalized output (the running-statistics outputs are buffer updates,
    not differentiated, as in PyTorch). Training normalizes with the batch statistics (their
    dependence on x included); inference with the running ones (whose gradients are given)."""
    x, gamma, beta, mean, var = orig_call.args
    attrs = orig_call.attrs
    ndim = int(x.ty.ndim)
    axis = int(attrs.axis) % ndim
    others = [a for a in range(ndim) if a != axis]
    eps = relax.const(float(attrs.epsilon), _dtype(x))
    dy = relax.TupleGetItem(output_grad, 0)
    g = _channel_view(gamma, ndim, axis) if bool(attrs.scale) else relax.const(1.0, _dtype(x))
    if bool(attrs.training):
        mu = op.mean(x, axis=others, keepdims=True)
        rstd = op.rsqrt(op.variance(x, axis=others, keepdims=True) + eps)
        xhat = (x - mu) * rstd
        dx = g * rstd * (dy - op.mean(dy, axis=others, keepdims=True)
                         - xhat * op.mean(dy * xhat, axis=others, keepdims=True))
        d_mean, d_var = op.zeros_like(mean), op.zeros_like(var)
    else:
        rstd = op.rsqrt(_channel_view(var, ndim, axis) + eps)
        xhat = (x - _channel_view(mean, ndim, axis)) * rstd
        dx = dy * g * rstd
        d_mean = op.reshape(op.negative(op.sum(dx, axis=others)), mean.ty.shape)
        half = relax.const(-0.5, _dtype(x))
        d_var = op.reshape(op.sum(dx * xhat, axis=others) * half, var.ty.shape) / (var + eps)
    d_gamma = op.sum(dy * xhat, axis=others) if bool(attrs.scale) else op.zeros_like(gamma)
    d_beta = op.sum(dy, axis=others) if bool(attrs.center) else op.zeros_like(beta)
    return [dx, d_gamma, d_beta, d_mean, d_var]


@rule("relax.nn.instance_norm")
def _instance_norm_grad(orig_var, orig_call, output_grad, ctx):
    x, gamma, beta = orig_call.args
    attrs = orig_call.attrs
    ndim = int(x.ty.ndim)
    axis = int(attrs.channel_axis) % ndim
    axes = sorted(int(a) % ndim for a in attrs.axes)
    eps = relax.const(float(attrs.epsilon), _dtype(x))
    mu = op.mean(x, axis=axes, keepdims=True)
    rstd = op.rsqrt(op.variance(x, axis=axes, keepdims=True) + eps)
    xhat = (x - mu) * rstd
    dy = output_grad
    g = _channel_view(gamma, ndim, axis) if bool(attrs.scale) else relax.const(1.0, _dtype(x))
    dx = g * rstd * (dy - op.mean(dy, axis=axes, keepdims=True) - xhat * op.mean(dy * xhat, axis=axes, keepdims=True))
    others = [a for a in range(ndim) if a != axis]
    d_gamma = op.sum(dy * xhat, axis=others) if bool(attrs.scale) else op.zeros_like(gamma)
    d_beta = op.sum(dy, axis=others) if bool(attrs.center) else op.zeros_like(beta)
    return [dx, d_gamma, d_beta]


@rule("relax.nn.pixel_shuffle")
def _pixel_shuffle_grad(orig_var, orig_call, output_grad, ctx):
    """``[N, C r^2, H, W] -> [N, C, H r, W r]`` with ``y[n, c, h r + i, w r + j] =
    x[n, c r^2 + i r + j, h, w]``; the gradient undoes the shuffle."""
    (x,) = orig_call.args
    r = int(orig_call.attrs.upscale_factor)
    n, cr2, h, w = _static(x, "x", "relax.nn.pixel_shuffle")
    c = cr2 // (r * r)
    g = op.reshape(output_grad, [n, c, h, r, w, r])
    g = op.permute_dims(g, [0, 1, 3, 5, 2, 4])
    return [op.reshape(g, [n, cr2, h, w])]




def _affine_base(sizes: list[int], align_corners: bool) -> np.ndarray:
    """The (ndim + 1) x prod(sizes) normalized coordinates ``topi.image.affine_grid`` multiplies
    the affine matrix with (columns x, y[, z], 1)."""
    ndim = len(sizes)
    axes = []
    for s in sizes:
        if align_corners:
            axes.append(-1.0 + np.arange(s) * ((2.0 - 1e-7) / (s - 1)))
        else:
            axes.append(-1.0 + 1.0 / s + np.arange(s) * (2.0 / s))
    grids = np.meshgrid(*axes, indexing="ij")
    base = np.ones((ndim + 1, int(np.prod(sizes))))
    for r in range(ndim):
        base[ndim - 1 - r] = grids[r].reshape(-1)
    return base


@rule("relax.image.affine_grid")
def _affine_grid_grad(orig_var, orig_call, output_grad, ctx):
    """``grid[n, d, p] = sum_c theta[n, d, c] base[c, p]``: ``d theta = dy base^T``."""
    theta = orig_call.args[0]
    out = _static(orig_var, "the output", "relax.image.affine_grid")
    n, nd, sizes = out[0], out[1], out[2:]
    base = _affine_base(sizes, bool(orig_call.attrs.align_corners))
    dtype = _dtype(theta)
    flat = op.reshape(output_grad, [n, nd, int(np.prod(sizes))])
    d_theta = op.matmul(flat, relax.const(base.T.astype(dtype), dtype))
    return [d_theta] + [no_grad(a) for a in orig_call.args[1:]]
