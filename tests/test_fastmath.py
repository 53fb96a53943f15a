"""The vectorizable float32 exp / erf / tanh / sigmoid of the fused kernels, against float64 NumPy
over their whole range, the float32 edge values and the special values, built for a generic
x86-64 target (powers of two assembled in the exponent bits) and for this machine (``vscalefps``
where it has AVX-512); the check that a fused kernel using them no longer calls libm's scalar
functions; and that kernels TVM legalizes get them too (``VectorizableTranscendentals``)."""

import math
import re

import numpy as np
import pytest
import tvm
from tvm import te

from rlx_tvm.kernels import fastmath as _math
from rlx_tvm.target import cpu_target

from .helpers import tensor_var

F32_MAX = float(np.finfo(np.float32).max)
DENORMAL = float(np.finfo(np.float32).smallest_subnormal)


def _inputs() -> np.ndarray:
    rng = np.random.default_rng(0)
    xs = np.concatenate([
        np.linspace(-110, 95, 1 << 16),
        rng.standard_normal(1 << 16) * 3,
        np.logspace(-30, 0, 4096), -np.logspace(-30, 0, 4096),
        [88.0, 88.72, 88.7228, 88.723, 89.0, -87.3, -87.4, -103.0, -104.0, -105.0, 0.5, -0.5, 0.125, -0.125],
        [0.0, -0.0, np.inf, -np.inf, np.nan],
    ]).astype(np.float32)
    # NaNs with payloads (quiet, signaling, negative): the exponent-bit arithmetic must not make
    # a number of one
    payloads = np.array([0x7FC000FF, 0x7F800001, 0xFFC00001, 0x7FC0007F, 0xFFFFFFFF], np.uint32)
    return np.concatenate([xs, payloads.view(np.float32)])


# The two ways of scaling by 2^n: generic x86-64 (no AVX-512) and the machine the tests run on
# (on an AVX-512 machine, like the benchmark's, llvm.ldexp, which LLVM lowers to vscalefps).
TARGETS = {"generic": lambda: tvm.target.Target("llvm"), "host": cpu_target}


def _stage(x, name, fn):
    return te.compute(x.shape, lambda i: fn(x[i]), name=name)


def _build(stages, target: tvm.target.Target):
    """Build the elementwise ``stages`` (name -> function of a TIR float32 value) of one float32
    input; the expressions are made under ``target``, as the fused kernels' are."""
    with target:
        n = te.var("n")
        x = te.placeholder((n,), "float32", name="x")
        outs = [_stage(x, name, fn) for name, fn in stages.items()]
    return tvm.compile(tvm.IRModule({"main": te.create_prim_func([x, *outs])}), target=target)


def _evaluate(xs: np.ndarray, target: tvm.target.Target) -> dict[str, np.ndarray]:
    fns = {"exp": _math.exp_f32, "erf": _math.erf_f32, "tanh": _math.tanh_f32, "sigmoid": _math.tir_sigmoid}
    f = _build(fns, target)
    results = [tvm.runtime.empty(xs.shape, "float32") for _ in fns]
    f(tvm.runtime.tensor(xs), *results)
    return {name: r.numpy().astype(np.float64) for name, r in zip(fns, results)}


def test_exp_scales_with_vscalefps_on_avx512_only():
    """The exponential's 2^n: one vscalefps per vector where the target has AVX-512 (about 7 vector
    instructions fewer), the exponent-bit assembly elsewhere; never a libm call (LLVM's ldexp
    is a scalar ldexpf call without AVX-512)."""
    for mcpu, scalef in (("znver4", True), ("skylake-avx512", True), ("haswell", False)):
        target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu})
        with target:
            uses_ldexp = _math._scales_in_hardware()
        asm = _build({"exp": _math.exp_f32}, target).mod.inspect_source("asm")
        assert uses_ldexp == scalef and ("vscalefps" in asm) == scalef, mcpu
        assert not re.search(r"call\w*\s+\S*(ldexp|exp)f?\b", asm), mcpu
    assert not _math._scales_in_hardware()  # no target: the portable form


@pytest.mark.parametrize("target", TARGETS)
def test_float32_transcendentals_match_float64(target):
    xs = _inputs()
    got = _evaluate(xs, TARGETS[target]())
    x = xs.astype(np.float64)
    with np.errstate(all="ignore"):
        ref = {
            "exp": np.exp(x),
            "erf": np.vectorize(math.erf, otypes=[np.float64])(x),
            "tanh": np.tanh(x),
            "sigmoid": 1.0 / (1.0 + np.exp(-x)),
        }
    # (relative tolerance, absolute tolerance) per function
    budget = {"exp": (3e-7, 0.0), "erf": (1e-6, 4e-7), "tanh": (4e-7, 1.5e-7), "sigmoid": (3e-7, 1e-7)}
    for name, (rtol, atol) in budget.items():
        g, r = got[name], ref[name]
        nan = np.isnan(x)
        assert np.isnan(g[nan]).all(), f"{name}: NaN input must give NaN"
        overflow = r > F32_MAX
        assert (g[overflow] == np.inf).all(), f"{name}: overflow must give inf"
        ok = ~nan & ~overflow
        if name == "exp":  # denormal results: within two denormal steps
            tiny = ok & (r < float(np.finfo(np.float32).tiny))
            assert np.all(np.abs(g[tiny] - r[tiny]) <= 2 * DENORMAL), "exp: denormal range"
            ok &= ~tiny
        err = np.abs(g[ok] - r[ok])
        bad = err > atol + rtol * np.abs(r[ok])
        assert not bad.any(), f"{name}: max error {err.max():.3g} at x={xs[ok][bad][:5]}"
    assert got["exp"][xs == -np.inf].item() == 0.0 and got["exp"][xs == np.inf].item() == np.inf
    assert got["erf"][xs == np.inf].item() == 1.0 and got["tanh"][xs == -np.inf].item() == -1.0
    assert got["sigmoid"][xs == -np.inf].item() == 0.0 and got["sigmoid"][xs == np.inf].item() == 1.0


@pytest.mark.parametrize("target", TARGETS)
def test_float32_normal_cdf_and_nonpositive_exp_match_float64(target):
    """GELU's float32 CDF (1 + erf(z)) / 2 from exp(-z^2) and the exponential of an argument
    <= 0, in each of its ways with NaN, against float64 erfc / exp: relative accuracy in the lower
    tail too, down to where the result leaves float32's normal range (1 + erf(z) cancels to
    nothing there)."""
    xs = _inputs()
    modes = ("select", "clamp", "drop")
    stages = {"cdf": lambda v: _math.normal_cdf_f32(v, _math.exp_nonpositive_f32(-(v * v)))}
    stages.update({mode: (lambda v, mode=mode: _math.exp_nonpositive_f32(-tvm.tirx.abs(v), nan=mode)) for mode in modes})
    f = _build(stages, TARGETS[target]())
    outs = [tvm.runtime.empty(xs.shape, "float32") for _ in stages]
    f(tvm.runtime.tensor(xs), *outs)
    got = dict(zip(stages, (o.numpy().astype(np.float64) for o in outs)))
    got_cdf = got["cdf"]
    z = xs.astype(np.float64)
    real = ~np.isnan(z)
    with np.errstate(all="ignore"):
        ref_cdf = 0.5 * np.vectorize(math.erfc, otypes=[np.float64])(-z)
        ref_exp = np.exp(-np.abs(z))
    assert np.isnan(got_cdf[~real]).all()
    assert got_cdf[z == np.inf].item() == 1.0 and got_cdf[z == -np.inf].item() == 0.0
    normal = real & (ref_cdf >= 1e-37)
    # error budget: the rational form's rounding, and exp(-z^2)'s argument z^2 rounded to float32
    # (relative error z^2 * 2^-24 in the exponential)
    budget = 4e-7 + 1.2e-7 * z[normal] ** 2
    rel = np.abs(got_cdf[normal] - ref_cdf[normal]) / ref_cdf[normal]
    assert (rel <= budget).all(), f"cdf: max relative error {rel.max():.3g} at z={xs[normal][rel > budget][:5]}"
    assert (rel[z[normal] < -5] > 0).any() and ref_cdf[normal].min() < 1e-30  # the tail is in the check
    assert np.abs(got_cdf[real & ~normal] - ref_cdf[real & ~normal]).max() <= 1e-40
    tiny = real & (ref_exp < float(np.finfo(np.float32).tiny))
    big = real & ~tiny
    for mode in modes:
        got_exp = got[mode]
        assert got_exp[z == -np.inf].item() == 0.0 and got_exp[z == 0].min() == 1.0, mode
        assert np.all(np.abs(got_exp[tiny] - ref_exp[tiny]) <= 2 * DENORMAL), f"exp ({mode}): denormal range"
        err = np.abs(got_exp[big] - ref_exp[big]) / ref_exp[big]
        assert err.max() <= 3e-7, f"exp of a nonpositive argument ({mode}): max relative error {err.max():.3g}"
        # "drop": NaN in, a number out (its callers take the NaN from elsewhere)
        assert (np.isnan(got_exp[~real]) if mode != "drop" else np.isfinite(got_exp[~real])).all(), mode


def _activation_backward_kernel(kind: str):
    """The default-scheduled CPU kernel of ``activation_backward`` at (64, 256), built alone."""
    import rlx_tvm
    from tvm import relax

    bb = relax.BlockBuilder()
    x, dy = tensor_var("x", (64, 256)), tensor_var("dy", (64, 256))
    with bb.function("main", [x, dy]):
        out = bb.emit(rlx_tvm.ops.activation_backward(x, dy, kind=kind))
        bb.emit_func_output(out)
    target = cpu_target()
    lowered = rlx_tvm.build.lower(bb.get(), target, tuning_log=None, verbose=False)
    (kernel,) = [f for f in lowered.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    return tvm.tirx.build(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}), target=target)


def test_fused_gelu_backward_is_vectorized_without_libm_calls():
    lib = _activation_backward_kernel("gelu")
    calls = set(re.findall(r"call\w*\s+(\S+)", lib.inspect_source("asm")))
    assert not {c for c in calls if re.match(r"(erf|exp|tanh)f?@", c)}, calls


def test_attention_exp_is_vector_code():
    """The exp stage of causal attention backward's CPU kernel (the vector loop right inside the
    parallel loop) compiles to vector code: with tirx.isnan as the NaN test, TVM 0.27's vectorizer
    turned that loop back into a scalar one (one exp at a time, 16% of the kernel's time at
    B4 S512 H8 D64); the NaN test is made of bit operations instead."""
    import dataclasses

    import rlx_tvm
    from rlx_tvm.bench.suite import suite_kernel, suite_module

    shape = (1, 64, 2, 16)
    kernel = dataclasses.replace(suite_kernel("attention_backward"),
                                 shapes=lambda scale: {n: (shape, "normal") for n in ("q", "k", "v", "dy")})
    target = cpu_target()
    lowered = rlx_tvm.build.lower(suite_module(kernel, "full"), target, tuning_log=None, verbose=False)
    funcs = [f for g, f in lowered.functions.items() if g.name_hint.startswith("rlx_attention_backward")]
    assert funcs
    for f in funcs:
        ir = tvm.tirx.build(tvm.IRModule({"main": f.with_attr("global_symbol", "main")}), target=target).inspect_source("ll")
        assert re.search(r"@llvm\.floor\.v\d+f32\(", ir) and not re.search(r"@llvm\.floor\.f32\(", ir)


def _relax_unary_module(dtype: str, shape):
    """One Relax function per primitive whose TVM legalization calls exp / sigmoid / tanh / erf."""
    from tvm import relax

    bb = relax.BlockBuilder()
    ops = {"softmax": lambda x: relax.op.nn.softmax(x, axis=-1),
           "log_softmax": lambda x: relax.op.nn.log_softmax(x, axis=-1),
           "sigmoid": relax.op.sigmoid, "tanh": relax.op.tanh, "gelu": relax.op.nn.gelu, "exp": relax.op.exp}
    for name, op in ops.items():
        x = relax.Var("x", relax.TensorType(shape, dtype))
        with bb.function(name, [x]):
            bb.emit_func_output(bb.emit(op(x)))
    return bb.get(), list(ops)


def _relax_reference(name, x):
    with np.errstate(all="ignore"):
        if name in ("softmax", "log_softmax"):
            m = np.max(x, axis=-1, keepdims=True)
            s = np.sum(np.exp(x - m), axis=-1, keepdims=True)
            return np.exp(x - m) / s if name == "softmax" else x - m - np.log(s)
        return {"sigmoid": lambda v: 1.0 / (1.0 + np.exp(-v)), "tanh": np.tanh, "exp": np.exp,
                "gelu": lambda v: 0.5 * v * (1.0 + np.vectorize(math.erf, otypes=[np.float64])(v / math.sqrt(2.0)))}[name](x)


def test_tvm_legalized_kernels_use_the_vectorizable_transcendentals():
    """Kernels that TVM legalizes (softmax, log_softmax, sigmoid, tanh, GELU, exp: a model's forward,
    the decomposed backward graphs) get the float32 formulas in place of libm calls when built with
    ``rlx_tvm.compile`` for an LLVM target: no exp/erf/tanh call left in the TIR or the code; results
    against float64 NumPy over ordinary and extreme rows (+-100, +-inf, NaN); float64 keeps libm."""
    import rlx_tvm
    from tvm import relax

    rng = np.random.default_rng(1)
    x = (rng.standard_normal((6, 1000)) * 4).astype(np.float32)
    x[1, :] *= 25.0
    x[2, 7], x[3, 9], x[4, 11], x[5, 13] = np.inf, -np.inf, np.nan, 100.0
    target = cpu_target()
    for dtype in ("float32", "float64"):
        mod, names = _relax_unary_module(dtype, x.shape)
        lowered = rlx_tvm.build.lower(mod, target, tuning_log=None, verbose=False)
        scripts = "\n".join(f.script() for f in lowered.functions.values() if isinstance(f, tvm.tirx.PrimFunc))
        libm = re.findall(r"T\.(exp|erf|tanh|sigmoid)\(", scripts)
        assert (not libm) if dtype == "float32" else libm, (dtype, sorted(set(libm)))
        ex = tvm.compile(lowered, target=target)
        if dtype == "float32":
            calls = set(re.findall(r"call\w*\s+(\S+)", ex.mod.imports[0].inspect_source("asm")))
            assert not {c for c in calls if re.match(r"(erf|exp|tanh)f?@", c)}, calls
        vm = relax.VirtualMachine(ex, tvm.cpu())
        xd = x.astype(dtype)
        for name in names:
            got = vm[name](tvm.runtime.tensor(xd)).numpy().astype(np.float64)
            with np.errstate(over="ignore"):  # rounded to the dtype: float32 exp overflows past 88.7
                want = _relax_reference(name, xd.astype(np.float64)).astype(dtype).astype(np.float64)
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{name} {dtype}")
            ok = ~np.isnan(want)
            np.testing.assert_array_equal(np.isinf(got[ok]), np.isinf(want[ok]), err_msg=f"{name} {dtype}")
            fin = ok & np.isfinite(want)
            tol = 2e-6 if dtype == "float32" else 1e-12
            np.testing.assert_allclose(got[fin], want[fin], rtol=tol, atol=tol, err_msg=f"{name} {dtype}")


def test_transcendental_of_a_large_argument_keeps_libm():
    """A call whose argument is already large (here exp of a rewritten tanh) stays the intrinsic:
    the formulas repeat their argument, and build time would grow with each nesting level."""
    from tvm.script import tirx as T

    from rlx_tvm.schedules.transcendentals import vectorizable_transcendentals

    @T.prim_func(private=True, s_tir=True)
    def nested(x: T.Buffer((8,), "float32"), y: T.Buffer((8,), "float32")):
        for i in range(8):
            with T.sblock("y"):
                vi = T.axis.remap("S", [i])
                y[vi] = T.exp(T.tanh(x[vi]))

    script = vectorizable_transcendentals(nested).script()
    assert script.count("T.exp(") == 1 and "T.tanh(" not in script, script
    lib = tvm.compile(tvm.IRModule({"main": vectorizable_transcendentals(nested).with_attr("global_symbol", "main")}),
                      target=cpu_target())
    xs = np.linspace(-3, 3, 8).astype(np.float32)
    out = tvm.runtime.empty((8,), "float32")
    lib(tvm.runtime.tensor(xs), out)
    np.testing.assert_allclose(out.numpy(), np.exp(np.tanh(xs.astype(np.float64))), rtol=1e-6)
