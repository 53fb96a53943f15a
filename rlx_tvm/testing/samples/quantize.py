"""Samples of fake_quantize and fake_quantize_backward: per tensor and per axis on every axis
position, every estimator, 2/4/8 bits, on inputs whose scales are exact in every float dtype.

Every ``ste`` of fake_quantize_backward is a surrogate gradient (a straight-through estimator),
not the derivative of fake_quantize (a step function), so the backward cases carry no
finite-difference forward; tests/test_quantize.py checks them against the smooth surrogate each
estimator differentiates.
"""

import numpy as np

from .. import Case

RNG = np.random.default_rng(5)
STES = ("identity", "clipped", "tanh", "hardtanh")


# -- an independent NumPy implementation of operators.md §2, written literally ----------------------------


def spec_scale(x, bits, axis):
    """s = max(max|x| / q, 1e-12), one per tensor or per index of ``axis`` (max over all other axes)."""
    q = 2 ** (bits - 1) - 1
    if axis is None:
        return q, max(np.abs(x).max() / q, 1e-12)
    moved = np.moveaxis(np.abs(x), axis, 0).reshape(x.shape[axis], -1)
    s = np.maximum(moved.max(axis=1) / q, 1e-12)
    shape = [1] * x.ndim
    shape[axis] = x.shape[axis]
    return q, s.reshape(shape)


def spec_fake_quantize(x, bits, axis=None):
    q, s = spec_scale(x, bits, axis)
    return np.clip(np.round(x / s), -q, q) * s  # half to even, as the kernels round


def spec_backward(x, dy, bits, axis=None, ste="identity"):
    q, s = spec_scale(x, bits, axis)
    if ste == "identity":
        return dy
    if ste == "clipped":
        return dy * (np.abs(x) <= q * s)
    if ste == "tanh":
        return dy * (1 - np.tanh(x / s) ** 2)
    return dy * np.maximum(0, 1 - np.abs(x) / (q * s))


# -- inputs -------------------------------------------------------------------------------------------


def quant_input(shape, bits, axis=None, rng=RNG):
    """Random values whose slices (along ``axis``, or the whole tensor) differ in magnitude by
    powers of 4, each with its max|x| an exact multiple of q, so that ``m / q * q == m`` holds in
    every float dtype (the contract's literal ``q*s`` then equals the max exactly), and with no
    element within 2% of a step of a rounding tie (float32 and float64 round alike)."""
    q = 2 ** (bits - 1) - 1
    x = rng.uniform(-1, 1, shape)
    slices = x[None] if axis is None else np.moveaxis(x, axis, 0)  # views: writes go to x
    for k in range(len(slices)):
        part = slices[k, ...]  # a view, also when the slice is a single element
        # max|x| = q * t with t a short dyadic number >= 1/q: exact, and above every other |x| < 1.
        t = 2.0 ** np.ceil(np.log2(1.0 / q)) * (1 + rng.integers(0, 8) / 8)
        part[np.unravel_index(rng.integers(part.size), part.shape)] = rng.choice([-1.0, 1.0]) * q * t
        part *= 4.0 ** (k - len(slices) // 2)
        s = np.abs(part).max() / q
        r = np.abs(part) / s
        near_tie = (np.abs(r - np.floor(r) - 0.5) < 0.02) & (r < q - 1)
        part[near_tie] -= np.sign(part[near_tie]) * 0.05 * s
    return x


CONFIGS = [  # (shape, axis, bits): per tensor, per axis on every axis position, a square matrix
    ((4, 6), None, 8),
    ((4, 6), 0, 4),
    ((4, 6), 1, 2),
    ((2, 3, 4), 1, 8),
    ((2, 3, 4), -1, 4),
    ((5, 5), 0, 2),
    ((5, 5), 1, 8),
    ((7,), 0, 4),  # rank 1 per axis: every element is its own slice
]


def _cases():
    cases = []
    for shape, axis, bits in CONFIGS:
        x = quant_input(shape, bits, axis)
        batch = {"x": 0} if len(shape) > 1 else None
        attrs = {"bits": bits} if axis is None else {"bits": bits, "axis": axis}
        cases.append(Case("fake_quantize", {"x": x}, attrs, batch=batch, label=f"fake_quantize[{shape},{axis},{bits}]"))
    # Every estimator per tensor and per axis (a different per-axis config each), bits cycling.
    for k, ste in enumerate(STES):
        for j, config in enumerate((0, 1 + k)):
            shape, axis, _ = CONFIGS[config]
            bits = (2, 4, 8)[(2 * k + j) % 3]
            x = quant_input(shape, bits, axis)
            attrs = {"bits": bits, "ste": ste} if axis is None else {"bits": bits, "axis": axis, "ste": ste}
            cases.append(Case("fake_quantize_backward", {"x": x, "dy": RNG.standard_normal(shape)}, attrs,
                              batch={"x": 0, "dy": 0}, label=f"fake_quantize_backward[{ste},{shape},{axis},{bits}]"))
    return cases


CASES = _cases()
