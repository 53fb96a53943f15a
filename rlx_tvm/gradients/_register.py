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


_OVERRIDDEN: dict[str, object] = {}


def override_gradient(op_name: str, fn, level: int) -> None:
    """Register ``fn`` as ``op_name``'s gradient at ``level`` (above TVM's 10), replacing TVM's rule.

    TVM refuses a second registration at the same level, so a re-import (module reload) swaps the
    Python function behind a dispatcher registered once instead of registering again.
    """
    first = op_name not in _OVERRIDDEN
    _OVERRIDDEN[op_name] = fn
    if first:

        def dispatch(orig_var, orig_call, output_grad, ctx, _name=op_name):
            return _OVERRIDDEN[_name](orig_var, orig_call, output_grad, ctx)

        register_gradient(op_name, dispatch, level=level)
