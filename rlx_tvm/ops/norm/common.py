"""What the parts of the norm ops share: default epsilons, casts, shapes and axes."""

from __future__ import annotations

from tvm import relax

# Defaults, shared by the attributes and the references (``Case.reference`` passes only the
# attributes a case sets).
LAYER_EPS, RMS_EPS, GROUP_EPS = 1e-5, 1e-6, 1e-5


def cast(e, src: str, dst: str):
    """``e`` (of dtype ``src``) as ``dst``; nested expressions carry no type yet, hence ``src``."""
    return e if src == dst else relax.op.astype(e, dst)


def shape_of(e):
    return list(e.ty.shape.values)


def attr_axes(axes, ndim: int) -> list[int]:
    return [int(a) % ndim for a in axes]
