"""What the parts of the norm ops share: default epsilons, casts, shapes and axes."""

from __future__ import annotations

from tvm import relax

# Defaults, shared by the attributes and the references (``Case.reference`` passes only the
# attributes a case sets).
LAYER_EPS, RMS_EPS, GROUP_EPS = 1e-5, 1e-6, 1e-5


# The input-gradient formulas, for NumPy arrays (the references) and Relax expressions (the
# decompositions) alike; ``mean`` averages over the elements normalized together, keeping dims.


def normalized_dx(r, xh, g, mean):
    """``r * (g - mean(g) - xh * mean(g * xh))``: the input gradient of ``xh = (x - mean(x)) * r``
    for an output gradient ``g`` (layer norm; group norm per block)."""
    return r * (g - mean(g) - xh * mean(g * xh))


def rms_norm_dx(r, x, gdy, mean):
    """``r * (gdy - r^2 * x * mean(x * gdy))``: the input gradient of ``x * r`` with
    ``r = (mean(x^2) + eps)^(-1/2)`` for an output gradient ``gdy``."""
    return r * (gdy - r * r * x * mean(x * gdy))


def cast(e, src: str, dst: str):
    """``e`` (of dtype ``src``) as ``dst``; nested expressions carry no type yet, hence ``src``."""
    return e if src == dst else relax.op.astype(e, dst)


def shape_of(e):
    return list(e.ty.shape.values)


def attr_axes(axes, ndim: int) -> list[int]:
    return [int(a) % ndim for a in axes]
