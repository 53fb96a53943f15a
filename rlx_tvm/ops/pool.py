"""Max-pool backward: ``max_pool2d_backward(x[N,C,H,W], dy[N,C,Ho,Wo]; kernel_size, stride=None
(= kernel_size), padding=0, dilation=1, ceil_mode=False) -> dx`` like x.

Each window sends its dy to the FIRST maximal position in row-major window order (PyTorch's
convention), in the reference, the fused kernel and the decomposition alike; padded positions never
win (not even against an all-negative or -inf input); overlapping windows accumulate. Output
size as PyTorch: ``floor`` or, with ``ceil_mode``, ``ceil`` of ``(H + pads - span) / s`` plus one,
where a last window starting inside the bottom/right padding is dropped. ``padding`` takes an int,
an (h, w) pair or (top, left, bottom, right). Spatial dims must be static; batch and channels may
be symbolic. NaN inputs are not given PyTorch's NaN-wins treatment (a NaN never wins), and a
window lying entirely in padding (only possible with padding > kernel/2, which PyTorch rejects)
sends its dy nowhere.

* Fused kernels: per window its max and then the smallest row-major tap index among the real
  taps equal to it (the result does not depend on the order of evaluation); then dy goes to each
  window's argmax tap. On CPU one kernel does both per (batch, channel) plane, one plane per
  parallel iteration (race-free: a plane has one owner), dx gathered from a per-plane table of
  the windows' winning taps (:mod:`rlx_tvm.kernels.cpu.pool`). On GPU targets (legalized in
  their scope) it is two kernels, the argmax and a gather: for every input position the sum over the windows that
  contain it of dy where it is their argmax tap.
* Decomposition (graph size independent of the window): ``take`` with a constant index map
  gathers every window's taps into [N, C, kh*kw, Ho, Wo]; the winner is the smallest tap index
  (``min``) among the real taps equal to the window max (``max`` over the tap axis); a second
  constant map gathers, for every input position, the dy of the (at most one per tap) windows
  that read it and chose it, and ``sum`` adds them up. x enters only through comparisons, so the
  decomposition's derivative in x is exactly zero, as max-pool's second derivative is. (It
  compares -inf as the most negative finite value, which only matters for a window holding both.)

Also registers the gradient of ``R.nn.max_pool2d`` (NCHW) so that ``relax.transform.Gradient``
emits this op instead of ``relax.grad.max_pool2d_backward`` (which has no gradient of its own).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from tvm import relax, te, tirx

from ..kernels.common import acc_dtype, clamp_index, tensor_dtype
from ..kernels import strategy
from ..kernels.cpu import pool as _cpu  # noqa: F401  (registers the CPU kernel)
from ..overrides import override_gradient
from .conv import check_pair, check_padding, check_window_fits, same_dim, span, static_dims, window_geometry
from .registry import Attr, check_bool, check_optional, define_op

NEG_INF = float("-inf")


def pool_out_size(size: int, before: int, after: int, s: int, d: int, k: int, ceil_mode: bool) -> int:
    room = size + before + after - span(k, d)
    if not ceil_mode:
        return room // s + 1
    out = -(-room // s) + 1
    # PyTorch: the last window must start inside the input or its leading padding.
    if (out - 1) * s >= size + before:
        out -= 1
    return out


def _geometry(a):
    """(stride, per-axis geometry) with the stride defaulting to the kernel size."""
    stride = a["stride"] if a["stride"] is not None else a["kernel_size"]
    return stride, window_geometry(a["padding"], stride, a["dilation"], a["kernel_size"])


max_pool2d_backward = define_op(
    "max_pool2d_backward",
    inputs=("x", "dy"),
    attrs=(
        Attr("kernel_size", check=check_pair),
        Attr("stride", None, check_optional(check_pair)),
        Attr("padding", 0, check_padding),
        Attr("dilation", 1, check_pair),
        Attr("ceil_mode", False, check_bool),
    ),
    doc="Gradient of 2-D max pooling (NCHW): dy to the first maximal position of each window.",
)


@max_pool2d_backward.infer
def _infer(ctx):
    x = ctx.tensor("x", ndim=4)
    dy = ctx.tensor("dy", ndim=4)
    ctx.same_dtype(x, dy)
    ctx.dim_equals(dy, 0, x.dim(0), "batch, x's dim 0")
    ctx.dim_equals(dy, 1, x.dim(1), "channels, x's dim 1")
    size = (x.static_dim(2), x.static_dim(3))
    if None in size:
        raise ctx.error("x", "static spatial dims (input height and width)", f"shape {[str(d) for d in x.shape]}")
    a = ctx.attrs
    stride, geometry = _geometry(a)
    expected = []
    for axis, n, (before, after, s, d, k) in zip("hw", size, geometry):
        check_window_fits(ctx, "kernel_size", axis, n, before, after, k, d)
        expected.append(pool_out_size(n, before, after, s, d, k, a["ceil_mode"]))
    for axis, want in zip((2, 3), expected):
        if dy.static_dim(axis) != want:
            raise ctx.error(
                "dy",
                f"dim {axis} == {want} (the pooled size of input {list(size)} for kernel_size={a['kernel_size']}, "
                f"stride={stride}, padding={a['padding']}, dilation={a['dilation']}, ceil_mode={a['ceil_mode']})",
                f"{dy.dim(axis)} (shape {[str(d) for d in dy.shape]})",
            )
    return ctx.out(x.shape, x.dtype)


def _tap_positions(tap: int, out: int, before: int, s: int, d: int, size: int):
    """Input indices read by kernel tap ``tap`` for each of the ``out`` windows, and which of them
    are inside the input (the others are padding)."""
    pos = tap * d + s * np.arange(out) - before
    return pos, (pos >= 0) & (pos < size)


@max_pool2d_backward.reference
def _reference(x, dy, **attrs):
    a = max_pool2d_backward.normalize_attrs(attrs)
    x = np.asarray(x, np.float64)
    dy = np.asarray(dy, np.float64)
    _, _, h, w = x.shape
    ho, wo = dy.shape[2:]
    _, ((pt, _, sh, dh, kh), (pl, _, sw, dw, kw)) = _geometry(a)
    taps = [(i, j) for i in range(kh) for j in range(kw)]  # row-major window order
    rows = [_tap_positions(i, ho, pt, sh, dh, h) for i in range(kh)]
    cols = [_tap_positions(j, wo, pl, sw, dw, w) for j in range(kw)]
    views, valid = [], []
    for i, j in taps:
        (r, rv), (c, cv) = rows[i], cols[j]
        v = x[:, :, np.clip(r, 0, h - 1)][:, :, :, np.clip(c, 0, w - 1)]
        ok = rv[:, None] & cv[None, :]
        views.append(np.where(ok, v, -np.inf))
        valid.append(np.broadcast_to(ok, v.shape))
    views, valid = np.stack(views), np.stack(valid)
    best = views.max(axis=0)
    candidate = valid & (views == best)
    winner = np.argmax(candidate, axis=0)  # the first True
    dx = np.zeros_like(x)
    for t, (i, j) in enumerate(taps):
        (r, rv), (c, cv) = rows[i], cols[j]
        share = np.where(candidate[t] & (winner == t), dy, 0.0)
        # For a fixed tap the windows read distinct positions: a plain += does not lose updates.
        dx[:, :, r[rv][:, None], c[cv][None, :]] += share[:, :, rv][:, :, :, cv]
    return dx


class FrameGeometry(NamedTuple):
    """A max-pool backward's static geometry, (rows, columns) each: what its kernels are built for."""

    size: tuple
    out_size: tuple
    stride: tuple
    dilation: tuple
    kernel: tuple
    pads: tuple  # (top, left)
    frame: tuple  # the padded frame that holds every window (ceil_mode windows may reach past the padding)


def _frame_geometry(x, dy, kernel_size, stride, padding, dilation) -> FrameGeometry:
    stride = stride if stride is not None else kernel_size
    (sh, sw), (dh, dw), (kh, kw) = stride, dilation, kernel_size
    pt, pl, _, _ = padding
    _, _, h, w = static_dims(x.ty)
    _, _, ho, wo = static_dims(dy.ty)
    hp, wp = (max(pt + h, (ho - 1) * sh + span(kh, dh)), max(pl + w, (wo - 1) * sw + span(kw, dw)))
    return FrameGeometry((h, w), (ho, wo), (sh, sw), (dh, dw), (kh, kw), (pt, pl), (hp, wp))


@max_pool2d_backward.fused
def _fused(bb, x, dy, *, kernel_size, stride, padding, dilation, ceil_mode):
    """The TE kernels below on GPUs; the plane kernel of :mod:`rlx_tvm.kernels.cpu.pool` on CPUs."""
    geometry = _frame_geometry(x, dy, kernel_size, stride, padding, dilation)
    return strategy.build(max_pool2d_backward.name, bb, x, dy, geometry)


@strategy.register("max_pool2d_backward", "te", strategy.on_gpu)
def _te_kernels(target, bb, x, dy, geometry: FrameGeometry):
    """Two TE kernels: the first tap equal to each window's max, then dx as a gather over the
    windows that hold each element. (With the argmax a kernel parameter of the gather, TIR
    lowering does not have to bound the gather's data-dependent reads of an intermediate buffer.)"""
    dtype = tensor_dtype(x)
    acc = acc_dtype(dtype)
    (h, w), (ho, wo), (sh, sw), (dh, dw), (kh, kw), (pt, pl), (hp, wp) = geometry
    n_taps = kh * kw
    neg_inf = tirx.const(NEG_INF, acc)
    # te.max starts from the lowest finite value; the window max must start from -inf so that a
    # window of -inf values still has a maximum that its entries equal.
    window_max = te.comm_reducer(lambda a, b: tirx.max(a, b), lambda t: tirx.const(NEG_INF, t), name="window_max")

    def is_real(y, xx):  # padded-frame coordinates inside the input
        return tirx.all(y >= pt, y < pt + h, xx >= pl, xx < pl + w)

    def argmax_kernel(xt: te.Tensor):
        n, c = xt.shape[:2]

        def frame(b, ch, y, xx):
            # A select of a clamped (always in-bounds) read. Its condition is "the clamp changed
            # nothing", not the bounds themselves: under a bounds condition TVM's simplifier
            # proves the clamp redundant and drops it, and the read that the select evaluates
            # anyway goes out of bounds at the padding.
            yc, xc = clamp_index(y - pt, h), clamp_index(xx - pl, w)
            return tirx.Select(tirx.all(yc == y - pt, xc == xx - pl), xt[b, ch, yc, xc].astype(acc), neg_inf)

        return window_argmax(te.compute((n, c, hp, wp), frame, name="framed"))

    def window_argmax(framed: te.Tensor):
        n, c = framed.shape[:2]
        i, j = te.reduce_axis((0, kh), name="i"), te.reduce_axis((0, kw), name="j")
        best = te.compute(
            (n, c, ho, wo),
            lambda b, ch, oy, ox: window_max(framed[b, ch, oy * sh + i * dh, ox * sw + j * dw], axis=[i, j]),
            name="best",
        )
        i, j = te.reduce_axis((0, kh), name="i"), te.reduce_axis((0, kw), name="j")

        def first(b, ch, oy, ox):
            # The smallest row-major tap index among the real taps equal to the window max.
            y, xx = oy * sh + i * dh, ox * sw + j * dw
            wins = tirx.all(is_real(y, xx), framed[b, ch, y, xx] == best[b, ch, oy, ox])
            tap = (i * kw + j).astype("int32")
            return te.min(tirx.Select(wins, tap, tirx.const(n_taps, "int32")), axis=[i, j])

        return te.compute((n, c, ho, wo), first, name="first_argmax")

    # Windows that can hold a given input row: the ``ry`` windows ending at or before it (span
    # ``(kh-1)*dh + 1``, step ``sh``). Visiting those instead of the ``kh`` taps is cheaper whenever
    # windows overlap little (k3 s2: 2 instead of 3 per axis) and needs no stride-divisibility test.
    ry, rx = -(-span(kh, dh) // sh), -(-span(kw, dw) // sw)
    by_window = ry * rx < kh * kw

    def gather_kernel(winner: te.Tensor, dyt: te.Tensor):
        n, c = dyt.shape[:2]

        def pick(b, ch, oy, ox, i, j, hit):
            # Window (oy, ox), if it exists, sends its dy here when tap (i, j) won it. Clamped
            # reads stay in bounds even where TIR evaluates them before knowing the condition,
            # which says "the clamp changed nothing" instead of stating the bounds (see frame()).
            oyc, oxc = clamp_index(oy, ho), clamp_index(ox, wo)
            mine = tirx.all(hit, oyc == oy, oxc == ox, winner[b, ch, oyc, oxc] == (i * kw + j).astype("int32"))
            return tirx.Select(mine, dyt[b, ch, oyc, oxc].astype(acc), tirx.const(0, acc))

        if by_window:
            r, q = te.reduce_axis((0, ry), name="r"), te.reduce_axis((0, rx), name="q")

            def gather(b, ch, y, xx):
                # Window oy starts at oy*s - p <= y; the input is its tap (y + p - oy*s) / d.
                oy, ox = tirx.floordiv(y + pt, sh) - r, tirx.floordiv(xx + pl, sw) - q
                ty, tx = y + pt - oy * sh, xx + pl - ox * sw  # >= 0 by construction
                i, j = tirx.floordiv(ty, dh), tirx.floordiv(tx, dw)
                hit = tirx.all(i < kh, j < kw, tirx.floormod(ty, dh) == 0, tirx.floormod(tx, dw) == 0)
                return te.sum(pick(b, ch, oy, ox, i, j, hit), axis=[r, q])
        else:
            i, j = te.reduce_axis((0, kh), name="i"), te.reduce_axis((0, kw), name="j")

            def gather(b, ch, y, xx):
                # Window (oy, ox) holds input (y, x) as its tap (i, j) iff y + pt = oy*s + i*d.
                ty, tx = y + pt - i * dh, xx + pl - j * dw
                oy, ox = tirx.floordiv(ty, sh), tirx.floordiv(tx, sw)
                hit = tirx.all(tirx.floormod(ty, sh) == 0, tirx.floormod(tx, sw) == 0)  # oy >= 0 iff ty >= 0
                return te.sum(pick(b, ch, oy, ox, i, j, hit), axis=[i, j])

        total = te.compute((n, c, h, w), gather, name="max_pool2d_dx_acc")
        if acc == dtype:
            return total
        return te.compute(total.shape, lambda *idx: total(*idx).astype(dtype), name="max_pool2d_dx")

    winner = bb.emit(bb.call_te(argmax_kernel, x, primfunc_name_hint="rlx_max_pool2d_argmax"))
    return bb.call_te(gather_kernel, winner, dy, primfunc_name_hint="rlx_max_pool2d_backward")


# --------------------------------------------------------------------------------------------
# Decomposition: gathers with constant index maps, so the graph size does not grow with the window
# --------------------------------------------------------------------------------------------


def _index_maps(h, w, ho, wo, geometry):
    """Constant index maps over the flattened spatial axis (static geometry):

    * ``taps[k, oy, ox]``: the input position read by tap k of window (oy, ox); ``inside`` marks
      the taps that fall on the input rather than on padding (those read position 0);
    * ``windows[p, k]``: the flat (k, oy, ox) entry of the window that reads input position p as
      its tap k; ``has_window`` marks the (p, k) that have one. For a fixed tap distinct windows
      read distinct positions, so the map is well defined and the placement a pure gather.
    """
    (pt, _, sh, dh, kh), (pl, _, sw, dw, kw) = geometry
    n_taps = kh * kw
    taps = np.zeros((n_taps, ho, wo), dtype=np.int64)
    inside = np.zeros((n_taps, ho, wo), dtype=bool)
    windows = np.zeros((h * w, n_taps), dtype=np.int64)
    has_window = np.zeros((h * w, n_taps), dtype=bool)
    for k, (i, j) in enumerate((i, j) for i in range(kh) for j in range(kw)):  # row-major window order
        rows, rows_in = _tap_positions(i, ho, pt, sh, dh, h)
        cols, cols_in = _tap_positions(j, wo, pl, sw, dw, w)
        ok = rows_in[:, None] & cols_in[None, :]
        flat = (rows[:, None] * w + cols[None, :])[ok]
        taps[k][ok] = flat
        inside[k] = ok
        oy, ox = np.nonzero(ok)
        windows[flat, k] = (k * ho + oy) * wo + ox
        has_window[flat, k] = True
    return taps, inside, windows, has_window


@max_pool2d_backward.decomposition
def _decompose(bb, x, dy, *, kernel_size, stride, padding, dilation, ceil_mode):
    dtype = tensor_dtype(x)
    acc = acc_dtype(dtype)
    stride = stride if stride is not None else kernel_size
    n, c = x.ty.shape.values[:2]
    _, _, h, w = static_dims(x.ty)
    _, _, ho, wo = static_dims(dy.ty)
    taps, inside, windows, has_window = _index_maps(h, w, ho, wo, window_geometry(padding, stride, dilation, kernel_size))
    n_taps = taps.shape[0]
    op = relax.op
    # (A nested expression: the block builder binds shared subexpressions, like window, once.)

    # Every window's taps, [N, C, K, Ho, Wo], compared in the accumulation dtype (exact for half
    # types). The index maps are in range by construction (padding reads position 0 and is
    # masked), so take keeps its default mode, whose gradient the project routes to
    # rlx.gather_backward.
    lowest = relax.const(float(np.finfo(acc).min), acc)
    xa = x if acc == dtype else op.astype(x, acc)
    window = op.reshape(op.take(op.reshape(xa, [n, c, h * w]), relax.const(taps.reshape(-1)), axis=2),
                        [n, c, n_taps, ho, wo])
    # Padding holds the lowest value so that it never raises the window max. max starts from the
    # lowest finite value, so -inf is compared as that value too (a window of -inf still gets a
    # winner; only -inf against -max(float) would tie).
    window = op.where(relax.const(inside), op.maximum(window, lowest), lowest)
    best = op.max(window, axis=2, keepdims=True)
    candidate = op.logical_and(op.equal(window, best), relax.const(inside))
    # The first maximal tap: the smallest row-major tap index among the candidates. x enters only
    # through these comparisons, so the derivative in x is exactly zero.
    tap_ids = relax.const(np.arange(n_taps, dtype=np.int32).reshape(n_taps, 1, 1))
    winner = op.min(op.where(candidate, tap_ids, relax.const(n_taps, "int32")), axis=2, keepdims=True)
    g = dy if acc == dtype else op.astype(dy, acc)
    # (broadcast_to explicitly: where's gradient does not reduce broadcast operands)
    g = op.broadcast_to(op.expand_dims(g, 2), [n, c, n_taps, ho, wo])
    share = op.where(op.equal(tap_ids, winner), g, relax.const(0.0, acc))

    # Back to input positions: gather each position's (at most one per tap) shares and sum them.
    gathered = op.take(op.reshape(share, [n, c, n_taps * ho * wo]), relax.const(windows.reshape(-1)), axis=2)
    gathered = op.where(relax.const(has_window.reshape(-1)), gathered, relax.const(0.0, acc))
    dx = op.sum(op.reshape(gathered, [n, c, h, w, n_taps]), axis=4)
    return dx if acc == dtype else op.astype(dx, dtype)


def _keep_fused(call: relax.Call) -> bool:
    x, dy = call.args
    return not (same_dim(x.ty, dy.ty, 0) and same_dim(x.ty, dy.ty, 1))


max_pool2d_backward.extra["keep_fused"] = _keep_fused


# --------------------------------------------------------------------------------------------
# Gradient of R.nn.max_pool2d: relax.transform.Gradient emits max_pool2d_backward
# --------------------------------------------------------------------------------------------

def _max_pool2d_gradient(orig_var, orig_call, output_grad, ctx):
    """d max_pool2d(x) -> rlx.max_pool2d_backward (NCHW, static spatial dims; anything else keeps
    TVM's rule)."""
    attrs = orig_call.attrs
    (x,) = orig_call.args
    if (attrs.layout, attrs.out_layout) != ("NCHW", "NCHW") or None in static_dims(x.ty)[2:]:
        from tvm.relax.op._op_gradient import max_pool2d_grad

        return max_pool2d_grad(orig_var, orig_call, output_grad, ctx)
    return [
        max_pool2d_backward(
            x, output_grad,
            kernel_size=tuple(int(v) for v in attrs.pool_size),
            stride=tuple(int(v) for v in attrs.strides),
            padding=tuple(int(v) for v in attrs.padding),
            dilation=tuple(int(v) for v in attrs.dilation),
            ceil_mode=bool(attrs.ceil_mode),
        )
    ]


override_gradient("relax.nn.max_pool2d", _max_pool2d_gradient)
