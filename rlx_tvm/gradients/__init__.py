"""Gradients for Relax primitives that TVM 0.27 leaves without one.

The decompositions in :mod:`rlx_tvm.ops` only emit primitives with a registered gradient, so that
``relax.transform.Gradient`` can run on a decomposed backward graph (second and higher order).
Each rule is registered with :func:`rlx_tvm.overrides.fill_gradient`, only if the op has no
gradient of TVM's own, so a future TVM that ships one keeps it.
"""

from ..overrides import fill_gradient, has_gradient, override_gradient
from . import attention, elementwise, nn, reduce, scatter, shape  # noqa: F401  (registration on import)
from . import attention_bias, nn3d, nn_extra, pointwise, slicing, tensor_ops  # noqa: F401  (importer coverage, registered at the project level)

__all__ = ["fill_gradient", "has_gradient", "override_gradient"]
