"""The base of the rules that schedule one block: a kernel of that one block (after its injective
stages are inlined) as a dlight rule, and each block of a multi-block kernel through
:class:`~rlx_tvm.schedules.cpu.fallback.ParallelFallback`."""

from __future__ import annotations

from dataclasses import dataclass

from tvm import s_tir, tirx
from tvm.s_tir.dlight.cpu.base import CPUScheduleRule
from tvm.target import Target

from ..common import inlined_blocks, target_cores, vector_lanes, vector_registers


@dataclass(frozen=True)
class CPU:
    """What the rules size their loops by."""

    lanes: int  # float32 lanes of a vector register
    cores: int
    registers: int  # vector registers

    @staticmethod
    def of(target: Target) -> "CPU":
        return CPU(vector_lanes(target), target_cores(target), vector_registers(target))


@dataclass
class BlockShape:
    """A block's loops as dlight sees them: ``kinds`` ("S" spatial, "R" reduction, "O" other) per
    loop, ``n_lead`` leading spatial loops."""

    block: object
    loops: list
    kinds: str
    n_lead: int

    @property
    def lead(self) -> list:
        return list(self.loops[: self.n_lead])

    @property
    def reduced(self) -> list:
        return list(self.loops[self.n_lead:])

    @property
    def is_reduction(self) -> bool:
        """S...S R...R."""
        return self.n_lead < len(self.kinds) and self.kinds.strip("R") == "S" * self.n_lead

    @property
    def is_spatial(self) -> bool:
        return self.n_lead == len(self.kinds)


def block_shape(sch: s_tir.Schedule, info) -> BlockShape | None:
    """The shape of a dlight block info's block; None where its loops are not one per iterator or
    it has no leading spatial loop (nothing for a block rule to do)."""
    loops = sch.get_loops(info.block_rv)
    kinds = info.dom_kind()
    n_lead = len(kinds) - len(kinds.lstrip("S"))
    if not loops or len(kinds) != len(loops) or n_lead == 0:
        return None
    return BlockShape(info.block_rv, list(loops), kinds, n_lead)


class BlockRule(CPUScheduleRule):
    """A rule for one pattern of block. ``schedule_block`` schedules a block that fits and returns
    True, or returns False with the schedule unchanged; as a rule of its own it takes kernels of one
    block (after inlining) and declines every other kernel."""

    def schedule_block(self, sch: s_tir.Schedule, info, cpu: CPU) -> bool:
        raise NotImplementedError

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        found = inlined_blocks(self, func, target)
        if found is None or len(found[1]) != 1:
            return None
        sch, (info,) = found
        try:
            return sch if self.schedule_block(sch, info, CPU.of(target)) else None
        except s_tir.ScheduleError:
            return None
