"""Dtype and index helpers shared by the kernels of every op family."""

from __future__ import annotations

import tvm
from tvm import tirx


def clamp_index(i, n):
    """``i`` clamped into ``[0, n)``: an index that is safe to load even where a select discards
    the value. Pair it with a condition ``clamp_index(i, n) == i`` rather than ``0 <= i < n``: TVM's
    simplifier drops a clamp that its select's condition proves redundant, and the select still
    evaluates the load."""
    return tirx.max(tirx.min(i, n - 1), 0)


def acc_dtype(dtype: str) -> str:
    """Accumulation / compute dtype: half types compute in float32."""
    return "float32" if dtype in ("float16", "bfloat16") else dtype


def tensor_dtype(expr) -> str:
    """dtype string of a Relax tensor expression or a TE tensor."""
    if isinstance(expr, tvm.te.Tensor):
        return str(expr.dtype)
    return str(expr.ty.dtype.dtype)
