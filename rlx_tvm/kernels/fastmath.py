"""Vectorizable float32 transcendentals for the fused kernels.

LLVM lowers tirx.exp / erf / tanh to scalar libm calls (expf, erff, tanhf), which keeps every loop
around them scalar. These are written in plain arithmetic, floor, select and bit casts, all of
which LLVM vectorizes. Float64 (and anything else) keeps the exact intrinsics.
"""

from __future__ import annotations

import math

import tvm
from tvm import tirx

from ..target import has_avx512

_LOG2E = 1.4426950408889634
_LN2_HI = 0.693359375  # ln 2 split so that n * _LN2_HI is exact in float32 for |n| <= 2^9
_LN2_LO = -2.12194440e-4
_EXP_HI = 88.72283935546875  # ln(float32 max): exp overflows above
# The arguments are clamped to [_EXP_LO, _EXP_HI]. At _EXP_LO the result is exactly 0 (2^-159 times
# the polynomial, below half the smallest float32 denormal; exp(x) rounds to 0 from x < -103.98):
# no select is needed for underflow.
_EXP_LO = -110.0


def _f32(v: float):
    return tirx.const(v, "float32")


def _scales_in_hardware() -> bool:
    """Whether the target being compiled for is an LLVM CPU target with AVX-512F, whose
    ``vscalefps`` computes p * 2^n (denormal results included) in one instruction: LLVM lowers
    its ``llvm.ldexp`` intrinsic to it, also on vectors. Elsewhere ``llvm.ldexp`` is a scalar libm
    call, so other targets keep the bit-assembled powers of two."""
    return has_avx512(tvm.target.Target.current(allow_none=True))


def _times_pow2_f32(p, n):
    """p * 2^n for an int32 n in [-252, 254]: ``ldexp`` where the target scales in hardware (about 7
    vector instructions fewer per exp, bit-identical results), else two multiplications by normal
    powers of two (so that the result may be a denormal, or p * 2^128 when that is below float32
    max)."""
    if _scales_in_hardware():
        return tirx.call_llvm_pure_intrin("float32", "llvm.ldexp.f32.i32", p, n)
    h = tirx.shift_right(n, tirx.const(1, "int32"))

    def exponent(k):
        return tirx.reinterpret("float32", tirx.shift_left(k + 127, tirx.const(23, "int32")))

    return (p * exponent(h)) * exponent(n - h)


def _is_nan_f32(x):
    """x is NaN, from its bits: exponent all ones, mantissa not 0. Not tirx.isnan: with it, TVM
    0.27's vectorizer turned the exp loop of causal attention backward (a vector loop right inside
    the parallel loop) back into a scalar one; nor x != x, which TVM's simplifier folds to false.
    (The test also moves off the float pipes.) Unsigned: the same
    test on int32 bits failed LLVM's verifier in some unscheduled attention kernels."""
    magnitude = tirx.bitwise_and(tirx.reinterpret("uint32", x), tirx.const(0x7FFFFFFF, "uint32"))
    return magnitude > tirx.const(0x7F800000, "uint32")


def _nan_passthrough(x, y):
    return tirx.Select(_is_nan_f32(x), x, y)


def _odd_series(x, coefficients):
    """x * (c0 + c1 x^2 + c2 x^4 + ...) in Horner form."""
    x2 = x * x
    acc = _f32(coefficients[-1])
    for c in reversed(coefficients[:-1]):
        acc = acc * x2 + _f32(c)
    return x * acc


# e^r on |r| <= ln2 / 2 as a polynomial of degree 6 (lowest degree first), fitted for this module
# to relative error (least squares with Lawson's reweighting): 1.9e-9 in float64, below 1e-7 when
# evaluated in float32. One multiply-add less than the degree-7 Taylor series it replaces.
_EXP_POLY = (1.0000000005545797, 1.0000000363413992, 0.49999992075012584, 0.16666420086776992,
             0.041668226310695604, 0.008374822840233775, 0.0013836823385086283)


def _reduced_exp(xc, n, scale: float = 1.0):
    """(r, scale * e^r) for r = xc - n ln2 (|r| <= ln2 / 2 for n the integer nearest xc / ln2):
    the range reduction and ``_EXP_POLY`` that both forms of the exponential share."""
    r = xc - n * _f32(_LN2_HI) - n * _f32(_LN2_LO)
    p = _f32(_EXP_POLY[-1] * scale)
    for c in reversed(_EXP_POLY[:-1]):
        p = p * r + _f32(c * scale)
    return r, p


def _exp_in_range_f32(xc, nan_possible: bool = False):
    """exp(xc) for xc in [_EXP_LO, _EXP_HI]: xc = n ln2 + r with |r| <= ln2 / 2, e^r by
    ``_EXP_POLY``, 2^n assembled in the exponent bits. ``nan_possible``: xc may be NaN, and the
    result is then NaN (p is; n is clamped before its conversion to int32, which is undefined for
    NaN: a NaN fails the comparison in max)."""
    n = tirx.floor(xc * _f32(_LOG2E) + _f32(0.5))
    _, p = _reduced_exp(xc, n)
    return _times_pow2_f32(p, (tirx.max(n, _f32(-200.0)) if nan_possible else n).astype("int32"))


# x + 1.5 * 2^23 rounds x (|x| < 2^22) to the nearest integer n, which the sum then holds in its low
# mantissa bits: its bit pattern is that of 1.5 * 2^23 plus n, whose low 9 bits are 0.
_ROUNDING_SHIFTER = 12582912.0
# The nonpositive exponential's polynomial is scaled by 2^36, so that p * 2^36 * 2^n is a normal
# float32 down to n = -159 (x = _EXP_LO): 2^n goes in by an integer add to the exponent bits, and
# one multiplication by 2^-36 rounds a denormal result once.
_EXP_SCALE_BITS = 36


def _exp_nonpositive_in_range_f32(xc, nan_possible: bool = False):
    """exp(xc) for xc in [_EXP_LO, 0], as :func:`_exp_in_range_f32` computes it but with its
    floor, float-to-int conversion, clamp and two multiplications by assembled powers of two
    replaced by the rounding shifter, one integer add of n to the exponent bits of the (scaled)
    polynomial and one multiplication: AVX2 has no ``vscalefps``, and these are the vector pipes
    the exponential is bound by (the outputs are the same bit for bit). Denormal results are
    rounded once,
    as by the two multiplications. ``nan_possible``: a NaN xc must give NaN, which the integer add
    to a NaN's bits need not keep: ``r - r`` (0, or NaN) is added in the final multiply-add."""
    def opaque(v):  # the same value, where TVM's simplifier cannot fold (v + c) - c or v - v
        return tirx.reinterpret("float32", tirx.reinterpret("int32", v))

    shifted = xc * _f32(_LOG2E) + _f32(_ROUNDING_SHIFTER)
    n = opaque(shifted) - _f32(_ROUNDING_SHIFTER)
    scale = 2.0 ** _EXP_SCALE_BITS
    r, p = _reduced_exp(xc, n, scale)
    n_in_exponent = tirx.shift_left(tirx.reinterpret("int32", shifted), tirx.const(23, "int32"))
    y = tirx.reinterpret("float32", tirx.reinterpret("int32", p) + n_in_exponent) * _f32(1.0 / scale)
    return y + (r - opaque(r)) if nan_possible else y


def exp_f32(x):
    """exp(x) for float32, every input (overflow to inf, underflow to 0, NaN passed through)."""
    y = _exp_in_range_f32(tirx.min(tirx.max(x, _f32(_EXP_LO)), _f32(_EXP_HI)))
    y = tirx.Select(x > _f32(_EXP_HI), _f32(float("inf")), y)
    return _nan_passthrough(x, y)


def exp_nonpositive_f32(x, nan: str = "select"):
    """exp(x) for a float32 x <= 0 or NaN (exp(z - max z), exp(-|x|), exp(-z^2)): no overflow to
    handle. How a NaN x comes out (``nan``):

    * ``"select"``: NaN, by a bit test of x and a select after the exponential;
    * ``"clamp"``: NaN, through the lower clamp, written as a select that a NaN fails (LLVM makes it
      the one ``vmaxps``; ``tirx.max`` would turn NaN into the bound): three vector instructions
      fewer than ``"select"``, but x appears twice as often in the expression, which TVM's
      simplifier pays for steeply in nested uses (Mish's tanh of softplus took 90 s to build
      instead of 4): for short arguments such as ``z - max z``;
    * ``"drop"``: a number, for callers whose result takes the NaN from x elsewhere."""
    in_range = _exp_in_range_f32 if _scales_in_hardware() else _exp_nonpositive_in_range_f32
    if nan == "clamp":
        return in_range(tirx.Select(x < _f32(_EXP_LO), _f32(_EXP_LO), x), nan_possible=True)
    y = in_range(tirx.max(x, _f32(_EXP_LO)))
    return _nan_passthrough(x, y) if nan == "select" else y


_ERF_SERIES = [2 / math.sqrt(math.pi) * c for c in (1, -1 / 3, 1 / 10, -1 / 42, 1 / 216, -1 / 1320, 1 / 9360)]


def erf_f32(x):
    """erf(x) for float32: its Taylor series for |x| < 0.5 (relative error ~1e-9), Abramowitz &
    Stegun 7.1.26 above (absolute error <= 1.5e-7, where erf(x) > 0.52)."""
    ax = tirx.abs(x)
    t = _f32(1.0) / (_f32(1.0) + _f32(0.3275911) * ax)
    poly = _f32(1.061405429)
    for a in (-1.453152027, 1.421413741, -0.284496736, 0.254829592):
        poly = poly * t + _f32(a)
    tail = _f32(1.0) - poly * t * exp_f32(-(x * x))
    y = tirx.Select(x < _f32(0.0), -tail, tail)
    return _nan_passthrough(x, tirx.Select(ax < _f32(0.5), _odd_series(x, _ERF_SERIES), y))


# erfc(z) = t exp(-z^2) R(t) with t = 1 / (1 + z / 2), z >= 0: R, a polynomial in t (highest
# degree first), fitted for this module to relative error (weighted least squares, Lawson's
# reweighting) on z in [0, 9.5], beyond which exp(-z^2) is below float32's normal range; its
# relative error there is below 2e-8 in float64.
_ERFC_R = (0.013851472230597002, -0.1316136351733736, 0.44816765856361257, -0.6950425172641383,
           0.4414772272371197, -0.10879078162871499, 0.22901708749233368, 0.23793506530225883,
           0.28293780113853506, 0.28206060468891825)


def normal_cdf_f32(z, exp_neg_z2):
    """(1 + erf(z)) / 2 for float32 (the normal CDF at sqrt(2) z) from ``exp_neg_z2`` = exp(-z^2),
    which GELU's derivative needs anyway: erfc(|z|) / 2 below zero, 1 - erfc(z) / 2 above, with
    erfc in the form above. Unlike (1 + erf(z)) / 2, the lower tail keeps its relative accuracy
    (1 + erf(z) cancels to nothing there), and there is no second branch near zero."""
    t = _f32(1.0) / (_f32(1.0) + _f32(0.5) * tirx.abs(z))
    r = _f32(_ERFC_R[0])
    for c in _ERFC_R[1:]:
        r = r * t + _f32(c)
    half_erfc = _f32(0.5) * (t * r * exp_neg_z2)
    return tirx.Select(z < _f32(0.0), half_erfc, _f32(1.0) - half_erfc)


_TANH_SERIES = (1.0, -1 / 3, 2 / 15, -17 / 315, 62 / 2835)


def tanh_f32(x):
    """tanh(x) for float32: sign(x) (1 - e) / (1 + e) with e = exp(-2|x|) (no overflow), its Taylor
    series for |x| < 0.125 where that form would lose digits."""
    e = exp_nonpositive_f32(_f32(-2.0) * tirx.abs(x))
    y = (_f32(1.0) - e) / (_f32(1.0) + e)
    y = tirx.Select(x < _f32(0.0), -y, y)
    return _nan_passthrough(x, tirx.Select(tirx.abs(x) < _f32(0.125), _odd_series(x, _TANH_SERIES), y))


def _is_f32(x) -> bool:
    dtype = x.dtype if isinstance(x, tvm.te.TensorSlice) else x.ty  # a PrimExpr carries its type
    return str(dtype) == "float32"


def tir_exp(x):
    return exp_f32(x) if _is_f32(x) else tirx.exp(x)


def tir_exp_nonpositive(x, nan: str = "select"):
    """exp(x) where x <= 0 or NaN by construction (cheaper in float32: no overflow check; ``nan``
    as in :func:`exp_nonpositive_f32`)."""
    return exp_nonpositive_f32(x, nan) if _is_f32(x) else tirx.exp(x)


def tir_erf(x):
    return erf_f32(x) if _is_f32(x) else tirx.erf(x)


def tir_tanh(x):
    return tanh_f32(x) if _is_f32(x) else tirx.tanh(x)


def tir_sigmoid(x):
    if not _is_f32(x):
        return tirx.sigmoid(x)
    # 1 / (1 + e^-x) for x >= 0, e^x / (1 + e^x) below: neither side overflows.
    e = exp_nonpositive_f32(-tirx.abs(x), nan="clamp")
    return tirx.Select(x >= _f32(0.0), _f32(1.0) / (_f32(1.0) + e), e / (_f32(1.0) + e))
