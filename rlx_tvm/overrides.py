"""Every change rlx_tvm makes to TVM's operator registry, through one mechanism.

``import rlx_tvm`` sets attributes of TVM operators: the type inference, legalization and purity
of the ``relax.rlx.*`` ops it declares (:mod:`rlx_tvm.registry`), gradient rules
(``FPrimalGradient``) of Relax's own ops (the op families' rules, ``relu`` and the other
activations among them, and :mod:`rlx_tvm.gradients`), and the forward legalization of
``relax.nn.layer_norm``, ``rms_norm`` and ``group_norm`` (:mod:`rlx_tvm.ops.norm.legalize` says
why it is on).

TVM keeps one value per (op, attribute) and level: the highest level wins, a lower one is ignored
and a second registration at the same level raises. So :func:`set_op_attr` registers each
(op, attribute) once per process, with a dispatcher that calls the function last given for it;
importing again or reloading a module that sets attributes swaps that function. That the
dispatcher is registered is recorded on the op itself (attribute ``rlx_tvm.set.<attribute>``),
which survives a fresh import of this module as well.

New gradient rules use :func:`gradient` (or :func:`override_gradient`)::

    @overrides.gradient("relax.nn.softplus")
    def _softplus_grad(orig_var, orig_call, output_grad, ctx): ...

which replaces TVM's rule where it has one; :func:`fill_gradient` keeps TVM's where it has one.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import tvm

__all__ = ["GRADIENT_LEVEL", "LEGALIZE_LEVEL", "fill_gradient", "function_set_here", "gradient", "has_gradient", "override_gradient",
           "override_legalize", "set_op_attr"]

# TVM registers its own rules at level 10 (``register_gradient``/``register_legalize`` default);
# ours sit above, so an rlx rule wins where TVM ships one.
GRADIENT_LEVEL = 20
LEGALIZE_LEVEL = 20

_MARK = "rlx_tvm.set."
# (op name, attribute) -> the function the registered dispatcher calls now.
_CURRENT: dict[tuple[str, str], Callable] = {}


def _get_attr(op: tvm.ir.Op, key: str):
    try:
        return op.get_attr(key)
    except Exception:  # no op has this attribute yet
        return None


def _dispatcher(key: tuple[str, str], first: Callable) -> Callable:
    def dispatch(*args):
        # This module as imported now: after a fresh import its table holds the newest functions.
        current = getattr(sys.modules.get(__name__), "_CURRENT", _CURRENT)
        return current.get(key, first)(*args)

    dispatch.__name__ = f"rlx_tvm_{key[1]}"
    return dispatch


def set_op_attr(op_name: str, attr: str, value: Any, level: int = 10) -> None:
    """Make ``value`` the ``attr`` of TVM op ``op_name`` at ``level``, idempotently.

    A function is registered once, behind a dispatcher; later calls only replace the function it
    calls. Any other value (``FPurity``'s True) is registered once and kept."""
    op = tvm.ir.Op.get(op_name)
    key = (op_name, attr)
    if callable(value):
        _CURRENT[key] = value
    if _get_attr(op, _MARK + attr) is None:
        tvm.ir.register_op_attr(op_name, attr, _dispatcher(key, value) if callable(value) else value, level=level)
        tvm.ir.register_op_attr(op_name, _MARK + attr, level)


def function_set_here(op_name: str, attr: str = "FPrimalGradient") -> Callable | None:
    """The function rlx_tvm registered as ``attr`` of ``op_name`` (its gradient rule by default), or None."""
    return _CURRENT.get((op_name, attr))


def is_set_here(op_name: str, attr: str) -> bool:
    """Whether rlx_tvm registered ``attr`` of ``op_name`` (through :func:`set_op_attr`)."""
    return _get_attr(tvm.ir.Op.get(op_name), _MARK + attr) is not None


def has_gradient(op_name: str) -> bool:
    """Whether ``op_name`` has a gradient rule (TVM's or rlx_tvm's)."""
    return _get_attr(tvm.ir.Op.get(op_name), "FPrimalGradient") is not None


def override_gradient(op_name: str, fn: Callable) -> None:
    """``fn(orig_var, orig_call, output_grad, ctx) -> [grad per arg]`` becomes ``op_name``'s
    gradient rule, replacing TVM's where it has one."""
    set_op_attr(op_name, "FPrimalGradient", fn, GRADIENT_LEVEL)


def gradient(op_name: str):
    """Decorator form of :func:`override_gradient`."""

    def deco(fn):
        override_gradient(op_name, fn)
        return fn

    return deco


def fill_gradient(op_name: str):
    """Decorator: the gradient rule of ``op_name`` unless TVM ships one (a future TVM's own wins)."""

    def deco(fn):
        if is_set_here(op_name, "FPrimalGradient") or not has_gradient(op_name):
            override_gradient(op_name, fn)
        return fn

    return deco


def override_legalize(op_name: str, fn: Callable) -> None:
    """``fn(bb, call) -> Expr`` becomes the legalization of ``op_name``, replacing TVM's."""
    set_op_attr(op_name, "FLegalize", fn, LEGALIZE_LEVEL)
