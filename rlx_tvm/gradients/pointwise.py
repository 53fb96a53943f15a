"""Gradients of the elementwise ops TVM's torch importer emits and TVM 0.27 leaves without one:
inverse and hyperbolic trigonometry, ``square``, ``clip``, ``log_add_exp``, ``atan2``, the
remainders, ``trunc``/``floor_divide`` (zero almost everywhere), ``nn.leakyrelu``, ``nn.selu``,
``nn.prelu`` and ``tril``.

At a kink the rules follow PyTorch: ``clamp`` passes the gradient on its bounds, leaky ReLU, SELU
and PReLU take the negative branch at 0.
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.op.grad import no_grad

from ._rule import rule

op = relax.op


def _dtype(expr) -> str:
    return str(expr.ty.dtype.dtype)


def _c(value: float, like) -> relax.Constant:
    return relax.const(value, _dtype(like))


def _unary(name: str, derivative):
    @rule(name)
    def _grad(orig_var, orig_call, output_grad, ctx):
        x = orig_call.args[0]
        return [output_grad * derivative(x, orig_var)]

    return _grad


_unary("relax.acos", lambda x, y: op.negative(op.rsqrt(_c(1.0, x) - x * x)))
_unary("relax.asin", lambda x, y: op.rsqrt(_c(1.0, x) - x * x))
_unary("relax.acosh", lambda x, y: op.rsqrt(x * x - _c(1.0, x)))
_unary("relax.asinh", lambda x, y: op.rsqrt(x * x + _c(1.0, x)))
_unary("relax.atanh", lambda x, y: _c(1.0, x) / (_c(1.0, x) - x * x))
_unary("relax.sinh", lambda x, y: op.cosh(x))
_unary("relax.cosh", lambda x, y: op.sinh(x))
_unary("relax.square", lambda x, y: _c(2.0, x) * x)
_unary("relax.nn.selu", lambda x, y: op.where(
    op.greater(x, _c(0.0, x)), _c(1.0507009873554805, x), _c(1.0507009873554805 * 1.6732632423543772, x) * op.exp(x)))


@rule("relax.trunc", "relax.floor_divide")
def _zero_grad(orig_var, orig_call, output_grad, ctx):
    """Piecewise constant: zero almost everywhere."""
    return [op.zeros_like(a) if isinstance(a.ty, relax.TensorType) else no_grad(a) for a in orig_call.args]


@rule("relax.clip")
def _clip_grad(orig_var, orig_call, output_grad, ctx):
    """``clamp(x, lo, hi)``: ``dy`` where ``lo <= x <= hi`` (PyTorch passes it on the bounds)."""
    x, lo, hi = orig_call.args
    inside = op.logical_and(
        op.greater_equal(x, relax.const(float(lo.value), _dtype(x))),
        op.less_equal(x, relax.const(float(hi.value), _dtype(x))),
    )
    return [op.where(inside, output_grad, op.zeros_like(output_grad)), no_grad(lo), no_grad(hi)]


@rule("relax.log_add_exp")
def _log_add_exp_grad(orig_var, orig_call, output_grad, ctx):
    """``log(e^a + e^b)``: ``d a = dy * sigmoid(a - b)``, ``d b = dy * sigmoid(b - a)``."""
    a, b = orig_call.args
    return [
        op.collapse_sum_to(output_grad * op.sigmoid(a - b), a.ty.shape),
        op.collapse_sum_to(output_grad * op.sigmoid(b - a), b.ty.shape),
    ]


@rule("relax.atan2")
def _atan2_grad(orig_var, orig_call, output_grad, ctx):
    """``atan2(y, x)``: ``d y = x / (x^2 + y^2)``, ``d x = -y / (x^2 + y^2)``."""
    y, x = orig_call.args
    r2 = x * x + y * y
    return [
        op.collapse_sum_to(output_grad * x / r2, y.ty.shape),
        op.collapse_sum_to(op.negative(output_grad * y) / r2, x.ty.shape),
    ]


def _remainder(rounding):
    def _grad(orig_var, orig_call, output_grad, ctx):
        """``a - round(a / b) * b``: ``d a = dy``, ``d b = -dy * round(a / b)``."""
        a, b = orig_call.args
        return [
            op.collapse_sum_to(output_grad, a.ty.shape),
            op.collapse_sum_to(op.negative(output_grad * rounding(a / b)), b.ty.shape),
        ]

    return _grad


rule("relax.floor_mod")(_remainder(op.floor))
rule("relax.mod")(_remainder(op.trunc))


@rule("relax.nn.leakyrelu")
def _leakyrelu_grad(orig_var, orig_call, output_grad, ctx):
    (x,) = orig_call.args
    alpha = float(orig_call.attrs.alpha)
    slope = op.where(op.greater(x, _c(0.0, x)), _c(1.0, x), _c(alpha, x))
    return [output_grad * slope]


@rule("relax.nn.prelu")
def _prelu_grad(orig_var, orig_call, output_grad, ctx):
    """``y = x`` where ``x > 0``, else ``alpha[c] * x`` (``alpha`` along ``axis``)."""
    x, alpha = orig_call.args
    ndim = int(x.ty.ndim)
    axis = int(orig_call.attrs.axis) % ndim
    shape = [1] * ndim
    shape[axis] = x.ty.shape[axis]
    alpha_b = op.reshape(alpha, shape) if int(alpha.ty.ndim) == 1 and ndim > 1 else alpha
    positive = op.greater(x, _c(0.0, x))
    dx = op.where(positive, output_grad, output_grad * alpha_b)
    d_alpha = op.where(positive, op.zeros_like(x), output_grad * x)
    others = [i for i in range(ndim) if i != axis]
    d_alpha = op.sum(d_alpha, axis=others) if others else d_alpha
    return [dx, op.reshape(d_alpha, alpha.ty.shape)]


@rule("relax.tril")
def _tril_grad(orig_var, orig_call, output_grad, ctx):
    x, k = orig_call.args
    return [op.tril(output_grad, k), no_grad(k)]


@rule("relax.triu")
def _triu_grad(orig_var, orig_call, output_grad, ctx):
    """TVM's rule returns one partial for triu's two arguments (x, k), which Gradient rejects
    ("partials number != inputs number") whenever k is an argument."""
    x, k = orig_call.args
    return [op.triu(output_grad, k), no_grad(k)]
