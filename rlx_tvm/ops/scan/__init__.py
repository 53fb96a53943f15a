"""Scan with checkpointing: ``rlx.scan`` and its backward ops (docs/operators.md §6).

``rlx.scan`` applies a Relax function of the module (``body(carry, *x_t, *params) -> carry``) over
the leading axis of stacked inputs ``xs``, keeping the final carry or a trajectory of ``K`` rows
(checkpoints). Its gradient recomputes each segment between checkpoints from its checkpoint and
sweeps it backwards through the body's VJP (built by :mod:`rlx_tvm.autodiff`), so training an RNN
over ``L`` steps holds O(K + L/K) carries. It lowers to recursive Relax functions (a loop whose
compiled size does not depend on ``L``); short static scans decompose by unrolling, so their
backward can be differentiated again. Design, usage and limits: ``docs/scan.md``.

The parts: :mod:`.layout` (call layout, Python bodies, shape templates), :mod:`.body` (body
function and VJP), :mod:`.infer` (type inference), :mod:`.reference` (NumPy),
:mod:`.decomposition` (unrolling), :mod:`.lowering` and :mod:`.kernels` (the loops and the row
kernels they call), :mod:`.declarations` (the ops and the gradient rule of ``rlx.scan``).
"""

from .body import body_vjp
from .declarations import scan, scan_backward, scan_backward_params, scan_backward_xs
from .layout import MAX_UNROLL, ScanBody, row_steps

__all__ = ["ScanBody", "body_vjp", "MAX_UNROLL", "row_steps", "scan", "scan_backward", "scan_backward_xs",
           "scan_backward_params"]
