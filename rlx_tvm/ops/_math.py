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

import numpy as np
import tvm
from tvm import relax, tirx


class TirMath:
    def __init__(self, dtype: str):
        self.dtype = dtype

    def c(self, v):
        return tirx.const(v, self.dtype)

    exp = staticmethod(tirx.exp)
    log = staticmethod(tirx.log)
    tanh = staticmethod(tirx.tanh)
    erf = staticmethod(tirx.erf)
    sqrt = staticmethod(tirx.sqrt)
    sin = staticmethod(tirx.sin)
    cos = staticmethod(tirx.cos)
    abs = staticmethod(tirx.abs)

    def sigmoid(self, x):
        return tirx.sigmoid(x)

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
    def sigmoid(x):
        return 0.5 * (1.0 + np.tanh(0.5 * x))

    def where(self, cond, a, b):
        with np.errstate(all="ignore"):
            return np.where(cond, a, b)


def _np_erf(x):
    """erf in float64 without SciPy (``math.erf`` is correctly rounded; vectorize it)."""
    import math

    return np.vectorize(math.erf, otypes=[np.float64])(np.asarray(x, dtype=np.float64))


def acc_dtype(dtype: str) -> str:
    """Accumulation / compute dtype: half types compute in float32."""
    return "float32" if dtype in ("float16", "bfloat16") else dtype


def tensor_dtype(expr) -> str:
    """dtype string of a Relax tensor expression or a TE tensor."""
    if isinstance(expr, tvm.te.Tensor):
        return str(expr.dtype)
    return str(expr.ty.dtype.dtype)
