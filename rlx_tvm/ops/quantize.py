"""Symmetric fake quantization: ``fake_quantize(x; bits, axis)`` and its surrogate gradient
``fake_quantize_backward(x, dy; bits, axis, ste)`` (docs/operators.md §2).

With ``q = 2^(bits-1) - 1`` and ``m = max|x|`` (over the whole tensor when ``axis`` is None, else
over all axes other than ``axis``, one scale per index of ``axis``), the scale is
``s = max(m / q, 1e-12)`` -- the floor keeps an all-zero tensor (or slice) free of 0/0 -- and

    fake_quantize(x) = clip(round(x / s), -q, q) * s

``round`` rounds half to even, like ``np.round``: Relax's ``round`` legalizes to TIR
``nearbyint`` (IEEE round-to-nearest-even in the default rounding mode, on every target), and the
fused kernel calls ``nearbyint`` directly. (``tirx.round`` is not used: targets may lower it to
C ``round``, which rounds half away from zero.)

The derivative of fake_quantize is 0 almost everywhere, so training uses a straight-through
estimator (STE) chosen by ``ste``:

    identity: dy          clipped:  dy * (|x| <= q s)
    tanh:     dy * (1 - tanh(x / s)^2)          hardtanh: dy * max(0, 1 - |x| / (q s))

``fake_quantize`` takes the same ``ste`` attribute (default ``identity``): it leaves the forward
unchanged and names the estimator that the op's gradient rule emits, so a training graph picks
its STE where it quantizes.

``q s`` is evaluated as ``max(m, q * 1e-12)``, which equals it exactly in real arithmetic but has no
rounding error: the elements at the maximum sit exactly on the clip boundary, and a rounded
``q * (m / q)`` could land below ``m`` and drop their gradient in ``clipped`` (and make
``hardtanh`` slightly negative there before the max with 0).
"""

from __future__ import annotations

import numpy as np
from tvm import relax, te, tirx

from ..kernels.common import acc_dtype, tensor_dtype
from ..overrides import override_gradient
from ._math import NumpyMath, RelaxMath, TirMath
from .registry import Attr, check_choice, check_int, check_optional, define_op, op_error

BITS = (2, 4, 8)
STES = ("identity", "clipped", "tanh", "hardtanh")
SCALE_FLOOR = 1e-12


def qmax(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def _check_bits(op: str, name: str, v) -> int:
    v = check_int()(op, name, v)
    if v not in BITS:
        raise op_error(op, name, f"one of {list(BITS)}", v)
    return v


_BITS = Attr("bits", check=_check_bits)
_AXIS = Attr("axis", None, check=check_optional(check_int()))


def _ste_factor(ste: str, m, x, s, qs):
    """d fake_quantize / d x as the estimator ``ste`` defines it, given the scale ``s`` and the
    clip boundary ``qs`` (= q s) broadcast against x."""
    if ste == "clipped":
        return m.where(m.le(m.abs(x), qs), m.ones_like(x), m.zeros_like(x))
    if ste == "tanh":
        t = m.tanh(x / s)
        return m.c(1.0) - t * t
    if ste == "hardtanh":
        return m.maximum(m.c(0.0), m.c(1.0) - m.abs(x) / qs)
    raise ValueError(ste)  # identity is handled by the callers: dy passes unchanged


def _reduced_axes(ndim: int, axis: int | None) -> list[int]:
    """The axes ``max|x|`` runs over: all of them, or all but ``axis``."""
    if axis is None:
        return list(range(ndim))
    return [a for a in range(ndim) if a != axis % ndim]


def _infer_x(ctx):
    x = ctx.tensor("x", min_ndim=1)
    if ctx.attrs["axis"] is not None:
        ctx.axis("axis", x.ndim)
    return x


# --------------------------------------------------------------------------------------------
# The scale, in each evaluator
# --------------------------------------------------------------------------------------------


def _np_scale(x, bits, axis):
    """(s, q s) broadcastable against x, in float64."""
    q = qmax(bits)
    m = np.max(np.abs(x), axis=tuple(_reduced_axes(x.ndim, axis)), keepdims=True)
    return np.maximum(m / q, SCALE_FLOOR), np.maximum(m, q * SCALE_FLOOR)


def _relax_scale(bb, x, bits, axis):
    """(x, s, q s) in the accumulation dtype; s and q s keep the reduced axes as size 1."""
    q = qmax(bits)
    dtype = tensor_dtype(x)
    acc = acc_dtype(dtype)
    axes = _reduced_axes(int(x.ty.ndim), axis)
    if acc != dtype:
        x = bb.emit(relax.op.astype(x, acc))  # emitted once: used by the scale and the formula
    m = bb.emit(relax.op.max(relax.op.abs(x), axis=axes, keepdims=True) if axes else relax.op.abs(x))
    s = relax.op.maximum(m / relax.const(q, acc), relax.const(SCALE_FLOOR, acc))
    qs = relax.op.maximum(m, relax.const(q * SCALE_FLOOR, acc))
    return x, s, qs


def _te_absmax(x: te.Tensor, axis: int | None, acc: str):
    """``index of x -> max|x| of its slice``, read from a reduction stage of shape [] (per
    tensor) or [x.shape[axis]] (per axis)."""
    ndim = len(x.shape)
    axes = _reduced_axes(ndim, axis)
    if not axes:  # rank 1 with axis 0: every element is its own slice
        return lambda idx: tirx.abs(x(*idx).astype(acc))
    kept = [a for a in range(ndim) if a not in axes]
    rk = {a: te.reduce_axis((0, x.shape[a]), name=f"r{a}") for a in axes}

    def body(*out_idx):
        pos = dict(zip(kept, out_idx))
        full = [pos[a] if a in pos else rk[a] for a in range(ndim)]
        return te.max(tirx.abs(x(*full).astype(acc)), axis=[rk[a] for a in axes])

    absmax = te.compute([x.shape[a] for a in kept], body, name="absmax")
    return lambda idx: absmax(*[idx[a] for a in kept])


# --------------------------------------------------------------------------------------------
# fake_quantize (forward)
# --------------------------------------------------------------------------------------------

fake_quantize = define_op(
    "fake_quantize",
    inputs=("x",),
    attrs=(_BITS, _AXIS, Attr("ste", "identity", check=check_choice(*STES))),
    backward=False,
    doc="clip(round(x / s), -q, q) * s with a symmetric per-tensor or per-axis scale (docs/operators.md §2). "
    "`ste` only chooses the estimator its gradient uses (fake_quantize_backward).",
)
# Its gradient rule (the STE) is not the derivative of its decomposition (round's derivative), so
# higher-order autodiff keeps the op between levels instead of decomposing it.
fake_quantize.extra["surrogate_gradient"] = True


@fake_quantize.infer
def _fq_infer(ctx):
    x = _infer_x(ctx)
    return ctx.out(x.shape, x.dtype)


@fake_quantize.reference
def _fq_ref(x, *, bits, axis=None, ste="identity"):
    x = np.asarray(x, dtype=np.float64)
    q = qmax(bits)
    s, _ = _np_scale(x, bits, axis)
    return np.clip(np.round(x / s), -q, q) * s  # np.round: half to even


@fake_quantize.decomposition
def _fq_decompose(bb, x, *, bits, axis=None, ste="identity"):
    dtype = tensor_dtype(x)
    xa, s, _ = _relax_scale(bb, x, bits, axis)
    acc = acc_dtype(dtype)
    q = relax.const(qmax(bits), acc)
    level = relax.op.minimum(relax.op.maximum(relax.op.round(xa / s), relax.op.negative(q)), q)
    y = level * s
    return y if acc == dtype else relax.op.astype(y, dtype)


@fake_quantize.fused
def _fq_fused(bb, x, *, bits, axis=None, ste="identity"):
    dtype = tensor_dtype(x)
    acc = acc_dtype(dtype)
    q = qmax(bits)

    def kernel(xt):
        absmax = _te_absmax(xt, axis, acc)

        def body(*i):
            s = tirx.max(absmax(i) / tirx.const(q, acc), tirx.const(SCALE_FLOOR, acc))
            level = tirx.nearbyint(xt(*i).astype(acc) / s)
            level = tirx.min(tirx.max(level, tirx.const(-q, acc)), tirx.const(q, acc))
            return (level * s).astype(dtype)

        return te.compute(xt.shape, body, name="fake_quantize")

    return bb.call_te(kernel, x, primfunc_name_hint=f"rlx_fake_quantize_{bits}bit")


# --------------------------------------------------------------------------------------------
# fake_quantize_backward
# --------------------------------------------------------------------------------------------

fake_quantize_backward = define_op(
    "fake_quantize_backward",
    inputs=("x", "dy"),
    attrs=(_BITS, _AXIS, Attr("ste", "identity", check=check_choice(*STES))),
    doc="Straight-through-estimator gradient of fake_quantize: identity, clipped, tanh or hardtanh (docs/operators.md §2).",
)


@fake_quantize_backward.infer
def _fqb_infer(ctx):
    x = _infer_x(ctx)
    dy = ctx.tensor("dy")
    ctx.same_dtype(x, dy)
    ctx.same_shape(x, dy)
    return ctx.out(x.shape, x.dtype)


@fake_quantize_backward.reference
def _fqb_ref(x, dy, *, bits, axis=None, ste="identity"):
    dy = np.asarray(dy, dtype=np.float64)
    if ste == "identity":
        return dy
    x = np.asarray(x, dtype=np.float64)
    s, qs = _np_scale(x, bits, axis)
    return dy * _ste_factor(ste, NumpyMath(), x, s, qs)


@fake_quantize_backward.decomposition
def _fqb_decompose(bb, x, dy, *, bits, axis=None, ste="identity"):
    if ste == "identity":
        return dy
    dtype = tensor_dtype(x)
    acc = acc_dtype(dtype)
    xa, s, qs = _relax_scale(bb, x, bits, axis)
    dya = dy if acc == dtype else relax.op.astype(dy, acc)
    dx = dya * _ste_factor(ste, RelaxMath(acc), xa, s, qs)
    return dx if acc == dtype else relax.op.astype(dx, dtype)


@fake_quantize_backward.fused
def _fqb_fused(bb, x, dy, *, bits, axis=None, ste="identity"):
    dtype = tensor_dtype(x)
    acc = acc_dtype(dtype)
    q = qmax(bits)
    m = TirMath(acc)

    def kernel(xt, dyt):
        if ste == "identity":
            return te.compute(dyt.shape, lambda *i: dyt(*i), name="fake_quantize_backward")
        absmax = _te_absmax(xt, axis, acc)

        def body(*i):
            mx = absmax(i)
            s = tirx.max(mx / tirx.const(q, acc), tirx.const(SCALE_FLOOR, acc))
            qs = tirx.max(mx, tirx.const(q * SCALE_FLOOR, acc))
            factor = _ste_factor(ste, m, xt(*i).astype(acc), s, qs)
            return (dyt(*i).astype(acc) * factor).astype(dtype)

        return te.compute(xt.shape, body, name="fake_quantize_backward")

    return bb.call_te(kernel, x, dy, primfunc_name_hint=f"rlx_fake_quantize_backward_{ste}")


# --------------------------------------------------------------------------------------------
# Gradient of rlx.fake_quantize: the straight-through estimator its `ste` names
# --------------------------------------------------------------------------------------------


def _fake_quantize_gradient(orig_var, orig_call, output_grad, ctx):
    (x,) = orig_call.args
    return [fake_quantize_backward(x, output_grad, **fake_quantize.call_attrs(orig_call))]


override_gradient(fake_quantize.op_name, _fake_quantize_gradient)
