"""The vectorizable float32 exp / erf / tanh / sigmoid of the fused kernels, against float64 NumPy
over their whole range, the float32 edge values and the special values; and the check that a
fused kernel using them no longer calls libm's scalar functions."""

import math
import re

import numpy as np
import tvm
from tvm import te

from rlx_tvm.ops import _math
from rlx_tvm.schedules.tune import cpu_target

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
    return xs


def _evaluate(xs: np.ndarray) -> dict[str, np.ndarray]:
    x = te.placeholder(xs.shape, "float32", name="x")
    fns = {"exp": _math.exp_f32, "erf": _math.erf_f32, "tanh": _math.tanh_f32, "sigmoid": _math.tir_sigmoid}

    def stage(name, fn):
        return te.compute(x.shape, lambda i: fn(x[i]), name=name)

    outs = [stage(name, fn) for name, fn in fns.items()]
    f = tvm.compile(tvm.IRModule({"main": te.create_prim_func([x, *outs])}), target="llvm")
    results = [tvm.runtime.empty(xs.shape, "float32") for _ in outs]
    f(tvm.runtime.tensor(xs), *results)
    return {name: r.numpy().astype(np.float64) for name, r in zip(fns, results)}


def test_float32_transcendentals_match_float64():
    xs = _inputs()
    got = _evaluate(xs)
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


def test_fused_gelu_backward_is_vectorized_without_libm_calls():
    import rlx_tvm
    from tvm import relax

    bb = relax.BlockBuilder()
    x, dy = tensor_var("x", (64, 256)), tensor_var("dy", (64, 256))
    with bb.function("main", [x, dy]):
        out = bb.emit(rlx_tvm.ops.activation_backward(x, dy, kind="gelu"))
        bb.emit_func_output(out)
    target = cpu_target()
    lowered = rlx_tvm.build.lower(bb.get(), target, tuning_log=None, verbose=False)
    (kernel,) = [f for f in lowered.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    lib = tvm.tirx.build(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}), target=target)
    calls = set(re.findall(r"call\w*\s+(\S+)", lib.inspect_source("asm")))
    assert not {c for c in calls if re.match(r"(erf|exp|tanh)f?@", c)}, calls
