"""max_pool2d_backward: the reference vs a naive per-window implementation of the definition, the
GPU form, the SPEC §8 traps (ties, padding, overlapping windows on large inputs, ceil_mode) through
both paths, the decomposition policy, bad input, the CPU kernel, and the gradient rule of
R.nn.max_pool2d (second derivative exactly zero). Values on the samples
(rlx_tvm.testing.samples.pool, finite differences of an independent NumPy max_pool2d) are checked
by tests/test_ops.py."""

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

from rlx_tvm import autodiff, ops
from rlx_tvm.passes import DecomposeBackwardOps, count_rlx_calls
from rlx_tvm.testing import build_module, compare, run_cases
from rlx_tvm.testing.samples import gpu_form_outputs, outputs
from rlx_tvm.testing.samples.pool import (
    CASES, GRAD_X, POOL_ATTRS, SAMPLES, TRAP_BY_NAME, TRAP_CASES, distinct, max_pool2d_vjp, pool_loss, pool_windows,
    pooled_size, trap_case,
)

from .helpers import assert_op_error, tensor_var

RNG = np.random.default_rng(5)


@pytest.mark.parametrize("dtype,symbolic", [("float64", False), ("float32", False), ("float64", True)])
def test_gpu_form_matches_reference(dtype, symbolic):
    """GPU targets route dy with a gather over each input's candidate windows (the CPU gets a
    per-plane scatter): that TE compute, built for the CPU here, on every case."""
    with tvm.target.Target("cuda"):
        gpu = relax.transform.LegalizeOps()(build_module(CASES[:1], dtype, False))
    assert "max_pool2d_dx_acc" in gpu.script()  # the gather form, not the scatter
    outs = gpu_form_outputs(dtype, symbolic)
    selected = [c for c in SAMPLES if c.batch is not None or not symbolic]
    failures = [f"{c.name}: {p}" for c in selected if (p := compare(outs[c.name], c.reference(dtype), dtype))]
    assert not failures, "\n".join(failures)


def test_reference_matches_the_definition():
    for case in CASES + TRAP_CASES:
        want = max_pool2d_vjp(case.inputs["x"], case.inputs["dy"], **case.attrs)
        np.testing.assert_allclose(case.reference(), want, rtol=1e-13, atol=1e-13, err_msg=case.name)


# -- SPEC §8 traps: both paths, float64, vs the window-by-window definition ------------------------


def _trap_results(name):
    """(case, {path: output}) for the trap case; each output checked against the definition."""
    case = TRAP_BY_NAME[name]
    want = max_pool2d_vjp(case.inputs["x"], case.inputs["dy"], **case.attrs)
    outs = {}
    for symbolic in (False, True):
        for path in ("fused", "decomposed"):
            out = outputs("float64", symbolic, path)[name]
            np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12, err_msg=f"{name} {path} symbolic={symbolic}")
            outs[path, symbolic] = out
    return case, outs


def test_ties_one_winner_per_window_the_first():
    for name in ("ties: constant input", "ties: constant input, overlapping"):
        case, outs = _trap_results(name)
        x, dy = case.inputs["x"], case.inputs["dy"]
        _, windows = pool_windows(x.shape, **case.attrs)
        # On a constant input every window's first real position wins, and only it.
        want = np.zeros_like(x)
        for (oy, ox), pos in windows.items():
            want[:, :, pos[0][0], pos[0][1]] += dy[:, :, oy, ox]
        for key, out in outs.items():
            np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12, err_msg=str(key))
        # ... and the two paths agree bit for bit.
        np.testing.assert_array_equal(outs["fused", False], outs["decomposed", False])


def test_padding_never_wins_even_against_negative_or_minus_inf_input():
    case, outs = _trap_results("padding: all negative, one channel all -inf")
    for key, out in outs.items():
        # Every window hands its whole dy to some input position: nothing is lost to padding.
        np.testing.assert_allclose(out.sum(axis=(2, 3)), case.inputs["dy"].sum(axis=(2, 3)), rtol=1e-12, err_msg=str(key))
        assert np.all(np.isfinite(out)), key


def test_overlapping_windows_on_a_large_input_accumulate():
    case, outs = _trap_results("overlapping k3 s1 on 2*1*50*50 > 4096 elements")
    assert case.inputs["x"].size > 4096 and case.inputs["dy"].size > 4096
    for key, out in outs.items():
        assert out.max() > np.abs(case.inputs["dy"]).max(), key  # some position won several windows


def test_ceil_mode():
    for name in ("ceil_mode", "ceil_mode drops a window starting in the padding"):
        case, outs = _trap_results(name)
    assert TRAP_BY_NAME["ceil_mode"].inputs["dy"].shape[2:] == (4, 4)  # floor mode: 3x3
    assert TRAP_BY_NAME["ceil_mode drops a window starting in the padding"].inputs["dy"].shape[2:] == (3, 3)


# -- decomposition policy ---------------------------------------------------------------------


def test_decomposed_unless_x_and_dy_dims_differ():
    n, m = tirx.Var("n", "int64"), tirx.Var("m", "int64")
    for (xs, dys), decomposed in ((((n, 2, 6, 6), (n, 2, 3, 3)), True), (((n, 2, 6, 6), (m, 2, 3, 3)), False)):
        call = ops.max_pool2d_backward(tensor_var("x", xs), tensor_var("dy", dys), kernel_size=2)
        bb = relax.BlockBuilder()
        with bb.function("main", list(call.args)):
            with bb.dataflow():
                out = bb.emit_output(bb.emit(call))
            bb.emit_func_output(out)
        assert (not count_rlx_calls(DecomposeBackwardOps()(bb.get()))) == decomposed, (xs, dys)


# -- bad input ------------------------------------------------------------------------------------


def _call(x_shape, dy_shape, dtype="float32", dy_dtype=None, **attrs):
    return lambda: ops.max_pool2d_backward(tensor_var("x", x_shape, dtype), tensor_var("dy", dy_shape, dy_dtype or dtype), **attrs)


def test_bad_input_wrong_layout_rank():
    assert_op_error(_call((2, 6, 6), (2, 3, 3), kernel_size=2), "max_pool2d_backward", "x", "rank 4", "rank 3")


def test_bad_input_mismatched_shapes():
    assert_op_error(_call((2, 3, 6, 6), (2, 4, 3, 3), kernel_size=2), "max_pool2d_backward", "dy", "channels")
    assert_op_error(_call((2, 3, 6, 6), (1, 3, 3, 3), kernel_size=2), "max_pool2d_backward", "dy", "batch")
    msg = assert_op_error(_call((2, 3, 7, 7), (2, 3, 4, 3), kernel_size=2), "max_pool2d_backward", "dy", "dim 2 == 3", "4")
    assert "ceil_mode=False" in msg
    assert_op_error(_call((2, 3, 7, 7), (2, 3, 3, 3), kernel_size=2, ceil_mode=True), "max_pool2d_backward", "dy", "dim 2 == 4")


def test_bad_input_kernel_larger_than_padded_input():
    assert_op_error(_call((1, 1, 3, 3), (1, 1, 1, 1), kernel_size=4), "max_pool2d_backward", "kernel_size", "extent 4")
    assert_op_error(_call((1, 1, 5, 5), (1, 1, 1, 1), kernel_size=3, dilation=3), "max_pool2d_backward", "kernel_size", "extent 7")


def test_bad_input_attribute_values():
    for attrs, arg in (({"stride": 0}, "stride"), ({"dilation": (1, 0)}, "dilation"), ({"padding": -1}, "padding"),
                       ({"kernel_size": 0}, "kernel_size"), ({"ceil_mode": 1}, "ceil_mode")):
        assert_op_error(_call((1, 1, 6, 6), (1, 1, 3, 3), **{"kernel_size": 2, **attrs}), "max_pool2d_backward", arg)
    assert_op_error(_call((1, 1, 6, 6), (1, 1, 3, 3)), "max_pool2d_backward", "kernel_size", "required")


def test_bad_input_dtype():
    assert_op_error(_call((1, 1, 6, 6), (1, 1, 3, 3), "int32", kernel_size=2), "max_pool2d_backward", "x", "int32")
    assert_op_error(_call((1, 1, 6, 6), (1, 1, 3, 3), dy_dtype="float64", kernel_size=2), "max_pool2d_backward", "dy", "float64")


# -- the gradient of R.nn.max_pool2d; its second derivative is exactly zero -----------------------


def _pool_loss_module() -> tvm.IRModule:
    """``f(x, c) = sum(max_pool2d(x) * c)`` in float64, the loss the rule tests differentiate."""
    bb = relax.BlockBuilder()
    params = [tensor_var("x", GRAD_X.shape, "float64"), tensor_var("c", (2, 2, 4, 4), "float64")]
    with bb.function("f", params):
        with bb.dataflow():
            out = bb.emit_output(pool_loss(False, **POOL_ATTRS)(*params))
        bb.emit_func_output(out)
    return bb.get()


def test_max_pool2d_gradient_rule_emits_the_rlx_op():
    mod = autodiff.grad(_pool_loss_module(), "f", wrt=["x"])
    assert count_rlx_calls(mod) == {"max_pool2d_backward": 1}


def test_second_derivative_is_exactly_zero():
    """H v for a loss linear in max_pool2d(x): the decomposition's x-dependence is only through
    comparisons, so the Hessian is exactly 0 (not merely small), and the gradient is the definition's."""
    ties = np.round(RNG.standard_normal(GRAD_X.shape))  # ties too: the first max wins in both orders
    mod = autodiff.hvp(_pool_loss_module(), "f", wrt=["x"])
    vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
    c = RNG.standard_normal((2, 2, 4, 4))
    attrs = dict(kernel_size=3, stride=2, padding=1, ceil_mode=True)
    for x in (GRAD_X, ties):
        _, (grad,), (hv,) = vm["f_hvp"](*[tvm.runtime.tensor(a) for a in (x, c, RNG.standard_normal(x.shape))])
        np.testing.assert_array_equal(hv.numpy(), 0.0)
        np.testing.assert_allclose(grad.numpy(), max_pool2d_vjp(x, c, **attrs), rtol=1e-12, atol=1e-12)


def test_cpu_kernel_is_one_parallel_loop_over_planes():
    """On CPU the op is one kernel (no separate argmax), a parallel loop over (batch, channel)
    planes with vector loops inside: exact on ties, on -inf input next to padding, on distinct
    values, and on rows of several vectors of windows, full or not (fp32 and fp64)."""
    from rlx_tvm import build
    from rlx_tvm.target import cpu_target

    attrs = {"kernel_size": 3, "stride": 2, "padding": 1}
    ties = np.round(RNG.standard_normal((2, 3, 32, 32)))
    ties[1, 2] = -np.inf
    wide = np.round(RNG.standard_normal((1, 2, 5, 70)) * 2)  # 35 windows per row: 3 vectors, the last partly used
    xs = [ties, distinct(2, 3, 32, 32), wide]
    for dtype in ("float32", "float64"):
        cases = [trap_case(f"{dtype} {i}", x.astype(dtype), **attrs) for i, x in enumerate(xs)]
        cases.append(trap_case(f"{dtype} dilated", distinct(1, 2, 6, 75).astype(dtype), kernel_size=(2, 3), stride=(1, 2),
                           padding=(0, 2), dilation=(1, 3), ceil_mode=True))
        lowered = build.lower(build_module(cases, dtype, False), cpu_target(), tuning_log=None, verbose=False)
        names = [g.name_hint for g, f in lowered.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]
        assert not [n for n in names if "argmax" in n], names
        kernels = [f.script() for g, f in lowered.functions.items() if g.name_hint.startswith("rlx_max_pool2d_backward")]
        assert len(kernels) == 3 and all(  # one per geometry: the two 32 x 32 cases share theirs
            s.count("T.parallel") == 1 and "T.vectorized" in s for s in kernels)
        vm = relax.VirtualMachine(tvm.compile(lowered, target=cpu_target()), tvm.cpu())
        for i, case in enumerate(cases):
            x, dy = (case.cast_inputs(dtype)[k] for k in ("x", "dy"))
            got = vm[f"case_{i}"](tvm.runtime.tensor(x), tvm.runtime.tensor(dy)).numpy()
            want = max_pool2d_vjp(x.astype("float64"), dy.astype("float64"), **case.attrs)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=case.name)


def test_half_precision_inputs():
    """float16 and bfloat16 x/dy: compared and accumulated in float32 (overlapping k3 s1 windows
    add up to 9 dy values per input), rounded once; the result has the input dtype."""
    case = trap_case("half, overlapping", distinct(2, 3, 9, 40), kernel_size=3, stride=1, padding=1)
    for dtype in ("float16", "bfloat16"):
        ref = case.reference(dtype)  # exact math on the rounded inputs
        (out,) = run_cases([case], dtype, symbolic=False, path="fused")
        assert str(out.dtype) == dtype
        err = np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max()
        assert err < 1e-2, (dtype, err)


def test_llvm_intrinsics_only_for_llvm_targets():
    """The CPU kernel prefetches the next plane with an LLVM intrinsic and writes rows of dx as
    explicit vectors (shuffles) on llvm targets; for the C target (whose code generator has no
    LLVM intrinsics) neither, and no plane is cleared with memset on either."""
    from rlx_tvm import build
    from rlx_tvm.target import cpu_target

    case = trap_case("prefetch", distinct(1, 2, 8, 40), kernel_size=3, stride=2, padding=1)
    for target, expected in ((cpu_target(), True), (tvm.target.Target("c"), False)):
        lowered = build.lower(build_module([case], "float32", False), target, tuning_log=None, verbose=False)
        script = lowered["rlx_max_pool2d_backward"].script()
        assert ("llvm.prefetch" in script) == expected, target
        assert ("T.Shuffle" in script) == expected, target
        assert "llvm.memset" not in script, target


def test_cpu_kernel_scalar_and_vector_paths_agree():
    """The kernel's scalar code (non-LLVM targets, and planes too narrow for a vector of windows)
    and its vector code (frame split and dx rows by shuffles, edges from end vectors; 8 lanes, the
    width it is built with, and 16, a width it accepts) against the reference, all compiled with
    LLVM: k3 s2 p1 on widths with and without a partial last vector, a dilated ceil-mode geometry
    with several windows per element, and float64."""
    from rlx_tvm.kernels.cpu.pool import plane_kernel as _cpu_kernel
    from rlx_tvm.target import cpu_target

    geometries = [
        (dict(kernel_size=(3, 3), stride=(2, 2), padding=(1, 1, 1, 1), dilation=(1, 1), ceil_mode=False), (3, 40)),
        (dict(kernel_size=(3, 3), stride=(2, 2), padding=(1, 1, 1, 1), dilation=(1, 1), ceil_mode=False), (4, 69)),
        (dict(kernel_size=(2, 3), stride=(1, 2), padding=(0, 2, 0, 2), dilation=(1, 3), ceil_mode=True), (5, 75)),
    ]
    checks, kernels = [], {}  # every kernel in one module, compiled once
    for dtype in ("float32", "float64"):
        for attrs, (h, w) in geometries:
            x = np.round(RNG.standard_normal((2, 3, h, w)) * 2).astype(dtype)  # ties
            (pt, pl, pb, pr), (kh, kw), (sh, sw), (dh, dw) = attrs["padding"], attrs["kernel_size"], attrs["stride"], attrs["dilation"]
            ho = pooled_size(h, pt, pb, kh, sh, dh, attrs["ceil_mode"])
            wo = pooled_size(w, pl, pr, kw, sw, dw, attrs["ceil_mode"])
            dy = RNG.standard_normal((2, 3, ho, wo)).astype(dtype)
            hp = max(pt + h, (ho - 1) * sh + (kh - 1) * dh + 1)
            want = max_pool2d_vjp(x.astype("float64"), dy.astype("float64"), **attrs).reshape(2, 3, h * w)
            for llvm, lanes in ((True, 8), (True, 16), (False, 8)):
                kernel = _cpu_kernel(dtype, dtype, 2, 3, (h, w), (ho, wo), (sh, sw), (dh, dw), (kh, kw), (pt, pl), hp,
                                     llvm, lanes)
                assert ("T.Shuffle" in kernel.script()) == llvm
                name = f"k{len(kernels)}"
                kernels[name] = kernel.with_attr("global_symbol", name)
                checks.append((name, x, dy, want, f"{dtype} {attrs} {w} llvm={llvm} lanes={lanes}"))
    lib = tvm.compile(tvm.IRModule(kernels), target=cpu_target())
    for name, x, dy, want, label in checks:
        got = tvm.runtime.empty(want.shape, str(x.dtype))
        lib[name](tvm.runtime.tensor(x), tvm.runtime.tensor(dy), got)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6, err_msg=label)
