"""rlx_tvm: the training half of Apache TVM Relax.

``import rlx_tvm`` registers the ``relax.rlx.*`` backward operators (with their type inference,
fused TensorIR legalizations and decompositions), the gradients of the Relax primitives that the
decompositions use, and the ``R.rlx`` TVMScript namespace. It also has TVM's CPU thread pool run on
every CPU of the process (:mod:`rlx_tvm.threads`) unless ``TVM_NUM_THREADS`` or ``OMP_NUM_THREADS``
says otherwise.
"""

from . import ops
from . import gradients
from . import passes
from . import autodiff
from .build import compile  # noqa: A004 - rlx_tvm.compile mirrors tvm.compile
from .ops import OpError
from .threads import default_tvm_threads

default_tvm_threads()  # before any kernel runs (importing runs none): TVM's pool reads it when it starts

__version__ = "0.1.0"

__all__ = ["ops", "gradients", "passes", "autodiff", "compile", "OpError", "__version__"]
