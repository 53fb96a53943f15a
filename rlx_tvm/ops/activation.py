"""Activation backward ops: ``relu_backward(x, dy)`` and ``activation_backward(x, dy; kind)``.

Each kind is a forward function (NumPy, float64: the finite-difference oracle) and its
derivative ``f'(m, x)`` written once in the :mod:`._math` vocabulary; the fused kernel, the
decomposition and the reference all evaluate that one formula (docs/operators.md §3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
from tvm import relax, te, tirx

from ..kernels.common import acc_dtype, tensor_dtype
from ..overrides import override_gradient
from ._math import NumpyMath, RelaxMath, TirMath, _np_erf
from .registry import Attr, check_choice, define_op

_SQRT_HALF = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_TANH_C = 0.044715


@dataclass(frozen=True)
class Activation:
    forward: Callable[[np.ndarray], np.ndarray]  # NumPy float64
    derivative: Callable  # (m, x) -> f'(x)
    # Points where f is not differentiable (or the op's convention differs from the true
    # derivative); finite-difference tests keep away from them.
    kinks: tuple[float, ...] = ()
    domain: tuple[float, float] = (-4.0, 4.0)
    # False when f' is a convention rather than the derivative (round: straight-through).
    matches_forward: bool = True


def _softplus_np(x):
    return np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))


def _softplus(m, x):
    # Stable log(1 + exp(x)) = max(x, 0) + log(1 + exp(-|x|)).
    return m.maximum(x, m.c(0.0)) + m.log(m.c(1.0) + m.exp(-m.abs(x)))


def _step(m, x):
    """1 where x > 0 else 0 (0 at exactly 0, PyTorch's convention for relu)."""
    return m.where(m.gt(x, m.c(0.0)), m.ones_like(x), m.zeros_like(x))


def _sign(m, x):
    return m.where(m.gt(x, m.c(0.0)), m.ones_like(x), m.where(m.lt(x, m.c(0.0)), -m.ones_like(x), m.zeros_like(x)))


def _gelu_d(m, x):
    # Phi(x) + x phi(x) with z = x / sqrt(2): Phi(x) = (1 + erf(z)) / 2 and phi(x) = exp(-z^2) /
    # sqrt(2 pi); the float32 kernel computes Phi from exp(-z^2) too (erfc's form), once for both.
    cdf, gauss = m.normal_cdf_and_gauss(x * m.c(_SQRT_HALF))
    return cdf + x * (m.c(_INV_SQRT_2PI) * gauss)


def _gelu_tanh_d(m, x):
    u = m.c(_SQRT_2_OVER_PI) * (x + m.c(_GELU_TANH_C) * x * x * x)
    t = m.tanh(u)
    du = m.c(_SQRT_2_OVER_PI) * (m.c(1.0) + m.c(3.0 * _GELU_TANH_C) * x * x)
    return m.c(0.5) * (m.c(1.0) + t) + m.c(0.5) * x * (m.c(1.0) - t * t) * du


def _silu_d(m, x):
    s = m.sigmoid(x)
    return s * (m.c(1.0) + x * (m.c(1.0) - s))


def _sigmoid_d(m, x):
    s = m.sigmoid(x)
    return s * (m.c(1.0) - s)


def _tanh_d(m, x):
    t = m.tanh(x)
    return m.c(1.0) - t * t


def _positive_only(m, x, value):
    """``value`` where x > 0, else 0: sqrt/rsqrt have no finite derivative at or below 0, and we
    return 0 there instead of inf/NaN (docs/operators.md §3)."""
    pos = m.gt(x, m.c(0.0))
    safe = m.where(pos, x, m.ones_like(x))
    return m.where(pos, value(safe), m.zeros_like(x))


def _mish_d(m, x):
    sp = _softplus(m, x)
    t = m.tanh(sp)
    return t + x * m.sigmoid(x) * (m.c(1.0) - t * t)


def _hard_sigmoid_d(m, x):
    inside = m.logical_and(m.gt(x, m.c(-3.0)), m.lt(x, m.c(3.0)))
    return m.where(inside, m.ones_like(x) * m.c(1.0 / 6.0), m.zeros_like(x))


def _hard_swish_d(m, x):
    # PyTorch: 0 for x < -3, (2x + 3) / 6 for -3 <= x <= 3, 1 above.
    mid = (m.c(2.0) * x + m.c(3.0)) * m.c(1.0 / 6.0)
    return m.where(m.lt(x, m.c(-3.0)), m.zeros_like(x), m.where(m.le(x, m.c(3.0)), mid, m.ones_like(x)))


def _softsign_d(m, x):
    d = m.c(1.0) + m.abs(x)
    return m.c(1.0) / (d * d)


def _elu_d(m, x):
    return m.where(m.gt(x, m.c(0.0)), m.ones_like(x), m.exp(x))


def _sigmoid_np(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))


ACTIVATIONS: dict[str, Activation] = {
    "relu": Activation(lambda x: np.maximum(x, 0), _step, kinks=(0.0,)),
    "gelu": Activation(lambda x: 0.5 * x * (1 + _np_erf(x * _SQRT_HALF)), _gelu_d),
    "gelu_tanh": Activation(
        lambda x: 0.5 * x * (1 + np.tanh(_SQRT_2_OVER_PI * (x + _GELU_TANH_C * x**3))), _gelu_tanh_d
    ),
    "silu": Activation(lambda x: x * _sigmoid_np(x), _silu_d),
    "sigmoid": Activation(_sigmoid_np, _sigmoid_d),
    "tanh": Activation(np.tanh, _tanh_d),
    "exp": Activation(np.exp, lambda m, x: m.exp(x)),
    "log": Activation(np.log, lambda m, x: m.c(1.0) / x, domain=(0.1, 4.0)),
    "sqrt": Activation(
        np.sqrt, lambda m, x: _positive_only(m, x, lambda s: m.c(0.5) / m.sqrt(s)), kinks=(0.0,), domain=(0.1, 4.0)
    ),
    "rsqrt": Activation(
        lambda x: 1 / np.sqrt(x),
        lambda m, x: _positive_only(m, x, lambda s: m.c(-0.5) / (s * m.sqrt(s))),
        kinks=(0.0,),
        domain=(0.1, 4.0),
    ),
    "neg": Activation(np.negative, lambda m, x: -m.ones_like(x)),
    "abs": Activation(np.abs, _sign, kinks=(0.0,)),
    "sin": Activation(np.sin, lambda m, x: m.cos(x)),
    "cos": Activation(np.cos, lambda m, x: -m.sin(x)),
    "tan": Activation(np.tan, lambda m, x: m.c(1.0) / (m.cos(x) * m.cos(x)), domain=(-1.2, 1.2)),
    "atan": Activation(np.arctan, lambda m, x: m.c(1.0) / (m.c(1.0) + x * x)),
    "reciprocal": Activation(lambda x: 1 / x, lambda m, x: m.c(-1.0) / (x * x), domain=(0.1, 4.0)),
    # Straight-through: round passes the gradient unchanged (docs/operators.md §3, §8).
    "round": Activation(np.round, lambda m, x: m.ones_like(x), matches_forward=False),
    "floor": Activation(np.floor, lambda m, x: m.zeros_like(x), matches_forward=False),
    "ceil": Activation(np.ceil, lambda m, x: m.zeros_like(x), matches_forward=False),
    "sign": Activation(np.sign, lambda m, x: m.zeros_like(x), kinks=(0.0,)),
    "softplus": Activation(_softplus_np, lambda m, x: m.sigmoid(x)),
    "elu": Activation(lambda x: np.where(x > 0, x, np.expm1(np.minimum(x, 0))), _elu_d, kinks=(0.0,)),
    "erf": Activation(_np_erf, lambda m, x: m.c(2.0 / math.sqrt(math.pi)) * m.exp(-x * x)),
    "hard_sigmoid": Activation(lambda x: np.clip(x + 3, 0, 6) / 6, _hard_sigmoid_d, kinks=(-3.0, 3.0)),
    "hard_swish": Activation(lambda x: x * np.clip(x + 3, 0, 6) / 6, _hard_swish_d, kinks=(-3.0, 3.0)),
    "mish": Activation(lambda x: x * np.tanh(_softplus_np(x)), _mish_d),
    "softsign": Activation(lambda x: x / (1 + np.abs(x)), _softsign_d, kinks=(0.0,)),
    "log_sigmoid": Activation(lambda x: -_softplus_np(-x), lambda m, x: m.sigmoid(-x)),
}

ACTIVATION_KINDS = tuple(ACTIVATIONS)


# --------------------------------------------------------------------------------------------
# Shared pieces for the two ops
# --------------------------------------------------------------------------------------------


def _infer_elementwise(ctx):
    x = ctx.tensor("x")
    dy = ctx.tensor("dy")
    ctx.same_dtype(x, dy)
    ctx.same_shape(x, dy)
    return ctx.out(x.shape, x.dtype)


def _fused(bb, x, dy, kind: str):
    derivative = ACTIVATIONS[kind].derivative
    dtype = tensor_dtype(x)
    acc = acc_dtype(dtype)
    m = TirMath(acc)

    def kernel(xt: te.Tensor, dyt: te.Tensor):
        def body(*i):
            xv = xt(*i).astype(acc)
            return (dyt(*i).astype(acc) * derivative(m, xv)).astype(dtype)

        return te.compute(xt.shape, body, name=f"{kind}_backward")

    return bb.call_te(kernel, x, dy, primfunc_name_hint=f"rlx_{kind}_backward")


def _decompose(bb, x, dy, kind: str):
    return dy * ACTIVATIONS[kind].derivative(RelaxMath(tensor_dtype(x)), x)


def _reference(x, dy, kind: str):
    x64 = np.asarray(x, dtype=np.float64)
    return np.asarray(dy, dtype=np.float64) * ACTIVATIONS[kind].derivative(NumpyMath(), x64)


# --------------------------------------------------------------------------------------------
# relu_backward
# --------------------------------------------------------------------------------------------

relu_backward = define_op(
    "relu_backward",
    inputs=("x", "dy"),
    doc="dy * (x > 0); exactly 0 at x == 0 (PyTorch convention).",
)
relu_backward.infer(_infer_elementwise)


@relu_backward.reference
def _relu_backward_ref(x, dy):
    return _reference(x, dy, "relu")


@relu_backward.decomposition
def _relu_backward_decompose(bb, x, dy):
    return _decompose(bb, x, dy, "relu")


@relu_backward.fused
def _relu_backward_fused(bb, x, dy):
    return _fused(bb, x, dy, "relu")


# --------------------------------------------------------------------------------------------
# activation_backward
# --------------------------------------------------------------------------------------------

activation_backward = define_op(
    "activation_backward",
    inputs=("x", "dy"),
    attrs=(Attr("kind", check=check_choice(*ACTIVATION_KINDS)),),
    doc="dy * f'(x) for an elementwise activation f (docs/operators.md §3).",
)
activation_backward.infer(_infer_elementwise)


@activation_backward.reference
def _activation_backward_ref(x, dy, *, kind):
    return _reference(x, dy, kind)


@activation_backward.decomposition
def _activation_backward_decompose(bb, x, dy, *, kind):
    return _decompose(bb, x, dy, kind)


@activation_backward.fused
def _activation_backward_fused(bb, x, dy, *, kind):
    return _fused(bb, x, dy, kind)


# --------------------------------------------------------------------------------------------
# Gradient rules: relax.transform.Gradient emits these ops for Relax's own activations
# --------------------------------------------------------------------------------------------

# Relax elementwise op -> kind. Level 20 overrides TVM's level-10 rules where it has one (its
# relu rule passes dy at x == 0, PyTorch gives 0). relax.round is not mapped to the
# straight-through "round" kind: as a Relax primitive (torch.round imported) its derivative is 0,
# as in PyTorch; the estimator belongs to the ops that want it (fake_quantize).
RELAX_ACTIVATIONS = {
    "relax.nn.relu": "relu",
    "relax.nn.gelu": "gelu",
    "relax.nn.gelu_tanh": "gelu_tanh",
    "relax.nn.silu": "silu",
    "relax.sigmoid": "sigmoid",
    "relax.tanh": "tanh",
    "relax.exp": "exp",
    "relax.log": "log",
    "relax.sqrt": "sqrt",
    "relax.rsqrt": "rsqrt",
    "relax.abs": "abs",
    "relax.sin": "sin",
    "relax.cos": "cos",
    "relax.tan": "tan",
    "relax.atan": "atan",
    "relax.erf": "erf",
    "relax.floor": "floor",
    "relax.ceil": "ceil",
    "relax.sign": "sign",
}


def _activation_gradient(kind: str):
    def rule(orig_var, orig_call, output_grad, ctx):
        (x,) = orig_call.args[:1]
        if kind == "relu":
            return [relu_backward(x, output_grad)]
        return [activation_backward(x, output_grad, kind=kind)]

    rule.__doc__ = f"d {kind}(x) -> rlx.activation_backward(x, dy, kind={kind!r})"
    return rule


def _softplus_gradient(orig_var, orig_call, output_grad, ctx):
    """softplus(x; beta, threshold): sigmoid(beta x) below the threshold, 1 above (PyTorch)."""
    (x,) = orig_call.args
    beta = float(orig_call.attrs.beta)
    threshold = float(orig_call.attrs.threshold)
    if beta == 1.0 and threshold >= 40.0:  # sigmoid(40) == 1 in float64: plain softplus
        return [activation_backward(x, output_grad, kind="softplus")]
    dtype = tensor_dtype(x)
    bx = relax.op.multiply(x, relax.const(beta, dtype))
    slope = relax.op.where(relax.op.greater(bx, relax.const(threshold, dtype)), relax.op.ones_like(x), relax.op.sigmoid(bx))
    return [relax.op.multiply(output_grad, slope)]


for _name, _kind in RELAX_ACTIVATIONS.items():
    override_gradient(_name, _activation_gradient(_kind))
override_gradient("relax.nn.softplus", _softplus_gradient)
