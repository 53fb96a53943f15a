"""The CPU kernel of ``rlx.softmax_cross_entropy_backward``: a row in two passes, by chunks of
vectors (used on LLVM CPU targets where the class count is static)."""

from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.script import tirx as T

from ...target import vector_lanes
from .. import strategy
from ..common import acc_dtype, tensor_dtype
from ..fastmath import tir_exp_nonpositive
from ..llvm import has_llvm_intrinsics


# Vectors per chunk of a row in the CPU kernel (the largest that divides the row): each chunk's
# max is reduced across lanes once, so longer chunks spend less on that.
CHUNK_VECTORS = 16


def chunking(target, logits) -> tuple[int, int] | None:
    """(lanes, vectors per chunk) where the CPU kernel applies: an LLVM CPU target and a static
    class count of one of the target's vectors (of the accumulation type) or more, for half
    precision only a count that is no whole number of vectors; None elsewhere (the TE kernel).
    A row that is a whole number of vectors takes the longest chunk that divides it; any other
    row the longest chunk it holds, and the classes after its last whole chunk are a shorter
    chunk of their own (vectors, then single classes: 50257 = 196 chunks of 256, 5 vectors of 16
    and 1). Half precision with a
    whole number of vectors stays with the TE kernel, which is faster there (this kernel keeps its
    exp row in a buffer of its own); otherwise the TE kernel runs scalar."""
    dtype = tensor_dtype(logits)
    classes = logits.ty.shape.values[1]
    if target is None or not has_llvm_intrinsics(target) or not isinstance(classes, tirx.IntImm):
        return None
    lanes = vector_lanes(target, tvm.DataType(acc_dtype(dtype)).bits)
    vectors = int(classes) // lanes
    whole = int(classes) % lanes == 0
    if not vectors or (whole and acc_dtype(dtype) != dtype):
        return None
    return lanes, next(k for k in (CHUNK_VECTORS, 8, 4, 2, 1) if (vectors % k == 0 if whole else k <= vectors))


def row_kernel(dtype, acc, label_dtype, n, c: int, lanes: int, chunk_vectors: int, per_row: bool,
                ignore_index: int, ls: float) -> tirx.PrimFunc:
    """The CPU kernel of ``rlx.softmax_cross_entropy_backward``: one row per iteration of the (parallel) row loop, in two passes over it.

    1. Chunk by chunk (``chunk_vectors`` vectors): the chunk's max ``m_k``, then
       ``exp(z - m_k)`` written to the output row and summed per lane. The logits are read from
       memory once, in the pass that also does the exponentials, and the output lines are
       fetched for writing alongside them (a copy's traffic pattern).
    2. With the row max ``M`` and ``total = sum_k s_k exp(m_k - M)``, each chunk rescaled in place
       by ``exp(m_k - M) * d_loss / total`` (the row is in cache), minus the smoothing term; the
       label's one element gets its ``(1 - ls) * d_loss`` afterwards, not a compare per element.

    The classes after the last whole chunk (``c`` not a multiple of the chunk) are one more,
    shorter chunk: its whole vectors as above, then its last classes one at a time.

    The TE kernel reads the row three times (max, exp, gradient) and keeps ``exp`` in a row of its
    own; this one reads it from memory once. A chunk max starts from the lowest finite
    value, so that a chunk of -inf scales to 0 (not NaN); NaN logits fail every comparison of
    the max and make their row NaN through the exponential, +inf through inf - inf."""
    n = tirx.IntImm("int64", int(n)) if isinstance(n, (int, tirx.IntImm)) else tirx.Var("n", "int64")
    chunk = lanes * chunk_vectors
    n_whole = c // chunk  # whole chunks; then the short chunk (if any): vectors, then classes
    tail_start, tail_vectors = n_whole * chunk, (c - n_whole * chunk) // lanes
    single_start = tail_start + tail_vectors * lanes
    singles = c - single_start
    n_chunks = n_whole + (1 if tail_start < c else 0)
    direct = acc == dtype
    lowest, zero = tirx.min_value(acc), tirx.const(0, acc)
    hit_weight, spread = tirx.const(1.0 - ls, acc), tirx.const(ls / c, acc)
    ignored = tirx.const(ignore_index, "int64")
    d_rows = n if per_row else tirx.IntImm("int64", 1)  # a scalar d_loss comes as [1]

    def d_loss_row(i):
        return i if per_row else tirx.IntImm("int64", 0)

    # exp(z - chunk max) goes straight into the output row dz (its own type), or for half
    # precision into a row of its own in the accumulation type, e, so that dz is rounded once
    def exps(dz, e):
        return dz if direct else e

    def exp_row(i):
        return i if direct else tirx.IntImm("int64", 0)

    def exp_at(dz, e, i, j):
        return tirx.BufferLoad(exps(dz, e), [exp_row(i), j])

    @T.macro
    def chunk_stats(z, dz, e, i, lane_max, lane_sum, chunk_max, chunk_sum, k, start, vectors, singles_start, singles):
        """Chunk ``k`` of row ``i`` (``vectors`` vectors from ``start``, then ``singles`` single
        classes): its max into chunk_max[k]; exp(z - max) into the exp row, summed into
        chunk_sum[k]."""
        for l in T.vectorized(lanes):
            lane_max[l] = lowest
        if vectors > 0:
            for v in range(vectors):
                for l in T.vectorized(lanes):
                    lane_max[l] = T.Select(T.cast(z[i, start + v * lanes + l], acc) > lane_max[l],
                                           T.cast(z[i, start + v * lanes + l], acc), lane_max[l])
        chunk_max[k] = lowest
        for l in range(lanes):
            chunk_max[k] = T.max(chunk_max[k], lane_max[l])
        if singles > 0:
            for j in range(singles):
                chunk_max[k] = T.Select(T.cast(z[i, singles_start + j], acc) > chunk_max[k],
                                        T.cast(z[i, singles_start + j], acc), chunk_max[k])
        for l in T.vectorized(lanes):
            lane_sum[l] = zero
        if vectors > 0:
            for v in range(vectors):
                for l in T.vectorized(lanes):
                    T.buffer_store(exps(dz, e), tir_exp_nonpositive(
                        T.cast(z[i, start + v * lanes + l], acc) - chunk_max[k], nan="clamp"),
                        [exp_row(i), start + v * lanes + l])
                    lane_sum[l] = lane_sum[l] + exp_at(dz, e, i, start + v * lanes + l)
        chunk_sum[k] = zero
        for l in range(lanes):
            chunk_sum[k] = chunk_sum[k] + lane_sum[l]
        if singles > 0:
            for j in range(singles):
                T.buffer_store(exps(dz, e), tir_exp_nonpositive(
                    T.cast(z[i, singles_start + j], acc) - chunk_max[k], nan="clamp"), [exp_row(i), singles_start + j])
                chunk_sum[k] = chunk_sum[k] + exp_at(dz, e, i, singles_start + j)

    @T.macro
    def gradient(dz, e, i, label, d_loss, chunk_max, k, start, vectors, singles_start, singles):
        """Chunk ``k``'s gradient in row ``i``, from its exps and its factor (chunk_max[k] by then)."""
        if vectors > 0:
            for v in range(vectors):
                for l in T.vectorized(lanes):
                    dz[i, start + v * lanes + l] = T.cast(T.Select(
                        T.Cast("int64", label[i]) != ignored,
                        exp_at(dz, e, i, start + v * lanes + l) * chunk_max[k]
                        - spread * T.cast(d_loss[d_loss_row(i)], acc), zero), dtype)
        if singles > 0:
            for j in range(singles):
                dz[i, singles_start + j] = T.cast(T.Select(
                    T.Cast("int64", label[i]) != ignored,
                    exp_at(dz, e, i, singles_start + j) * chunk_max[k] - spread * T.cast(d_loss[d_loss_row(i)], acc),
                    zero), dtype)

    @T.prim_func(private=True, s_tir=True)
    def kernel(z_h: T.handle, label_h: T.handle, d_loss_h: T.handle, dz_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        z = T.match_buffer(z_h, (n, c), dtype)
        label = T.match_buffer(label_h, (n,), label_dtype)
        d_loss = T.match_buffer(d_loss_h, (d_rows,), dtype)
        dz = T.match_buffer(dz_h, (n, c), dtype)
        for row in range(n):
            with T.sblock("softmax_cross_entropy_backward"):
                i = T.axis.spatial(n, row)
                T.reads(z[i, 0:c], label[i], d_loss[d_loss_row(i)])
                T.writes(dz[i, 0:c])
                chunk_max = T.sblock_alloc_buffer((n_chunks,), acc)
                chunk_sum = T.sblock_alloc_buffer((n_chunks,), acc)
                lane_max = T.sblock_alloc_buffer((lanes,), acc)
                lane_sum = T.sblock_alloc_buffer((lanes,), acc)
                stats = T.sblock_alloc_buffer((2,), acc)  # the row max, then the row's sum of exp
                e = T.sblock_alloc_buffer((1, 1 if direct else c), acc)
                for k in range(n_whole):
                    chunk_stats(z, dz, e, i, lane_max, lane_sum, chunk_max, chunk_sum, k, k * chunk, chunk_vectors, 0, 0)
                if n_chunks > n_whole:  # the short chunk, the same way
                    chunk_stats(z, dz, e, i, lane_max, lane_sum, chunk_max, chunk_sum, n_whole, tail_start, tail_vectors,
                                single_start, singles)
                stats[0] = lowest
                for k in range(n_chunks):
                    stats[0] = T.max(stats[0], chunk_max[k])
                stats[1] = zero
                for k in range(n_chunks):  # each chunk's factor, in place of its max: exp(m_k - M), ...
                    chunk_max[k] = tir_exp_nonpositive(chunk_max[k] - stats[0], nan="clamp")
                    stats[1] = stats[1] + chunk_sum[k] * chunk_max[k]
                for k in range(n_chunks):  # ... times d_loss / total
                    chunk_max[k] = chunk_max[k] * (T.cast(d_loss[d_loss_row(i)], acc) / stats[1])
                for k in range(n_whole):
                    gradient(dz, e, i, label, d_loss, chunk_max, k, k * chunk, chunk_vectors, 0, 0)
                if n_chunks > n_whole:
                    gradient(dz, e, i, label, d_loss, chunk_max, n_whole, tail_start, tail_vectors, single_start, singles)
                if T.Cast("int64", label[i]) != ignored and T.Cast("int64", label[i]) >= 0 \
                        and T.Cast("int64", label[i]) < c:
                    if direct:
                        dz[i, label[i]] = dz[i, label[i]] - hit_weight * d_loss[d_loss_row(i)]
                    else:  # the label's element again from its exp, the one-hot term in (one rounding)
                        dz[i, label[i]] = T.cast(
                            e[0, label[i]] * chunk_max[T.Cast("int64", label[i]) // chunk]
                            - (spread + hit_weight) * T.cast(d_loss[d_loss_row(i)], acc), dtype)

    return kernel


def _on_llvm_target(target) -> bool:
    return target is not None and has_llvm_intrinsics(target)


@strategy.register("softmax_cross_entropy_backward", "cpu-chunks", _on_llvm_target)
def legalize(target, bb, logits, labels, d_loss, *, ignore_index=-100, label_smoothing=0.0):
    """:func:`row_kernel` where :func:`chunking` applies; None (declined) elsewhere."""
    found = chunking(target, logits)
    if found is None:
        return None
    dtype = tensor_dtype(logits)
    per_row = d_loss.ty.ndim == 1
    n, c = logits.ty.shape.values
    kernel = row_kernel(dtype, acc_dtype(dtype), tensor_dtype(labels), n, int(c), *found, per_row, ignore_index,
                        label_smoothing)
    scale = d_loss if per_row else relax.op.reshape(d_loss, [1])
    return relax.call_tir(bb.add_func(kernel, "rlx_softmax_cross_entropy_backward"), [logits, labels, scale],
                          relax.TensorType(logits.ty.shape, dtype))
