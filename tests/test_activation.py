"""relu_backward and activation_backward: the SPEC §8 edge cases through both paths, and bad input.
Values on the samples (rlx_tvm.testing.samples.activation) are checked by tests/test_ops.py."""

import math

import numpy as np

from rlx_tvm import ops
from rlx_tvm.ops.activation import ACTIVATIONS
from rlx_tvm.testing import Case
from rlx_tvm.testing.samples import family

from .helpers import CaseGroups, assert_op_error, tensor_var

CASES = family("activation").CASES


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


# The hand-made inputs of the edge-case tests.
ZERO_X, ZERO_DY = np.array([0.0, 0.0, 0.0, 1.0, -1.0]), np.array([1.0, -2.0, 3.0, 1.0, 1.0])
ZERO_KINDS = ["relu_backward", "relu", "abs", "sqrt", "rsqrt"]
ROUND_X, ROUND_DY = np.array([-1.5, -0.4, 0.0, 0.49, 2.5, 3.7]), np.array([1.0, 2.0, -3.0, 4.0, 5.0, -6.0])
GELU_X = np.linspace(-3, 3, 13)
LARGE_X = np.array([-80.0, -30.0, -5.0, 5.0, 30.0, 80.0])
LARGE_KINDS = ["gelu", "gelu_tanh", "silu", "sigmoid", "tanh", "softplus", "mish", "log_sigmoid", "elu", "softsign"]


def _calls(kind_inputs):
    return [
        Case("activation_backward" if k != "relu_backward" else "relu_backward",
             {"x": x, "dy": dy}, {} if k == "relu_backward" else {"kind": k}, label=k)
        for k, x, dy in kind_inputs
    ]


# Every edge-case test's relu_backward / activation_backward calls, in one module per (dtype, path).
EDGE = CaseGroups({
    "zero": (_calls((k, ZERO_X, ZERO_DY) for k in ZERO_KINDS), ("float64",)),
    "round": (_calls((k, ROUND_X, ROUND_DY) for k in ("round", "floor", "ceil", "sign")), ("float64",)),
    "gelu": (_calls((k, GELU_X, np.ones_like(GELU_X)) for k in ("gelu", "gelu_tanh")), ("float64",)),
    "large": (_calls((k, LARGE_X, np.ones_like(LARGE_X)) for k in LARGE_KINDS), ("float32", "float64")),
})


def _edge_outputs(group, dtype="float64"):
    return EDGE.outputs(group, dtype)


def test_zero_is_handled_explicitly():
    """relu, abs, sqrt, rsqrt at exactly 0: finite, and 0 (relu: PyTorch convention)."""
    for path, results in _edge_outputs("zero").items():
        for k, out in zip(ZERO_KINDS, results):
            assert np.all(np.isfinite(out)), (path, k, out)
            assert np.all(out[:3] == 0.0), (path, k, out)
        relu_out = results[0]
        np.testing.assert_array_equal(relu_out, [0, 0, 0, 1, 0])
        np.testing.assert_array_equal(results[2], [0, 0, 0, 1, -1])  # abs: sign(x), 0 at 0
        np.testing.assert_allclose(results[3][3], 0.5)  # sqrt'(1) = 1/2


def test_round_is_straight_through_and_floor_ceil_sign_are_zero():
    for path, (rnd, flo, cei, sgn) in _edge_outputs("round").items():
        np.testing.assert_array_equal(rnd, ROUND_DY, err_msg=path)
        for z in (flo, cei, sgn):
            np.testing.assert_array_equal(z, np.zeros_like(ROUND_DY), err_msg=path)


def test_gelu_is_exact_erf_not_tanh_approximation():
    x = GELU_X
    phi = np.array([0.5 * (1 + math.erf(v / math.sqrt(2))) for v in x])
    exact = phi + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    for path, (g, gt) in _edge_outputs("gelu").items():
        np.testing.assert_allclose(g, exact, rtol=1e-12, atol=1e-12, err_msg=path)
        assert np.max(np.abs(gt - exact)) > 1e-4  # the approximation really differs


def test_no_nan_or_inf_where_derivative_is_finite():
    """Large |x| for the saturating kinds: no overflow to NaN."""
    for dtype in ("float32", "float64"):
        for path, results in _edge_outputs("large", dtype).items():
            for k, out in zip(LARGE_KINDS, results):
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
