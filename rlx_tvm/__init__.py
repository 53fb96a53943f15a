"""rlx_tvm: the training half of Apache TVM Relax.

``import rlx_tvm`` registers the ``relax.rlx.*`` backward operators (with their type inference,
fused TensorIR legalizations and decompositions), the gradients of the Relax primitives that the
decompositions use, and the ``R.rlx`` TVMScript namespace.
"""

from . import ops
from . import gradients
from . import passes
from . import autodiff
from .build import compile  # noqa: A004 - rlx_tvm.compile mirrors tvm.compile
from .ops import OpError

__version__ = "0.1.0"

__all__ = ["ops", "gradients", "passes", "autodiff", "compile", "OpError", "__version__"]
