"""Layer / RMS / group norm backward ops: fused and decomposed paths vs the NumPy reference, fp64
finite differences of independent NumPy forwards, the SPEC §8 traps, bad input, and the
gradient rules of R.nn.layer_norm / rms_norm / group_norm."""

from functools import partial

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

from rlx_tvm import autodiff, ops
from rlx_tvm.ops import get_op
from rlx_tvm.testing import (
    Case, GradCase, check_cases, check_finite_differences, check_gradients, finite_difference_vjp, run_cases,
)

from .helpers import MATRIX, assert_op_error, tensor_var

RNG = np.random.default_rng(3)


# -- independent NumPy forwards (float64) ---------------------------------------------------------


def layer_norm(x, gamma, beta=None, *, axis=-1, eps=1e-5):
    """y = (x - mean) / sqrt(var + eps) * gamma + beta along ``axis`` (biased variance)."""
    xt = np.moveaxis(x, axis, -1)
    mu = xt.mean(-1, keepdims=True)
    var = ((xt - mu) ** 2).mean(-1, keepdims=True)
    y = (xt - mu) / np.sqrt(var + eps) * gamma + (0.0 if beta is None else beta)
    return np.moveaxis(y, -1, axis)


def rms_norm(x, gamma, beta, *, axis=-1, eps=1e-6):
    """y = x / sqrt(mean(x^2) + eps) * gamma + beta along ``axis``."""
    xt = np.moveaxis(x, axis, -1)
    y = xt / np.sqrt((xt**2).mean(-1, keepdims=True) + eps) * gamma + beta
    return np.moveaxis(y, -1, axis)


def group_norm(x, gamma, beta=None, *, num_groups, eps=1e-5):
    """x [N, C, *spatial]: normalize each (n, group of C/G channels) block, then per channel."""
    n, c = x.shape[:2]
    blocks = x.reshape(n, num_groups, -1)
    mu = blocks.mean(-1, keepdims=True)
    var = ((blocks - mu) ** 2).mean(-1, keepdims=True)
    xh = ((blocks - mu) / np.sqrt(var + eps)).reshape(x.shape)
    per_channel = (1, c) + (1,) * (x.ndim - 2)
    y = xh * gamma.reshape(per_channel)
    return y if beta is None else y + beta.reshape(per_channel)


# -- cases ----------------------------------------------------------------------------------------


def _normal(*shape):
    return RNG.standard_normal(shape)


def _scale(n):
    return RNG.uniform(0.5, 1.5, n)


def _row_batch(x, axis):
    """Symbolic variant: the first axis that is not normalized (None for rank 1)."""
    others = [i for i in range(x.ndim) if i != axis % x.ndim]
    return {"x": others[0], "dy": others[0]} if others else None


def layer_cases(shape, label, which=("input", "gamma"), **attrs):
    axis = attrs.get("axis", -1)
    x, dy = _normal(*shape), _normal(*shape)
    gamma = _scale(shape[axis])
    common = dict(attrs=attrs, batch=_row_batch(x, axis), forward=partial(layer_norm, **attrs))

    def case(o):
        if o == "input":
            return Case("layer_norm_backward_input", {"x": x, "gamma": gamma, "dy": dy}, wrt="x",
                        label=f"layer_input[{label}]", **common)
        return Case("layer_norm_backward_gamma", {"x": x, "dy": dy}, wrt="gamma", fd_extra={"gamma": gamma},
                    label=f"layer_gamma[{label}]", **common)

    return [case(o) for o in which]


def rms_cases(shape, label, which=("input", "gamma", "beta"), **attrs):
    axis = attrs.get("axis", -1)
    x, dy = _normal(*shape), _normal(*shape)
    ins = {"x": x, "gamma": _scale(shape[axis]), "beta": _normal(shape[axis]), "dy": dy}
    return [
        Case(f"rms_norm_backward_{o}", ins, attrs, batch=_row_batch(x, axis), label=f"rms_{o}[{label}]",
             forward=partial(rms_norm, **attrs), wrt="x" if o == "input" else o)
        for o in which
    ]


def group_cases(shape, label, which=("input", "gamma", "beta"), **attrs):
    x, dy = _normal(*shape), _normal(*shape)
    params = {"gamma": _scale(shape[1]), "beta": _normal(shape[1])}
    common = dict(attrs=attrs, batch={"x": 0, "dy": 0}, forward=partial(group_norm, **attrs))

    def case(o):
        if o == "input":
            return Case("group_norm_backward_input", {"x": x, **params, "dy": dy}, wrt="x",
                        label=f"group_input[{label}]", **common)
        return Case(f"group_norm_backward_{o}", {"x": x, "dy": dy}, wrt=o, fd_extra=params,
                    label=f"group_{o}[{label}]", **common)

    return [case(o) for o in which]


CASES = [
    *layer_cases((8, 8), "square 8x8"),
    *layer_cases((4, 4, 4), "cube, middle axis", axis=1, eps=1e-3),
    *layer_cases((5, 3), "axis 0", which=("input",), axis=0),
    *layer_cases((6,), "rank 1", axis=0),
    *rms_cases((8, 8), "square 8x8"),
    *rms_cases((4, 4, 4), "cube, axis -2", which=("input", "gamma"), axis=-2, eps=1e-2),
    *group_cases((3, 6), "N=3, no spatial", which=("input", "gamma"), num_groups=3),
    *group_cases((2, 4, 5), "N=2, 1d, one group", which=("input",), num_groups=1),
    *group_cases((3, 6, 3, 2), "N=3, 2d", num_groups=3, eps=1e-3),
    *group_cases((2, 4, 2, 3, 2), "N=2, 3d, instance-like", which=("input",), num_groups=4),
]


@pytest.mark.parametrize("dtype,shape_mode,path", MATRIX)
def test_matches_reference(dtype, shape_mode, path):
    check_cases(CASES, dtype, symbolic=shape_mode == "symbolic", path=path)


def test_finite_differences():
    check_finite_differences(CASES)


def test_every_op_is_covered():
    ops_seen = {c.op for c in CASES}
    assert ops_seen == {
        "layer_norm_backward_input", "layer_norm_backward_gamma",
        "rms_norm_backward_input", "rms_norm_backward_gamma", "rms_norm_backward_beta",
        "group_norm_backward_input", "group_norm_backward_gamma", "group_norm_backward_beta",
    }
    spatial = {c.inputs["x"].ndim - 2 for c in CASES if c.op.startswith("group")}
    assert spatial == {0, 1, 2, 3}


def test_half_precision_accumulates_in_float32():
    """float16 in, float16 out, statistics in float32: close to the fp64 reference."""
    labels = ("layer_input[cube, middle axis]", "rms_input[square 8x8]", "group_gamma[N=3, 2d]")
    cases = [c for c in CASES if c.name in labels]
    assert len(cases) == len(labels)
    for path in ("fused", "decomposed"):
        for case, out in zip(cases, run_cases(cases, "float16", symbolic=False, path=path)):
            assert out.dtype == np.float16, (path, case.name)
            ref = case.reference("float16")
            err = np.abs(out.astype(np.float64) - ref).max()
            assert err <= 2e-2 * max(1.0, np.abs(ref).max()), (path, case.name, err)


# -- SPEC §8 traps --------------------------------------------------------------------------------


def _fd(case):
    """fp64 finite-difference VJP of the case's independent forward (not the op's reference)."""
    ins = case.cast_inputs("float64")
    primals = {k: v for k, v in ins.items() if k != "dy"} | case.fd_extra
    return finite_difference_vjp(case.forward, primals, case.wrt, ins["dy"])


def _both_paths_match_fd(cases):
    for path in ("fused", "decomposed"):
        for case, out in zip(cases, run_cases(cases, "float64", symbolic=False, path=path)):
            np.testing.assert_allclose(out, _fd(case), rtol=1e-5, atol=1e-6, err_msg=f"{path}: {case.name}")


def test_square_inputs_scale_the_normalized_axis():
    """Rows == features ([8, 8], [4, 4, 4]): gamma goes along the normalized axis, not the
    leading one (nor, for axis=0, the trailing one that plain broadcasting would pick). CASES
    has the [8, 8] last-axis cases and [4, 4, 4] middle-axis ones; these are the other axes."""
    cases = [
        *layer_cases((8, 8), "square, axis 0", which=("input",), axis=0),
        *layer_cases((4, 4, 4), "cube, axis -1", which=("input", "gamma")),
        *rms_cases((8, 8), "square, axis 0", which=("input", "gamma"), axis=0),
        *rms_cases((4, 4, 4), "cube, axis -1", which=("input",)),
    ]
    _both_paths_match_fd(cases)
    # The check can fail: gamma laid along the other axis of the square gives a different dx.
    case = cases[0]
    trailing = lambda x, gamma: layer_norm(x, np.ones_like(gamma), axis=0) * gamma  # noqa: E731
    wrong = Case(case.op, case.inputs, case.attrs, forward=trailing, wrt="x")
    assert not np.allclose(_fd(wrong), _fd(case), atol=1e-3), "trap case does not discriminate"


def test_group_norm_parameter_grads_reduce_over_the_batch():
    """N = 2 and 3: dgamma/dbeta sum over n too (a reshape that keeps N is wrong for N > 1)."""
    cases = [
        *group_cases((2, 4, 3), "N=2", which=("gamma", "beta"), num_groups=2),
        *group_cases((3, 6, 2, 2), "N=3", which=("gamma", "beta"), num_groups=3),
    ]
    _both_paths_match_fd(cases)
    # Sum of the per-sample gradients: every sample really contributes.
    for case in cases:
        ins = case.cast_inputs("float64")
        per_sample = [
            _fd(Case(case.op, {"x": ins["x"][n:n + 1], "dy": ins["dy"][n:n + 1]}, case.attrs, forward=case.forward,
                     wrt=case.wrt, fd_extra=case.fd_extra))
            for n in range(ins["x"].shape[0])
        ]
        np.testing.assert_allclose(sum(per_sample), _fd(case), rtol=1e-6, atol=1e-7)
        assert not np.allclose(per_sample[0], _fd(case), atol=1e-3)


# -- bad input ------------------------------------------------------------------------------------


def test_bad_parameter_shape():
    x, dy = tensor_var("x", (4, 6)), tensor_var("dy", (4, 6))
    assert_op_error(lambda: ops.layer_norm_backward_input(x, tensor_var("gamma", (4,)), dy),
                    "layer_norm_backward_input", "gamma", "[6]", "got [4]")
    # Square-ish trap at validation time: axis=0 wants gamma of x's dim 0.
    assert_op_error(lambda: ops.rms_norm_backward_input(x, tensor_var("gamma", (6,)), tensor_var("beta", (6,)), dy, axis=0),
                    "rms_norm_backward_input", "gamma", "[4]", "axis 0")
    assert_op_error(lambda: ops.rms_norm_backward_gamma(x, tensor_var("gamma", (6,)), tensor_var("beta", (5,)), dy),
                    "rms_norm_backward_gamma", "beta", "[6]", "got [5]")
    assert_op_error(lambda: ops.layer_norm_backward_input(x, tensor_var("gamma", (1, 6)), dy),
                    "layer_norm_backward_input", "gamma", "rank 1")
    xg = tensor_var("x", (2, 6, 3))
    assert_op_error(lambda: ops.group_norm_backward_input(xg, tensor_var("gamma", (3,)), tensor_var("beta", (6,)),
                                                          tensor_var("dy", (2, 6, 3)), num_groups=2),
                    "group_norm_backward_input", "gamma", "[6]", "channel")


def test_bad_shapes_and_ranks():
    assert_op_error(lambda: ops.layer_norm_backward_gamma(tensor_var("x", (4, 6)), tensor_var("dy", (4, 5))),
                    "layer_norm_backward_gamma", "dy", "[4, 6]", "[4, 5]")
    assert_op_error(lambda: ops.group_norm_backward_beta(tensor_var("x", (6,)), tensor_var("dy", (6,)), num_groups=2),
                    "group_norm_backward_beta", "x", "rank >= 2")
    n = tirx.Var("c", "int64")
    assert_op_error(lambda: ops.group_norm_backward_gamma(tensor_var("x", (2, n)), tensor_var("dy", (2, n)), num_groups=2),
                    "group_norm_backward_gamma", "x", "static channel")


def test_bad_attributes():
    x, dy = tensor_var("x", (4, 6)), tensor_var("dy", (4, 6))
    for eps in (0.0, -1e-5, float("nan")):
        assert_op_error(lambda: ops.layer_norm_backward_gamma(x, dy, eps=eps), "layer_norm_backward_gamma", "eps", "> 0")
    assert_op_error(lambda: ops.layer_norm_backward_gamma(x, dy, axis=2), "layer_norm_backward_gamma", "axis", "[-2, 2)")
    assert_op_error(lambda: ops.rms_norm_backward_beta(x, tensor_var("gamma", (6,)), tensor_var("beta", (6,)), dy, axis=-3),
                    "rms_norm_backward_beta", "axis", "-3")
    assert_op_error(lambda: ops.layer_norm_backward_gamma(x, dy, axis=1.0), "layer_norm_backward_gamma", "axis", "integer")
    xg, dyg = tensor_var("x", (2, 6, 3)), tensor_var("dy", (2, 6, 3))
    assert_op_error(lambda: ops.group_norm_backward_gamma(xg, dyg, num_groups=4),
                    "group_norm_backward_gamma", "num_groups", "divisor", "6", "got 4")
    assert_op_error(lambda: ops.group_norm_backward_beta(xg, dyg, num_groups=0), "group_norm_backward_beta", "num_groups", "got 0")
    assert_op_error(lambda: ops.group_norm_backward_beta(xg, dyg), "group_norm_backward_beta", "num_groups", "required")


def test_bad_dtypes():
    x = tensor_var("x", (4, 6))
    assert_op_error(lambda: ops.layer_norm_backward_input(x, tensor_var("gamma", (6,), "float64"), tensor_var("dy", (4, 6))),
                    "layer_norm_backward_input", "gamma", "float64")
    assert_op_error(lambda: ops.rms_norm_backward_input(x, tensor_var("gamma", (6,)), tensor_var("beta", (6,)),
                                                        tensor_var("dy", (4, 6), "float16")),
                    "rms_norm_backward_input", "dy", "float16")
    assert_op_error(lambda: ops.group_norm_backward_beta(tensor_var("x", (2, 4), "int32"), tensor_var("dy", (2, 4), "int32"),
                                                         num_groups=2),
                    "group_norm_backward_beta", "x", "int32")


# -- gradient rules of Relax's own norms ----------------------------------------------------------

op = relax.op


def _rule_cases():
    """(label, forward Relax builder, independent NumPy forward, inputs)."""
    x3, w3 = _normal(2, 3, 4), _normal(2, 3, 4)
    x4, w4 = _normal(2, 4, 3, 2), _normal(2, 4, 3, 2)
    x4l, w4l = _normal(2, 3, 2, 4), _normal(2, 3, 2, 4)
    return [
        ("layer_norm axes=[-1]", lambda x, g, b: op.nn.layer_norm(x, g, b, axes=[-1]),
         lambda x, g, b: layer_norm(x, g, b), {"x": x3, "g": _scale(4), "b": _normal(4), "w": w3}),
        ("layer_norm axes=[1, 2]", lambda x, g, b: op.nn.layer_norm(x, g, b, axes=[1, 2], epsilon=1e-3),
         lambda x, g, b: layer_norm(x.reshape(2, 12), g.reshape(12), b.reshape(12), eps=1e-3).reshape(x.shape),
         {"x": x3, "g": _scale(12).reshape(3, 4), "b": _normal(3, 4), "w": w3}),
        ("rms_norm axes=[-1]", lambda x, g: op.nn.rms_norm(x, g, axes=[-1], epsilon=1e-6),
         lambda x, g: rms_norm(x, g, 0.0), {"x": x3, "g": _scale(4), "w": w3}),
        # (TVM's own rms_norm kernel only handles trailing axes.)
        ("rms_norm axes=[1, 2]", lambda x, g: op.nn.rms_norm(x, g, axes=[1, 2], epsilon=1e-6),
         lambda x, g: rms_norm(x.reshape(2, 12), g.reshape(12), 0.0).reshape(x.shape),
         {"x": x3, "g": _scale(12).reshape(3, 4), "w": w3}),
        ("group_norm NCHW", lambda x, g, b: op.nn.group_norm(x, g, b, num_groups=2, channel_axis=1, axes=[2, 3]),
         lambda x, g, b: group_norm(x, g, b, num_groups=2), {"x": x4, "g": _scale(4), "b": _normal(4), "w": w4}),
        ("group_norm NHWC", lambda x, g, b: op.nn.group_norm(x, g, b, num_groups=2, channel_axis=3, axes=[1, 2]),
         lambda x, g, b: np.moveaxis(group_norm(np.moveaxis(x, 3, 1), g, b, num_groups=2), 1, 3),
         {"x": x4l, "g": _scale(4), "b": _normal(4), "w": w4l}),
    ]


def _rule_module(rules):
    bb = relax.BlockBuilder()
    for i, (_, build, _, ins) in enumerate(rules):
        params = [tensor_var(k, v.shape) for k, v in ins.items()]
        with bb.function(f"f{i}", params):
            with bb.dataflow():
                out = bb.emit_output(op.sum(op.multiply(build(*params[:-1]), params[-1])))
            bb.emit_func_output(out)
    return bb.get()


def test_relax_norm_gradients_emit_rlx_ops():
    rules = _rule_cases()
    mod = _rule_module(rules)
    for i, (label, *_) in enumerate(rules):
        text = autodiff.grad(mod, f"f{i}")[f"f{i}_adjoint"].script()
        family = label.split()[0].replace("_norm", "")
        assert f"R.rlx.{family}_norm_backward_input(" in text, (label, text)
        assert f"R.rlx.{family}_norm_backward_gamma(" in text, (label, text)


def test_relax_norm_gradients_and_hessian_vector_products():
    """R.nn.layer_norm/rms_norm/group_norm through rlx autodiff, in float32 (TVM's layer/group
    norm kernels reject float64): gradients vs fp64 finite differences of the independent NumPy
    forwards; Hessian-vector products (the decompositions differentiated) vs central
    differences of the compiled gradients along the same direction."""
    rules = _rule_cases()
    mod = _rule_module(rules)
    for i, (_, _, _, ins) in enumerate(rules):
        mod = autodiff.hvp(mod, f"f{i}", wrt=[k for k in ins if k != "w"])
    vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
    failures = []

    def close(got, want, rtol):
        return np.allclose(got, want, rtol=rtol, atol=rtol * 0.1 * max(1.0, np.abs(want).max()))

    for i, (label, _, forward, ins) in enumerate(rules):
        primals = {k: v for k, v in ins.items() if k != "w"}
        dirs = [RNG.standard_normal(v.shape) for v in primals.values()]

        def run(t):
            moved = [v + t * d for v, d in zip(primals.values(), dirs)] + [ins["w"]]
            args = [tvm.runtime.tensor(a.astype("float32")) for a in moved + dirs]
            _, grads, hv = vm[f"f{i}_hvp"](*args)
            return [g.numpy() for g in grads], [h.numpy() for h in hv]

        (grads, hv), (plus, _), (minus, _) = run(0.0), run(1e-2), run(-1e-2)
        for k, name in enumerate(primals):
            fd = finite_difference_vjp(forward, primals, name, ins["w"])
            if not close(grads[k], fd, 2e-3):
                failures.append(f"{label} d/d{name}: max abs err {np.abs(grads[k] - fd).max():.3g}")
            fd_hv = (plus[k] - minus[k]) / 2e-2
            if not close(hv[k], fd_hv, 1e-2):
                failures.append(f"{label} (H v)[{name}]: max abs err {np.abs(hv[k] - fd_hv).max():.3g}")
    assert not failures, "\n".join(failures)


def _decomposed(name, **attrs):
    """A builder that inlines the op's decomposition, so rlx autodiff differentiates it."""
    opdef = get_op(name)
    return lambda *args: op.sum(op.multiply(opdef.decompose_fn(None, *args[:-1], **attrs), args[-1]))


def _grad_cases():
    """For tests/test_gradients.py (float32, float64, Hessian-vector products): each decomposition
    differentiated, i.e. second order of the norms. The R.nn.* rules are checked in float32 by
    the test below instead: TVM's layer/group norm kernels reject float64, and its float64
    rms_norm is only float32-accurate (~1e-7), too noisy for finite differences."""
    x, dy, xg, dyg = _normal(3, 4), _normal(3, 4), _normal(2, 4, 3), _normal(2, 4, 3)
    g, b = _scale(4), _normal(4)
    cases = [
        GradCase("decomposed layer_input", {"x": x, "gamma": g, "dy": dy, "w": _normal(3, 4)},
                 _decomposed("layer_norm_backward_input", axis=-1, eps=1e-5)),
        GradCase("decomposed layer_gamma axis 0", {"x": x.T, "dy": dy.T, "w": _normal(4)},
                 _decomposed("layer_norm_backward_gamma", axis=0, eps=1e-3)),
        *[
            GradCase(f"decomposed rms_{o}", {"x": x, "gamma": g, "beta": b, "dy": dy, "w": _normal(*shape)},
                     _decomposed(f"rms_norm_backward_{o}", axis=-1, eps=1e-6))
            for o, shape in (("input", (3, 4)), ("gamma", (4,)), ("beta", (4,)))
        ],
        GradCase("decomposed group_input", {"x": xg, "gamma": g, "beta": b, "dy": dyg, "w": _normal(2, 4, 3)},
                 _decomposed("group_norm_backward_input", num_groups=2, eps=1e-5)),
        *[
            GradCase(f"decomposed group_{o}", {"x": xg, "dy": dyg, "w": _normal(4)},
                     _decomposed(f"group_norm_backward_{o}", num_groups=2, eps=1e-5))
            for o in ("gamma", "beta")
        ],
    ]
    for c in cases:
        c.wrt = [k for k in c.inputs if k != "w"]
    return cases


GRAD_CASES = _grad_cases()


def test_decompositions_differentiate_correctly():
    """float64 autodiff of every decomposition (each primitive's gradient rule: second order of
    the norms) vs finite differences of the compiled decomposition."""
    check_gradients(GRAD_CASES, "float64")
