"""rlx_tvm: the training half of Apache TVM Relax.

``import rlx_tvm`` registers the ``relax.rlx.*`` backward operators (with their type inference,
fused TensorIR legalizations and decompositions), the gradients of the Relax primitives that the
decompositions use, and the ``R.rlx`` TVMScript namespace.
"""

from . import ops
from . import gradients
from . import passes
from .ops import OpError

__version__ = "0.1.0"

__all__ = ["ops", "gradients", "passes", "OpError", "__version__"]
