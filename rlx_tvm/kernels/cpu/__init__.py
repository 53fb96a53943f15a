"""Hand-written TensorIR kernels for CPUs, one module per op family; each registers its kernels
in the op's table of :mod:`rlx_tvm.kernels.strategy`."""

from . import indexing, loss, pool  # noqa: F401  (registration on import)
