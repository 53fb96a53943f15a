"""rope and rope_backward: the references vs an independent NumPy rope (explicit rotation
matrices), every combination covered, the SPEC §8 traps through both paths (on the samples'
outputs, checked against the references by tests/test_ops.py), autodiff and second order, float16,
and bad input."""

import numpy as np
import pytest
from tvm import relax, tirx

from rlx_tvm.ops import get_op
from rlx_tvm.ops.rope import rope
from rlx_tvm.testing import Case, GradCase, check_gradients, check_nth_order, check_second_order, run_cases
from rlx_tvm.testing.samples import outputs
from rlx_tvm.testing.samples.rope import B, CASES, H, PARTIAL, S, np_rope, rope_tables

from .helpers import assert_op_error, tensor_var

RNG = np.random.default_rng(11)


def test_reference_matches_independent_numpy():
    """The op module's references against the rotation-matrix implementation above (the
    backward: the transposed matrices)."""
    for case in CASES:
        act = "x" if case.op == "rope" else "dy"
        ins = case.inputs
        expected = np_rope(ins[act], ins["cos"], ins["sin"], transpose=case.op == "rope_backward", **case.attrs)
        np.testing.assert_allclose(case.reference(), expected, rtol=1e-12, atol=1e-12, err_msg=case.name)


def test_every_combination_is_covered():
    """Partial rotary: every (op, style, table kind, layout); full rotary: every (op, style)."""
    partial = {(c.op, c.attrs["style"], c.inputs["cos"].shape[0] == B * S, next(iter(c.inputs.values())).ndim)
               for c in CASES if "n_rot" in c.attrs}
    full = {(c.op, c.attrs["style"]) for c in CASES if "n_rot" not in c.attrs}
    assert len(partial) == 16 and len(full) == 4, (sorted(partial), sorted(full))
    assert all(c.batch is not None for c in CASES)


# -- SPEC §8 traps ------------------------------------------------------------------------------


def _output_of(case, path):
    return outputs("float64", False, path)[case.name]


@pytest.mark.parametrize("path", ["fused", "decomposed"])
def test_partial_rotary_and_multi_head_rank3(path):
    """n_rot < head_dim, both styles, both layouts, both table kinds, 3 heads: the dims >= n_rot of
    every head are copied exactly, and a rank-3 [B, S, H*head_dim] input gives exactly the rank-4
    result (heads are contiguous blocks; mixing them, e.g. by a reshape to [B*H, S, hd] without a
    transpose, would rotate the wrong numbers)."""
    for (style, per_token), group in PARTIAL.items():
        for op, act in (("rope", "x"), ("rope_backward", "dy")):
            c4, c3 = group[(op, 4)], group[(op, 3)]
            x4, y4, y3 = c4.inputs[act], _output_of(c4, path), _output_of(c3, path)
            np.testing.assert_array_equal(y3.reshape(y4.shape), y4, err_msg=c3.name)
            np.testing.assert_array_equal(y4[..., 4:], x4[..., 4:], err_msg=c4.name)
            expected = np_rope(x4, c4.inputs["cos"], c4.inputs["sin"], transpose=op == "rope_backward", **c4.attrs)
            np.testing.assert_allclose(y4, expected, rtol=1e-12, atol=1e-12, err_msg=c4.name)
            assert np.abs(y4[..., :4] - x4[..., :4]).max() > 0.1  # the rotary dims did rotate


@pytest.mark.parametrize("path", ["fused", "decomposed"])
def test_backward_is_transpose_of_forward(path):
    """<rope(x), dy> == <x, rope_backward(dy)> with the same tables (adjoint identity through the kernels)."""
    for group in PARTIAL.values():
        for rank in (3, 4):
            fwd, bwd = group[("rope", rank)], group[("rope_backward", rank)]
            y, dx = _output_of(fwd, path), _output_of(bwd, path)
            lhs, rhs = np.sum(y * bwd.inputs["dy"]), np.sum(fwd.inputs["x"] * dx)
            np.testing.assert_allclose(lhs, rhs, rtol=1e-12, err_msg=fwd.name)


def test_single_batch_tables_agree():
    """B == 1: [S, n/2] reads as per position and per token alike; both give the same result."""
    x = RNG.standard_normal((1, S, H * 4))
    cos, sin = rope_tables(S, 4)
    out = run_cases([Case("rope", {"x": x, "cos": cos, "sin": sin}, {"head_dim": 4})], "float64", False, "fused")[0]
    np.testing.assert_allclose(out, np_rope(x, cos, sin, head_dim=4), rtol=1e-12, atol=1e-12)


def test_autodiff_through_rope():
    """Gradient of rlx.rope: rope_backward for x, and the true gradients of both tables."""

    def build(per_token):
        attrs = {"head_dim": 6, "n_rot": 4, "style": "gptj" if per_token else "neox"}
        return lambda x, cos, sin, w: relax.op.sum(relax.op.multiply(rope(x, cos, sin, **attrs), w))

    cases = []
    for per_token in (False, True):
        cos, sin = rope_tables(B * S if per_token else S, 4)
        shape = (B, S, H * 6) if per_token else (B, S, H, 6)
        ins = {"x": RNG.standard_normal(shape), "cos": cos, "sin": sin, "w": RNG.standard_normal(shape)}
        cases.append(GradCase(f"rope(per_token={per_token})", ins, build(per_token), wrt=["x", "cos", "sin"]))
    check_gradients(cases, "float64")


def test_second_order_through_rope():
    """Hessian-vector products of a non-linear loss of rope (x and both tables): the gradient rule's
    rope_backward and table gradients decompose into primitives that are differentiated again."""
    op = relax.op
    cos, sin = rope_tables(S, 4)
    x = RNG.standard_normal((B, S, H * 6))

    def loss(x, cos, sin):
        y = rope(x, cos, sin, head_dim=6, n_rot=4, style="gptj")
        return op.sum(op.exp(op.multiply(y, relax.const(0.3, "float64"))))

    case = GradCase("rope", {"x": x, "cos": cos, "sin": sin}, loss)
    check_second_order([case])
    check_nth_order([case], order=3)


def test_half_precision_computes_in_float32():
    """float16 inputs: both paths compute in float32 and round once, so they match the float64
    reference of the float16-cast inputs to float16 output precision."""
    cases = CASES[:2] + CASES[8:10] + CASES[-3:]
    for path in ("fused", "decomposed"):
        for c, out in zip(cases, run_cases(cases, "float16", symbolic=False, path=path)):
            assert out.dtype == np.float16
            ref = c.reference("float16")
            np.testing.assert_allclose(out, ref, rtol=2e-3, atol=2e-3 * max(1.0, np.abs(ref).max()), err_msg=f"{path} {c.name}")


# -- bad input ------------------------------------------------------------------------------------


def _call(op="rope_backward", act_shape=(2, 3, 8), cos_shape=(3, 2), sin_shape=None, dtype="float32", **attrs):
    act = tensor_var("x" if op == "rope" else "dy", act_shape, dtype)
    cos = tensor_var("cos", cos_shape)
    sin = tensor_var("sin", sin_shape or cos_shape)
    return lambda: get_op(op)(act, cos, sin, **{"head_dim": 4, **attrs})


def test_bad_input_rank_and_dtype():
    assert_op_error(_call(act_shape=(6, 8)), "rope_backward", "dy", "rank in [3, 4]", "rank 2")
    assert_op_error(_call(cos_shape=(3, 2, 1)), "rope_backward", "cos", "rank 2")
    assert_op_error(_call(act_shape=(2, 3, 8), dtype="float64"), "rope_backward", "cos", "float64", "float32")
    assert_op_error(_call("rope", act_shape=(2, 3, 8), dtype="int32"), "rope", "x", "int32")


def test_bad_input_attributes():
    assert_op_error(_call(n_rot=3), "rope_backward", "n_rot", "even", "3")
    assert_op_error(_call(n_rot=6, cos_shape=(3, 3)), "rope_backward", "n_rot", "<= head_dim = 4", "6")
    assert_op_error(_call(style="llama"), "rope_backward", "style", "neox", "llama")
    assert_op_error(_call(head_dim=5, act_shape=(2, 3, 10)), "rope_backward", "head_dim", "even")
    assert_op_error(_call("rope", head_dim="4"), "rope", "head_dim", "an integer")
    x, cos = tensor_var("x", (2, 3, 8)), tensor_var("cos", (3, 2))
    assert_op_error(lambda: rope(x, cos, tensor_var("sin", (3, 2))), "rope", "head_dim", "required")


def test_bad_input_layouts():
    assert_op_error(_call(act_shape=(2, 3, 10)), "rope_backward", "dy", "divisible by head_dim = 4", "10")
    assert_op_error(_call(act_shape=(2, 3, 2, 8)), "rope_backward", "dy", "last dim == head_dim = 4", "8")


def test_bad_input_tables():
    assert_op_error(_call(cos_shape=(3, 2), sin_shape=(3, 1)), "rope_backward", "sin", "[3, 2]", "[3, 1]")
    assert_op_error(_call(cos_shape=(3, 3)), "rope_backward", "cos", "dim 1 == n_rot/2 = 2", "3")
    # 5 rows: neither S = 3 (per position) nor B*S = 6 (per token).
    assert_op_error(_call(cos_shape=(5, 2)), "rope_backward", "cos", "S = 3", "B*S = 6", "5")
    # A symbolic row count that is not provably S or B*S.
    x = tensor_var("x", (tirx.Var("n", "int64"), 3, 8))
    m = tirx.Var("m", "int64")
    cos, sin = tensor_var("cos", (m, 2)), tensor_var("sin", (m, 2))
    assert_op_error(lambda: rope(x, cos, sin, head_dim=4), "rope", "cos", "one row per token")
