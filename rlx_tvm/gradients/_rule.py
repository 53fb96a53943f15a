"""The one place the importer-coverage gradient rules are registered from.

Rules registered here sit at the project's gradient level (20), above TVM's own (10), through
:func:`override_gradient` (safe on module re-import). Switching every such rule to another
registry means changing only :func:`rule`.
"""

from __future__ import annotations

from ._register import override_gradient

GRADIENT_LEVEL = 20


def rule(*op_names: str):
    """Register the decorated ``fn(orig_var, orig_call, output_grad, ctx) -> [grad per arg]`` as
    the gradient of each of ``op_names``."""

    def deco(fn):
        for name in op_names:
            override_gradient(name, fn, GRADIENT_LEVEL)
        return fn

    return deco
