"""Gradients of the 3-d convolution and pooling TVM's torch importer emits (none in TVM 0.27).

* ``conv3d``: ``d x`` is ``conv3d_transpose(dy, w)``; ``d w`` is a convolution of ``x`` with
  ``dy`` (batch and channel axes swapped, stride and dilation exchanged), cropped to the kernel;
  ``groups == 1`` for the weight gradient.
* ``avg_pool3d``: a depthwise ``conv3d_transpose`` of ``dy`` with the constant averaging kernel
  (windows that count the padding, or no padding).
* ``max_pool3d``: non-overlapping windows (kernel == stride, no padding, sizes divisible): the
  gradient goes to the window's maximum (shared equally by ties).
"""

from __future__ import annotations

import numpy as np
from tvm import relax

from ._rule import rule
from .nn_extra import _static

op = relax.op


def _ints(values) -> list[int]:
    return [int(v) for v in values]


def _pads(padding) -> tuple[list[int], list[int]]:
    p = _ints(padding)
    if len(p) == 3:
        return p, p
    return p[:3], p[3:]


def _transpose_output_padding(in_sizes, out_sizes, kernel, strides, dilation, before, after) -> list[int]:
    extra = []
    for n, m, k, s, d, b, a in zip(in_sizes, out_sizes, kernel, strides, dilation, before, after):
        extra.append(n - ((m - 1) * s - b - a + d * (k - 1) + 1))
    return extra


@rule("relax.nn.conv3d")
def _conv3d_grad(orig_var, orig_call, output_grad, ctx):
    name = "relax.nn.conv3d"
    attrs = orig_call.attrs
    if (attrs.data_layout, attrs.kernel_layout) != ("NCDHW", "OIDHW"):
        raise ValueError(f"gradient of {name}: NCDHW/OIDHW layouts expected, got {attrs.data_layout}/{attrs.kernel_layout}")
    x, w = orig_call.args
    dtype = str(x.ty.dtype.dtype)
    dy = output_grad if str(orig_var.ty.dtype.dtype) == dtype else op.astype(output_grad, dtype)
    xs, ws, ys = _static(x, "x", name), _static(w, "weight", name), _static(orig_var, "the output", name)
    strides, dilation, groups = _ints(attrs.strides), _ints(attrs.dilation), int(attrs.groups)
    before, after = _pads(attrs.padding)
    out_pad = _transpose_output_padding(xs[2:], ys[2:], ws[2:], strides, dilation, before, after)
    dx = op.nn.conv3d_transpose(
        dy, w, strides=strides, padding=before + after, output_padding=out_pad, dilation=dilation, groups=groups,
        data_layout="NCDHW", kernel_layout="IODHW",
    )
    if groups != 1:
        raise ValueError(f"gradient of {name}: the weight gradient needs groups == 1, got {groups}")
    swap = [1, 0, 2, 3, 4]
    dw = op.nn.conv3d(
        op.permute_dims(x, swap), op.permute_dims(dy, swap), strides=dilation, padding=before + after,
        dilation=strides,
    )
    dw = op.permute_dims(dw, swap)
    dw = op.strided_slice(dw, [2, 3, 4], [0, 0, 0], ws[2:], assume_inbound=True)
    return [dx, dw]


@rule("relax.nn.avg_pool3d")
def _avg_pool3d_grad(orig_var, orig_call, output_grad, ctx):
    name = "relax.nn.avg_pool3d"
    attrs = orig_call.attrs
    (x,) = orig_call.args
    before, after = _pads(attrs.padding)
    if str(attrs.layout) != "NCDHW" or bool(attrs.ceil_mode) or (any(before + after) and not bool(attrs.count_include_pad)):
        raise ValueError(f"gradient of {name}: NCDHW, ceil_mode=False and padding counted in the windows expected")
    xs, ys = _static(x, "x", name), _static(orig_var, "the output", name)
    kernel, strides, dilation = _ints(attrs.pool_size), _ints(attrs.strides), _ints(attrs.dilation)
    dtype = str(x.ty.dtype.dtype)
    channels = xs[1]
    weight = relax.const(np.full([channels, 1] + kernel, 1.0 / float(np.prod(kernel))).astype(dtype), dtype)
    out_pad = _transpose_output_padding(xs[2:], ys[2:], kernel, strides, dilation, before, after)
    dx = op.nn.conv3d_transpose(
        output_grad, weight, strides=strides, padding=before + after, output_padding=out_pad, dilation=dilation,
        groups=channels, data_layout="NCDHW", kernel_layout="IODHW",
    )
    return [dx]


@rule("relax.nn.max_pool3d")
def _max_pool3d_grad(orig_var, orig_call, output_grad, ctx):
    name = "relax.nn.max_pool3d"
    attrs = orig_call.attrs
    (x,) = orig_call.args
    xs = _static(x, "x", name)
    kernel, strides = _ints(attrs.pool_size), _ints(attrs.strides)
    before, after = _pads(attrs.padding)
    tiled = kernel == strides and not any(before + after) and all(n % k == 0 for n, k in zip(xs[2:], kernel))
    if str(attrs.layout) != "NCDHW" or not tiled or any(d != 1 for d in _ints(attrs.dilation)):
        raise ValueError(
            f"gradient of {name}: non-overlapping windows expected (kernel == stride, no padding, no dilation, "
            f"sizes divisible), got kernel {kernel}, stride {strides}, padding {before + after}"
        )
    n, c = xs[:2]
    (d, h, w), (kd, kh, kw) = [s // k for s, k in zip(xs[2:], kernel)], kernel
    windows = op.reshape(x, [n, c, d, kd, h, kh, w, kw])
    y = op.reshape(orig_var, [n, c, d, 1, h, 1, w, 1])
    dtype = str(x.ty.dtype.dtype)
    hit = op.astype(op.equal(windows, y), dtype)
    share = hit / op.sum(hit, axis=[3, 5, 7], keepdims=True)
    dy = op.reshape(output_grad, [n, c, d, 1, h, 1, w, 1])
    return [op.reshape(share * dy, xs)]
