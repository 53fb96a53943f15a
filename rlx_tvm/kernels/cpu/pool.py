"""The CPU kernel of ``rlx.max_pool2d_backward``: dx plane by plane, no scatter."""

from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import tirx as T_builder

from .. import strategy
from ..common import acc_dtype, clamp_index, tensor_dtype
from ..llvm import has_llvm_intrinsics, prefetch

NEG_INF = float("-inf")


def span(k: int, d: int) -> int:
    """Extent of a dilated kernel."""
    return d * (k - 1) + 1


# Windows per vector, on every target: 8. With 16 (two AVX2 registers) the nine taps of a vector
# spill to the stack; on AVX-512 16 is one register, and still slower than 8.
LANES = 8


def plane_kernel(dtype, acc, n, c, size, out_size, stride, dilation, kernel, pads, hp, llvm=True,
                lanes=LANES) -> tirx.PrimFunc:
    """The CPU kernel of ``rlx.max_pool2d_backward``: one (batch, channel) plane per iteration of the (parallel) plane loop, so
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

    x and dy of the next plane are prefetched along the way, a slice per row of windows and per
    row pair of dx, so that the plane's reads overlap the previous plane's work; with ``llvm``
    only (the target's code generator is LLVM). dx is not cleared with ``memset`` first: every
    element is stored once anyway, and letting the stores fetch their lines is cheaper.
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


@strategy.register("max_pool2d_backward", "cpu-planes", strategy.on_cpu)
def legalize(target, bb, x, dy, geometry):
    """dx of ``x`` [N, C, H, W] by :func:`plane_kernel` for ``geometry`` (``FrameGeometry`` of
    :mod:`rlx_tvm.ops.pool`); written plane by plane as flat arrays, then reshaped."""
    dtype = tensor_dtype(x)
    acc = acc_dtype(dtype)
    n, c = x.ty.shape.values[:2]
    (h, w), out_size, stride, dilation, kernel, pads, (hp, _) = geometry
    func = plane_kernel(dtype, acc, n, c, (h, w), out_size, stride, dilation, kernel, pads, hp, has_llvm_intrinsics(target))
    # The kernel writes each plane of dx as a flat array (the routed dy lands at a flat offset).
    flat = bb.emit(relax.call_tir(bb.add_func(func, "rlx_max_pool2d_backward"), [x, dy],
                                  relax.TensorType([n, c, h * w], acc)))
    out = relax.op.reshape(flat, x.ty.shape)
    return out if acc == dtype else relax.op.astype(out, dtype)
