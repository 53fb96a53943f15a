"""Gradients of the primitives that the attention decompositions emit and TVM leaves without one.

The causal / sliding-window masks are built from two ``arange`` position vectors (query and key
positions, compared into an [Sq, Sk] boolean mask). ``arange`` takes only integer PrimValues, so
its output depends on nothing differentiable; the rule says so, which lets ``relax.transform.Gradient``
run over decomposed attention graphs.
"""

from __future__ import annotations

from tvm.relax.op.grad import no_grad

from ..overrides import fill_gradient


@fill_gradient("relax.arange")
def _arange_grad(orig_var, orig_call, output_grad, ctx):
    """arange(start, end, step): integer bounds, nothing to differentiate."""
    return [no_grad(a) for a in orig_call.args]
