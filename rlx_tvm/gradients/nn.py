"""Gradients of the nn primitives that the conv decompositions emit and TVM 0.27 leaves without
one: ``relax.nn.conv2d_transpose``."""

from __future__ import annotations

from tvm import relax, tirx

from ..ops.conv import conv2d_backward_weight
from ..overrides import fill_gradient


@fill_gradient("relax.nn.conv2d_transpose")
def _conv2d_transpose_grad(orig_var, orig_call, output_grad, ctx):
    """``y = conv2d_transpose(x, w)`` is the adjoint of ``conv2d(., w)`` with the same stride,
    padding, dilation and groups (output_padding only sizes y). So

    * d x = conv2d(dy, w): y's extra output_padding rows (< stride) fall out of the floor
      division, so the result is x-sized;
    * d w[co, c, i, j] = sum dy-windows * x, i.e. the conv2d weight gradient with dy in the role
      of the conv input and x in the role of its output gradient (``rlx.conv2d_backward_weight``).

    NCHW data and IOHW kernel only (the layouts TVM can legalize)."""
    attrs = orig_call.attrs
    layouts = (attrs.data_layout, attrs.kernel_layout, attrs.out_layout)
    if layouts != ("NCHW", "IOHW", "NCHW"):
        raise ValueError(f"gradient of relax.nn.conv2d_transpose: only NCHW/IOHW/NCHW layouts, got {layouts}")
    x, w = orig_call.args
    dtype = str(x.ty.dtype.dtype)
    dy = output_grad
    if str(orig_var.ty.dtype.dtype) != dtype:
        dy = relax.op.astype(dy, dtype)
    geometry = dict(
        stride=tuple(int(v) for v in attrs.strides),
        padding=tuple(int(v) for v in attrs.padding),
        dilation=tuple(int(v) for v in attrs.dilation),
        groups=int(attrs.groups),
    )
    kernel = tuple(int(v) if isinstance(v, tirx.IntImm) else v for v in w.ty.shape.values[2:])
    dx = relax.op.nn.conv2d(
        dy, w, strides=geometry["stride"], padding=geometry["padding"], dilation=geometry["dilation"],
        groups=geometry["groups"],
    )
    dw = conv2d_backward_weight(dy, x, kernel_size=kernel, **geometry)
    return [dx, dw]
