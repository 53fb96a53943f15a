"""Rotary position embedding: ``rope(x, cos, sin)`` and ``rope_backward(dy, cos, sin)`` (docs/operators.md §4).

Layouts: activations are ``[B, S, H*head_dim]`` or ``[B, S, H, head_dim]``; the tables ``cos`` and
``sin`` are ``[S, n_rot/2]`` (one row per position) or ``[B*S, n_rot/2]`` (one row per token,
row ``b*S + s``). Which of the two is decided from the shapes: the table is per position when its
row count provably equals S, per token when it provably equals B*S (with B == 1 both read the same
rows), and an error otherwise.

Within each head the first ``n_rot`` dims rotate in pairs (``neox``: ``i`` with ``i + n_rot/2``;
``gptj``: ``2i`` with ``2i+1``) and the dims ``>= n_rot`` pass through. With ``(a, b)`` a pair and
``c, s`` its table entries, ``rope`` maps it to ``(a c - b s, b c + a s)``. The rotation is
orthogonal, so its transpose (the backward) is the same map with ``s -> -s``.

Heads are contiguous blocks of the last dim, so viewing ``[B, S, H*head_dim]`` as
``[B, S, H, head_dim]`` is a plain reshape; folding heads into another axis would need a
transpose (docs/operators.md §8), and no path here does that.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tvm import relax, te, tirx
from tvm.sym import Analyzer

from ..kernels.common import acc_dtype, tensor_dtype
from ..overrides import override_gradient
from .registry import Attr, check_choice, check_int, check_optional, define_op, op_error, static_int

STYLES = ("neox", "gptj")

_ATTRS = (
    Attr("head_dim", check=check_int(lo=2)),
    Attr("n_rot", None, check=check_optional(check_int(lo=2))),
    Attr("style", "neox", check=check_choice(*STYLES)),
)


# --------------------------------------------------------------------------------------------
# Geometry: what the shapes mean, decided once for type inference and for both lowerings
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RopeGeometry:
    rank: int  # 3: [B, S, H*head_dim], 4: [B, S, H, head_dim]
    batch: object  # B (PrimExpr, may be symbolic)
    seq: object  # S
    heads: object  # H
    head_dim: int
    n_rot: int
    style: str
    per_token: bool  # tables [B*S, n_rot/2] rather than [S, n_rot/2]

    @property
    def half(self) -> int:
        return self.n_rot // 2

    def heads_shape(self, last: int | None = None) -> list:
        """The 4-D per-head view ``[B, S, H, last]`` (default last: head_dim)."""
        return [self.batch, self.seq, self.heads, self.head_dim if last is None else last]

    def table_view(self) -> list:
        """Shape that broadcasts a table against ``[B, S, H, n_rot/2]``."""
        return [self.batch if self.per_token else 1, self.seq, 1, self.half]


def _fmt(d) -> str:
    return str(int(d.value)) if isinstance(d, tirx.IntImm) else str(d)


def geometry(error, act: str, shape, table_shape, head_dim: int, n_rot: int | None, style: str) -> RopeGeometry:
    """Validate the activation ``act`` (``x`` or ``dy``) of shape ``shape``, the shape of the
    tables and the attributes; ``error(arg, expected, got)`` builds the exception."""
    analyzer = Analyzer()

    def equal(a, b) -> bool:
        return bool(analyzer.can_prove_equal(a, b))

    if n_rot is None:
        if head_dim % 2:
            raise error("head_dim", "an even integer when n_rot is not given (n_rot defaults to head_dim)", head_dim)
        n_rot = head_dim
    if n_rot % 2:
        raise error("n_rot", "an even integer", n_rot)
    if n_rot > head_dim:
        raise error("n_rot", f"an integer <= head_dim = {head_dim}", n_rot)

    rank = len(shape)
    last = static_int(shape[-1])
    if rank == 4:
        if last != head_dim:
            raise error(act, f"last dim == head_dim = {head_dim} (layout [B, S, H, head_dim])", _fmt(shape[-1]))
        heads = shape[2]
    else:
        if last is None or last % head_dim:
            raise error(
                act, f"a static last dim divisible by head_dim = {head_dim} (layout [B, S, H*head_dim])", _fmt(shape[-1])
            )
        heads = tirx.IntImm("int64", last // head_dim)
    batch, seq = shape[0], shape[1]

    rows, cols = table_shape
    half = n_rot // 2
    if not equal(cols, half):
        raise error("cos", f"dim 1 == n_rot/2 = {half}", _fmt(cols))
    if equal(rows, seq):
        per_token = False
    elif equal(rows, batch * seq):
        per_token = True
    else:
        raise error(
            "cos",
            f"dim 0 == S = {_fmt(seq)} (one row per position) or B*S = {_fmt(analyzer.simplify(batch * seq))} "
            "(one row per token)",
            _fmt(rows),
        )
    return RopeGeometry(rank, batch, seq, heads, head_dim, n_rot, style, per_token)


def _geometry_of(op: str, act, cos, head_dim, n_rot, style) -> RopeGeometry:
    """Geometry of an already type-checked call (the lowerings and gradient rule)."""
    error = lambda arg, expected, got: op_error(op, arg, expected, got)  # noqa: E731
    name = "x" if op == "rope" else "dy"
    return geometry(error, name, list(act.ty.shape.values), list(cos.ty.shape.values), head_dim, n_rot, style)


def _infer(ctx, act_name: str):
    act = ctx.tensor(act_name, ndim=(3, 4))
    cos = ctx.tensor("cos", ndim=2)
    sin = ctx.tensor("sin", ndim=2)
    ctx.same_dtype(act, cos, sin)
    ctx.same_shape(cos, sin)
    a = ctx.attrs
    geometry(ctx.error, act_name, act.shape, cos.shape, a["head_dim"], a["n_rot"], a["style"])
    return ctx.out(act.shape, act.dtype)


# --------------------------------------------------------------------------------------------
# The three evaluations of the rotation; ``sin_sign`` -1 gives the transpose (the backward)
# --------------------------------------------------------------------------------------------


def _reference(x, cos, sin, head_dim, n_rot, style, sin_sign):
    x = np.asarray(x, dtype=np.float64)
    cos = np.asarray(cos, dtype=np.float64)
    sin = sin_sign * np.asarray(sin, dtype=np.float64)
    n_rot = head_dim if n_rot is None else n_rot
    B, S = x.shape[:2]
    x4 = x.reshape(B, S, -1, head_dim)
    if cos.shape[0] == S:
        c, s = cos[None, :, None, :], sin[None, :, None, :]
    else:
        c, s = cos.reshape(B, S, 1, -1), sin.reshape(B, S, 1, -1)
    out = x4.copy()
    h = n_rot // 2
    first, second = (np.arange(h), np.arange(h) + h) if style == "neox" else (np.arange(h) * 2, np.arange(h) * 2 + 1)
    a, b = x4[..., first], x4[..., second]
    out[..., first] = a * c - b * s
    out[..., second] = b * c + a * s
    return out.reshape(x.shape)


def _rope_te(act, cos, sin, g: RopeGeometry, sin_sign: float, name: str):
    """One ``te.compute``: each output element reads itself, its pair partner and one table entry."""
    dtype = str(act.dtype)
    acc = acc_dtype(dtype)

    def body(*idx):
        last = idx[-1]
        d = last if g.rank == 4 else tirx.floormod(last, g.head_dim)  # dim within the head
        in_rot = d < g.n_rot
        # Indices in range for every d by arithmetic, not by a select: a select evaluates both
        # sides, and TVM's simplifier rewrites each side under the select's condition (dropping
        # a guard that only the other side needed), so a load inside one may go out of bounds.
        if g.style == "neox":
            first = d < g.half
            # d < n_rot: the pair partner; else any dim in range. (Taken mod n_rot of d, not of
            # the whole index: floormod(floormod(i, n) + h, n) trips TVM's simplifier.)
            partner = d + g.half - g.n_rot * (d + g.half >= g.n_rot).astype(d.ty.dtype) \
                if g.rank == 3 and g.n_rot == g.head_dim else tirx.floormod(d + g.half, g.n_rot)
            j = tirx.floormod(d, g.half)
        else:
            first = tirx.floormod(d, 2) == 0
            j = tirx.floormod(tirx.floordiv(d, 2), g.half)
            partner = d + 1 - 2 * tirx.floormod(d, 2)
            if g.n_rot < g.head_dim:  # an odd head_dim: the last pass-through dim has no d + 1
                partner = tirx.floormod(partner, g.n_rot)
        # The TE tensor's own dims, not the Relax ones: call_te renames symbolic vars.
        row = idx[0] * act.shape[1] + idx[1] if g.per_token else idx[1]
        xv = act(*idx).astype(acc)
        xp = act(*idx[:-1], last - d + partner).astype(acc)
        c = cos[row, j].astype(acc)
        s = sin[row, j].astype(acc) * tirx.const(sin_sign, acc)
        # (a, b) -> (a c - b s, b c + a s)
        rotated = xv * c + tirx.Select(first, tirx.const(-1.0, acc), tirx.const(1.0, acc)) * xp * s
        return tirx.Select(in_rot, rotated, xv).astype(dtype)

    return te.compute(act.shape, body, name=name)


def _split_pairs(emit, r, g: RopeGeometry):
    """The two halves of every pair of the rotary block ``r`` [B, S, H, n_rot], each [B, S, H, h]."""
    if g.style == "neox":
        parts = emit(relax.op.split(r, 2, axis=3))
        return relax.TupleGetItem(parts, 0), relax.TupleGetItem(parts, 1)
    parts = emit(relax.op.split(relax.op.reshape(r, g.heads_shape()[:3] + [g.half, 2]), 2, axis=4))
    quarter = g.heads_shape(g.half)
    return tuple(relax.op.reshape(relax.TupleGetItem(parts, i), quarter) for i in range(2))


def _join_pairs(a, b, g: RopeGeometry):
    """Inverse of :func:`_split_pairs`."""
    if g.style == "neox":
        return relax.op.concat([a, b], axis=3)
    pair = g.heads_shape()[:3] + [g.half, 1]
    joined = relax.op.concat([relax.op.reshape(a, pair), relax.op.reshape(b, pair)], axis=4)
    return relax.op.reshape(joined, g.heads_shape(g.n_rot))


def _split_rotary(emit, x4, g: RopeGeometry):
    """(rotary block [B, S, H, n_rot], pass-through block or None)."""
    if g.n_rot == g.head_dim:
        return x4, None
    parts = emit(relax.op.split(x4, [g.n_rot], axis=3))
    return relax.TupleGetItem(parts, 0), relax.TupleGetItem(parts, 1)


def _as_acc(e, dtype: str):
    acc = acc_dtype(dtype)
    return e if acc == dtype else relax.op.astype(e, acc)


def _rope_relax(emit, act, cos, sin, g: RopeGeometry, sin_sign: float):
    dtype = tensor_dtype(act)
    x4 = relax.op.reshape(_as_acc(act, dtype), g.heads_shape()) if g.rank == 3 else _as_acc(act, dtype)
    c = relax.op.reshape(_as_acc(cos, dtype), g.table_view())
    s = relax.op.reshape(_as_acc(sin, dtype), g.table_view())
    if sin_sign < 0:
        s = relax.op.negative(s)
    c, s = emit(c), emit(s)
    rot, rest = _split_rotary(emit, x4, g)
    a, b = _split_pairs(emit, rot, g)
    a, b = emit(a), emit(b)
    out = _join_pairs(a * c - b * s, b * c + a * s, g)
    if rest is not None:
        out = relax.op.concat([out, rest], axis=3)
    if g.rank == 3:
        out = relax.op.reshape(out, act.ty.shape)
    return out if acc_dtype(dtype) == dtype else relax.op.astype(out, dtype)


# --------------------------------------------------------------------------------------------
# rope (forward) and rope_backward
# --------------------------------------------------------------------------------------------

rope = define_op(
    "rope",
    inputs=("x", "cos", "sin"),
    attrs=_ATTRS,
    backward=False,
    doc="Rotary position embedding of x [B, S, H*head_dim] or [B, S, H, head_dim] (docs/operators.md §4).",
)
rope_backward = define_op(
    "rope_backward",
    inputs=("dy", "cos", "sin"),
    attrs=_ATTRS,
    doc="Transposed rotation of rope: dx = rope(dy, cos, -sin); dims >= n_rot pass through (docs/operators.md §4).",
)


@rope.infer
def _rope_infer(ctx):
    return _infer(ctx, "x")


@rope_backward.infer
def _rope_backward_infer(ctx):
    return _infer(ctx, "dy")


@rope.reference
def _rope_ref(x, cos, sin, *, head_dim, n_rot=None, style="neox"):
    return _reference(x, cos, sin, head_dim, n_rot, style, 1.0)


@rope_backward.reference
def _rope_backward_ref(dy, cos, sin, *, head_dim, n_rot=None, style="neox"):
    return _reference(dy, cos, sin, head_dim, n_rot, style, -1.0)


def _decompose(op, sin_sign):
    def decompose(bb, act, cos, sin, *, head_dim, n_rot=None, style="neox"):
        g = _geometry_of(op, act, cos, head_dim, n_rot, style)
        return _rope_relax(bb.emit, act, cos, sin, g, sin_sign)

    return decompose


def _fused(op, sin_sign):
    def fused(bb, act, cos, sin, *, head_dim, n_rot=None, style="neox"):
        g = _geometry_of(op, act, cos, head_dim, n_rot, style)
        return bb.call_te(
            lambda a, c, s: _rope_te(a, c, s, g, sin_sign, op), act, cos, sin, primfunc_name_hint=f"rlx_{op}_{style}"
        )

    return fused


rope.decomposition(_decompose("rope", 1.0))
rope.fused(_fused("rope", 1.0))
rope_backward.decomposition(_decompose("rope_backward", -1.0))
rope_backward.fused(_fused("rope_backward", -1.0))


# --------------------------------------------------------------------------------------------
# Gradient of rlx.rope: rope_backward for x, and the true table gradients
# --------------------------------------------------------------------------------------------


def _table_gradients(x, dy, g: RopeGeometry, dtype: str):
    """d cos and d sin for y = rope(x): per pair (a, b) with cotangents (ga, gb),
    ``d c = ga a + gb b`` and ``d s = gb a - ga b``, summed over heads (and over the batch for a
    per-position table)."""

    def pairs(t):
        t4 = relax.op.reshape(_as_acc(t, dtype), g.heads_shape())
        rot, _ = _split_rotary(lambda e: e, t4, g)
        return _split_pairs(lambda e: e, rot, g)

    a, b = pairs(x)
    ga, gb = pairs(dy)
    grads = []
    for full in (ga * a + gb * b, gb * a - ga * b):
        per_token = relax.op.sum(full, axis=[2])  # [B, S, h]
        if g.per_token:
            t = relax.op.reshape(per_token, [g.batch * g.seq, g.half])
        else:
            t = relax.op.sum(per_token, axis=[0])
        grads.append(t if acc_dtype(dtype) == dtype else relax.op.astype(t, dtype))
    return grads


def _rope_gradient(orig_var, orig_call, output_grad, ctx):
    x, cos, sin = orig_call.args
    attrs = rope.call_attrs(orig_call)
    g = _geometry_of("rope", x, cos, **attrs)
    dcos, dsin = _table_gradients(x, output_grad, g, tensor_dtype(x))
    return [rope_backward(output_grad, cos, sin, **attrs), dcos, dsin]


override_gradient(rope.op_name, _rope_gradient)
