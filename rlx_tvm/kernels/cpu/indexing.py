"""The CPU kernels of the indexing backward ops: ``rlx.cumsum_backward``'s reverse scans and
``rlx.gather_backward``'s scatter-add (whose row-blocked form serves GPUs)."""

from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.script import tirx as T
from tvm.sym import Analyzer

from ...registry import static_int
from ...target import target_cores
from .. import strategy
from ..common import tensor_dtype
from ..llvm import has_llvm_intrinsics, zero_bytes


def _i64(v):
    return tirx.IntImm("int64", v) if isinstance(v, int) else v


def _prod(dims):
    """Product of shape dims (ints or PrimExprs), folded to an int when all are static."""
    out = _i64(1)
    for d in dims:
        out = out * _i64(d)
    return Analyzer().simplify(out)


def _fresh(dim, name):
    """A kernel-local shape var for a symbolic dim (the PrimFunc binds it from its buffer)."""
    s = static_int(dim)
    return _i64(s) if s is not None else tirx.Var(name, "int64")


# Vector length of the CPU scan along a contiguous axis (_suffix_sum_rows_kernel; 8 float64 =
# one AVX-512 register): a serial float64 chain is latency-bound at ~4 cycles per element.
SCAN_LANES = 8


def suffix_sum_kernel(dtype: str, outer, n, inner, exclusive: bool) -> tirx.PrimFunc:
    """``out[o, j, i] = sum_{k >= j} dy[o, k, i]`` (``k > j`` when exclusive) over the
    ``[outer, n, inner]`` view: one block per ``o`` (the parallel loop) walking ``j`` downwards
    with a float64 running sum per ``i`` (one rounding per output; the ``i`` loop is contiguous,
    so LLVM vectorizes it). Reads each input once: memory-bound, where the blocked form does
    ``O(B)`` work per element."""
    outer, n, inner = _fresh(outer, "outer"), _fresh(n, "n"), _fresh(inner, "inner")
    run_dtype = "float64"

    @T.prim_func(private=True, s_tir=True)
    def kernel(dy_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        dy = T.match_buffer(dy_h, (outer, n, inner), dtype)
        out = T.match_buffer(out_h, (outer, n, inner), dtype)
        for o in range(outer):
            with T.sblock("suffix_sum"):
                vo = T.axis.spatial(outer, o)
                T.reads(dy[vo, 0:n, 0:inner])
                T.writes(out[vo, 0:n, 0:inner])
                run = T.sblock_alloc_buffer((inner,), run_dtype)
                for i in range(inner):
                    run[i] = T.cast(0, run_dtype)
                for k in range(n):
                    for i in range(inner):
                        if exclusive:
                            out[vo, n - 1 - k, i] = T.cast(run[i], dtype)
                            run[i] = run[i] + T.cast(dy[vo, n - 1 - k, i], run_dtype)
                        else:
                            run[i] = run[i] + T.cast(dy[vo, n - 1 - k, i], run_dtype)
                            out[vo, n - 1 - k, i] = T.cast(run[i], dtype)

    return kernel


def _shifted_down(lanes: int, by: int) -> list[int]:
    """Shuffle indices taking lane ``l + by`` of a vector into lane ``l`` (lane ``lanes``, a zero
    of the second operand, past the end)."""
    return [min(l + by, lanes) for l in range(lanes)]


def _suffix_sum_rows_kernel(dtype: str, outer, n, exclusive: bool) -> tirx.PrimFunc:
    """The scan along a contiguous axis (``[outer, n]``), one block per row, ``SCAN_LANES``
    elements at a time from the end: a vector's own suffix sums by log2(lanes) shifted adds (lane
    shuffles), plus the carried total of the vectors after it, so the chain between vectors is
    one add (a serial scan has one per element and is latency-bound). The row's last ``n %
    SCAN_LANES`` elements run serially first. float64 throughout: one rounding per output."""
    lanes, run_dtype = SCAN_LANES, "float64"
    vec = f"{run_dtype}x{lanes}"
    assert lanes == 8, "three shifted adds below"
    by1, by2, by4 = (_shifted_down(lanes, s) for s in (1, 2, 4))
    outer, n = _fresh(outer, "outer"), _fresh(n, "n")
    zero = tirx.Broadcast(tirx.const(0, run_dtype), lanes)

    @T.prim_func(private=True, s_tir=True)
    def kernel(dy_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        dy = T.match_buffer(dy_h, (outer, n), dtype)
        out = T.match_buffer(out_h, (outer, n), dtype)
        for o in range(outer):
            with T.sblock("suffix_sum"):
                vo = T.axis.spatial(outer, o)
                T.reads(dy[vo, 0:n])
                T.writes(out[vo, 0:n])
                carry = T.sblock_alloc_buffer((1,), run_dtype)
                # One element of vector type (s_tir's buffer compaction mangles ramp indices).
                scan = T.sblock_alloc_buffer((1,), vec)
                # Flat views for the vector accesses (TVM 0.27's printer fails on a vector index
                # into a 2-d buffer).
                dy_flat = T.decl_buffer((outer * n,), dtype, data=dy.data)
                out_flat = T.decl_buffer((outer * n,), dtype, data=out.data)
                carry[0] = T.cast(0, run_dtype)
                for k in range(n % lanes):
                    if exclusive:
                        out[vo, n - 1 - k] = T.cast(carry[0], dtype)
                        carry[0] = carry[0] + T.cast(dy[vo, n - 1 - k], run_dtype)
                    else:
                        carry[0] = carry[0] + T.cast(dy[vo, n - 1 - k], run_dtype)
                        out[vo, n - 1 - k] = T.cast(carry[0], dtype)
                for b in range(n // lanes):
                    scan[0] = T.Cast(vec, dy_flat[T.Ramp(vo * n + (n // lanes - 1 - b) * lanes, 1, lanes)])
                    scan[0] = scan[0] + T.Shuffle([scan[0], zero], by1)
                    scan[0] = scan[0] + T.Shuffle([scan[0], zero], by2)
                    scan[0] = scan[0] + T.Shuffle([scan[0], zero], by4)
                    if exclusive:
                        out_flat[T.Ramp(vo * n + (n // lanes - 1 - b) * lanes, 1, lanes)] = T.Cast(
                            f"{dtype}x{lanes}", T.Shuffle([scan[0], zero], by1)
                            + T.Broadcast(carry[0], lanes))
                    else:
                        out_flat[T.Ramp(vo * n + (n // lanes - 1 - b) * lanes, 1, lanes)] = T.Cast(
                            f"{dtype}x{lanes}", scan[0] + T.Broadcast(carry[0], lanes))
                    carry[0] = carry[0] + T.Shuffle([scan[0]], [0])

    return kernel


@strategy.register("cumsum_backward", "cpu-serial", strategy.on_cpu)
def cumsum_backward_serial(target, bb, dy, *, axis, exclusive=False):
    """The CPU kernels: along the contiguous axis (``inner == 1``) :func:`_suffix_sum_rows_kernel`
    on dy's ``[outer, n]`` view, else :func:`suffix_sum_kernel` on its ``[outer, n, inner]`` view."""
    axis = axis % dy.ty.ndim
    dims = list(dy.ty.shape.values)
    outer, n, inner = _prod(dims[:axis]), dims[axis], _prod(dims[axis + 1:])
    if static_int(inner) == 1:
        view = [outer, n]
        func = _suffix_sum_rows_kernel(tensor_dtype(dy), outer, n, bool(exclusive))
    else:
        view = [outer, n, inner]
        func = suffix_sum_kernel(tensor_dtype(dy), outer, n, inner, bool(exclusive))
    gv = bb.add_func(func, "rlx_cumsum_backward")
    dy_view = bb.emit(relax.op.reshape(dy, view))
    out = bb.emit(relax.call_tir(gv, [dy_view], relax.TensorType(view, tensor_dtype(dy))))
    return relax.op.reshape(out, dims)


# Features per block of the CPU form: 4 AVX-512 vectors of float32 (fewer when they do not divide).
FEATURE_CHUNK = 64


# Threads the GPU form aims for (one per block of output rows and feature column): enough to fill
# a GPU; each more compares every index once more.
GPU_THREADS_WANTED = 1 << 16


def scatter_add_kernel(dtype: str, acc: str, idx_dtype: str, outer, n_idx, inner, dim_size: int,
                       chunked: bool = True, clear_parts: int | None = None) -> tirx.PrimFunc:
    """``out[o, wrap(idx[j]), i] += dy[o, j, i]`` over ``[outer, n_idx, inner]`` (``out`` in the
    accumulation dtype ``acc``); indices outside ``[-dim_size, dim_size)`` are skipped. Race-free
    in both forms (no two threads write the same element):

    * ``chunked`` (CPU): one block per (outer, chunk of features), which walks all the indices and
      adds each dy row's chunk to its output row as one vector loop; the blocks are spatial, so the
      parallel loop over them is race-free (a chunk has one owner). (In the per-element form the
      index loop is outside the feature loop, and no CPU schedule can parallelize or vectorize
      it: TVM's parallel/vectorize ask for a complete or reduction block, and it has no init.)
    * row-blocked (GPU): the output rows are cut into blocks of ``rows`` rows; block (o, b, i)
      owns output column ``i`` of rows ``b*rows ..`` and walks all the indices, adding the dy
      elements whose index falls in its rows. It is a reduction block (its init zeroes what it
      owns; the index loop is its reduction iterator), so the spatial (o, b, i) loops bind to
      threads by schedule primitives: ``outer x blocks x inner`` threads, each comparing every
      index (cheap: the index is the same for every thread of a warp) and adding ``n_idx / blocks``
      rows on average. (A scatter with the rows written through a separate init block is neither
      complete nor a reduction block, and thread binding refuses it.)

    With ``clear_parts`` (the CPU form, for a target whose code generator is LLVM) the output is
    cleared by ``memset`` in that many parts of whole rows, one per core: a large enough part goes
    out as non-temporal stores (glibc's memset, past a threshold near the last-level cache size),
    which write whole lines without reading them first. Most rows of an embedding's gradient stay
    0, so the clear is most of its traffic; parts of 25 MB or less gain nothing over the vector
    loop."""
    static_inner = static_int(inner)
    chunk = next((c for c in (FEATURE_CHUNK, 32, 16, 8, 4, 2) if static_inner and static_inner % c == 0), 1)
    columns = (static_int(outer) or 1) * (static_inner or 256)
    blocks = max(1, min(dim_size, -(-GPU_THREADS_WANTED // columns)))
    rows = -(-dim_size // blocks)
    blocks = -(-dim_size // rows)  # no empty block
    outer, n_idx, inner = _fresh(outer, "outer"), _fresh(n_idx, "n_idx"), _fresh(inner, "inner")
    clear_by_memset = bool(chunked and clear_parts)  # (a plain bool: the TVMScript if needs one)
    part_rows = -(-dim_size // min(clear_parts or 1, dim_size))
    parts = -(-dim_size // part_rows)  # no empty part
    acc_bytes = tvm.DataType(acc).bits // 8
    dim, rows, blocks = _i64(dim_size), _i64(rows), _i64(blocks)
    part_rows, parts = _i64(part_rows), _i64(parts)

    @T.prim_func(private=True, s_tir=True)
    def kernel(dy_h: T.handle, idx_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        dy = T.match_buffer(dy_h, (outer, n_idx, inner), dtype)
        idx = T.match_buffer(idx_h, (n_idx,), idx_dtype)
        out = T.match_buffer(out_h, (outer, dim, inner), acc)
        if clear_by_memset:
            for o, part in T.grid(outer, parts):
                with T.sblock("init"):
                    vo, vp = T.axis.remap("SS", [o, part])
                    T.reads()
                    T.writes(out[vo, vp * part_rows:T.min(vp * part_rows + part_rows, dim), 0:inner])
                    T.evaluate(zero_bytes(T.address_of(out[vo, vp * part_rows, 0]),
                                          (T.min(vp * part_rows + part_rows, dim) - vp * part_rows) * inner * acc_bytes))
        elif chunked:
            for o, d, i in T.grid(outer, dim, inner):
                with T.sblock("init"):
                    vo, vd, vi = T.axis.remap("SSS", [o, d, i])
                    out[vo, vd, vi] = T.cast(0, acc)
        if chunked:
            for o, c in T.grid(outer, inner // chunk):
                with T.sblock("accumulate"):
                    vo, vc = T.axis.remap("SS", [o, c])
                    T.reads(idx[0:n_idx], dy[vo, 0:n_idx, vc * chunk:vc * chunk + chunk])
                    T.writes(out[vo, 0:dim, vc * chunk:vc * chunk + chunk])
                    for j in range(n_idx):
                        row: T.int64 = T.Cast("int64", idx[j]) + T.if_then_else(idx[j] < 0, dim, T.int64(0))
                        if 0 <= row and row < dim:
                            for f in T.vectorized(chunk):
                                out[vo, row, vc * chunk + f] = out[vo, row, vc * chunk + f] + T.Cast(acc, dy[vo, j, vc * chunk + f])
        else:
            for o, b, j, i in T.grid(outer, blocks, n_idx, inner):
                with T.sblock("accumulate"):
                    vo, vb, vj, vi = T.axis.remap("SSRS", [o, b, j, i])
                    T.reads(idx[vj], dy[vo, vj, vi])
                    T.writes(out[vo, vb * rows:T.min(vb * rows + rows, dim), vi])
                    with T.init():
                        for r in range(rows):
                            if vb * rows + r < dim:
                                out[vo, vb * rows + r, vi] = T.cast(0, acc)
                    row: T.int64 = T.Cast("int64", idx[vj]) + T.if_then_else(idx[vj] < 0, dim, T.int64(0))
                    if vb * rows <= row and row < vb * rows + rows and row < dim:
                        out[vo, row, vi] = out[vo, row, vi] + T.Cast(acc, dy[vo, vj, vi])

    return kernel


@strategy.register("gather_backward", "cpu-chunks", strategy.on_cpu)
def _gather_chunks(target, dtype, acc, idx_dtype, outer, n_idx, inner, dim_size):
    clear_parts = target_cores(target) if has_llvm_intrinsics(target) else None
    return scatter_add_kernel(dtype, acc, idx_dtype, outer, n_idx, inner, dim_size, chunked=True, clear_parts=clear_parts)


@strategy.register("gather_backward", "gpu-row-blocks", strategy.on_gpu)
def _gather_row_blocks(target, dtype, acc, idx_dtype, outer, n_idx, inner, dim_size):
    return scatter_add_kernel(dtype, acc, idx_dtype, outer, n_idx, inner, dim_size, chunked=False)
