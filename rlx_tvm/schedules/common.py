"""What the CPU and GPU default rules share."""

from __future__ import annotations


import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.sym import detect_linear_equation

from ..kernels.annotations import KEEP_STAGE, is_kept  # noqa: F401 (re-exported)
from ..target import has_avx512, target_cores, vector_bits, vector_lanes, vector_registers  # noqa: F401 (re-exported)


def try_inline(sch: s_tir.Schedule, blocks: list, keep=None) -> list:
    """dlight's ``try_inline`` (inline, then reverse-inline, until nothing changes), leaving the
    blocks annotated with :data:`KEEP_STAGE` in place, and those for which ``keep(sch, block)``
    holds."""
    while True:
        for i, info in enumerate(blocks):
            if is_kept(sch, info.block_rv) or (keep is not None and keep(sch, info.block_rv)):
                continue
            try:
                sch.compute_inline(info.block_rv)
            except (s_tir.ScheduleError, tvm.error.InternalError):
                try:
                    sch.reverse_compute_inline(info.block_rv)
                except (s_tir.ScheduleError, tvm.error.InternalError):
                    # InternalError: TVM 0.27's reverse_compute_inline fails its interval analysis
                    # ("Cannot dispatch a null expression") on some consumers of a strided slice
                    # before changing anything; the stage stays a block of its own.
                    continue
            blocks.pop(i)
            break
        else:
            return blocks


def inlined_blocks(rule, func, target, keep=None) -> tuple[s_tir.Schedule, list] | None:
    """For a dlight ``rule`` applied to ``func``: a schedule of ``func`` with its injective stages
    inlined (but those ``keep`` names, see :func:`try_inline`), and the remaining blocks (dlight's
    block infos); None when ``func`` is not a PrimFunc, the rule does not serve ``target``, or dlight
    cannot normalize the function."""
    if not isinstance(func, tirx.PrimFunc) or not rule.is_target_available(target):
        return None
    sch = s_tir.Schedule(func)
    blocks = normalize_prim_func(sch)
    if blocks is None:
        return None
    if len(blocks) > 1:
        blocks = try_inline(sch, blocks, keep)
    return sch, blocks


def root_blocks(sch: s_tir.Schedule) -> list:
    """The blocks directly under the root block; none for hand-written TIR without a root block
    (e.g. TOPI's scatter kernels)."""
    try:
        return list(sch.get_child_blocks(sch.get_sblock("root")))
    except s_tir.ScheduleError:
        return []


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
