"""Softmax cross-entropy with class-index labels: the forward ``softmax_cross_entropy(logits[N, C],
labels[N]; ignore_index=-100, label_smoothing=0.0) -> loss[N]`` and its gradient
``softmax_cross_entropy_backward(logits, labels, d_loss) -> d_logits[N, C]``.

With ``p = softmax(logits[n])`` and the smoothed target ``t = (1 - ls) * onehot(labels[n]) + ls / C``
(PyTorch's ``cross_entropy(..., reduction="none", label_smoothing=ls)``):

* ``loss[n] = -sum_c t_c log p_c = (1 - ls) * (lse - z_label) + ls * (lse - mean_c z_c)``,
  ``lse = logsumexp(logits[n])``;
* ``d_logits[n] = (p - t) * d_loss[n]`` with ``d_loss`` of shape ``[N]`` or a scalar ``[]``.

Rows whose label is ``ignore_index`` give 0 in both. A label outside ``[0, C)`` that is not
``ignore_index`` is an error when the labels are a constant; at run time its one-hot row is empty
(only the smoothing term remains) and nothing is read out of bounds. The fused kernels subtract
the row max (the CPU backward kernel: each chunk's max, rescaled after) before exponentiating; the
decompositions use ``nn.log_softmax`` / ``nn.softmax``.
float16/bfloat16 compute in float32.

Also registers the gradient of ``rlx.softmax_cross_entropy`` so that ``relax.transform.Gradient``
emits the backward op.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te, tirx
from tvm.script import tirx as T

from ..kernels.annotations import KEEP_STAGE
from ..kernels.llvm import has_llvm_intrinsics
from ..overrides import override_gradient
from ..target import vector_lanes
from ._math import acc_dtype, tensor_dtype, tir_exp_nonpositive
from .indexing import constant_array
from .registry import INT_DTYPES, Attr, check_float, check_int, define_op, fmt_shape

_ATTRS = (
    Attr("ignore_index", -100, check_int()),
    Attr("label_smoothing", 0.0, check_float(lo=0.0, hi=1.0)),
)


def _check_logits_labels(ctx):
    logits = ctx.tensor("logits", ndim=2)
    labels = ctx.tensor("labels", ndim=1, dtypes=INT_DTYPES)
    ctx.dim_equals(labels, 0, logits.dim(0), "one label per row of 'logits'")
    values = constant_array(ctx, "labels")
    classes = logits.static_dim(1)
    if values is not None and classes is not None:
        bad = values[((values < 0) | (values >= classes)) & (values != ctx.attrs["ignore_index"])]
        if bad.size:
            raise ctx.error(
                "labels",
                f"class indices in [0, {classes}) or ignore_index {ctx.attrs['ignore_index']}",
                f"label {int(bad.flat[0])}",
            )
    return logits, labels


# --------------------------------------------------------------------------------------------
# NumPy (float64)
# --------------------------------------------------------------------------------------------


def _np_parts(logits, labels, ignore_index):
    """log_softmax, one-hot targets (empty rows for out-of-range labels) and the kept-row mask."""
    z = np.asarray(logits, dtype=np.float64)
    labels = np.asarray(labels).astype(np.int64)
    shifted = z - z.max(axis=1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    onehot = (labels[:, None] == np.arange(z.shape[1])[None, :]).astype(np.float64)
    return log_p, onehot, labels != ignore_index


# --------------------------------------------------------------------------------------------
# softmax_cross_entropy (forward)
# --------------------------------------------------------------------------------------------

softmax_cross_entropy = define_op(
    "softmax_cross_entropy",
    inputs=("logits", "labels"),
    attrs=_ATTRS,
    backward=False,
    doc="Per-row softmax cross-entropy with class-index labels, ignore_index and label smoothing.",
)


@softmax_cross_entropy.infer
def _sce_infer(ctx):
    logits, _ = _check_logits_labels(ctx)
    return ctx.out([logits.dim(0)], logits.dtype)


@softmax_cross_entropy.reference
def _sce_ref(logits, labels, *, ignore_index=-100, label_smoothing=0.0):
    log_p, onehot, keep = _np_parts(logits, labels, ignore_index)
    ls = label_smoothing
    loss = -(1.0 - ls) * (onehot * log_p).sum(axis=1) - ls * log_p.mean(axis=1)
    return np.where(keep, loss, 0.0)


def _relax_onehot(logits, labels, dtype):
    """``labels[:, None] == arange(C)[None, :]`` as ``dtype`` (an empty row for out-of-range labels)."""
    op = relax.op
    idx_dtype = tensor_dtype(labels)
    classes = logits.ty.shape.values[1]
    if isinstance(classes, tirx.IntImm):
        arange = relax.const(np.arange(int(classes)), idx_dtype)
    else:  # symbolic class count: 0..C-1 as a running count of ones
        arange = op.subtract(op.cumsum(op.ones([classes], idx_dtype), axis=0), relax.const(1, idx_dtype))
    hit = op.equal(op.expand_dims(labels, 1), op.expand_dims(arange, 0))
    return op.astype(hit, dtype)


def _keep_rows(labels, ignore_index):
    return relax.op.not_equal(labels, relax.const(ignore_index, tensor_dtype(labels)))


@softmax_cross_entropy.decomposition
def _sce_decompose(bb, logits, labels, *, ignore_index=-100, label_smoothing=0.0):
    op = relax.op
    dtype = tensor_dtype(logits)
    acc = acc_dtype(dtype)
    z = logits if acc == dtype else op.astype(logits, acc)
    log_p = op.nn.log_softmax(z, axis=-1)
    ls = label_smoothing
    picked = op.sum(op.multiply(_relax_onehot(logits, labels, acc), log_p), axis=1)
    loss = op.negative(op.multiply(picked, relax.const(1.0 - ls, acc)))
    if ls:
        loss = op.subtract(loss, op.multiply(op.mean(log_p, axis=1), relax.const(ls, acc)))
    loss = op.where(_keep_rows(labels, ignore_index), loss, op.zeros_like(loss))
    return loss if acc == dtype else op.astype(loss, dtype)


def _row_stats(z, acc):
    """Row max and sum of exp(z - max) of ``z[N, C]``: the stable log-sum-exp's two reductions."""
    n, c = z.shape
    k = te.reduce_axis((0, c), name="k")
    row_max = te.compute((n,), lambda i: te.max(z[i, k].astype(acc), axis=k), name="row_max")
    k2 = te.reduce_axis((0, c), name="k2")
    row_sum = te.compute(
        (n,), lambda i: te.sum(tir_exp_nonpositive(z[i, k2].astype(acc) - row_max[i]), axis=k2), name="row_sum_exp"
    )
    return row_max, row_sum


def _label_in_range(label, classes):
    return tirx.all(label >= 0, label < classes)


@softmax_cross_entropy.fused
def _sce_fused(bb, logits, labels, *, ignore_index=-100, label_smoothing=0.0):
    dtype = tensor_dtype(logits)
    acc = acc_dtype(dtype)
    ls = label_smoothing

    def kernel(z: te.Tensor, lab: te.Tensor):
        n, c = z.shape
        row_max, row_sum = _row_stats(z, acc)
        k = te.reduce_axis((0, c), name="k3")
        row_total = te.compute((n,), lambda i: te.sum(z[i, k].astype(acc), axis=k), name="row_sum")

        def loss(i):
            label = lab[i].astype("int64")
            lse = row_max[i] + tirx.log(row_sum[i])
            inside = _label_in_range(label, c)
            # Clamped so that the load stays in bounds even where the select discards it.
            safe = tirx.max(tirx.min(label, c - 1), tirx.const(0, "int64"))
            nll = tirx.if_then_else(inside, lse - z[i, safe].astype(acc), tirx.const(0.0, acc))
            value = tirx.const(1.0 - ls, acc) * nll
            if ls:
                value = value + tirx.const(ls, acc) * (lse - row_total[i] / c.astype(acc))
            keep = label != tirx.const(ignore_index, "int64")
            return tirx.Select(keep, value, tirx.const(0.0, acc)).astype(dtype)

        return te.compute((n,), loss, name="softmax_cross_entropy")

    return bb.call_te(kernel, logits, labels, primfunc_name_hint="rlx_softmax_cross_entropy")


# --------------------------------------------------------------------------------------------
# softmax_cross_entropy_backward
# --------------------------------------------------------------------------------------------

softmax_cross_entropy_backward = define_op(
    "softmax_cross_entropy_backward",
    inputs=("logits", "labels", "d_loss"),
    attrs=_ATTRS,
    doc="(softmax(logits) - smoothed one-hot target) * d_loss per row; 0 for ignored rows.",
)


@softmax_cross_entropy_backward.infer
def _sce_backward_infer(ctx):
    logits, _ = _check_logits_labels(ctx)
    d_loss = ctx.tensor("d_loss", ndim=(0, 1))
    ctx.same_dtype(logits, d_loss)
    if d_loss.ndim == 1 and ctx.provably_different(d_loss.dim(0), logits.dim(0)):
        raise ctx.error(
            "d_loss", f"shape [{logits.dim(0)}] (one per row of 'logits') or a scalar []", fmt_shape(d_loss.shape)
        )
    return ctx.out(logits.shape, logits.dtype)


@softmax_cross_entropy_backward.reference
def _sce_backward_ref(logits, labels, d_loss, *, ignore_index=-100, label_smoothing=0.0):
    log_p, onehot, keep = _np_parts(logits, labels, ignore_index)
    ls = label_smoothing
    target = (1.0 - ls) * onehot + ls / log_p.shape[1]
    d_loss = np.asarray(d_loss, dtype=np.float64)
    scale = d_loss[:, None] if d_loss.ndim == 1 else d_loss
    return np.where(keep[:, None], (np.exp(log_p) - target) * scale, 0.0)


@softmax_cross_entropy_backward.decomposition
def _sce_backward_decompose(bb, logits, labels, d_loss, *, ignore_index=-100, label_smoothing=0.0):
    op = relax.op
    dtype = tensor_dtype(logits)
    acc = acc_dtype(dtype)
    z = logits if acc == dtype else op.astype(logits, acc)
    ls = label_smoothing
    diff = op.subtract(op.nn.softmax(z, axis=-1), op.multiply(_relax_onehot(logits, labels, acc), relax.const(1.0 - ls, acc)))
    if ls:
        classes = logits.ty.shape.values[1]
        if isinstance(classes, tirx.IntImm):
            uniform = relax.const(ls / int(classes), acc)
        else:  # ls / C with a symbolic C: C counted as a row sum of ones
            uniform = op.divide(relax.const(ls, acc), op.sum(op.ones_like(z), axis=1, keepdims=True))
        diff = op.subtract(diff, uniform)
    scale = d_loss if acc == dtype else op.astype(d_loss, acc)
    if d_loss.ty.ndim == 1:
        scale = op.expand_dims(scale, 1)
    grad = op.multiply(diff, scale)
    grad = op.where(op.expand_dims(_keep_rows(labels, ignore_index), 1), grad, op.zeros_like(grad))
    return grad if acc == dtype else op.astype(grad, dtype)


def _is_column(j, label):
    """``j == label`` for the class index ``j`` of a row, written for the CPU vectorizer: as equal
    blocks of the target's vector width and equal places in the block. Under the schedule's vector
    loop over j, the block index is then one number per vector and the place a constant vector;
    ``label == j`` itself compares with the int64 ramp of the loop, which LLVM assembles with about
    ten shuffles per vector (softmax-CE backward: 4.8 -> 3.9 us per row of 8192 in cache)."""
    target = tvm.target.Target.current(allow_none=True)
    if target is None or target.kind.name != "llvm":
        return label == j
    width = tirx.const(vector_lanes(target), "int64")
    return tirx.all(tirx.floordiv(j, width) == tirx.floordiv(label, width),
                    tirx.floormod(j, width) == tirx.floormod(label, width))


@softmax_cross_entropy_backward.fused
def _sce_backward_fused(bb, logits, labels, d_loss, *, ignore_index=-100, label_smoothing=0.0):
    dtype = tensor_dtype(logits)
    acc = acc_dtype(dtype)
    ls = label_smoothing
    per_row = d_loss.ty.ndim == 1
    chunking = _cpu_chunking(logits)
    if chunking is not None:
        n, c = logits.ty.shape.values
        kernel = _cpu_kernel(dtype, acc, tensor_dtype(labels), n, int(c), *chunking, per_row, ignore_index, ls)
        scale = d_loss if per_row else relax.op.reshape(d_loss, [1])
        return relax.call_tir(bb.add_func(kernel, "rlx_softmax_cross_entropy_backward"), [logits, labels, scale],
                              relax.TensorType(logits.ty.shape, dtype))

    def kernel(z: te.Tensor, lab: te.Tensor, dl: te.Tensor):
        n, c = z.shape
        k = te.reduce_axis((0, c), name="k")
        row_max = te.compute((n,), lambda i: te.max(z[i, k].astype(acc), axis=k), name="row_max")
        # exp(z - max) as a stage of its own (kept: not inlined), read by the row sum and by the
        # gradient: one exp per element instead of two. The CPU schedule computes it per row into
        # a row-sized buffer that stays in cache.
        shifted_exp = te.compute((n, c), lambda i, j: tir_exp_nonpositive(z[i, j].astype(acc) - row_max[i], nan="clamp"),
                                 name="shifted_exp", attrs=KEEP_STAGE)
        k2 = te.reduce_axis((0, c), name="k2")
        row_sum = te.compute((n,), lambda i: te.sum(shifted_exp[i, k2], axis=k2), name="row_sum_exp")

        def grad(i, j):
            label = lab[i].astype("int64")
            # times the reciprocal: loop-invariant per row, so one division per row, not per element
            p = shifted_exp[i, j] * (tirx.const(1.0, acc) / row_sum[i])
            hit = tirx.Select(_is_column(j, label), tirx.const(1.0 - ls, acc), tirx.const(0.0, acc))
            target = hit + tirx.const(ls, acc) / c.astype(acc) if ls else hit
            scale = (dl[i] if per_row else dl()).astype(acc)
            keep = label != tirx.const(ignore_index, "int64")
            return tirx.Select(keep, (p - target) * scale, tirx.const(0.0, acc)).astype(dtype)

        return te.compute((n, c), grad, name="softmax_cross_entropy_backward")

    return bb.call_te(kernel, logits, labels, d_loss, primfunc_name_hint="rlx_softmax_cross_entropy_backward")


# Vectors per chunk of a row in the CPU kernel (the largest that divides the row): each chunk's
# max is reduced across lanes once, so longer chunks spend less on that.
CHUNK_VECTORS = 16


def _cpu_chunking(logits) -> tuple[int, int] | None:
    """(lanes, vectors per chunk) where the CPU kernel applies: an LLVM CPU target and a static
    class count of one of the target's vectors (of the accumulation type) or more, for half
    precision only a count that is no whole number of vectors; None elsewhere (the TE kernel).
    A row that is a whole number of vectors takes the longest chunk that divides it; any other
    row the longest chunk it holds, and the classes after its last whole chunk are a shorter
    chunk of their own (vectors, then single classes: 50257 = 196 chunks of 256, 5 vectors of 16
    and 1). Half precision, same process, 2 threads, float16 / bfloat16: at (2048, 8192) the TE
    kernel took 4.0 / 4.9 ms and this one 6.0 / 5.7 ms (its exp row in a buffer of its own); at
    (256, 50257), where the TE kernel runs scalar, 41.5 / 38.8 ms against 4.0 / 6.0 ms."""
    target = tvm.target.Target.current(allow_none=True)
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


def _cpu_kernel(dtype, acc, label_dtype, n, c: int, lanes: int, chunk_vectors: int, per_row: bool,
                ignore_index: int, ls: float) -> tirx.PrimFunc:
    """The CPU kernel: one row per iteration of the (parallel) row loop, in two passes over it.

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
    own: at (2048, 8192) it took 6.9 and 6.4 ms where this one took 5.4 and 4.1 ms (two runs, 2
    threads, side by side; 10.6 vs 7.0 ms on one thread). A chunk max starts from the lowest finite
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


# --------------------------------------------------------------------------------------------
# Gradient of rlx.softmax_cross_entropy
# --------------------------------------------------------------------------------------------

def _sce_gradient(orig_var, orig_call, output_grad, ctx):
    from tvm.relax.op.grad import no_grad

    logits, labels = orig_call.args
    attrs = softmax_cross_entropy.call_attrs(orig_call)
    return [softmax_cross_entropy_backward(logits, labels, output_grad, **attrs), no_grad(labels)]


override_gradient(softmax_cross_entropy.op_name, _sce_gradient)
