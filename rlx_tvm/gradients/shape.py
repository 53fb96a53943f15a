"""Gradients of shape primitives TVM 0.27 leaves without one.

``squeeze`` appears in TVM's own gradient of ``expand_dims``, so without a rule of its own any graph
using ``expand_dims`` could be differentiated once but not twice.
"""

from __future__ import annotations

from tvm import relax

from ..overrides import fill_gradient


@fill_gradient("relax.squeeze")
def _squeeze_grad(orig_var, orig_call, output_grad, ctx):
    x = orig_call.args[0]
    shape = x.ty.shape
    if shape is None:  # unknown shape: recover it at run time
        shape = relax.op.shape_of(x)
    return [relax.op.reshape(output_grad, shape)]
