"""What the CPU and GPU default rules share."""

from __future__ import annotations

import os

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.target.codegen import llvm_get_vector_width, target_has_features
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.sym import detect_linear_equation

# A block annotation that keeps a stage materialized: MetaSchedule's AutoInline honours it, and
# so do the default rules (a stage whose inlining would recompute it many times, e.g. attention's
# probabilities, read Dv times each by the reduction that consumes them).
KEEP_STAGE = {"meta_schedule.inline_rule": "disable"}


def is_kept(sch: s_tir.Schedule, block_rv) -> bool:
    rule = sch.get(block_rv).annotations.get("meta_schedule.inline_rule")
    return rule is not None and str(rule) == "disable"


def try_inline(sch: s_tir.Schedule, blocks: list) -> list:
    """dlight's ``try_inline`` (inline, then reverse-inline, until nothing changes), leaving the
    blocks annotated with :data:`KEEP_STAGE` in place."""
    while True:
        for i, info in enumerate(blocks):
            if is_kept(sch, info.block_rv):
                continue
            try:
                sch.compute_inline(info.block_rv)
            except s_tir.ScheduleError:
                try:
                    sch.reverse_compute_inline(info.block_rv)
                except s_tir.ScheduleError:
                    continue
            blocks.pop(i)
            break
        else:
            return blocks


def inlined_blocks(rule, func, target) -> tuple[s_tir.Schedule, list] | None:
    """For a dlight ``rule`` applied to ``func``: a schedule of ``func`` with its injective stages
    inlined, and the remaining blocks (dlight's block infos); None when ``func`` is not a PrimFunc,
    the rule does not serve ``target``, or dlight cannot normalize the function."""
    if not isinstance(func, tirx.PrimFunc) or not rule.is_target_available(target):
        return None
    sch = s_tir.Schedule(func)
    blocks = normalize_prim_func(sch)
    if blocks is None:
        return None
    if len(blocks) > 1:
        blocks = try_inline(sch, blocks)
    return sch, blocks


def root_blocks(sch: s_tir.Schedule) -> list:
    """The blocks directly under the root block; none for hand-written TIR without a root block
    (e.g. TOPI's scatter kernels)."""
    try:
        return list(sch.get_child_blocks(sch.get_sblock("root")))
    except s_tir.ScheduleError:
        return []


def target_cores(target) -> int:
    """The cores a CPU target names (``num-cores``), else this machine's CPU count (also for no
    target)."""
    cores = target.attrs.get("num-cores") if target is not None else None
    return int(cores or os.cpu_count() or 1)


def _is_x86(target) -> bool:
    return target is not None and target.kind.name == "llvm" and bool(target_has_features("sse2", target))


def vector_bits(target) -> int:
    """Bits in one vector register of an LLVM CPU target. On x86 from its features: 512 with
    AVX-512F, 256 with AVX, else 128. (TVM 0.27's ``llvm_get_vector_width`` answers 512 for every
    x86 CPU, AVX2-only ``znver3`` and ``haswell`` and SSE-only ``x86-64`` included: schedules sized
    by it gave AVX2 vectors of two registers each, and register-blocked tiles of twice the
    registers there are.)"""
    if _is_x86(target):
        return 512 if has_avx512(target) else 256 if target_has_features("avx", target) else 128
    return llvm_get_vector_width(target)


def has_avx512(target) -> bool:
    """An LLVM x86 CPU target with AVX-512F."""
    return _is_x86(target) and bool(target_has_features("avx512f", target))


def vector_lanes(target, bits: int = 32) -> int:
    """Elements of ``bits`` bits in one vector register of an LLVM CPU target (16 float32 with
    AVX-512, 8 with AVX2; the schedules size their vector loops by float32)."""
    return max(1, vector_bits(target) // bits)


def vector_registers(target) -> int:
    """Vector registers of an LLVM CPU target: 16 on x86 without AVX-512 (ymm0-15), else 32
    (AVX-512's zmm0-31, AArch64's v0-31)."""
    return 16 if _is_x86(target) and not has_avx512(target) else 32


def expression_nodes(expr) -> int:
    """The nodes of a TIR expression tree (a size: repeated subtrees count each time)."""
    count = [0]

    def visit(_node):
        count[0] += 1
        return None

    tvm_ffi.structural_walk(expr, (tvm.ir.expr.Expr, visit), order="post")
    return count[0]


def fuse_loops(sch: s_tir.Schedule, loops: list):
    """``loops`` fused into one (a single loop as it is)."""
    return sch.fuse(*loops) if len(loops) > 1 else loops[0]


def uses(expr, var) -> bool:
    return any(v.same_as(var) for v in tirx.analysis.undefined_vars(expr))


def is_column_reduction(sch: s_tir.Schedule, block, n_spatial: int) -> bool:
    """A reduction whose inputs are contiguous along its innermost output axis (the column): some
    read's innermost index uses the column, and every read that is contiguous along a reduced axis
    instead is a per-row broadcast (e.g. a norm's mean[row]) that does not depend on the column."""
    stmt = sch.get(block)
    iters = [iv.var for iv in stmt.iter_vars]
    if n_spatial == len(iters):
        return False
    column, reduced = iters[n_spatial - 1], iters[n_spatial:]
    contiguous_along_column = False
    for read in stmt.reads:
        if not read.region:
            continue
        inner = read.region[-1].min
        if uses(inner, column):
            if any(uses(inner, v) for v in reduced) and not is_shifted(inner, column):
                return False  # e.g. cumsum's in-block dy[i, i // b * b + k]: a gather, not a column
            contiguous_along_column = True  # x[..., j] or a sliding window x[..., j + k]
        elif any(uses(inner, v) for v in reduced) and any(uses(r.min, column) for r in read.region):
            return False  # e.g. group norm's x[n, c, hw]: a row reduction over hw
    return contiguous_along_column


def is_shifted(index, column) -> bool:
    """``index`` is ``column + f(other vars)``: contiguous along the column for every fixed value
    of the others (a convolution's sliding window ``x + j``)."""
    coeffs = detect_linear_equation(index, [column])
    return len(coeffs) == 2 and isinstance(coeffs[0], tirx.IntImm) and coeffs[0].value == 1 and not uses(coeffs[1], column)
