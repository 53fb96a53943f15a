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
from tvm import relax, te, tirx

from ..kernels import strategy
from ..kernels.annotations import KEEP_STAGE
from ..kernels.common import acc_dtype, tensor_dtype
from ..kernels.cpu import loss as _cpu  # noqa: F401  (registers the CPU kernel)
from ..kernels.fastmath import tir_exp_nonpositive
from ..overrides import override_gradient
from ..target import vector_lanes
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


def _is_column(j, label, target):
    """``j == label`` for the class index ``j`` of a row, written for the CPU vectorizer: as equal
    blocks of the target's vector width and equal places in the block. Under the schedule's vector
    loop over j, the block index is then one number per vector and the place a constant vector;
    ``label == j`` itself compares with the int64 ramp of the loop, which LLVM assembles with about
    ten shuffles per vector."""
    if target is None or target.kind.name != "llvm":
        return label == j
    width = tirx.const(vector_lanes(target), "int64")
    return tirx.all(tirx.floordiv(j, width) == tirx.floordiv(label, width),
                    tirx.floormod(j, width) == tirx.floormod(label, width))


@softmax_cross_entropy_backward.fused
def _sce_backward_fused(bb, logits, labels, d_loss, *, ignore_index=-100, label_smoothing=0.0):
    """The chunked CPU kernel of :mod:`rlx_tvm.kernels.cpu.loss` where it applies, else the TE
    kernel below."""
    return strategy.build(softmax_cross_entropy_backward.name, bb, logits, labels, d_loss, ignore_index=ignore_index,
                          label_smoothing=label_smoothing)


@strategy.register("softmax_cross_entropy_backward", "te", strategy.anywhere)
def _sce_backward_te(target, bb, logits, labels, d_loss, *, ignore_index=-100, label_smoothing=0.0):
    dtype = tensor_dtype(logits)
    acc = acc_dtype(dtype)
    ls = label_smoothing
    per_row = d_loss.ty.ndim == 1

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
            hit = tirx.Select(_is_column(j, label, target), tirx.const(1.0 - ls, acc), tirx.const(0.0, acc))
            wanted = hit + tirx.const(ls, acc) / c.astype(acc) if ls else hit
            scale = (dl[i] if per_row else dl()).astype(acc)
            keep = label != tirx.const(ignore_index, "int64")
            return tirx.Select(keep, (p - wanted) * scale, tirx.const(0.0, acc)).astype(dtype)

        return te.compute((n, c), grad, name="softmax_cross_entropy_backward")

    return bb.call_te(kernel, logits, labels, d_loss, primfunc_name_hint="rlx_softmax_cross_entropy_backward")


# --------------------------------------------------------------------------------------------
# Gradient of rlx.softmax_cross_entropy
# --------------------------------------------------------------------------------------------

def _sce_gradient(orig_var, orig_call, output_grad, ctx):
    from tvm.relax.op.grad import no_grad

    logits, labels = orig_call.args
    attrs = softmax_cross_entropy.call_attrs(orig_call)
    return [softmax_cross_entropy_backward(logits, labels, output_grad, **attrs), no_grad(labels)]


override_gradient(softmax_cross_entropy.op_name, _sce_gradient)
