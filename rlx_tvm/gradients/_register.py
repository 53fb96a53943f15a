"""Registering gradients of Relax primitives without clobbering TVM's own."""

from __future__ import annotations

import tvm
from tvm.relax.op import register_gradient

_DEFAULT_LEVEL = 10


def has_gradient(op_name: str) -> bool:
    try:
        return tvm.ir.Op.get(op_name).get_attr("FPrimalGradient") is not None
    except Exception:  # no op has the attribute at all
        return False


def fill_gradient(op_name: str):
    """Register the decorated ``fn(orig_var, orig_call, output_grad, ctx) -> [grad per arg]`` as
    the gradient of ``op_name`` unless one is registered already (idempotent on re-import)."""

    def deco(fn):
        if not has_gradient(op_name):
            register_gradient(op_name, fn, level=_DEFAULT_LEVEL)
        return fn

    return deco
