"""Samples of max_pool2d_backward (finite differences of an independent NumPy max_pool2d, a naive
per-window definition of its gradient), the operators.md §8 trap inputs (ties, padding, overlapping
windows on large inputs, ceil_mode), and the gradient rule of R.nn.max_pool2d."""

import numpy as np
from tvm import relax

from .. import Case, GradCase
from ._util import pair, pads

RNG = np.random.default_rng(5)


# -- an independent NumPy max_pool2d and its gradient, window by window --------------------------




def pooled_size(size, before, after, k, s, d, ceil_mode):
    """PyTorch's pooled size; with ceil_mode a window starting in the trailing padding is dropped."""
    room = size + before + after - d * (k - 1) - 1
    out = (room + s - 1) // s + 1 if ceil_mode else room // s + 1
    if ceil_mode and (out - 1) * s >= size + before:
        out -= 1
    return out


def pool_windows(shape, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False):
    """For each window (oy, ox): its real (in-input) positions in row-major window order."""
    h, w = shape[2:]
    (kh, kw), (dh, dw) = pair(kernel_size), pair(dilation)
    sh, sw = pair(stride if stride is not None else kernel_size)
    pt, pl, pb, pr = pads(padding)
    ho = pooled_size(h, pt, pb, kh, sh, dh, ceil_mode)
    wo = pooled_size(w, pl, pr, kw, sw, dw, ceil_mode)
    out = {}
    for oy in range(ho):
        for ox in range(wo):
            out[oy, ox] = [(oy * sh - pt + i * dh, ox * sw - pl + j * dw) for i in range(kh) for j in range(kw)
                           if 0 <= oy * sh - pt + i * dh < h and 0 <= ox * sw - pl + j * dw < w]
    return (ho, wo), out


def max_pool2d(x, **attrs):
    (ho, wo), windows = pool_windows(x.shape, **attrs)
    y = np.full(x.shape[:2] + (ho, wo), -np.inf)
    for (oy, ox), pos in windows.items():
        for r, c in pos:
            y[:, :, oy, ox] = np.maximum(y[:, :, oy, ox], x[:, :, r, c])
    return y


def max_pool2d_vjp(x, dy, **attrs):
    """Each window's dy to its first maximal real position (a strict '>' scan in window order)."""
    _, windows = pool_windows(x.shape, **attrs)
    dx = np.zeros_like(x, dtype=np.float64)
    for n in range(x.shape[0]):
        for ch in range(x.shape[1]):
            for (oy, ox), pos in windows.items():
                best = None
                for r, c in pos:
                    if best is None or x[n, ch, r, c] > x[n, ch, best[0], best[1]]:
                        best = (r, c)
                if best is not None:
                    dx[n, ch, best[0], best[1]] += dy[n, ch, oy, ox]
    return dx


# -- cases ----------------------------------------------------------------------------------------


def distinct(*shape):
    """Values 0.1 apart, shuffled: no ties, and finite differences never change an argmax."""
    return RNG.permutation(np.prod(shape)).reshape(shape) * 0.1 - 1.0


def pool_case(label, x, batch=("x", 0), fd=True, **attrs):
    dy = RNG.standard_normal(max_pool2d(x, **attrs).shape)
    spec = None if batch is None else {"x": batch[1], "dy": batch[1]}
    return Case("max_pool2d_backward", {"x": x, "dy": dy}, attrs, batch=spec, label=f"max_pool2d_backward[{label}]",
                forward=(lambda x, a=attrs: max_pool2d(x, **a)) if fd else None, wrt="x")


CASES = [
    pool_case("k2, default stride", distinct(2, 3, 6, 7), kernel_size=2),
    pool_case("k3 s2 p1 ceil_mode", distinct(2, 2, 7, 8), kernel_size=3, stride=2, padding=1, ceil_mode=True),
    pool_case("k3 s1 p1 overlapping, symbolic channels", distinct(1, 3, 6, 6), batch=("x", 1),
              kernel_size=3, stride=1, padding=1),
    pool_case("rect kernel, dilation, 4-tuple padding", distinct(3, 1, 9, 8), kernel_size=(2, 3), stride=(2, 1),
              padding=(1, 0, 0, 1), dilation=(2, 1)),
    # dilated windows visited by window, not by tap (k3 d2 s3: 2x2 candidate windows < 9 taps), ceil_mode
    pool_case("k3 s3 d2 p1 ceil_mode", distinct(1, 2, 11, 10), kernel_size=3, stride=3, padding=1, dilation=2,
              ceil_mode=True),
    pool_case("ties: rounded input", np.round(RNG.standard_normal((2, 2, 6, 6))), fd=False,
              kernel_size=3, stride=2, padding=1),
    # Rows of several 16-window vectors (the CPU kernel's unit), the last one partly past the
    # row's windows; at width 65 the last input column is in no window (wo = 32: two full vectors).
    pool_case("k3 s2 p1, wide rows", distinct(1, 2, 9, 70), fd=False, kernel_size=3, stride=2, padding=1),
    pool_case("k2 s2, wide rows, last column in no window", distinct(2, 1, 4, 65), fd=False, kernel_size=2),
]
CASE_BY_NAME = {c.name: c for c in CASES}


# -- operators.md §8 traps: the trap tests' inputs, also checked like every sample ----------------------


def trap_case(label, x, dy=None, **attrs):
    dy = RNG.standard_normal(max_pool2d(x, **attrs).shape) if dy is None else dy
    return Case("max_pool2d_backward", {"x": x, "dy": dy}, attrs, batch={"x": 0, "dy": 0}, label=label)


_all_negative = -RNG.uniform(1.0, 2.0, (1, 2, 5, 5))
_all_negative[0, 1] = -np.inf
TRAP_CASES = [
    trap_case("ties: constant input", np.full((2, 2, 5, 5), 0.5), kernel_size=3, stride=2, padding=1),
    trap_case("ties: constant input, overlapping", np.zeros((1, 1, 5, 6)), kernel_size=3, stride=1, padding=1),
    trap_case("padding: all negative, one channel all -inf", _all_negative, kernel_size=3, stride=2, padding=1),
    trap_case("overlapping k3 s1 on 2*1*50*50 > 4096 elements", distinct(2, 1, 50, 50), kernel_size=3, stride=1),
    trap_case("ceil_mode", distinct(1, 2, 8, 8), kernel_size=3, stride=2, ceil_mode=True),
    trap_case("ceil_mode drops a window starting in the padding", distinct(1, 1, 5, 5), kernel_size=2, stride=2,
          padding=1, ceil_mode=True),
]
TRAP_BY_NAME = {c.name: c for c in TRAP_CASES}
# Every pool sample the per-op tests check: the trap inputs too.
SAMPLES = CASES + TRAP_CASES


# -- the gradient of R.nn.max_pool2d -------------------------------------------------------------


def pool_loss(square, **attrs):
    def build(x, c):
        y = relax.op.nn.max_pool2d(x, **attrs)
        return relax.op.sum(relax.op.multiply(relax.op.multiply(y, y) if square else y, c))

    return build


POOL_ATTRS = dict(pool_size=3, strides=2, padding=1, ceil_mode=True)
GRAD_X = distinct(2, 2, 6, 7)
# For tests/test_gradients.py (first order float32/float64, Hessian-vector products).
GRAD_CASES = [
    GradCase("max_pool2d k3 s2 p1 ceil (squared)", {"x": GRAD_X, "c": RNG.standard_normal((2, 2, 4, 4))},
             pool_loss(True, **POOL_ATTRS), wrt=["x"]),
]
