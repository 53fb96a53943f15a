"""Which kernel legalizes an op for the target being compiled for.

Each op with more than one kernel has a table of ``(label, predicate on the target, builder)``,
tried in order: the first builder whose predicate holds and that does not decline (returns None)
builds the op's kernel. The op families' legalizations call :func:`build` instead of reading the
target themselves; the hand-written CPU kernels (``rlx_tvm/kernels/cpu/``) and the op families'
TE kernels register here. Registering a label again (a module reloaded) replaces its entry in
place.
"""

from __future__ import annotations

from typing import Callable

import tvm

__all__ = ["anywhere", "build", "current_target", "on_cpu", "on_gpu", "register", "strategies"]

Predicate = Callable[["tvm.target.Target | None"], bool]


def current_target() -> tvm.target.Target | None:
    """The target in scope (``with target:``), None outside one (a plain ``LegalizeOps``)."""
    return tvm.target.Target.current(allow_none=True)


def on_gpu(target) -> bool:
    """A GPU target (CUDA, ROCm, Vulkan, Metal, ...)."""
    return target is not None and "gpu" in target.keys


def on_cpu(target) -> bool:
    """Not a GPU target: a CPU one, or none (legalizing for the host)."""
    return not on_gpu(target)


def anywhere(target) -> bool:
    return True


_TABLE: dict[str, list[tuple[str, Predicate, Callable]]] = {}


def register(op: str, label: str, when: Predicate):
    """Decorator: ``builder(target, *args, **kwargs) -> Expr | None`` becomes the ``label`` entry
    of ``op``'s table, tried where ``when(target)`` holds (after the entries registered before it)."""

    def deco(builder):
        entries = _TABLE.setdefault(op, [])
        entry = (label, when, builder)
        for k, (existing, _, _) in enumerate(entries):
            if existing == label:
                entries[k] = entry
                break
        else:
            entries.append(entry)
        return builder

    return deco


def build(op: str, *args, target=None, **kwargs):
    """The kernel of ``op`` for ``target`` (default: the one in scope) from its table."""
    target = current_target() if target is None else target
    for label, when, builder in _TABLE.get(op, []):
        if when(target):
            out = builder(target, *args, **kwargs)
            if out is not None:
                return out
    raise ValueError(f"rlx.{op}: no kernel for target {target} (strategies: {[e[0] for e in _TABLE.get(op, [])]})")


def strategies(op: str) -> list[str]:
    """The labels of ``op``'s table, in the order they are tried."""
    return [label for label, _, _ in _TABLE.get(op, [])]
