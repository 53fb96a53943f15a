"""Attention: ``attention(q, k, v[, bias])`` and ``attention_backward(q, k, v, dy[, bias]; wrt)``.

Layout follows ``R.nn.attention`` (docs/operators.md §5): q ``[B, Sq, H, D]``, k ``[B, Sk, Hkv, D]``,
v ``[B, Sk, Hkv, Dv]``, out and dy ``[B, Sq, H, Dv]``; query head ``h`` reads kv head
``h // (H / Hkv)`` (grouped-query attention). Per (b, h)::

    S_raw = scale * Q K^T                       scale = 1/sqrt(D) unless given
    S     = c * tanh(S_raw / c) + bias          with softcap c (else S_raw + bias)
    P     = softmax(S) over the visible keys    0 for masked keys; a row with none is all 0
    out   = P V

Visibility of key ``j`` to query ``i``, with ``i' = i + (Sk - Sq)`` for "BottomRight" and
``i' = i`` otherwise (the query's absolute position): causal masks need ``j <= i'``, a window
``w`` needs ``j >= i' - w``. The softcap is applied before the bias and the mask, as in
flash-attention.

Gradients (``attention_backward``; none to bias)::

    dV = P^T dY        dP = dY V^T        dS = P * (dP - rowsum(P * dP)) [* (1 - tanh^2(S_raw/c))]
    dQ = scale * dS K  dK = scale * dS^T Q

with dK and dV summed over the query heads that share a kv head.

``attention`` is a project op (TVM's ``R.nn.attention`` has no softcap, no grouped-query heads
and no legalization for windows); ``relax.transform.Gradient`` differentiates both it and
``R.nn.attention`` into ``attention_backward``.
"""

from __future__ import annotations

import math
from functools import reduce

import numpy as np
from tvm import relax, te, tirx
from tvm.relax.op.grad import no_grad
from tvm.sym import Analyzer

from ..kernels.annotations import KEEP_STAGE
from ..kernels.common import acc_dtype, tensor_dtype
from ..kernels.fastmath import tir_exp, tir_tanh
from ..overrides import fill_gradient
from .registry import (Attr, OpError, check_choice, check_float, check_int, define_op, fmt_shape, fuse_siblings,
                       static_int)

CAUSAL_MASKS = ("TopLeft", "BottomRight")

# Stands in for -inf on masked scores in the decomposition: exp(_MASKED - max) is exactly 0 in
# float32 and float64, while the value stays finite so that autodiff never sees inf - inf.
_MASKED = -1e30

_MASK_ATTRS = (
    Attr("causal_mask", None, check_choice(*CAUSAL_MASKS)),
    Attr("window_size", None, check_int(lo=0)),
    Attr("scale", None, check_float()),
    Attr("softcap", None, check_float(lo=0.0, lo_open=True)),
)


def _group(h, hkv):
    """Query heads per kv head: a Python int when both head counts are static."""
    if static_int(h) is not None and static_int(hkv) is not None:
        return static_int(h) // static_int(hkv)
    return tirx.floordiv(h, hkv)


def _fmt_dim(d) -> str:
    return str(static_int(d)) if static_int(d) is not None else str(d)


def _is_one(x) -> bool:
    return isinstance(x, int) and x == 1


def _default_scale(scale, head_dim) -> float:
    return 1.0 / math.sqrt(int(head_dim)) if scale is None else float(scale)


def _query_offset(causal_mask, sq, sk):
    """Absolute position of query 0: the queries sit at the end of the keys for BottomRight."""
    return sk - sq if causal_mask == "BottomRight" else 0


def _masked(causal_mask, window_size) -> bool:
    return causal_mask is not None or window_size is not None


# --------------------------------------------------------------------------------------------
# Type inference (shared)
# --------------------------------------------------------------------------------------------


def _infer(ctx, backward: bool):
    q = ctx.tensor("q", ndim=4)
    k = ctx.tensor("k", ndim=4)
    v = ctx.tensor("v", ndim=4)
    ctx.same_dtype(q, k, v)
    b, sq, h, d = q.shape
    _, sk, hkv, _ = k.shape
    dv = v.dim(3)
    ctx.dim_equals(k, 0, b, "batch B of 'q' [B, Sq, H, D]")
    ctx.dim_equals(k, 3, d, "head dim D of 'q' [B, Sq, H, D]")
    ctx.dim_equals(v, 0, b, "batch B of 'q' and 'k'")
    ctx.dim_equals(v, 1, sk, "key length Sk of 'k' [B, Sk, Hkv, D]")
    ctx.dim_equals(v, 2, hkv, "kv heads Hkv of 'k' [B, Sk, Hkv, D]")
    if not ctx.analyzer.can_prove(tirx.floormod(h, hkv) == 0):
        raise ctx.error(
            "k", f"a number of kv heads Hkv dividing the {_fmt_dim(h)} query heads of 'q' (dim 2)",
            f"Hkv = {_fmt_dim(hkv)} (shape {fmt_shape(k.shape)})",
        )
    if ctx.attrs["scale"] is None and static_int(d) is None:
        raise ctx.error("q", "a static head dim D when 'scale' is not given (default 1/sqrt(D))", fmt_shape(q.shape))
    if ctx.has("bias"):
        bias = ctx.tensor("bias")
        ctx.same_dtype(q, bias)
        target = [b, h, sq, sk]
        ok = 1 <= bias.ndim <= 4 and all(
            static_int(bd) == 1 or ctx.provably_equal(bd, td) for bd, td in zip(bias.shape[::-1], target[::-1])
        )
        if not ok:
            raise ctx.error("bias", f"a shape broadcastable to [B, H, Sq, Sk] = {fmt_shape(target)}", fmt_shape(bias.shape))
    if not backward:
        return ctx.out([b, sq, h, dv], q.dtype)
    dy = ctx.tensor("dy", ndim=4)
    ctx.same_dtype(q, dy)
    want = [b, sq, h, dv]
    if any(ctx.provably_different(x, y) for x, y in zip(dy.shape, want)):
        raise ctx.error("dy", f"shape [B, Sq, H, Dv] = {fmt_shape(want)}", fmt_shape(dy.shape))
    chosen = {"q": q, "k": k, "v": v}[ctx.attrs["wrt"]]
    return ctx.out(chosen.shape, q.dtype)


# --------------------------------------------------------------------------------------------
# NumPy reference (float64)
# --------------------------------------------------------------------------------------------


def _np_visible(sq, sk, causal_mask, window_size):
    """[Sq, Sk] boolean: may query i attend to key j."""
    dist = np.arange(sq)[:, None] + _query_offset(causal_mask, sq, sk) - np.arange(sk)[None, :]
    visible = np.ones((sq, sk), dtype=bool)
    if causal_mask is not None:
        visible &= dist >= 0
    if window_size is not None:
        visible &= dist <= window_size
    return visible


def _np_forward(q, k, v, bias, causal_mask, window_size, scale, softcap):
    """Per-head tensors [B, H, ...] of the forward: (Q, K, V with kv heads repeated, P, tanh term)."""
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    _, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    qh = q.transpose(0, 2, 1, 3)
    # np.repeat keeps the copies of kv head c adjacent: head h reads kv head h // g.
    kh = np.repeat(k.transpose(0, 2, 1, 3), g, axis=1)
    vh = np.repeat(v.transpose(0, 2, 1, 3), g, axis=1)
    s = _default_scale(scale, d) * (qh @ kh.swapaxes(-1, -2))
    t = None
    if softcap is not None:
        t = np.tanh(s / softcap)
        s = softcap * t
    if bias is not None:
        s = s + np.asarray(bias, dtype=np.float64)
    visible = np.broadcast_to(_np_visible(sq, sk, causal_mask, window_size), s.shape)
    s = np.where(visible, s, -np.inf)
    row_max = s.max(axis=-1, keepdims=True)
    e = np.where(visible, np.exp(s - np.where(np.isfinite(row_max), row_max, 0.0)), 0.0)
    den = e.sum(axis=-1, keepdims=True)
    p = e / np.where(den > 0, den, 1.0)
    return qh, kh, vh, p, t


def _np_group_sum(x, hkv):
    """[B, H, S, E] -> [B, Hkv, S, E]: sum over the query heads sharing each kv head."""
    b, h, s, e = x.shape
    return x.reshape(b, hkv, h // hkv, s, e).sum(axis=2)


# --------------------------------------------------------------------------------------------
# Decomposition into differentiable Relax primitives
# --------------------------------------------------------------------------------------------


def _heads_first(x):
    """[B, S, H, E] <-> [B, H, S, E]: a transpose, never a reshape across heads."""
    return relax.op.permute_dims(x, [0, 2, 1, 3])


def _swap_last(x):
    return relax.op.permute_dims(x, [0, 1, 3, 2])


def _repeat_kv(x, b, hkv, g, s, e):
    """[B, Hkv, S, E] -> [B, Hkv*g, S, E] with head h = c*g + r reading kv head c: the new axis
    goes right after the kv-head axis, so merging the two adjacent axes is exact."""
    if _is_one(g):
        return x
    x = relax.op.broadcast_to(relax.op.expand_dims(x, 2), relax.ShapeExpr([b, hkv, g, s, e]))
    return relax.op.reshape(x, relax.ShapeExpr([b, hkv * g, s, e]))


def _group_sum(x, b, hkv, g, s, e):
    """Adjoint of :func:`_repeat_kv`: [B, H, S, E] -> [B, Hkv, S, E]."""
    if _is_one(g):
        return x
    return relax.op.sum(relax.op.reshape(x, relax.ShapeExpr([b, hkv, g, s, e])), axis=[2])


def _relax_visible(causal_mask, window_size, sq, sk):
    """[Sq, Sk] boolean mask from two position vectors (None when every key is visible)."""
    if not _masked(causal_mask, window_size):
        return None
    off = _query_offset(causal_mask, sq, sk)
    qpos = relax.op.expand_dims(relax.op.arange(off, sq + off, 1, "int64"), 1)
    kpos = relax.op.expand_dims(relax.op.arange(0, sk, 1, "int64"), 0)
    dist = relax.op.subtract(qpos, kpos)
    conds = []
    if causal_mask is not None:
        conds.append(relax.op.greater_equal(dist, relax.const(0, "int64")))
    if window_size is not None:
        conds.append(relax.op.less_equal(dist, relax.const(window_size, "int64")))
    visible = conds[0]
    for c in conds[1:]:
        visible = relax.op.logical_and(visible, c)
    return visible


class _RelaxAttention:
    """The forward of one call as Relax primitives, in the compute dtype, heads first."""

    def __init__(self, q, k, v, bias, causal_mask, window_size, scale, softcap):
        self.dtype = tensor_dtype(q)
        self.acc = acc_dtype(self.dtype)
        b, sq, h, d = q.ty.shape.values
        sk, hkv, dv = k.ty.shape.values[1], k.ty.shape.values[2], v.ty.shape.values[3]
        self.dims = dict(b=b, sq=sq, h=h, d=d, sk=sk, hkv=hkv, dv=dv)
        self.g = _group(h, hkv)
        self.scale = relax.const(_default_scale(scale, d), self.acc)
        self.softcap = softcap

        self.qh = _heads_first(self.cast(q))  # [B, H, Sq, D]
        self.kh = _repeat_kv(_heads_first(self.cast(k)), b, hkv, self.g, sk, d)  # [B, H, Sk, D]
        self.vh = _repeat_kv(_heads_first(self.cast(v)), b, hkv, self.g, sk, dv)  # [B, H, Sk, Dv]

        s = relax.op.multiply(relax.op.matmul(self.qh, _swap_last(self.kh)), self.scale)
        if softcap is not None:
            c = relax.const(softcap, self.acc)
            self.t = relax.op.tanh(relax.op.divide(s, c))
            s = relax.op.multiply(c, self.t)
        if bias is not None:
            s = relax.op.add(s, self.cast(bias))  # broadcasts to [B, H, Sq, Sk]
        visible = _relax_visible(causal_mask, window_size, sq, sk)
        if visible is None:
            self.p = relax.op.nn.softmax(s, axis=-1)
        else:
            # Masked scores become a finite large negative value (no inf in the graph or its
            # adjoints), and the where afterwards zeroes every masked probability, which also
            # turns a fully masked row (uniform softmax of equal scores) into zeros.
            s = relax.op.where(visible, s, relax.const(_MASKED, self.acc))
            self.p = relax.op.where(visible, relax.op.nn.softmax(s, axis=-1), relax.const(0.0, self.acc))

    def cast(self, x):
        return x if self.acc == self.dtype else relax.op.astype(x, self.acc)

    def finish(self, x):
        """[B, H, S, E] in the compute dtype -> [B, S, H, E] in the input dtype."""
        x = _heads_first(x)
        return x if self.acc == self.dtype else relax.op.astype(x, self.dtype)


# --------------------------------------------------------------------------------------------
# Fused TE kernels
# --------------------------------------------------------------------------------------------
#
# Scores are dot products over D, i.e. a reduction, and TE cannot nest one reduction in another,
# so one [Sq, Sk] tile of raw scores q.k per (batch, head) is materialized, then the row max m,
# then E = exp(S - m) (scale, softcap, bias and mask applied) as a tile of its own, then the row
# sums l of E; P = E / l is read as E times a per-row 1 / l. Every consumer of P is a reduction
# over Sq or Sk that reads each element Dv or D times, and an inlined E would recompute its exp
# that often (64x at D = 64). Likewise dS for dQ/dK. These stages carry KEEP_STAGE so that neither the
# default schedules nor MetaSchedule inline them back. k and v are read through transposed copies
# ([B, Hkv, D, Sk]) so that the products over D run along contiguous rows. What each kernel
# materializes (in the compute dtype: float32 for half inputs, else the input dtype):
#
#   attention                 2*B*H*Sq*Sk (scores, E)          + 3*B*H*Sq (m, l, 1/l)  + B*Hkv*Sk*D (k^T)
#   attention_backward, v     2*B*H*Sq*Sk (scores, E)          + 3*B*H*Sq (m, l, 1/l)  + B*Hkv*Sk*D (k^T)
#   attention_backward, q/k   4*B*H*Sq*Sk (scores, E, dP, dS)  + 4*B*H*Sq (m, l, 1/l, rowsum(P*dP))
#                                                              + B*Hkv*Sk*(D+Dv) (k^T, v^T)
#
# plus, for float16/bfloat16 inputs only, the float32 output before its cast. dP = dY V^T is a
# second reduction (over Dv), hence its own tile.


def transposed_keys(t, name):
    """[B, S, H, D] -> [B, H, D, S], kept materialized."""
    b, s, h, d = t.shape
    return te.compute((b, h, d, s), lambda b, h, d, j: t[b, j, h, d], name=name, attrs=KEEP_STAGE)


class _TeAttention:
    """Index helpers shared by the TE stages of one call."""

    def __init__(self, q, k, v, bias, causal_mask, window_size, scale, softcap):
        self.q, self.k, self.v, self.bias = q, k, v, bias
        self.dtype = tensor_dtype(q)
        self.acc = acc_dtype(self.dtype)
        self.b, self.sq, self.h, self.d = q.shape
        self.sk, self.hkv, self.dv = k.shape[1], k.shape[2], v.shape[3]
        self.g = _group(self.h, self.hkv)
        self.scale = tirx.const(_default_scale(scale, self.d), self.acc)
        self.softcap = None if softcap is None else tirx.const(softcap, self.acc)
        self.causal_mask, self.window_size = causal_mask, window_size
        self.offset = _query_offset(causal_mask, self.sq, self.sk)
        self.masked = _masked(causal_mask, window_size)

        # Scores as q times a transposed copy of k ([B, Hkv, D, Sk]): the reduction over D then
        # reads k along the output's contiguous axis, which the CPU schedule vectorizes.
        self.k_t = transposed_keys(k, name="k_t")
        rd = te.reduce_axis((0, self.d), "d")
        self.qk = te.compute(
            (self.b, self.h, self.sq, self.sk),
            lambda b, h, i, j: te.sum(self.load(q, b, i, h, rd) * self.load(self.k_t, b, self.kv(h), rd, j), axis=rd),
            name="scores",
        )
        rj = te.reduce_axis((0, self.sk), "j")
        self.m = te.compute(
            (self.b, self.h, self.sq),
            lambda b, h, i: te.max(self.where_visible(i, rj, self.logit(b, h, i, rj), tirx.min_value(self.acc)), axis=rj),
            name="row_max",
        )
        # exp(S - m) is stored once (the exp is the costly part); P = that times 1 / l, per row.
        self.e = te.compute(
            (self.b, self.h, self.sq, self.sk),
            lambda b, h, i, j: self.where_visible(i, j, tir_exp(self.logit(b, h, i, j) - self.m(b, h, i)), self.zero),
            name="exp_scores",
            attrs=KEEP_STAGE,
        )
        rj = te.reduce_axis((0, self.sk), "j")
        self.l = te.compute((self.b, self.h, self.sq), lambda b, h, i: te.sum(self.e(b, h, i, rj), axis=rj), name="row_sum")
        # l == 0 only on a fully masked row, where every entry is masked anyway.
        self.inv_l = te.compute(
            (self.b, self.h, self.sq),
            lambda b, h, i: tirx.const(1.0, self.acc)
            / tirx.Select(self.l(b, h, i) > self.zero, self.l(b, h, i), tirx.const(1.0, self.acc)),
            name="inv_row_sum",
            attrs=KEEP_STAGE,
        )

    @property
    def zero(self):
        return tirx.const(0.0, self.acc)

    def load(self, t, *idx):
        x = t(*idx)
        return x if self.acc == self.dtype else x.astype(self.acc)

    def kv(self, h):
        return h if _is_one(self.g) else tirx.floordiv(h, self.g)

    def visible(self, i, j):
        dist = i + self.offset - j
        conds = []
        if self.causal_mask is not None:
            conds.append(dist >= 0)
        if self.window_size is not None:
            conds.append(dist <= self.window_size)
        return tirx.all(*conds)

    def where_visible(self, i, j, value, otherwise):
        return tirx.Select(self.visible(i, j), value, otherwise) if self.masked else value

    def raw(self, b, h, i, j):
        return self.qk(b, h, i, j) * self.scale

    def logit(self, b, h, i, j):
        s = self.raw(b, h, i, j)
        if self.softcap is not None:
            s = self.softcap * tir_tanh(s / self.softcap)
        if self.bias is not None:
            s = s + self.bias_at(b, h, i, j)
        return s

    def bias_at(self, b, h, i, j):
        # Right-aligned broadcasting: a static 1 dim is read at 0, the others follow the index.
        idx = (b, h, i, j)[4 - len(self.bias.shape):]
        return self.load(self.bias, *[tirx.const(0, "int64") if static_int(d) == 1 else x for d, x in zip(self.bias.shape, idx)])

    def prob(self, b, h, i, j):
        return self.e(b, h, i, j) * self.inv_l(b, h, i)

    def softcap_grad(self, b, h, i, j):
        t = tir_tanh(self.raw(b, h, i, j) / self.softcap)
        return tirx.const(1.0, self.acc) - t * t

    def output(self, t):
        if self.acc == self.dtype:
            return t
        return te.compute(t.shape, lambda *i: t(*i).astype(self.dtype), name=t.op.name + "_cast")


def _te_attention(q, k, v, bias, **attrs):
    a = _TeAttention(q, k, v, bias, **attrs)
    rj = te.reduce_axis((0, a.sk), "j")
    out = te.compute(
        (a.b, a.sq, a.h, a.dv),
        lambda b, i, h, e: te.sum(a.prob(b, h, i, rj) * a.load(v, b, rj, a.kv(h), e), axis=rj),
        name="attention",
    )
    return a.output(out)


def _te_attention_backward(q, k, v, dy, bias, wrt, **attrs):
    """The gradients named by ``wrt`` ("q", "k", "v", or several of them, e.g. "qkv"), one
    output each in that order. Asked together they share one set of scores, probabilities and dS:
    five products over (Sq, Sk) tiles for all three, where one kernel per gradient takes eight."""
    a = _TeAttention(q, k, v, bias, **attrs)
    outs = {}
    if "v" in wrt:
        rg, ri = te.reduce_axis((0, a.g), "g"), te.reduce_axis((0, a.sq), "i")
        outs["v"] = te.compute(
            (a.b, a.sk, a.hkv, a.dv),
            lambda b, j, c, e: te.sum(
                a.prob(b, c * a.g + rg, ri, j) * a.load(dy, b, ri, c * a.g + rg, e), axis=[rg, ri]
            ),
            name="dv",
        )
    if "q" in wrt or "k" in wrt:
        ds_scaled = _te_scaled_ds(a, v, dy)
    if "q" in wrt:
        rj = te.reduce_axis((0, a.sk), "j")
        outs["q"] = te.compute(
            (a.b, a.sq, a.h, a.d),
            lambda b, i, h, d: te.sum(ds_scaled(b, h, i, rj) * a.load(k, b, rj, a.kv(h), d), axis=rj),
            name="dq",
        )
    if "k" in wrt:
        rg, ri = te.reduce_axis((0, a.g), "g"), te.reduce_axis((0, a.sq), "i")
        outs["k"] = te.compute(
            (a.b, a.sk, a.hkv, a.d),
            lambda b, j, c, d: te.sum(ds_scaled(b, c * a.g + rg, ri, j) * a.load(q, b, ri, c * a.g + rg, d),
                                      axis=[rg, ri]),
            name="dk",
        )
    results = [a.output(outs[w]) for w in wrt]
    return results[0] if len(results) == 1 else results


def _te_scaled_ds(a: _TeAttention, v, dy):
    """scale * dS = scale * P * (dP - rowsum(P * dP)), dP = dY V^T (times the softcap's
    derivative when capped), kept materialized: dQ and dK read each element D times."""
    v_t = transposed_keys(v, name="v_t")
    re = te.reduce_axis((0, a.dv), "e")
    dp = te.compute(
        (a.b, a.h, a.sq, a.sk),
        lambda b, h, i, j: te.sum(a.load(dy, b, i, h, re) * a.load(v_t, b, a.kv(h), re, j), axis=re),
        name="dp",
    )
    rj = te.reduce_axis((0, a.sk), "j")
    delta = te.compute(
        (a.b, a.h, a.sq),
        lambda b, h, i: te.sum(a.prob(b, h, i, rj) * dp(b, h, i, rj), axis=rj),
        name="rowsum_p_dp",
    )

    def scaled_ds(b, h, i, j):
        ds = a.prob(b, h, i, j) * (dp(b, h, i, j) - delta(b, h, i)) * a.scale
        return ds * a.softcap_grad(b, h, i, j) if a.softcap is not None else ds

    return te.compute((a.b, a.h, a.sq, a.sk), scaled_ds, name="scaled_ds", attrs=KEEP_STAGE)


# --------------------------------------------------------------------------------------------
# attention (forward)
# --------------------------------------------------------------------------------------------

attention = define_op(
    "attention",
    inputs=("q", "k", "v"),
    optional_inputs=("bias",),
    attrs=_MASK_ATTRS,
    backward=False,
    doc="softmax(softcap(scale * q k^T) + bias, masked) v with grouped-query heads (docs/operators.md §5).",
)


@attention.infer
def _attention_infer(ctx):
    return _infer(ctx, backward=False)


@attention.reference
def _attention_ref(q, k, v, bias=None, *, causal_mask=None, window_size=None, scale=None, softcap=None):
    _, _, vh, p, _ = _np_forward(q, k, v, bias, causal_mask, window_size, scale, softcap)
    return (p @ vh).transpose(0, 2, 1, 3)


@attention.decomposition
def _attention_decompose(bb, q, k, v, bias=None, **attrs):
    f = _RelaxAttention(q, k, v, bias, **attrs)
    return f.finish(relax.op.matmul(f.p, f.vh))


@attention.fused
def _attention_fused(bb, q, k, v, bias=None, **attrs):
    return bb.call_te(_te_attention, q, k, v, bias, **attrs, primfunc_name_hint="rlx_attention")


# --------------------------------------------------------------------------------------------
# attention_backward
# --------------------------------------------------------------------------------------------

attention_backward = define_op(
    "attention_backward",
    inputs=("q", "k", "v", "dy"),
    optional_inputs=("bias",),
    attrs=(Attr("wrt", check=check_choice("q", "k", "v")),) + _MASK_ATTRS,
    doc="Gradient of rlx.attention with respect to q, k or v (docs/operators.md §5); no gradient to bias.",
)


@attention_backward.infer
def _attention_backward_infer(ctx):
    return _infer(ctx, backward=True)


@attention_backward.reference
def _attention_backward_ref(q, k, v, dy, bias=None, *, wrt, causal_mask=None, window_size=None, scale=None, softcap=None):
    qh, kh, vh, p, t = _np_forward(q, k, v, bias, causal_mask, window_size, scale, softcap)
    hkv = k.shape[2]
    dyh = np.asarray(dy, dtype=np.float64).transpose(0, 2, 1, 3)
    if wrt == "v":
        return _np_group_sum(p.swapaxes(-1, -2) @ dyh, hkv).transpose(0, 2, 1, 3)
    dp = dyh @ vh.swapaxes(-1, -2)
    ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True))
    if t is not None:
        ds = ds * (1.0 - t * t)
    ds = _default_scale(scale, q.shape[3]) * ds
    if wrt == "q":
        return (ds @ kh).transpose(0, 2, 1, 3)
    return _np_group_sum(ds.swapaxes(-1, -2) @ qh, hkv).transpose(0, 2, 1, 3)


@attention_backward.decomposition
def _attention_backward_decompose(bb, q, k, v, dy, bias=None, *, wrt, **attrs):
    f = _RelaxAttention(q, k, v, bias, **attrs)
    n = f.dims
    dyh = _heads_first(f.cast(dy))  # [B, H, Sq, Dv]
    if wrt == "v":
        return f.finish(_group_sum(relax.op.matmul(_swap_last(f.p), dyh), n["b"], n["hkv"], f.g, n["sk"], n["dv"]))
    dp = relax.op.matmul(dyh, _swap_last(f.vh))
    ds = relax.op.multiply(f.p, relax.op.subtract(dp, relax.op.sum(relax.op.multiply(f.p, dp), axis=[-1], keepdims=True)))
    if f.softcap is not None:
        ds = relax.op.multiply(ds, relax.op.subtract(relax.const(1.0, f.acc), relax.op.multiply(f.t, f.t)))
    ds = relax.op.multiply(ds, f.scale)
    if wrt == "q":
        return f.finish(relax.op.matmul(ds, f.kh))
    return f.finish(_group_sum(relax.op.matmul(_swap_last(ds), f.qh), n["b"], n["hkv"], f.g, n["sk"], n["d"]))


@attention_backward.fused
def _attention_backward_fused(bb, q, k, v, dy, bias=None, *, wrt, **attrs):
    """The kernel of the gradients ``wrt`` (one letter here; several for siblings)."""
    return bb.call_te(
        _te_attention_backward, q, k, v, dy, bias, wrt, **attrs, primfunc_name_hint=f"rlx_attention_backward_{wrt}"
    )


def _sibling_key(opdef, call):
    """dq, dk and dv of one attention: same operands, same attributes but ``wrt``."""
    attrs = opdef.call_attrs(call)
    attrs.pop("wrt")
    return (*call.args, *sorted((k, repr(v)) for k, v in attrs.items()))


@fuse_siblings(attention_backward, key=_sibling_key)
def _attention_backward_together(bb, members):
    """One kernel for the gradients asked of one attention (five products over the (Sq, Sk) tiles
    instead of eight for dq, dk and dv apart, and one softmax instead of three), run on slices of
    a few (batch, kv head) pairs at a time (:func:`_head_chunks`)."""
    opdef, first = members[0]
    wrts = [opdef.call_attrs(call)["wrt"] for _, call in members]
    unique = "".join(dict.fromkeys(wrts))
    attrs = opdef.call_attrs(first)
    attrs.pop("wrt")
    q, k, v, dy, bias = opdef.call_args(first)

    def kernel(q, k, v, dy, bias, **mask):
        out = bb.emit(_attention_backward_fused(bb, q, k, v, dy, bias, wrt=unique, **{**attrs, **mask}))
        return [bb.emit(relax.TupleGetItem(out, n)) for n in range(len(unique))]

    def visible_blocks(q, k, v, dy, bias):
        """The gradients from blocks of query rows, each with only the keys it can see."""
        blocks = _visible_key_blocks(q, k, bias, attrs)
        if blocks is None:
            return kernel(q, k, v, dy, bias)
        sk = static_int(k.ty.shape.values[1])
        rows = lambda t, lo, hi: bb.emit(relax.op.strided_slice(t, axes=[1], begin=[lo], end=[hi]))  # noqa: E731
        parts = []
        for r0, r1, s0, s1 in blocks:
            # In the block, key j' = j - s0 is visible to row i' = i - r0 iff j' <= i' + (s1 - s0) -
            # (r1 - r0): BottomRight's rule for the block's shape (and the window as before).
            parts.append(kernel(rows(q, r0, r1), rows(k, s0, s1), rows(v, s0, s1), rows(dy, r0, r1),
                                _bias_piece(bb, bias, {2: (r0, r1), 3: (s0, s1)}), causal_mask="BottomRight"))
        grads = []
        for n, w in enumerate(unique):
            if w == "q":  # each row's gradient comes from its block
                grads.append(bb.emit(relax.op.concat([part[n] for part in parts], axis=1)))
            else:  # each key's gradient sums over the blocks that see it
                padded = [bb.emit(relax.op.nn.pad(part[n], [0, 0, s0, sk - s1, 0, 0, 0, 0]))
                          for (_, _, s0, s1), part in zip(blocks, parts)]
                grads.append(reduce(lambda a, b: bb.emit(relax.op.add(a, b)), padded))
        return grads

    chunks = _head_chunks(q, k)
    if chunks is None:
        grads = visible_blocks(q, k, v, dy, bias)
    else:
        g = static_int(q.ty.shape.values[2]) // static_int(k.ty.shape.values[2])
        parts = []
        for b, c0, c1 in chunks:  # (batch index, kv heads c0..c1-1, their query heads)
            piece = lambda t, h0, h1: bb.emit(relax.op.strided_slice(t, axes=[0, 2], begin=[b, h0], end=[b + 1, h1]))  # noqa: E731
            qc, dyc = piece(q, c0 * g, c1 * g), piece(dy, c0 * g, c1 * g)
            kc, vc = piece(k, c0, c1), piece(v, c0, c1)
            parts.append(visible_blocks(qc, kc, vc, dyc, _bias_piece(bb, bias, {0: (b, b + 1), 1: (c0 * g, c1 * g)})))
        grads = []
        for n in range(len(unique)):
            rows = {}
            for (b, _, _), part in zip(chunks, parts):
                rows.setdefault(b, []).append(part[n])
            per_batch = [bb.emit(relax.op.concat(heads, axis=2)) if len(heads) > 1 else heads[0] for heads in rows.values()]
            grads.append(bb.emit(relax.op.concat(per_batch, axis=0)) if len(per_batch) > 1 else per_batch[0])
    return [grads[unique.index(w)] for w in wrts]


# Tiles of scores per kernel call, in bytes: a few (batch, head) pairs' [Sq, Sk] float32 tiles, so
# that each stage's tiles stay in cache for the next stage (the kernel keeps four such tiles);
# all pairs in one call run about twice as slow per pair as two pairs per call.
CHUNK_TILE_BYTES = 2 << 20
MAX_CHUNKS = 64  # more pairs per call rather than more calls


def _head_chunks(q, k) -> list[tuple[int, int, int]] | None:
    """[(batch index, first kv head, end kv head)] covering every (batch, kv head) pair, each
    chunk's tiles (its query heads' [Sq, Sk] scores) within ``CHUNK_TILE_BYTES``; None to run
    the whole attention in one call (symbolic shapes, or a single chunk)."""
    b, sq, h, _ = (static_int(d) for d in q.ty.shape.values)
    sk, hkv = (static_int(d) for d in k.ty.shape.values[1:3])
    if None in (b, sq, h, sk, hkv):
        return None
    g = h // hkv
    per_kv_head = g * sq * sk * 4
    width = max(1, min(hkv, CHUNK_TILE_BYTES // per_kv_head))
    while hkv % width:
        width -= 1
    while b * hkv // width > MAX_CHUNKS and width < hkv:
        width = next(w for w in range(width + 1, hkv + 1) if hkv % w == 0)
    if b * hkv // width <= 1 or width == hkv and b * hkv // width > MAX_CHUNKS:
        return None
    return [(n, c, c + width) for n in range(b) for c in range(0, hkv, width)]


# Query rows per kernel call of a causal attention: a block of rows needs only the keys up to its
# last row's (and from its first row's window start), so the fully masked tiles beyond are never
# computed. At S = 512 two blocks compute 3 of 4 (row, key) tiles (blocks of 128 rows, 10 of 16
# tiles, are no faster: narrower calls run slower).
ROW_BLOCK = 256


def _visible_key_blocks(q, k, bias, attrs) -> list[tuple[int, int, int, int]] | None:
    """[(r0, r1, s0, s1)]: query rows r0..r1-1 see keys s0..s1-1 only, for a causal mask with
    static Sq <= Sk (every row sees a key; the last row of a block sees keys up to s1 - 1 <= Sk - 1);
    None to run all rows at once (no causal mask, symbolic or short sequences)."""
    sq, sk = static_int(q.ty.shape.values[1]), static_int(k.ty.shape.values[1])
    if attrs.get("causal_mask") is None or None in (sq, sk) or sk < sq or sq <= ROW_BLOCK:
        return None
    if bias is not None and None in [static_int(d) for d in bias.ty.shape.values]:
        return None
    offset, window = _query_offset(attrs["causal_mask"], sq, sk), attrs.get("window_size")
    blocks = []
    for r0 in range(0, sq, ROW_BLOCK):
        r1 = min(sq, r0 + ROW_BLOCK)
        s0 = max(0, r0 + offset - window) if window is not None else 0
        blocks.append((r0, r1, s0, r1 + offset))
    return blocks


def _bias_piece(bb, bias, ranges: dict):
    """The bias ([B|1, H|1, Sq|1, Sk|1] or fewer dims, right-aligned) restricted to ``ranges``
    ({axis of [B, H, Sq, Sk]: (begin, end)}): sliced along the dims it does not broadcast."""
    if bias is None:
        return None
    shape = [static_int(d) for d in bias.ty.shape.values]
    lead = 4 - len(shape)
    axes, begin, end = [], [], []
    for axis, (lo, hi) in ranges.items():
        k = axis - lead
        if k >= 0 and shape[k] != 1:
            axes.append(k)
            begin.append(lo)
            end.append(hi)
    return bb.emit(relax.op.strided_slice(bias, axes=axes, begin=begin, end=end)) if axes else bias


# --------------------------------------------------------------------------------------------
# Gradient rules: relax.transform.Gradient emits attention_backward for the forward ops
# --------------------------------------------------------------------------------------------


def _backward_calls(orig_call, output_grad, attrs):
    """One attention_backward per q, k, v; none to the bias (docs/operators.md §5, v1)."""
    q, k, v, *rest = orig_call.args
    bias = rest[0] if rest else None
    grads = [attention_backward(q, k, v, output_grad, bias, wrt=w, **attrs) for w in "qkv"]
    return grads + [no_grad(bias)] if bias is not None else grads


def _rlx_attention_gradient(orig_var, orig_call, output_grad, ctx):
    attrs = {k: v for k, v in attention.call_attrs(orig_call).items() if v is not None}
    return _backward_calls(orig_call, output_grad, attrs)


def _nn_attention_gradient(orig_var, orig_call, output_grad, ctx):
    """``R.nn.attention`` / ``R.nn.attention_bias``. TVM's BottomRight mask is
    ``tril(k=|Sk - Sq|)``, which equals ours (``tril(k=Sk - Sq)``) only when Sk >= Sq; for
    Sq > Sk TVM lets every query see more keys than the queries-at-the-end convention, which
    our attrs cannot express, so that case is refused instead of differentiated wrongly."""
    a = orig_call.attrs
    attrs = {}
    if a.scale is not None:
        attrs["scale"] = float(a.scale)
    if a.causal_mask is not None:
        attrs["causal_mask"] = str(a.causal_mask)
    if a.window_size is not None:
        attrs["window_size"] = int(a.window_size)
    if attrs.get("causal_mask") == "BottomRight":
        sq, sk = orig_call.args[0].ty.shape.values[1], orig_call.args[1].ty.shape.values[1]
        if not Analyzer().can_prove(sk >= sq):
            raise OpError(
                f"rlx.attention_backward: argument 'k' expected key length Sk >= query length Sq = {_fmt_dim(sq)} "
                f"to differentiate R.nn.attention with causal_mask='BottomRight' (TVM's mask for Sq > Sk "
                f"is tril(k=Sq-Sk), not the queries-at-the-end mask), got Sk = {_fmt_dim(sk)}"
            )
    return _backward_calls(orig_call, output_grad, attrs)


fill_gradient(attention.op_name)(_rlx_attention_gradient)
fill_gradient("relax.nn.attention")(_nn_attention_gradient)
fill_gradient("relax.nn.attention_bias")(_nn_attention_gradient)
