"""The op declaration API of the op families (:func:`define_op`, :class:`OpDef`, the attribute
checks): :mod:`rlx_tvm.registry`, which lives below the passes and autodiff that work on any
declared op."""

from ..registry import *  # noqa: F401,F403
from ..registry import __all__  # noqa: F401
