"""Default CPU schedules for kernels that have no tuning record.

TVM 0.27's CPU pipeline schedules nothing: every kernel runs as serial loops. ``default_cpu_rules``
is the rule list for ``dlight.ApplyDefaultSchedule``: dlight's own CPU rules where they fit (GEMV,
row reductions followed by elementwise work such as softmax/norms) and :class:`ParallelFallback`
for everything else (elementwise kernels, column reductions such as gamma/beta gradients, the
gather formulations of pooling/scatter backward, multi-stage fused kernels).
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.cpu.base import CPUScheduleRule
from tvm.target import Target
from tvm.target.codegen import llvm_get_vector_width

from .common import inlined_blocks, root_blocks

__all__ = ["ParallelFallback", "default_cpu_rules"]


def _static(extent) -> int | None:
    return int(extent.value) if isinstance(extent, tirx.IntImm) else None


class ParallelFallback(CPUScheduleRule):
    """Any kernel: inline injective stages, then per remaining block parallelize the fused
    leading spatial loops and vectorize a static innermost spatial loop.

    Reduction loops stay serial inside each parallel iteration, so every output element is written
    by exactly one thread: race-free by construction, also for the gather-style scatter kernels.
    """

    def __init__(self, min_parallel_extent: int = 2):
        self.min_parallel_extent = min_parallel_extent

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        found = inlined_blocks(self, func, target)
        if found is None:
            return None
        sch, blocks = found
        lanes = max(1, llvm_get_vector_width(target) // 32)
        for info in blocks:
            self._schedule_block(sch, info, lanes)
        return sch

    def _schedule_block(self, sch: s_tir.Schedule, info, lanes: int) -> None:
        block = info.block_rv
        loops = sch.get_loops(block)
        kinds = info.dom_kind()
        n_lead = len(kinds) - len(kinds.lstrip("S"))
        if not loops or len(kinds) != len(loops) or n_lead == 0:
            return
        lead = list(loops[:n_lead])
        if n_lead == len(loops):  # all spatial: vectorize the innermost loop when it splits evenly
            inner_extent = _static(sch.get(lead[-1]).extent)
            if inner_extent is not None and inner_extent % lanes == 0 and inner_extent >= lanes:
                outer, vec = sch.split(lead[-1], factors=[None, lanes])
                sch.vectorize(vec)
                lead[-1] = outer
        fused = sch.fuse(*lead) if len(lead) > 1 else lead[0]
        extent = _static(sch.get(fused).extent)
        if extent is None or extent >= self.min_parallel_extent:
            sch.parallel(fused)


class RowReduction(dl.cpu.Reduction):
    """dlight's CPU reduction rule, declined for kernels with a full reduction to a scalar (e.g.
    fake-quantize's ``max|x|``): it would put that reduction under the consumer's parallel row loop,
    recomputing it once per row (seconds at 8M elements) with every thread writing the same scalar."""

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        if isinstance(func, tirx.PrimFunc) and _has_full_reduction(func):
            return None
        return super().apply(func, target, tunable)


def _has_full_reduction(func: tirx.PrimFunc) -> bool:
    sch = s_tir.Schedule(func)
    for block in root_blocks(sch):
        iters = sch.get(block).iter_vars
        if iters and all(iv.iter_type != tirx.IterVar.DataPar for iv in iters):
            return True
    return False


def default_cpu_rules() -> list:
    """Rules in priority order: dlight's specialised CPU rules first, our fallback last."""
    return [dl.cpu.GEMV(), RowReduction(), ParallelFallback()]
