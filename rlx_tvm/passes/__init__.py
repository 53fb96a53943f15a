"""IRModule passes over the rlx ops."""

from .decompose import DecomposeBackwardOps, count_rlx_calls

__all__ = ["DecomposeBackwardOps", "count_rlx_calls"]
