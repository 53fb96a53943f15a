"""Gradients of elementwise primitives: erf, the boolean ops, collapse_sum_to/like."""

from __future__ import annotations

import math

from tvm import relax
from tvm.relax.op.grad import no_grad

from ..overrides import fill_gradient


def _dtype(expr) -> str:
    return str(expr.ty.dtype.dtype)


@fill_gradient("relax.erf")
def _erf_grad(orig_var, orig_call, output_grad, ctx):
    """d erf(x) = 2/sqrt(pi) * exp(-x^2)."""
    (x,) = orig_call.args
    c = relax.const(2.0 / math.sqrt(math.pi), _dtype(x))
    return [output_grad * c * relax.op.exp(relax.op.negative(x * x))]


@fill_gradient("relax.collapse_sum_to")
def _collapse_sum_to_grad(orig_var, orig_call, output_grad, ctx):
    """collapse_sum_to is the adjoint of broadcast_to: its gradient broadcasts back."""
    x, shape = orig_call.args
    return [relax.op.broadcast_to(output_grad, x.ty.shape), no_grad(shape)]


@fill_gradient("relax.collapse_sum_like")
def _collapse_sum_like_grad(orig_var, orig_call, output_grad, ctx):
    x, like = orig_call.args
    return [relax.op.broadcast_to(output_grad, x.ty.shape), no_grad(like)]


for _logical in ("relax.logical_and", "relax.logical_or", "relax.logical_not"):

    @fill_gradient(_logical)
    def _logical_grad(orig_var, orig_call, output_grad, ctx):
        """Boolean ops carry no gradient."""
        return [no_grad(a) for a in orig_call.args]


for _piecewise_constant in ("relax.round", "relax.floor", "relax.ceil", "relax.sign"):

    @fill_gradient(_piecewise_constant)
    def _piecewise_constant_grad(orig_var, orig_call, output_grad, ctx):
        """Piecewise-constant functions: the derivative is 0 almost everywhere. (Straight-through
        estimators are the business of the ops that want them, e.g. fake_quantize.)"""
        return [relax.op.zeros_like(orig_call.args[0])]
