"""One vocabulary for elementwise math, three evaluators.

Elementwise formulas (activation derivatives, straight-through estimators) are written once as
``f(m, x)`` against this small interface and evaluated by

* :class:`TirMath`  - on TIR scalars inside ``te.compute`` (the fused kernel),
* :class:`RelaxMath` - on Relax tensors with primitive ops that have gradients (the decomposition),
* :class:`NumpyMath` - on NumPy arrays in float64 (the reference the tests compare both against;
  the formula itself is checked independently against finite differences of the forward).

Arithmetic operators (+, -, *, /, unary -) work natively on all three kinds of values; everything
else goes through ``m``.
"""

from __future__ import annotations

import math

import numpy as np
from tvm import relax, tirx

from ..kernels.fastmath import _is_f32, exp_nonpositive_f32, normal_cdf_f32, tir_erf, tir_exp, tir_sigmoid, tir_tanh


class TirMath:
    def __init__(self, dtype: str):
        self.dtype = dtype

    def c(self, v):
        return tirx.const(v, self.dtype)

    exp = staticmethod(tir_exp)
    log = staticmethod(tirx.log)
    tanh = staticmethod(tir_tanh)
    erf = staticmethod(tir_erf)

    def normal_cdf_and_gauss(self, z):
        """((1 + erf(z)) / 2, exp(-z^2)), the exponential computed once for both."""
        if _is_f32(z):
            # NaN: the exponential gives a number, but z reaches both results (through t and z)
            gauss = exp_nonpositive_f32(-(z * z), nan="drop")
            return normal_cdf_f32(z, gauss), gauss
        return self.c(0.5) * (self.c(1.0) + tirx.erf(z)), tirx.exp(-(z * z))

    sqrt = staticmethod(tirx.sqrt)
    sin = staticmethod(tirx.sin)
    cos = staticmethod(tirx.cos)
    abs = staticmethod(tirx.abs)

    def sigmoid(self, x):
        return tir_sigmoid(x)

    def maximum(self, a, b):
        return tirx.max(a, b)

    def minimum(self, a, b):
        return tirx.min(a, b)

    def where(self, cond, a, b):
        return tirx.Select(cond, a, b)

    def gt(self, a, b):
        return a > b

    def ge(self, a, b):
        return a >= b

    def lt(self, a, b):
        return a < b

    def le(self, a, b):
        return a <= b

    def logical_and(self, a, b):
        return tirx.all(a, b)

    def zeros_like(self, x):
        return self.c(0.0)

    def ones_like(self, x):
        return self.c(1.0)


class RelaxMath:
    """Relax primitives only; each has a gradient in TVM or in :mod:`rlx_tvm.gradients`."""

    def __init__(self, dtype: str):
        self.dtype = dtype

    def c(self, v):
        return relax.const(v, self.dtype)

    exp = staticmethod(relax.op.exp)
    log = staticmethod(relax.op.log)
    tanh = staticmethod(relax.op.tanh)
    erf = staticmethod(relax.op.erf)

    def normal_cdf_and_gauss(self, z):
        cdf = relax.op.multiply(self.c(0.5), relax.op.add(self.c(1.0), relax.op.erf(z)))
        return cdf, relax.op.exp(relax.op.negative(relax.op.multiply(z, z)))

    sqrt = staticmethod(relax.op.sqrt)
    sin = staticmethod(relax.op.sin)
    cos = staticmethod(relax.op.cos)
    abs = staticmethod(relax.op.abs)
    sigmoid = staticmethod(relax.op.sigmoid)
    maximum = staticmethod(relax.op.maximum)
    minimum = staticmethod(relax.op.minimum)
    gt = staticmethod(relax.op.greater)
    ge = staticmethod(relax.op.greater_equal)
    lt = staticmethod(relax.op.less)
    le = staticmethod(relax.op.less_equal)
    logical_and = staticmethod(relax.op.logical_and)
    zeros_like = staticmethod(relax.op.zeros_like)
    ones_like = staticmethod(relax.op.ones_like)

    def where(self, cond, a, b):
        return relax.op.where(cond, a, b)


class NumpyMath:
    def __init__(self, dtype: str = "float64"):
        self.dtype = dtype

    def c(self, v):
        return np.asarray(v, dtype=self.dtype)

    exp = staticmethod(np.exp)
    log = staticmethod(np.log)
    tanh = staticmethod(np.tanh)
    sqrt = staticmethod(np.sqrt)
    sin = staticmethod(np.sin)
    cos = staticmethod(np.cos)
    abs = staticmethod(np.abs)
    maximum = staticmethod(np.maximum)
    minimum = staticmethod(np.minimum)
    gt = staticmethod(np.greater)
    ge = staticmethod(np.greater_equal)
    lt = staticmethod(np.less)
    le = staticmethod(np.less_equal)
    logical_and = staticmethod(np.logical_and)
    zeros_like = staticmethod(np.zeros_like)
    ones_like = staticmethod(np.ones_like)

    @staticmethod
    def erf(x):
        return _np_erf(x)

    @staticmethod
    def normal_cdf_and_gauss(z):
        # erfc(-z) / 2, not (1 + erf(z)) / 2: the reference keeps the lower tail's digits too
        return 0.5 * np.vectorize(math.erfc, otypes=[np.float64])(-np.asarray(z, dtype=np.float64)), np.exp(-(z * z))

    @staticmethod
    def sigmoid(x):
        return 0.5 * (1.0 + np.tanh(0.5 * x))

    def where(self, cond, a, b):
        with np.errstate(all="ignore"):
            return np.where(cond, a, b)


def _np_erf(x):
    """erf in float64 without SciPy (``math.erf`` is correctly rounded; vectorize it)."""
    return np.vectorize(math.erf, otypes=[np.float64])(np.asarray(x, dtype=np.float64))
