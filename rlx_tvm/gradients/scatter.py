"""Gradients of the indexing primitives the loss/indexing decompositions emit and TVM 0.27 leaves
without one: ``relax.flip``, ``relax.scatter_elements``, ``relax.gather_elements``.

Each rule is written with ops that have gradients themselves (the scatter and gather rules use
each other), so higher orders keep working.
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.op.grad import no_grad

from ..overrides import fill_gradient


@fill_gradient("relax.flip")
def _flip_grad(orig_var, orig_call, output_grad, ctx):
    """flip is a permutation that is its own inverse: d x = flip(dy)."""
    return [relax.op.flip(output_grad, int(orig_call.attrs.axis))]


@fill_gradient("relax.gather_elements")
def _gather_elements_grad(orig_var, orig_call, output_grad, ctx):
    """``y[.., j, ..] = x[.., idx[.., j, ..], ..]`` along axis: d x scatter-adds dy back to the
    positions read (duplicates accumulate)."""
    x, indices = orig_call.args
    axis = int(orig_call.attrs.axis)
    dx = relax.op.scatter_elements(relax.op.zeros_like(x), indices, output_grad, axis=axis, reduction="add")
    return [dx, no_grad(indices)]


@fill_gradient("relax.scatter_elements")
def _scatter_elements_grad(orig_var, orig_call, output_grad, ctx):
    """``reduction="add"``: ``y = x + scatter(updates)``, so d x = dy and d updates gathers dy at
    the scattered positions. ``reduction="update"``: the overwritten positions of x do not reach
    y (d x = dy with them zeroed); d updates gathers dy there (with duplicate indices only the
    winning update reaches y; which one wins is unspecified, so that case is not differentiable)."""
    x, indices, updates = orig_call.args
    axis = int(orig_call.attrs.axis)
    reduction = str(orig_call.attrs.reduction)
    d_updates = relax.op.gather_elements(output_grad, indices, axis=axis)
    if reduction == "add":
        d_x = output_grad
    elif reduction == "update":
        d_x = relax.op.scatter_elements(output_grad, indices, relax.op.zeros_like(updates), axis=axis, reduction="update")
    else:
        raise ValueError(
            f"gradient of relax.scatter_elements: reduction 'add' or 'update' expected, got {reduction!r}"
        )
    return [d_x, no_grad(indices), d_updates]
