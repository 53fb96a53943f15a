"""dlight's GEMV rule, declining where its analysis would fail."""

from __future__ import annotations

import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl


class GEMV(dl.cpu.GEMV):
    """dlight's GEMV rule, minus kernels that access more than one element per buffer in a block
    (hand-written whole-row or whole-plane blocks: serial scans, scatters), on which its analysis
    fails an assertion instead of declining."""

    def apply(self, func, target, tunable):
        if isinstance(func, tirx.PrimFunc) and _has_region_access(func):
            return None
        try:
            return super().apply(func, target, tunable)
        except AssertionError:
            # dlight's GEMV analysis asserts instead of declining on reductions whose operand is
            # broadcast (``sum(x * c, axis=1)`` with c[n, 1]); a rule that does not fit declines.
            return None


def _has_region_access(func: tirx.PrimFunc) -> bool:
    found = []

    def visit(node):
        if isinstance(node, s_tir.SBlock) and node.name_hint != "root":
            regions = [r for access in (*node.reads, *node.writes) for r in access.region]
            found.extend(r for r in regions if not (isinstance(r.extent, tirx.IntImm) and r.extent.value == 1))

    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, visit), order="post")
    return bool(found)
