"""IRModule passes over the rlx ops."""

from .decompose import DecomposeBackwardOps, count_rlx_calls
from .siblings import FuseSiblingBackwardOps

__all__ = ["DecomposeBackwardOps", "FuseSiblingBackwardOps", "count_rlx_calls"]
