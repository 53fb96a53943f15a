"""The decorator the importer-coverage gradient rules are registered with.

Each rule replaces TVM's own where it has one (:func:`rlx_tvm.overrides.override_gradient`, at the
project's gradient level, safe on module re-import).
"""

from __future__ import annotations

from ..overrides import override_gradient


def rule(*op_names: str):
    """Register the decorated ``fn(orig_var, orig_call, output_grad, ctx) -> [grad per arg]`` as
    the gradient of each of ``op_names``."""

    def deco(fn):
        for name in op_names:
            override_gradient(name, fn)
        return fn

    return deco
