"""Normalization backward ops: layer norm, RMS norm and group norm (docs/operators.md §2).

Notation, over the elements normalized together (one row along ``axis`` for layer/RMS norm, one
``(n, group)`` block of ``C/G * prod(spatial)`` elements for group norm): ``mean`` and the biased
variance ``var``, ``r = (var + eps)^(-1/2)`` (RMS norm: ``r = (mean(x^2) + eps)^(-1/2)``) and
``xh = (x - mean) * r``.

* layer norm, ``y = xh * gamma + beta``:
  ``dx = r * (g - mean(g) - xh * mean(g * xh))`` with ``g = dy * gamma``; ``dgamma = sum dy * xh``.
* RMS norm, ``y = x * r * gamma + beta``:
  ``dx = r * (gamma * dy - r^2 * x * mean(x * gamma * dy))``; ``dgamma = sum dy * x * r``;
  ``dbeta = sum dy``.
* group norm, ``y = xh * gamma_c + beta_c``: layer norm's formula per block with
  ``s = dy * gamma_c``; ``dgamma_c = sum_{n, spatial} dy * xh``, ``dbeta_c = sum_{n, spatial} dy``.

The parameter vectors are laid along the normalized axis (layer/RMS) or the channel axis (group),
never broadcast by trailing alignment alone: with a square ``[8, 8]`` input that would silently
scale the wrong axis (docs/operators.md §8). Parameter gradients reduce over every other axis, the batch
included (docs/operators.md §8: a reshape that keeps N is wrong for N > 1).

The parts: :mod:`.declarations` (signatures, type inference), :mod:`.reference` (NumPy),
:mod:`.decomposition` (primitive Relax ops, differentiable again), :mod:`.kernels` (fused TE
kernels), :mod:`.siblings` (the gradients of one norm in one kernel), :mod:`.gradients` (rules
for Relax's own norms) and :mod:`.legalize` (their forward legalizations).

Limits: group norm needs a static channel count (to check and split the groups). Symbolic dims
work everywhere in inference and both paths; differentiating a decomposition again needs the
normalized extent (and group block) static, since TVM's ``mean`` gradient reads it as an int.
"""

from . import gradients, legalize, siblings  # noqa: F401  (registration on import)
from .common import GROUP_EPS, LAYER_EPS, RMS_EPS
from .declarations import (group_norm_backward_beta, group_norm_backward_gamma, group_norm_backward_input,
                           layer_norm_backward_gamma, layer_norm_backward_input, rms_norm_backward_beta,
                           rms_norm_backward_gamma, rms_norm_backward_input)
from .siblings import ROW_CHUNKS

__all__ = ["GROUP_EPS", "LAYER_EPS", "RMS_EPS", "ROW_CHUNKS", "group_norm_backward_beta", "group_norm_backward_gamma",
           "group_norm_backward_input", "layer_norm_backward_gamma", "layer_norm_backward_input",
           "rms_norm_backward_beta", "rms_norm_backward_gamma", "rms_norm_backward_input"]
