"""Gradients of reductions TVM 0.27 leaves without one: ``max`` and ``min``.

Ties: when several elements attain the extremum, the cotangent is split equally among them
(PyTorch's ``amax``/``amin`` and JAX's convention). The split is symmetric in the tied elements,
so both the fused and the decomposed paths and any evaluation order give the same gradient, and
it is a valid subgradient (the shares sum to the cotangent). Without ties it is the usual
one-hot gradient.
"""

from __future__ import annotations

from tvm import relax

from ..overrides import fill_gradient


def _extremum_grad(orig_var, orig_call, output_grad, ctx):
    (x,) = orig_call.args
    ndim = int(x.ty.ndim)
    axis = orig_call.attrs.axis
    axes = list(range(ndim)) if axis is None else sorted(int(a) % ndim for a in axis)
    y, g = orig_var, output_grad
    if not orig_call.attrs.keepdims and axes:
        # Put the reduced axes back (size 1) so y and g broadcast against x.
        y, g = relax.op.expand_dims(y, axes), relax.op.expand_dims(g, axes)
    dtype = str(x.ty.dtype.dtype)
    hit = relax.op.astype(relax.op.equal(x, y), dtype)
    count = relax.op.sum(hit, axis=axes, keepdims=True)
    return [g * hit / count]


fill_gradient("relax.max")(_extremum_grad)
fill_gradient("relax.min")(_extremum_grad)
