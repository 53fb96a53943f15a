"""Gradients of shape primitives TVM 0.27 leaves without one.

None needed yet: the rope decomposition slices with ``split`` and reassembles with ``concat`` and
``reshape``, which all have TVM gradients, instead of ``strided_slice``.
"""
