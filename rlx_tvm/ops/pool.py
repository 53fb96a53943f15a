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
  the windows' winning taps (``_cpu_kernel``). On GPU targets (legalized in their scope) it is
  two kernels, the argmax and a gather: for every input position the sum over the windows that
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

import numpy as np
import tvm
from tvm import relax, te, tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import tirx as T_builder

from ..kernels.llvm import has_llvm_intrinsics, prefetch
from ..overrides import override_gradient
from ._math import acc_dtype, clamp_index, tensor_dtype
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


@max_pool2d_backward.fused
def _fused(bb, x, dy, *, kernel_size, stride, padding, dilation, ceil_mode):
    dtype = tensor_dtype(x)
    acc = acc_dtype(dtype)
    stride = stride if stride is not None else kernel_size
    (sh, sw), (dh, dw), (kh, kw) = stride, dilation, kernel_size
    pt, pl, _, _ = padding
    _, _, h, w = static_dims(x.ty)
    _, _, ho, wo = static_dims(dy.ty)
    n_taps = kh * kw
    # A padded frame that holds every window (ceil_mode windows may reach past the padding).
    hp, wp = (max(pt + h, (ho - 1) * sh + span(kh, dh)), max(pl + w, (wo - 1) * sw + span(kw, dw)))
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

    target = tvm.target.Target.current(allow_none=True)
    if target is not None and "gpu" in target.keys:
        # Two kernels: with the argmax a kernel parameter of the gather, TIR lowering does not
        # have to bound the gather's data-dependent reads of an intermediate buffer.
        winner = bb.emit(bb.call_te(argmax_kernel, x, primfunc_name_hint="rlx_max_pool2d_argmax"))
        return bb.call_te(gather_kernel, winner, dy, primfunc_name_hint="rlx_max_pool2d_backward")
    n, c = x.ty.shape.values[:2]
    llvm = has_llvm_intrinsics(target)
    kernel = _cpu_kernel(dtype, acc, n, c, (h, w), (ho, wo), (sh, sw), (dh, dw), (kh, kw), (pt, pl), hp, llvm)
    # The kernel writes each plane of dx as a flat array (the routed dy lands at a flat offset).
    flat = bb.emit(relax.call_tir(bb.add_func(kernel, "rlx_max_pool2d_backward"), [x, dy],
                                  relax.TensorType([n, c, h * w], acc)))
    out = relax.op.reshape(flat, x.ty.shape)
    return out if acc == dtype else relax.op.astype(out, dtype)


# Windows per vector, on every target: 8. On AVX2 (znver3) 16 (two registers) spilled the nine taps
# of a vector to the stack and, at 56 windows a row, computed 8 windows more than 8 lanes do; on
# AVX-512 (znver4), where 16 is one register, 16 was still slower than 8 (2.65 vs 2.39 ms for the
# suite's shape, 4 lanes 2.72: a row's interleaved store of 16 elements is one register there).
LANES = 8


def _cpu_kernel(dtype, acc, n, c, size, out_size, stride, dilation, kernel, pads, hp, llvm=True,
                lanes=LANES) -> tirx.PrimFunc:
    """The CPU kernel: one (batch, channel) plane per iteration of the (parallel) plane loop, so
    that planes are race-free, and within a plane:

    1. a padded frame of x, split by column phase (``frame[y, p, k]`` holds padded column
       ``k*sw + p``), so that each tap reads consecutive elements for consecutive windows
       (stride-free vector loads); NaN marks the padding, which never compares equal or greater;
    2. per row of windows, in vectors of ``lanes`` windows: the max over the taps, then the first
       tap equal to it (the ``min`` of the equal taps' ids): two passes whose dependency chains
       are one ``max`` and one integer ``min`` per tap (a one-pass running argmax was 1.5x
       slower, latency-bound); each window's winning tap and its dy go to two small per-plane
       tables, with a border of windows that do not exist (no tap wins there);
    3. dx, element by element, as the sum of dy over the windows that hold the element and chose
       it: split by phase like the frame (padded row ``ny*sh + py``, column ``nx*sw + px``), the
       windows holding an element and the tap it is to each are constants of its phase, so that
       each element is a few compares of the tables' neighbouring entries against constants. With
       ``llvm``, a row goes by vectors of ``lanes`` nx per phase, interleaved by a shuffle into
       one store of consecutive dx. No scatter: windows that overlap add up in registers, not
       through memory, and every element of dx is written once, with plain stores.

    x of the next plane is prefetched along the way, a slice per row of windows and per row pair
    of dx (about 10% faster at (8, 64, 112, 112): the plane's reads then overlap the previous
    plane's work), and so is its dy (5% faster on znver4: its copy into the table had waited on
    memory, 14% of the kernel's samples under ``perf``); with ``llvm`` only (the target's code
    generator is LLVM). Clearing each plane of dx first with ``memset`` (``_llvm.zero_bytes``),
    which claims its cache lines without reading them, was 15% slower than letting the stores
    read them (znver3, 2 threads): it is not done. Against the kernel this replaced (dy scattered
    to the winners, a memset'ed plane, 16 lanes): 3.4-3.7 ms vs 3.7-4.1 ms at (8, 64, 112, 112), 71-73% vs 57-63% of the copy bandwidth
    (znver3, 2 threads); 2.31-2.39 vs 2.49-2.54 ms on znver4 (with 8 lanes; 16 took 2.65).
    Written as TIR, not TE: the frame layout, the per-vector state and the phase-split tables are
    not expressible as TE stages that a schedule could vectorize. NaN inputs never win either (a
    window of NaN routes nowhere), nor does padding."""
    (h, w), (ho, wo), (sh, sw), (dh, dw), (kh, kw), (pt, pl) = size, out_size, stride, dilation, kernel, pads
    # Symbolic batch/channels: kernel-local vars, bound from the buffers.
    n = _i64(n) if isinstance(n, (int, tirx.IntImm)) else tirx.Var("n", "int64")
    c = _i64(c) if isinstance(c, (int, tirx.IntImm)) else tirx.Var("c", "int64")
    n_vec = -(-wo // lanes)
    wq = n_vec * lanes + (kw - 1) * dw // sw  # a phase row holds every tap of every lane
    line = 512 // tvm.DataType(dtype).bits  # elements per 64-byte cache line
    nan, lowest = tirx.const(float("nan"), acc), tirx.const(NEG_INF, acc)
    none = tirx.const(2**31 - 1, "int32")  # no tap of the window equals its max

    def inside_columns(count):
        # [lo, hi): the column groups g < count (padded columns g*sw + p, every phase p) that lie
        # wholly inside the input: g*sw + p - pl >= 0 for p = 0 and < w for p = sw - 1.
        lo = min(-(-pl // sw), count)
        return lo, max(lo, min((w + pl - sw) // sw + 1, count))

    k_lo, k_hi = inside_columns(wq)  # of the frame's columns k
    # Step 3's phase split: padded row ny*sh + py (and column nx*sw + px) over the input; window
    # ny - r (r < ry) is the only kind that can hold it.
    ry, rx = -(-span(kh, dh) // sh), -(-span(kw, dw) // sw)
    ny_n, nx_n = (pt + h - 1) // sh + 1, (pl + w - 1) // sw + 1
    ho_live, wo_live = min(ho, ny_n), min(wo, nx_n)  # windows past these hold no input: they route nowhere
    # x and dy of the next plane, a slice per row of windows (step 2) and per row pair of dx (step 3):
    # spread over both passes, so that the reads do not come in bursts.
    steps = ho_live + ny_n
    prefetch_lines = [-(-(h * w) // (line * steps)), -(-(ho * wo) // (line * steps))]  # of x, of dy
    # The tables: window (oy, ox) at [oy + ry - 1, ox + rx - 1], a border of none around them.
    rows_t, cols_t = ny_n + ry - 1, max(nx_n, n_vec * lanes) + rx - 1
    nx_lo, nx_hi = inside_columns(nx_n)  # of dx's column groups nx

    def holds(py, r, px, q):
        # Whether window (ny - r, nx - q) holds padded (ny*sh + py, nx*sw + px), and as which tap:
        # tap ((py + r*sh) / dh, (px + q*sw) / dw) when both divide and fall inside the window.
        ty, tx = py + r * sh, px + q * sw
        inside = tirx.all(tirx.floormod(ty, dh) == 0, tirx.floordiv(ty, dh) < kh,
                          tirx.floormod(tx, dw) == 0, tirx.floordiv(tx, dw) < kw)
        return inside, (tirx.floordiv(ty, dh) * kw + tirx.floordiv(tx, dw)).astype("int32")

    def routed(taps, dys, ny, py, nx, px):
        # dx at padded (ny*sh + py, nx*sw + px). py and px are unrolled loop variables: after
        # unrolling, ``inside`` and the taps fold to constants.
        total = tirx.const(0, acc)
        for r in range(ry):
            for q in range(rx):
                inside, tap = holds(py, r, px, q)
                at = (ny - r + ry - 1, nx - q + rx - 1)
                total = total + tirx.Select(tirx.all(inside, taps[at] == tap), dys[at], tirx.const(0, acc))
        return total

    def routed_vector(taps, dys, ny, py, nx):
        # ``routed`` for nx .. nx + lanes - 1 and every column phase, as one vector in dx order
        # (phases interleaved by a shuffle). Vector selects stay selects; in scalar code x86's
        # cmov conversion turns the select of a load into a branch, mispredicted on random data.
        zero = tirx.Broadcast(tirx.const(0, acc), lanes)
        phases = []
        for px in range(sw):
            total = zero
            for r in range(ry):
                for q in range(rx):
                    inside, tap = holds(py, r, px, q)
                    at = [ny - r + ry - 1, tirx.Ramp(nx - q + rx - 1, 1, lanes)]
                    chose = tirx.BufferLoad(taps, at) == tirx.Broadcast(tap, lanes)
                    total = total + tirx.Select(inside, tirx.Select(chose, tirx.BufferLoad(dys, at), zero), zero)
            phases.append(total)
        return tirx.Shuffle(phases, [(e % sw) * lanes + e // sw for e in range(lanes * sw)])

    # Rows of dx by vectors of ``lanes`` nx (the last one overlapping its predecessor rather than
    # leaving a scalar remainder: its elements are written twice, with the same values).
    # The edges (columns nx < nx_lo or >= nx_hi, where some phases fall outside the input) come
    # from one vector each, at either end of the row, lanes picked by a copy; scalar code would
    # branch (see ``routed_vector``). Narrow planes and non-LLVM targets: scalar code throughout.
    vector_rows = llvm and nx_hi - nx_lo >= lanes and nx_lo <= lanes and nx_n - nx_hi <= lanes
    n_blocks = -(-(nx_hi - nx_lo) // lanes)

    # The frame's copy by vectors of ``lanes`` k (the last one overlapping, as above): one load of
    # ``lanes * sw`` consecutive x, split into its phases by shuffles. (LLVM vectorized the
    # scalar loop as well, but left a scalar remainder as long as the vector part.)
    vector_frame = llvm and k_hi - k_lo >= lanes
    n_frame_blocks = -(-(k_hi - k_lo) // lanes)

    def split_phases(frame, x, vb, vc, y, k):
        row = tirx.BufferLoad(x, [vb, vc, y, tirx.Ramp(k * sw - pl, 1, lanes * sw)])
        if acc != dtype:
            row = tirx.Cast(tvm.DataType(acc).with_lanes(lanes * sw), row)
        for p in range(sw):  # emitted into the kernel by the script parser's IR builder
            T_builder.buffer_store(frame, tirx.Shuffle([row], [p + sw * l for l in range(lanes)]),
                                   [pt + y, p, tirx.Ramp(k, 1, lanes)])

    def prefetch_next_plane(x, dy, vb, vc, step):
        # Slice ``step`` of the next plane's x and dy.
        plane = T.min(vb * c + vc + 1, n * c - 1)
        for buf, lines in zip((x, dy), prefetch_lines):
            rows, cols = buf.shape[2:]
            for q in range(lines):
                e = T.min((step * lines + q) * line, rows * cols - 1)
                T_builder.evaluate(prefetch(tirx.address_of(tirx.BufferLoad(buf, [plane // c, plane % c, e // cols, e % cols]))))

    @T.prim_func(private=True, s_tir=True)
    def kernel(x_h: T.handle, dy_h: T.handle, dx_h: T.handle):
        # Scheduled as written (the plane loop parallel): dlight's rules would only fuse and
        # parallelize it, and after their rewrite TVM 0.27's CompactBufferAllocation gets the
        # regions of the vector (Ramp) accesses wrong, and lowering fails.
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        x = T.match_buffer(x_h, (n, c, h, w), dtype)
        dy = T.match_buffer(dy_h, (n, c, ho, wo), dtype)
        dx = T.match_buffer(dx_h, (n, c, h * w), acc)
        for plane in T.parallel(n * c):
            with T.sblock("route"):
                vb = T.axis.spatial(n, plane // c)
                vc = T.axis.spatial(c, plane % c)
                T.reads(x[vb, vc, 0:h, 0:w], dy[vb, vc, 0:ho, 0:wo])
                T.writes(dx[vb, vc, 0:h * w])
                frame = T.sblock_alloc_buffer((hp, sw, wq), acc)
                best = T.sblock_alloc_buffer((lanes,), acc)
                first = T.sblock_alloc_buffer((lanes,), "int32")
                taps = T.sblock_alloc_buffer((rows_t, cols_t), "int32")  # each window's winning tap
                dys = T.sblock_alloc_buffer((rows_t, cols_t), acc)  # and its dy
                edge = T.sblock_alloc_buffer((lanes * sw,), acc)  # a vector of dx at an edge of a row
                # The frame: NaN on the border, x inside. Padded column k*sw + p is input column
                # k*sw + p - pl; for k in [k_lo, k_hi) that is inside the input for every phase p
                # (a plain copy, phases innermost: LLVM loads consecutive x and splits it), the
                # few columns outside that range take a select of a clamped read.
                for y, p, k in T.grid(pt, sw, wq):
                    frame[y, p, k] = nan
                for y, p, k in T.grid(hp - pt - h, sw, wq):
                    frame[pt + h + y, p, k] = nan
                for y in range(h):
                    for p, k in T.grid(sw, k_lo):
                        frame[pt + y, p, k] = T.Select(
                            clamp_index(k * sw + p - pl, w) == k * sw + p - pl,
                            T.cast(x[vb, vc, y, clamp_index(k * sw + p - pl, w)], acc), nan)
                    if vector_frame:
                        for blk in range(n_frame_blocks):
                            split_phases(frame, x, vb, vc, y, T.min(k_lo + blk * lanes, k_hi - lanes))
                    else:
                        for p, k in T.grid(sw, k_hi - k_lo):
                            frame[pt + y, p, k_lo + k] = T.cast(x[vb, vc, y, (k_lo + k) * sw + p - pl], acc)
                    for p, k in T.grid(sw, wq - k_hi):
                        frame[pt + y, p, k_hi + k] = T.Select(
                            clamp_index((k_hi + k) * sw + p - pl, w) == (k_hi + k) * sw + p - pl,
                            T.cast(x[vb, vc, y, clamp_index((k_hi + k) * sw + p - pl, w)], acc), nan)
                # The tables' border (rows and columns of windows that do not exist) and dy.
                for yy in range(rows_t):
                    if yy < ry - 1 or yy >= ry - 1 + ho_live:
                        for xx in range(cols_t):
                            taps[yy, xx] = none
                            dys[yy, xx] = T.cast(0, acc)
                    else:
                        for xx in range(rx - 1):
                            taps[yy, xx] = none
                            dys[yy, xx] = T.cast(0, acc)
                        for xx in range(wo_live):
                            dys[yy, rx - 1 + xx] = T.cast(dy[vb, vc, yy - (ry - 1), xx], acc)
                        for xx in range(cols_t - (rx - 1) - wo_live):
                            dys[yy, rx - 1 + wo_live + xx] = T.cast(0, acc)
                        for xx in range(cols_t - (rx - 1) - n_vec * lanes):
                            taps[yy, rx - 1 + n_vec * lanes + xx] = none
                for oy in range(ho_live):
                    if llvm:
                        prefetch_next_plane(x, dy, vb, vc, oy)
                    for v in range(n_vec):
                        # (No let-bound values inside the vector loops: TVM 0.27's vectorizer
                        # gets them wrong; each tap's frame element is spelled out instead.)
                        for l in T.vectorized(lanes):
                            best[l] = lowest
                            first[l] = none
                        for i, j in T.grid(kh, kw):
                            for l in T.vectorized(lanes):
                                best[l] = T.Select(frame[oy * sh + i * dh, j * dw % sw, v * lanes + l + j * dw // sw] > best[l],
                                                   frame[oy * sh + i * dh, j * dw % sw, v * lanes + l + j * dw // sw], best[l])
                        for i, j in T.grid(kh, kw):
                            for l in T.vectorized(lanes):
                                first[l] = T.min(first[l], T.Select(
                                    frame[oy * sh + i * dh, j * dw % sw, v * lanes + l + j * dw // sw] == best[l],
                                    T.int32(i * kw + j), none))
                        for l in T.vectorized(lanes):
                            # Lanes past the last live window: none (a lane past ``wo`` may
                            # still see real input columns).
                            taps[ry - 1 + oy, rx - 1 + v * lanes + l] = T.Select(v * lanes + l < wo_live, first[l], none)
                for ny in range(ny_n):
                    if llvm:
                        prefetch_next_plane(x, dy, vb, vc, ho_live + ny)
                    for py in T.unroll(sh):
                        # (Indices clamped under their guards, so that bounds checks see them in range.)
                        if pt <= ny * sh + py and ny * sh + py < pt + h:
                            if vector_rows:
                                if nx_lo > 0:  # the left edge: the lanes of a vector at nx = 0 that fall inside
                                    edge[T.Ramp(0, 1, lanes * sw)] = routed_vector(taps, dys, ny, py, 0)
                                    for e in range(nx_lo * sw - pl):
                                        dx[vb, vc, clamp_index(ny * sh + py - pt, h) * w + e] = edge[pl + e]
                                for blk in range(n_blocks):
                                    dx[vb, vc, T.Ramp(clamp_index(ny * sh + py - pt, h) * w + T.min(nx_lo + blk * lanes, nx_hi - lanes) * sw - pl,
                                                      1, lanes * sw)] = routed_vector(
                                        taps, dys, ny, py, T.min(nx_lo + blk * lanes, nx_hi - lanes))
                                if nx_hi < nx_n:  # the right edge, from a vector at nx = nx_n - lanes
                                    edge[T.Ramp(0, 1, lanes * sw)] = routed_vector(taps, dys, ny, py, nx_n - lanes)
                                    for e in range(w - (nx_hi * sw - pl)):
                                        dx[vb, vc, clamp_index(ny * sh + py - pt, h) * w + nx_hi * sw - pl + e] = edge[(nx_hi - nx_n + lanes) * sw + e]
                            else:
                                for nx in range(nx_n):
                                    for px in T.unroll(sw):
                                        if pl <= nx * sw + px and nx * sw + px < pl + w:
                                            dx[vb, vc, clamp_index(ny * sh + py - pt, h) * w + clamp_index(nx * sw + px - pl, w)] = routed(
                                                taps, dys, ny, py, nx, px)

    return kernel


def _i64(v):
    return tirx.IntImm("int64", int(v)) if isinstance(v, (int, tirx.IntImm)) else v


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
