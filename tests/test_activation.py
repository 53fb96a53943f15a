import numpy as np
import pytest

from rlx_tvm.ops.activation import ACTIVATIONS
from rlx_tvm.testing import Case, check_cases, check_finite_differences, run_cases

from .helpers import MATRIX, assert_op_error, away_from, tensor_var
from rlx_tvm import ops

RNG = np.random.default_rng(1)


def _fd_forward(kind):
    f = ACTIVATIONS[kind].forward
    return lambda x: f(x)


def _cases():
    cases = []
    for kind, act in ACTIVATIONS.items():
        lo, hi = act.domain
        x = away_from(RNG, (3, 8), lo, hi, act.kinks)
        dy = RNG.standard_normal((3, 8))
        cases.append(
            Case(
                "activation_backward",
                {"x": x, "dy": dy},
                {"kind": kind},
                batch={"x": 0, "dy": 0},
                label=f"activation_backward[{kind}]",
                forward=_fd_forward(kind) if act.matches_forward else None,
                wrt="x",
            )
        )
    x = away_from(RNG, (2, 3, 5), -2, 2, (0.0,))
    cases.append(
        Case("relu_backward", {"x": x, "dy": RNG.standard_normal(x.shape)}, batch={"x": 1, "dy": 1},
             forward=ACTIVATIONS["relu"].forward, wrt="x")
    )
    return cases


CASES = _cases()


@pytest.mark.parametrize("dtype,shape_mode,path", MATRIX)
def test_matches_reference(dtype, shape_mode, path):
    check_cases(CASES, dtype, symbolic=shape_mode == "symbolic", path=path)


def test_finite_differences():
    check_finite_differences(CASES)


def test_every_kind_is_covered():
    kinds = {c.attrs.get("kind") for c in CASES if c.op == "activation_backward"}
    assert kinds == set(ACTIVATIONS)
    spec_kinds = {
        "relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh", "exp", "log", "sqrt", "rsqrt", "neg", "abs",
        "sin", "cos", "tan", "atan", "reciprocal", "round", "floor", "ceil", "sign", "softplus", "elu", "erf",
        "hard_sigmoid", "hard_swish", "mish", "softsign", "log_sigmoid",
    }
    assert spec_kinds <= set(ACTIVATIONS)


# -- SPEC §8 traps ------------------------------------------------------------------------------


def _edge_outputs(kind_inputs, dtype="float64"):
    """Run relu_backward / activation_backward on hand-made inputs through both paths."""
    cases = [
        Case("activation_backward" if k != "relu_backward" else "relu_backward",
             {"x": x, "dy": dy}, {} if k == "relu_backward" else {"kind": k}, label=k)
        for k, x, dy in kind_inputs
    ]
    return {p: run_cases(cases, dtype, symbolic=False, path=p) for p in ("fused", "decomposed")}


def test_zero_is_handled_explicitly():
    """relu, abs, sqrt, rsqrt at exactly 0: finite, and 0 (relu: PyTorch convention)."""
    x = np.array([0.0, 0.0, 0.0, 1.0, -1.0])
    dy = np.array([1.0, -2.0, 3.0, 1.0, 1.0])
    kinds = ["relu_backward", "relu", "abs", "sqrt", "rsqrt"]
    outs = _edge_outputs([(k, x, dy) for k in kinds])
    for path, results in outs.items():
        for k, out in zip(kinds, results):
            assert np.all(np.isfinite(out)), (path, k, out)
            assert np.all(out[:3] == 0.0), (path, k, out)
        relu_out = results[0]
        np.testing.assert_array_equal(relu_out, [0, 0, 0, 1, 0])
        np.testing.assert_array_equal(results[2], [0, 0, 0, 1, -1])  # abs: sign(x), 0 at 0
        np.testing.assert_allclose(results[3][3], 0.5)  # sqrt'(1) = 1/2


def test_round_is_straight_through_and_floor_ceil_sign_are_zero():
    x = np.array([-1.5, -0.4, 0.0, 0.49, 2.5, 3.7])
    dy = np.array([1.0, 2.0, -3.0, 4.0, 5.0, -6.0])
    outs = _edge_outputs([("round", x, dy), ("floor", x, dy), ("ceil", x, dy), ("sign", x, dy)])
    for path, (rnd, flo, cei, sgn) in outs.items():
        np.testing.assert_array_equal(rnd, dy, err_msg=path)
        for z in (flo, cei, sgn):
            np.testing.assert_array_equal(z, np.zeros_like(dy), err_msg=path)


def test_gelu_is_exact_erf_not_tanh_approximation():
    x = np.linspace(-3, 3, 13)
    dy = np.ones_like(x)
    outs = _edge_outputs([("gelu", x, dy), ("gelu_tanh", x, dy)])
    import math

    phi = np.array([0.5 * (1 + math.erf(v / math.sqrt(2))) for v in x])
    exact = phi + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    for path, (g, gt) in outs.items():
        np.testing.assert_allclose(g, exact, rtol=1e-12, atol=1e-12, err_msg=path)
        assert np.max(np.abs(gt - exact)) > 1e-4  # the approximation really differs


def test_no_nan_or_inf_where_derivative_is_finite():
    """Large |x| for the saturating kinds: no overflow to NaN."""
    x = np.array([-80.0, -30.0, -5.0, 5.0, 30.0, 80.0])
    dy = np.ones_like(x)
    kinds = ["gelu", "gelu_tanh", "silu", "sigmoid", "tanh", "softplus", "mish", "log_sigmoid", "elu", "softsign"]
    for dtype in ("float32", "float64"):
        outs = _edge_outputs([(k, x, dy) for k in kinds], dtype)
        for path, results in outs.items():
            for k, out in zip(kinds, results):
                assert np.all(np.isfinite(out)), (dtype, path, k, out)


# -- bad input ------------------------------------------------------------------------------------


def test_bad_input_mismatched_shapes():
    assert_op_error(lambda: ops.relu_backward(tensor_var("x", (4, 5)), tensor_var("dy", (4, 6))),
                    "relu_backward", "dy", "[4, 5]", "[4, 6]")


def test_bad_input_dtype():
    assert_op_error(lambda: ops.activation_backward(tensor_var("x", (4,), "int32"), tensor_var("dy", (4,), "int32"), kind="tanh"),
                    "activation_backward", "x", "int32")
    assert_op_error(lambda: ops.activation_backward(tensor_var("x", (4,)), tensor_var("dy", (4,), "float64"), kind="tanh"),
                    "activation_backward", "dy", "float64")


def test_bad_input_attribute():
    assert_op_error(lambda: ops.activation_backward(tensor_var("x", (4,)), tensor_var("dy", (4,)), kind="swish2"),
                    "activation_backward", "kind", "swish2")
    assert_op_error(lambda: ops.activation_backward(tensor_var("x", (4,)), tensor_var("dy", (4,))),
                    "activation_backward", "kind", "required")
    assert_op_error(lambda: ops.relu_backward(tensor_var("x", (4,)), tensor_var("dy", (4,)), alpha=0.1),
                    "relu_backward", "alpha", "unknown")
