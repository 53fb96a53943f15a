"""fake_quantize and fake_quantize_backward.

Every ``ste`` of fake_quantize_backward is a surrogate gradient (a straight-through estimator),
not the derivative of fake_quantize, whose true derivative is 0 almost everywhere (a step
function). So the op is checked against an independent NumPy implementation of the SPEC §2
formulas, written literally (rlx_tvm.testing.samples.quantize), and against finite differences
of the smooth surrogate each estimator is the exact derivative of (identity, clip, s tanh(x / s),
the hardtanh integral). The samples' values against the op references are checked by
tests/test_ops.py.
"""

import functools

import numpy as np
import pytest
import tvm
from tvm import relax

from rlx_tvm import autodiff, ops
from rlx_tvm.ops import get_op
from rlx_tvm.passes import count_rlx_calls
from rlx_tvm.testing import Case, GradCase, check_gradients, check_nth_order, compare, finite_difference_vjp, run_cases
from rlx_tvm.testing.samples import outputs as sample_outputs
from rlx_tvm.testing.samples.quantize import CASES, STES, quant_input, spec_backward, spec_fake_quantize, spec_scale

from .helpers import assert_op_error, tensor_var

RNG = np.random.default_rng(5)


def outputs(dtype, symbolic, path):
    """The samples' outputs, in the order of CASES (static: every sample has one)."""
    outs = sample_outputs(dtype, symbolic, path)
    return [outs[c.name] for c in CASES if c.batch is not None or not symbolic]


def surrogate_forward(ste, x, s, qs):
    """The function each estimator is the exact derivative of, with the scale ``s`` held fixed."""
    if ste == "identity":
        return x
    if ste == "clipped":
        return np.clip(x, -qs, qs)
    if ste == "tanh":
        return s * np.tanh(x / s)
    inside = x - np.sign(x) * x * x / (2 * qs)  # hardtanh: the integral of max(0, 1 - |x| / qs)
    return np.where(np.abs(x) <= qs, inside, np.sign(x) * qs / 2)


@pytest.mark.parametrize("path", ["fused", "decomposed"])
def test_estimators_are_finite_differences_of_their_surrogate_forward(path):
    """fp64 central differences of each surrogate forward (elementwise, scale fixed at its value for
    x) times dy, against the kernels; elements within a few steps of the clip boundary are left out
    (the surrogates have a kink there)."""
    h = 1e-6
    checked = 0
    for c, out in zip(CASES, outputs("float64", False, path)):
        if c.op != "fake_quantize_backward":
            continue
        x, dy = c.inputs["x"], c.inputs["dy"]
        q, s = spec_scale(x, c.attrs["bits"], c.attrs.get("axis"))
        qs = q * s
        fd = (surrogate_forward(c.attrs["ste"], x + h, s, qs) - surrogate_forward(c.attrs["ste"], x - h, s, qs)) / (2 * h)
        smooth = np.abs(np.abs(x) - qs) > 10 * h * np.maximum(1.0, qs)
        assert smooth.sum() >= x.size // 2, c.label
        np.testing.assert_allclose(out[smooth], (fd * dy)[smooth], rtol=1e-6, atol=1e-8, err_msg=c.label)
        checked += 1
    assert checked == 2 * len(STES)


def test_reference_matches_spec_formulas():
    """The op references against the literal SPEC formulas above (forward and every estimator)."""
    for c in CASES:
        ins = c.inputs
        if c.op == "fake_quantize":
            expected = spec_fake_quantize(ins["x"], c.attrs["bits"], c.attrs.get("axis"))
        else:
            expected = spec_backward(ins["x"], ins["dy"], **c.attrs)
        np.testing.assert_allclose(c.reference(), expected, rtol=1e-13, atol=1e-13, err_msg=c.name)
    assert {c.attrs.get("ste") for c in CASES if c.op == "fake_quantize_backward"} == set(STES)
    assert {c.attrs["bits"] for c in CASES} == {2, 4, 8}


@pytest.mark.parametrize("path", ["fused", "decomposed"])
def test_kernels_match_spec_formulas(path):
    """Kernel outputs (float64) against the SPEC formulas directly; identity is dy, bit for bit
    (float32 too)."""
    for c, out in zip(CASES, outputs("float64", False, path)):
        ins = c.inputs
        if c.op == "fake_quantize":
            expected = spec_fake_quantize(ins["x"], c.attrs["bits"], c.attrs.get("axis"))
        else:
            expected = spec_backward(ins["x"], ins["dy"], **c.attrs)
        np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12, err_msg=c.name)
    for c, out in zip(CASES, outputs("float32", False, path)):
        if c.attrs.get("ste") == "identity":
            np.testing.assert_array_equal(out, c.inputs["dy"].astype("float32"), err_msg=c.name)


# -- SPEC §8 traps ------------------------------------------------------------------------------


# The edge cases of all trap tests below, compiled into one module per (dtype, path).

AXIS_CONFIGS = [((4, 6), 0), ((4, 6), 1), ((2, 3, 4), 1), ((5, 5), 0), ((5, 5), 1)]


def _axis_cases():
    cases = []
    for shape, axis in AXIS_CONFIGS:
        # Rows and columns with very different ranges, so every choice of axis gives a different scale.
        x = RNG.uniform(-1, 1, shape) * np.exp(RNG.uniform(-3, 3, shape[:1] + (1,) * (len(shape) - 1)))
        x = x * np.exp(RNG.uniform(-3, 3, shape[-1:]))
        cases.append(Case("fake_quantize", {"x": x}, {"bits": 4, "axis": axis}))
        cases.append(Case("fake_quantize_backward", {"x": x, "dy": np.ones(shape)}, {"bits": 4, "axis": axis, "ste": "tanh"}))
    return cases


ZERO_ROWS = 1  # the all-zero slice of the partly zero input


def _zero_cases():
    zero = np.zeros((3, 4))
    some = RNG.uniform(-1, 1, (3, 4))
    some[ZERO_ROWS] = 0.0  # one all-zero slice along axis 0
    dy = RNG.standard_normal((3, 4))
    cases = []
    for x, axis, label in ((zero, None, "zero"), (some, 0, "some")):
        cases.append(Case("fake_quantize", {"x": x}, {"bits": 2} if axis is None else {"bits": 2, "axis": axis}, label=label))
        for ste in STES:
            attrs = {"bits": 8, "ste": ste} if axis is None else {"bits": 8, "axis": axis, "ste": ste}
            cases.append(Case("fake_quantize_backward", {"x": x, "dy": dy}, attrs, label=label))
    return cases


TIE_LEVELS = np.array([0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, 7.0])
TIE_ROUNDED = np.array([0.0, 2.0, 2.0, 4.0, -0.0, -2.0, -2.0, 7.0])  # half to even


def _tie_cases():
    # bits 4: q = 7; max|x| = 7/8, so s = 1/8 and x / s = TIE_LEVELS exactly in every float dtype.
    return [Case("fake_quantize", {"x": TIE_LEVELS / 8.0}, {"bits": 4})]


def _boundary_cases():
    x = RNG.standard_normal((6, 7)) * 3.7  # arbitrary values: max|x| / q * q need not round back to max|x|
    dy = RNG.standard_normal((6, 7))
    return [Case("fake_quantize_backward", {"x": x, "dy": dy}, {"bits": b, "axis": a, "ste": ste})
            for ste in ("clipped", "hardtanh") for b, a in ((4, 0), (8, 1))]


EDGE = {"axis": _axis_cases(), "zero": _zero_cases(), "tie": _tie_cases(), "boundary": _boundary_cases()}


@functools.lru_cache(maxsize=None)
def edge_outputs(dtype, path):
    """{group: outputs}; the per-axis group is checked in float64 only."""
    groups = {k: v for k, v in EDGE.items() if k != "axis" or dtype == "float64"}
    outs = iter(run_cases([c for g in groups.values() for c in g], dtype, symbolic=False, path=path))
    return {name: [next(outs) for _ in group] for name, group in groups.items()}


BOTH_PATHS = pytest.mark.parametrize("path", ["fused", "decomposed"])
BOTH_DTYPES = pytest.mark.parametrize("dtype", ["float32", "float64"])


@BOTH_PATHS
def test_per_axis_scale_is_over_the_other_axes(path):
    """x [4, 6] with axis 0 and axis 1, rank 3 with axis 1, and a square [5, 5] (where a scale
    broadcast along the wrong axis still has the right shape): one scale per index of ``axis``,
    the max taken over ALL other axes."""
    outs = edge_outputs("float64", path)["axis"]
    for k, (shape, axis) in enumerate(AXIS_CONFIGS):
        x = EDGE["axis"][2 * k].inputs["x"]
        y, d = outs[2 * k], outs[2 * k + 1]
        np.testing.assert_allclose(y, spec_fake_quantize(x, 4, axis), rtol=1e-12, atol=1e-12, err_msg=f"{shape} {axis}")
        np.testing.assert_allclose(d, spec_backward(x, np.ones(shape), 4, axis, "tanh"), rtol=1e-12, atol=1e-12)
        for other in [None] + [a for a in range(len(shape)) if a != axis]:
            # The scale over any other axis (or the whole tensor) gives a visibly different answer.
            assert np.abs(spec_fake_quantize(x, 4, other) - y).max() > 1e-3, (shape, axis, other)


@BOTH_PATHS
@BOTH_DTYPES
def test_scale_clamp_on_all_zero_input(dtype, path):
    """max|x| == 0 (whole tensor, or one slice): s = 1e-12 keeps every estimator finite; the
    estimators all give dy there and the forward gives exact zeros."""
    for c, out in zip(EDGE["zero"], edge_outputs(dtype, path)["zero"]):
        assert np.all(np.isfinite(out)), (c.name, c.attrs, out)
        zero = (slice(None),) if c.label == "zero" else (ZERO_ROWS,)
        if c.op == "fake_quantize":
            np.testing.assert_array_equal(out[zero], 0.0)
        else:
            np.testing.assert_array_equal(out[zero], c.inputs["dy"].astype(dtype)[zero], err_msg=str(c.attrs))
        assert compare(out, c.reference(dtype), dtype) is None, (c.name, c.attrs)


@BOTH_PATHS
@BOTH_DTYPES
def test_round_half_to_even(dtype, path):
    """x / s exactly on .5 steps rounds half to even in both paths (np.round's convention; half
    away from zero would give 1, 3, -1, -3 for 0.5, 2.5, -0.5, -2.5)."""
    (out,) = edge_outputs(dtype, path)["tie"]
    np.testing.assert_array_equal(out * 8.0, TIE_ROUNDED)
    np.testing.assert_array_equal(EDGE["tie"][0].reference() * 8.0, TIE_ROUNDED)


@BOTH_PATHS
@BOTH_DTYPES
def test_clip_boundary_keeps_the_maximum(dtype, path):
    """With arbitrary (not specially chosen) values, the elements at max|x| sit exactly on the
    clip boundary q*s: clipped still passes their gradient and hardtanh gives exactly 0 there
    (q*s is evaluated as max(m, q*1e-12), which has no rounding error)."""
    for c, out in zip(EDGE["boundary"], edge_outputs(dtype, path)["boundary"]):
        x, dy, axis = c.inputs["x"].astype(dtype), c.inputs["dy"].astype(dtype), c.attrs["axis"]
        at_max = np.abs(x) == np.abs(x).max(axis=1 - axis, keepdims=True)
        assert at_max.sum() == x.shape[axis]
        if c.attrs["ste"] == "clipped":
            np.testing.assert_array_equal(out, dy, err_msg=str(c.attrs))
        else:
            assert np.all(out[at_max] == 0) and np.all(out * dy >= 0), c.attrs


def test_autodiff_uses_the_chosen_estimator():
    """Differentiating rlx.fake_quantize emits fake_quantize_backward with the op's ``ste``."""
    x = RNG.standard_normal((3, 5))
    w = RNG.standard_normal((3, 5))
    bb = relax.BlockBuilder()
    xv, wv = tensor_var("x", x.shape, "float64"), tensor_var("w", w.shape, "float64")
    with bb.function("main", [xv, wv]):
        with bb.dataflow():
            y = bb.emit(ops.fake_quantize(xv, bits=4, axis=1, ste="tanh"))
            loss = bb.emit_output(relax.op.sum(relax.op.multiply(y, wv)))
        bb.emit_func_output(loss)
    mod = autodiff.grad(bb.get(), "main", wrt=["x"])
    assert count_rlx_calls(mod, ["fake_quantize_backward"]) == {"fake_quantize_backward": 1}
    vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
    _, (gx,) = vm["main_adjoint"](tvm.runtime.tensor(x), tvm.runtime.tensor(w))
    np.testing.assert_allclose(gx.numpy(), spec_backward(x, w, 4, 1, "tanh"), rtol=1e-12, atol=1e-12)


def test_max_min_gradients():
    """relax.max / relax.min gradients (used when decomposed fake_quantize graphs are
    differentiated again): finite differences away from ties, and an equal split at ties."""
    op = relax.op
    x = RNG.standard_normal((3, 4, 5))
    w = RNG.standard_normal((3, 5))
    cases = [
        GradCase("max(axis=1)", {"x": x, "w": w}, lambda x, w: op.sum(op.multiply(op.max(x, axis=1), w)), wrt=["x"]),
        GradCase("min(axis=[0,2],keepdims)", {"x": x}, lambda x: op.sum(op.exp(op.min(x, axis=[0, 2], keepdims=True)))),
        GradCase("max(all)", {"x": x}, lambda x: op.multiply(op.max(x), op.max(x))),
    ]
    check_gradients(cases, "float64")

    tied = np.array([[1.0, 3.0, 3.0, -2.0], [0.5, 0.5, 0.5, 0.5]])
    mod = autodiff.grad(_one_fn(lambda t: op.sum(op.max(t, axis=1)), tied), "main")
    vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
    _, (g,) = vm["main_adjoint"](tvm.runtime.tensor(tied))
    np.testing.assert_array_equal(g.numpy(), [[0, 0.5, 0.5, 0], [0.25, 0.25, 0.25, 0.25]])


def _one_fn(build, x):
    bb = relax.BlockBuilder()
    xv = tensor_var("x", x.shape, "float64")
    with bb.function("main", [xv]):
        with bb.dataflow():
            out = bb.emit_output(build(xv))
        bb.emit_func_output(out)
    return bb.get()


def test_half_precision_computes_in_float32():
    """float16 inputs: both paths compute in float32 and round once, so they match the float64
    reference of the float16-cast inputs to float16 output precision."""
    cases = CASES[:3] + CASES[-7::2]  # three forward configs; each estimator per axis
    for path in ("fused", "decomposed"):
        for c, out in zip(cases, run_cases(cases, "float16", symbolic=False, path=path)):
            assert out.dtype == np.float16
            ref = c.reference("float16")
            np.testing.assert_allclose(out, ref, rtol=2e-3, atol=2e-3 * max(1.0, np.abs(ref).max()), err_msg=f"{path} {c.name}")


def test_whole_tensor_scale_under_the_default_cpu_schedule():
    """A per-tensor scale at 128K elements, as rlx_tvm.compile schedules it untuned: max|x| over
    the whole tensor in parallel parts of vectors (not one serial scalar loop), each estimator
    equal to the SPEC formulas in float32 and float64 (the max is exact in any order)."""
    from rlx_tvm import build
    from rlx_tvm.target import cpu_target

    shape = (128, 1024)
    x, dy = quant_input(shape, 8), RNG.standard_normal(shape)
    for dtype in ("float32", "float64"):
        bb = relax.BlockBuilder()
        xv, dyv = tensor_var("x", shape, dtype), tensor_var("dy", shape, dtype)
        with bb.function("main", [xv, dyv]):
            with bb.dataflow():
                out = bb.emit_output(relax.Tuple([ops.fake_quantize_backward(xv, dyv, bits=8, ste=ste) for ste in STES]))
            bb.emit_func_output(out)
        lowered = build.lower(bb.get(), cpu_target(), tuning_log=None, verbose=False)
        checked = 0
        for name, func in lowered.functions.items():
            if isinstance(func, tvm.tirx.PrimFunc) and "absmax" in func.script():  # all but identity
                sch = tvm.s_tir.Schedule(func)
                partial = next(b for b in sch.get_child_blocks(sch.get_sblock("root"))
                               if sch.get(b).name_hint.startswith("absmax_rf"))
                kinds = [sch.get(lp).kind for lp in sch.get_loops(partial)]
                assert tvm.tirx.ForKind.PARALLEL in kinds and kinds[-1] == tvm.tirx.ForKind.VECTORIZED, (name, kinds)
                checked += 1
        assert checked == 3
        vm = relax.VirtualMachine(tvm.compile(lowered, target=cpu_target()), tvm.cpu())
        outs = vm["main"](tvm.runtime.tensor(x.astype(dtype)), tvm.runtime.tensor(dy.astype(dtype)))
        for ste, out in zip(STES, outs):
            ref = spec_backward(x.astype(dtype).astype(np.float64), dy.astype(dtype).astype(np.float64), 8, ste=ste)
            np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5 if dtype == "float32" else 1e-12, atol=1e-6,
                                       err_msg=f"{dtype} {ste}")


# -- bad input ------------------------------------------------------------------------------------


def _fqb(shape=(4, 6), dy_shape=None, dtype="float32", dy_dtype=None, **attrs):
    x = tensor_var("x", shape, dtype)
    dy = tensor_var("dy", dy_shape or shape, dy_dtype or dtype)
    return lambda: ops.fake_quantize_backward(x, dy, **{"bits": 8, **attrs})


def test_bad_input_attributes():
    assert_op_error(_fqb(bits=3), "fake_quantize_backward", "bits", "[2, 4, 8]", "3")
    assert_op_error(_fqb(bits=True), "fake_quantize_backward", "bits", "an integer")
    assert_op_error(_fqb(ste="sigmoid"), "fake_quantize_backward", "ste", "hardtanh", "sigmoid")
    x = tensor_var("x", (4, 6))
    assert_op_error(lambda: ops.fake_quantize(x, bits=16), "fake_quantize", "bits", "[2, 4, 8]", "16")
    assert_op_error(lambda: ops.fake_quantize(x), "fake_quantize", "bits", "required")


def test_bad_input_axis_out_of_range():
    assert_op_error(_fqb(axis=2), "fake_quantize_backward", "axis", "[-2, 2)", "2")
    assert_op_error(_fqb(axis=-3), "fake_quantize_backward", "axis", "[-2, 2)", "-3")
    x = tensor_var("x", (2, 3, 4))
    assert_op_error(lambda: ops.fake_quantize(x, bits=4, axis=3), "fake_quantize", "axis", "[-3, 3)")


def test_bad_input_shapes_and_dtypes():
    assert_op_error(_fqb(dy_shape=(6, 4)), "fake_quantize_backward", "dy", "[4, 6]", "[6, 4]")
    assert_op_error(_fqb(dy_dtype="float64"), "fake_quantize_backward", "dy", "float32", "float64")
    assert_op_error(_fqb(dtype="int32"), "fake_quantize_backward", "x", "int32")
    assert_op_error(lambda: ops.fake_quantize(tensor_var("x", ()), bits=4), "fake_quantize", "x", "rank >= 1")


def test_bad_input_unknown_attribute():
    assert_op_error(lambda: get_op("fake_quantize")(tensor_var("x", (3,)), bits=4, scale=0.1), "fake_quantize", "scale", "unknown")


def test_second_order_through_the_tanh_estimator():
    """Second order through fake_quantize with the tanh STE. The estimated gradient g(x) is not the
    gradient of any function (its Jacobian J is not symmetric: at a slice's max|x| g is constant in
    that element, yet the others depend on it through the scale), so ``hvp``'s d<g, v>/dx = J^T v is
    checked against finite differences of x -> <g(x), v> with the SPEC's g, element by element,
    not against J v. ``nth_order_grad`` (d sum(g_k)/dx at each level) has no such subtlety."""
    op = relax.op
    x, w, v = RNG.standard_normal((3, 5)), RNG.standard_normal((3, 5)), RNG.standard_normal((3, 5))

    def loss(x, w):
        y = ops.fake_quantize(x, bits=4, axis=1, ste="tanh")
        return op.sum(op.multiply(y, w))

    bb = relax.BlockBuilder()
    xv, wv = tensor_var("x", x.shape, "float64"), tensor_var("w", w.shape, "float64")
    with bb.function("main", [xv, wv]):
        with bb.dataflow():
            out = bb.emit_output(loss(xv, wv))
        bb.emit_func_output(out)
    vm = relax.VirtualMachine(tvm.compile(autodiff.hvp(bb.get(), "main", wrt=["x"]), "llvm"), tvm.cpu())
    _, (g,), (hv,) = vm["main_hvp"](*[tvm.runtime.tensor(a) for a in (x, w, v)])
    np.testing.assert_allclose(g.numpy(), spec_backward(x, w, 4, 1, "tanh"), rtol=1e-12, atol=1e-12)
    fd = finite_difference_vjp(lambda x: spec_backward(x, w, 4, 1, "tanh"), {"x": x}, "x", v)
    np.testing.assert_allclose(hv.numpy(), fd, rtol=1e-6, atol=1e-8)

    check_nth_order([GradCase("fake_quantize(ste=tanh)", {"x": x, "w": w}, loss, wrt=["x"])], order=3)
