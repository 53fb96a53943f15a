import functools

import numpy as np
import pytest
from tvm import relax, tirx

from rlx_tvm.ops import get_op
from rlx_tvm.ops.rope import STYLES, rope
from rlx_tvm.testing import (
    Case,
    GradCase,
    check_finite_differences,
    check_gradients,
    check_nth_order,
    check_second_order,
    compare,
    run_cases,
)

from .helpers import MATRIX, assert_op_error, tensor_var

RNG = np.random.default_rng(11)
B, S, H = 2, 3, 2


# -- an independent NumPy rope: one explicit rotation matrix per table row ------------------------


def _pairs(n_rot, style):
    h = n_rot // 2
    return [(i, i + h) for i in range(h)] if style == "neox" else [(2 * i, 2 * i + 1) for i in range(h)]


def rotation_matrices(cos, sin, head_dim, n_rot, style):
    """[rows, head_dim, head_dim]: identity except the 2x2 rotation [[c, -s], [s, c]] on each pair."""
    rows = cos.shape[0]
    r = np.tile(np.eye(head_dim), (rows, 1, 1))
    for k, (i, j) in enumerate(_pairs(n_rot, style)):
        c, s = cos[:, k], sin[:, k]
        r[:, i, i], r[:, i, j], r[:, j, i], r[:, j, j] = c, -s, s, c
    return r


def np_rope(x, cos, sin, *, head_dim, n_rot=None, style="neox", transpose=False):
    n_rot = head_dim if n_rot is None else n_rot
    b, s = x.shape[:2]
    x4 = x.reshape(b, s, -1, head_dim)
    r = rotation_matrices(cos, sin, head_dim, n_rot, style)
    if transpose:
        r = r.transpose(0, 2, 1)
    rows = np.arange(s)[None, :].repeat(b, 0) if cos.shape[0] == s else np.arange(b * s).reshape(b, s)
    return np.einsum("bsij,bshj->bshi", r[rows], x4).reshape(x.shape)


# -- cases ------------------------------------------------------------------------------------------
#
# Cases come in groups sharing one table pair and one set of attributes. A "partial" group (3 heads,
# head_dim 6, n_rot 4) holds rope and rope_backward, each on a [B, S, H, hd] array and on the same
# array viewed as [B, S, H*hd]: the trap tests compare those outputs with each other. The full-rotary
# cases (n_rot == head_dim) have each op with each style, table kinds and layouts alternating; two more
# make the sequence length S the symbolic dim.


def _tables(rows, n_rot):
    ang = RNG.uniform(-np.pi, np.pi, (rows, n_rot // 2))
    return np.cos(ang), np.sin(ang)


def _case(op, act_value, cos, sin, attrs, label, batch):
    act = "x" if op == "rope" else "dy"
    case = Case(op, {act: act_value, "cos": cos, "sin": sin}, attrs, batch=batch, label=label)
    if op == "rope_backward":
        # dx is the VJP of the forward rope (linear in x, so any x): finite differences of np_rope.
        case.forward = functools.partial(np_rope, **attrs)
        case.wrt = "x"
        case.fd_extra = {"x": RNG.standard_normal(act_value.shape)}
    return case


def _group(style, per_token, heads, head_dim, n_rot, layouts, symbolic_seq=False):
    """{(op, rank): Case} for the given (op, rank) layouts."""
    cos, sin = _tables(B * S if per_token else S, n_rot)
    attrs = {"head_dim": head_dim, "style": style}
    if n_rot != head_dim:
        attrs["n_rot"] = n_rot
    if symbolic_seq:  # S is the symbolic dim n: per-token tables have B*n rows, per-position ones n
        act_dim, table_spec = 1, ((0, B) if per_token else 0)
    else:  # B is the symbolic dim n: per-token tables have n*S rows, per-position ones stay static
        act_dim, table_spec = 0, ((0, S) if per_token else None)
    tables = {} if table_spec is None else {"cos": table_spec, "sin": table_spec}
    out = {}
    for op, rank in layouts:
        act = "x" if op == "rope" else "dy"
        x4 = RNG.standard_normal((B, S, heads, head_dim))
        value = x4 if rank == 4 else x4.reshape(B, S, heads * head_dim)
        label = f"{op}[{style},rank{rank},{'token' if per_token else 'position'},H={heads},n_rot={n_rot}/{head_dim}]"
        out[(op, rank)] = _case(op, value, cos, sin, attrs, label + (" symbolic S" if symbolic_seq else ""),
                                {act: act_dim, **tables})
    return out


def _partial_group(style, per_token):
    g = _group(style, per_token, 3, 6, 4, [("rope", 4), ("rope_backward", 4)])
    for op, act in (("rope", "x"), ("rope_backward", "dy")):  # the same numbers in rank 3
        c = g[(op, 4)]
        flat = Case(op, {**c.inputs, act: c.inputs[act].reshape(B, S, -1)}, c.attrs, batch=c.batch,
                    label=c.label.replace("rank4", "rank3"), forward=c.forward, wrt=c.wrt)
        if c.fd_extra:
            flat.fd_extra = {"x": c.fd_extra["x"].reshape(B, S, -1)}
        g[(op, 3)] = flat
    return g


FULL = [("rope", "neox", True, 4), ("rope_backward", "neox", False, 3), ("rope", "gptj", False, 3), ("rope_backward", "gptj", True, 4)]
PARTIAL = {(style, per_token): _partial_group(style, per_token) for style in STYLES for per_token in (False, True)}


def _cases():
    cases = [c for g in PARTIAL.values() for c in g.values()]
    for op, style, per_token, rank in FULL:
        cases += _group(style, per_token, 2, 4, 4, [(op, rank)]).values()
    cases += _group("neox", True, 2, 6, 4, [("rope", 3)], symbolic_seq=True).values()
    cases += _group("gptj", False, 2, 4, 4, [("rope_backward", 4)], symbolic_seq=True).values()
    return cases


CASES = _cases()


@functools.lru_cache(maxsize=None)
def outputs(dtype, symbolic, path):
    """Every selected case's output, compiled once per (dtype, shape mode, path) for all tests."""
    return run_cases(CASES, dtype, symbolic=symbolic, path=path)


@pytest.mark.parametrize("dtype,shape_mode,path", MATRIX)
def test_matches_reference(dtype, shape_mode, path):
    symbolic = shape_mode == "symbolic"
    selected = [c for c in CASES if c.batch is not None] if symbolic else CASES
    problems = [(c.name, compare(o, c.reference(dtype), dtype)) for c, o in zip(selected, outputs(dtype, symbolic, path))]
    failures = [f"{n}: {p}" for n, p in problems if p]
    assert not failures, f"{len(failures)} of {len(selected)} cases differ:\n" + "\n".join(failures)


def test_finite_differences():
    check_finite_differences(CASES)


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
    return outputs("float64", False, path)[next(i for i, c in enumerate(CASES) if c is case)]


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
    cos, sin = _tables(S, 4)
    out = run_cases([Case("rope", {"x": x, "cos": cos, "sin": sin}, {"head_dim": 4})], "float64", False, "fused")[0]
    np.testing.assert_allclose(out, np_rope(x, cos, sin, head_dim=4), rtol=1e-12, atol=1e-12)


def test_autodiff_through_rope():
    """Gradient of rlx.rope: rope_backward for x, and the true gradients of both tables."""

    def build(per_token):
        attrs = {"head_dim": 6, "n_rot": 4, "style": "gptj" if per_token else "neox"}
        return lambda x, cos, sin, w: relax.op.sum(relax.op.multiply(rope(x, cos, sin, **attrs), w))

    cases = []
    for per_token in (False, True):
        cos, sin = _tables(B * S if per_token else S, 4)
        shape = (B, S, H * 6) if per_token else (B, S, H, 6)
        ins = {"x": RNG.standard_normal(shape), "cos": cos, "sin": sin, "w": RNG.standard_normal(shape)}
        cases.append(GradCase(f"rope(per_token={per_token})", ins, build(per_token), wrt=["x", "cos", "sin"]))
    check_gradients(cases, "float64")


def test_second_order_through_rope():
    """Hessian-vector products of a non-linear loss of rope (x and both tables): the gradient rule's
    rope_backward and table gradients decompose into primitives that are differentiated again."""
    op = relax.op
    cos, sin = _tables(S, 4)
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
