"""cumsum_backward and gather_backward: both paths vs NumPy, finite differences of independent
NumPy forwards (np.cumsum, np.take), the SPEC §8 traps, bad input, and the gradient rules of
R.cumsum / R.take."""

import numpy as np
import pytest
import tvm
from tvm import relax

from rlx_tvm import autodiff, ops
from rlx_tvm.ops.indexing import SCAN_BLOCK
from rlx_tvm.passes import DecomposeBackwardOps, count_rlx_calls
from rlx_tvm.testing import Case, GradCase, build_module, check_cases, check_finite_differences, run_cases

from .helpers import MATRIX, assert_op_error, emit_call, tensor_var

RNG = np.random.default_rng(11)
op = relax.op


def _cumsum_forward(axis, exclusive):
    def forward(x):
        y = np.cumsum(x, axis=axis)
        return y - x if exclusive else y

    return forward


def _take_forward(axis):
    return lambda x, indices: np.take(x, indices, axis=axis)


def _cumsum_case(shape, axis, exclusive=False, batch=None, fd=False, label=""):
    dy = RNG.standard_normal(shape)
    return Case(
        "cumsum_backward", {"dy": dy}, {"axis": axis, "exclusive": exclusive}, batch=batch,
        label=label or f"cumsum_backward[{shape}, axis={axis}, exclusive={exclusive}]",
        forward=_cumsum_forward(axis, exclusive) if fd else None, wrt="x",
        fd_extra={"x": RNG.standard_normal(shape)} if fd else {},
    )


def _gather_case(x_shape, indices, axis, batch=None, fd=False, label=""):
    """dy for take(x, indices, axis) with x of ``x_shape``."""
    ax = axis % len(x_shape)
    dy_shape = x_shape[:ax] + indices.shape + x_shape[ax + 1:]
    return Case(
        "gather_backward", {"dy": RNG.standard_normal(dy_shape), "indices": indices},
        {"axis": axis, "dim_size": x_shape[ax]}, batch=batch,
        label=label or f"gather_backward[x{x_shape}, idx{indices.shape} {indices.dtype}, axis={axis}]",
        forward=_take_forward(axis) if fd else None, wrt="x",
        fd_extra={"x": RNG.standard_normal(x_shape)} if fd else {},
    )


def _cases():
    i32, i64 = np.int32, np.int64
    return [
        # cumsum: short rows (one block), several blocks with a partial last one, symbolic length,
        # axis 0 and a middle axis of rank 3, length 1.
        _cumsum_case((2, 9), 1, fd=True, batch={"dy": 0}),
        _cumsum_case((2, 9), -1, exclusive=True, fd=True, batch={"dy": 0}),
        _cumsum_case((1, 2 * SCAN_BLOCK + 7), 1, exclusive=True, fd=True, batch={"dy": 1},
                     label="cumsum_backward[multi-block, symbolic length]"),
        _cumsum_case((3, 3 * SCAN_BLOCK + 1), 1, batch={"dy": 1}),
        _cumsum_case((5, 3, 2), 0, fd=True, batch={"dy": 1}),
        _cumsum_case((2, SCAN_BLOCK + 5, 3), 1, exclusive=True, batch={"dy": 0}),
        _cumsum_case((2, 3, 4), -2, fd=True, batch={"dy": 2}),
        _cumsum_case((3, 1), 1, exclusive=True, batch={"dy": 0}),
        # gather: embedding-style axis 0 with duplicates and negatives, a symbolic index count.
        _gather_case((5, 3), np.array([0, 3, 3, -1, 2, -5], i32), 0, fd=True, batch={"dy": 0, "indices": 0}),
        _gather_case((4, 6), np.array([1, -1, 1, 0], i64), 1, fd=True, batch={"dy": 0}),
        _gather_case((2, 3, 4), np.array([[0, 2, 2], [-1, 1, 0]], i64), 1, fd=True, batch={"dy": 0}),
        _gather_case((3, 2, 5), np.array([4, -2, 0, 4], i32), -1, fd=True, batch={"dy": 1}),
        _gather_case((4,), np.array([3, 3, -4, 1], i64), 0, fd=True, batch={"dy": 0, "indices": 0}),
        # rows of features wide enough for the CPU kernel's chunks of 64 (3 chunks) and of 16 (80 = 5 x 16)
        _gather_case((9, 192), np.array([0, 8, 8, -1, 3, -9, 2], i64), 0, batch={"dy": 0, "indices": 0},
                     label="gather_backward[192 features: chunks of 64]"),
        _gather_case((3, 5, 80), np.array([4, 0, -1, 4], i32), 1, batch={"dy": 0},
                     label="gather_backward[80 features: chunks of 16]"),
        # indices outside [-dim_size, dim_size) are dropped at run time (np.take would raise, no FD)
        _gather_case((6, 2), np.array([7, -7, 5, -6, 100], i32), 0, batch={"dy": 0, "indices": 0},
                     label="gather_backward[runtime out-of-range dropped]"),
    ]


CASES = _cases()


@pytest.mark.parametrize("dtype,shape_mode,path", MATRIX)
def test_matches_reference(dtype, shape_mode, path):
    check_cases(CASES, dtype, symbolic=shape_mode == "symbolic", path=path)


def test_finite_differences():
    check_finite_differences(CASES)


@pytest.mark.parametrize("dtype,symbolic", [("float64", False), ("float32", False), ("float64", True)])
def test_gpu_form_of_cumsum_matches_reference(dtype, symbolic):
    """GPU targets legalize cumsum_backward to blocked reductions (the CPU gets a serial scan):
    that TE compute, built for the CPU here, on every cumsum case."""
    cases = [c for c in CASES if c.op == "cumsum_backward"]
    mod = build_module(cases[:1], dtype, False)
    with tvm.target.Target("cuda"):
        gpu = relax.transform.LegalizeOps()(mod)
    assert "cumsum_backward_in_block" in gpu.script()  # the blocked form, not the scan
    check_cases(cases, dtype, symbolic, "fused", legalize_for="cuda")


@pytest.mark.parametrize("dtype,symbolic", [("float64", False), ("float32", False), ("float64", True)])
def test_gpu_form_of_gather_matches_reference(dtype, symbolic):
    """GPU targets legalize gather_backward to the row-blocked reduction (one owner per block of
    output rows and feature: thread-bindable, race-free); the CPU gets the chunked scatter. That
    TIR, built for the CPU here, on every gather case."""
    cases = [c for c in CASES if c.op == "gather_backward"]
    mod = build_module(cases[:1], dtype, False)
    with tvm.target.Target("cuda"):
        gpu = relax.transform.LegalizeOps()(mod)
    assert "T.init()" in gpu.script()  # the reduction-block form, not the chunked scatter
    check_cases(cases, dtype, symbolic, "fused", legalize_for="cuda")


def test_gpu_form_of_gather_blocks_rows_and_skips_bad_indices():
    """Blocks of several rows with a short last block (1000 rows in blocks of 24), two outer
    slices, duplicates, negative and out-of-range indices, in the GPU form built for the CPU."""
    from rlx_tvm.kernels.cpu.indexing import scatter_add_kernel

    rng = np.random.default_rng(3)
    outer, n_idx, inner, dim = 2, 300, 768, 1000
    func = scatter_add_kernel("float32", "float32", "int64", outer, n_idx, inner, dim, chunked=False)
    assert "T.min(vb * T.int64(24) + T.int64(24), T.int64(1000))" in func.script()  # 42 blocks, the last short
    lib = tvm.tirx.build(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")
    dy = rng.standard_normal((outer, n_idx, inner)).astype("float32")
    idx = rng.integers(-dim - 5, dim + 5, n_idx)
    idx[:20] = 999  # a busy row in the short block
    out = tvm.runtime.empty((outer, dim, inner), "float32")
    lib(tvm.runtime.tensor(dy), tvm.runtime.tensor(idx), out)
    expected = np.zeros((outer, dim, inner))
    keep = (idx >= -dim) & (idx < dim)
    np.add.at(expected, (slice(None), idx[keep] % dim, slice(None)), dy[:, keep].astype(np.float64))
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-5)


def test_cpu_form_of_gather_clears_every_row_in_parts():
    """The CPU form's output cleared by memset in parts of whole rows (one per core): parts that
    do not divide the rows (7 rows in 3 parts: 3 + 3 + 1), more parts than rows, two outer slices,
    into an output that held NaN before; duplicate, negative and out-of-range indices."""
    from rlx_tvm.kernels.cpu.indexing import scatter_add_kernel

    rng = np.random.default_rng(4)
    for dtype, (outer, n_idx, inner, dim), parts in [("float32", (2, 40, 96, 7), 3), ("float64", (1, 9, 8, 2), 5),
                                                      ("float32", (2, 5, 16, 6), 1)]:
        func = scatter_add_kernel(dtype, dtype, "int64", outer, n_idx, inner, dim, clear_parts=parts)
        assert func.script().count("llvm.memset") == 1
        lib = tvm.tirx.build(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")
        dy = rng.standard_normal((outer, n_idx, inner)).astype(dtype)
        idx = rng.integers(-dim - 2, dim + 2, n_idx)
        idx[0] = idx[1] = 0
        out = tvm.runtime.tensor(np.full((outer, dim, inner), np.nan, dtype))
        lib(tvm.runtime.tensor(dy), tvm.runtime.tensor(idx), out)
        expected = np.zeros((outer, dim, inner))
        keep = (idx >= -dim) & (idx < dim)
        np.add.at(expected, (slice(None), idx[keep] % dim, slice(None)), dy[:, keep].astype(np.float64))
        np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-5, err_msg=f"{dtype} {dim} rows, {parts} parts")


# -- SPEC §8 traps ------------------------------------------------------------------------------


def _both_paths(cases, dtype="float64"):
    return {p: run_cases(cases, dtype, symbolic=False, path=p) for p in ("fused", "decomposed")}


def test_long_cumsum_float32_error_is_no_worse_than_flip_cumsum_flip():
    """No length cap (the reference design had 256), and no precision loss: lengths 4096 and 5000
    (not a multiple of the block) keep the float32 error within 2x of NumPy's float32 reverse scan."""
    lengths = (4096, 5000)
    dys = [RNG.standard_normal((2, n)) + 0.5 for n in lengths]  # a drift makes the sums large
    cases = [Case("cumsum_backward", {"dy": dy}, {"axis": 1}) for dy in dys]
    outs = _both_paths(cases, "float32")
    for i, dy in enumerate(dys):
        exact = np.cumsum(dy[:, ::-1], axis=1)[:, ::-1]  # float64
        d32 = dy.astype(np.float32)
        numpy32 = np.cumsum(d32[:, ::-1], axis=1, dtype=np.float32)[:, ::-1]
        budget = 2 * np.abs(numpy32 - exact).max()
        for path, results in outs.items():
            err = np.abs(results[i].astype(np.float64) - exact).max()
            assert err <= budget, (path, lengths[i], err, budget)


def test_exclusive_cumsum_is_strictly_after():
    dy = np.array([[1.0, 2.0, 3.0, 4.0]])
    cases = [Case("cumsum_backward", {"dy": dy}, {"axis": 1, "exclusive": e}) for e in (False, True)]
    for path, (incl, excl) in _both_paths(cases).items():
        np.testing.assert_array_equal(incl, [[10.0, 9.0, 7.0, 4.0]], err_msg=path)
        np.testing.assert_array_equal(excl, [[9.0, 7.0, 4.0, 0.0]], err_msg=path)


def test_cumsum_on_axis_0_and_middle_axis_of_rank_3():
    """dx along each axis equals an explicit upper-triangular matrix product (an independent oracle)."""
    dy = RNG.standard_normal((SCAN_BLOCK + 3, SCAN_BLOCK + 2, 3))
    axes = (0, 1)
    cases = [Case("cumsum_backward", {"dy": dy}, {"axis": a}) for a in axes]
    for path, results in _both_paths(cases).items():
        for a, out in zip(axes, results):
            n = dy.shape[a]
            upper = np.triu(np.ones((n, n)))  # dx_i = sum_{j >= i} dy_j
            expected = np.moveaxis(np.tensordot(upper, np.moveaxis(dy, a, 0), axes=1), 0, a)
            np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12, err_msg=f"{path} axis {a}")


def test_cpu_scan_along_the_contiguous_axis_is_vectorized():
    """With default CPU schedules, a cumsum along the last axis is one parallel loop over rows
    whose scan runs a vector at a time (lane shuffles; no serial chain per element): lengths with
    and without a tail, exclusive or not, symbolic rows and length, float32/float64/float16."""
    from rlx_tvm import build
    from rlx_tvm.target import cpu_target

    lengths = (1, 7, 8, 9, 64, 203)
    for dtype in ("float32", "float64", "float16"):
        cases = [Case("cumsum_backward", {"dy": RNG.standard_normal((3, n))}, {"axis": -1, "exclusive": e},
                      batch={"dy": int(e)})  # symbolic: rows for the inclusive ones, the length for the others
                 for n in lengths for e in (False, True)]
        for symbolic in (False, True):
            mod = build_module(cases, dtype, symbolic)
            lowered = build.lower(mod, cpu_target(), tuning_log=None, verbose=False)
            scans = [f.script() for g, f in lowered.functions.items() if g.name_hint.startswith("rlx_cumsum_backward")]
            assert scans and all("T.Shuffle" in s and s.count("T.parallel") == 1 for s in scans), scans[:1]
            vm = relax.VirtualMachine(tvm.compile(lowered, target=cpu_target()), tvm.cpu())
            for i, case in enumerate(cases):
                dy = case.cast_inputs(dtype)["dy"]
                got = vm[f"case_{i}"](tvm.runtime.tensor(dy)).numpy().astype(np.float64)
                exact = np.cumsum(dy.astype(np.float64)[:, ::-1], axis=1)[:, ::-1]
                want = exact - dy if case.attrs["exclusive"] else exact
                # one rounding to dtype, plus float64 summation-order error (ours and NumPy's)
                magnitude = np.cumsum(np.abs(dy.astype(np.float64))[:, ::-1], axis=1)[:, ::-1]
                tol = np.finfo(dtype).eps * np.maximum(np.abs(want), 1.0) + 8 * dy.shape[1] * 2.0**-52 * magnitude
                assert (np.abs(got - want) <= tol).all(), (dtype, symbolic, dy.shape, case.attrs)


def test_gather_duplicates_negatives_axis_and_index_dtypes():
    """Hand-computed adjoints: duplicate indices accumulate, -1 is the last row, axis 1 works, and
    int32 and int64 indices agree; out-of-range indices write nothing."""
    dy0 = np.arange(8.0).reshape(4, 2)  # rows r0..r3 of take(x[3, 2], [1, 1, -1, 0], 0)
    expected0 = np.array([dy0[3], dy0[0] + dy0[1], dy0[2]])
    dy1 = np.arange(12.0).reshape(2, 3, 2)  # take(x[2, 4, 2], [2, -4, 2], axis=1)
    expected1 = np.zeros((2, 4, 2))
    expected1[:, 0] = dy1[:, 1]
    expected1[:, 2] = dy1[:, 0] + dy1[:, 2]
    dy2 = np.ones((3, 2))
    cases = []
    for dt in (np.int32, np.int64):
        cases.append(Case("gather_backward", {"dy": dy0, "indices": np.array([1, 1, -1, 0], dt)}, {"axis": 0, "dim_size": 3}))
        cases.append(Case("gather_backward", {"dy": dy1, "indices": np.array([2, -4, 2], dt)}, {"axis": 1, "dim_size": 4}))
        cases.append(Case("gather_backward", {"dy": dy2, "indices": np.array([3, -4, 9], dt)}, {"axis": 0, "dim_size": 3}))
    for path, results in _both_paths(cases).items():
        for k in range(0, len(cases), 3):
            np.testing.assert_array_equal(results[k], expected0, err_msg=path)
            np.testing.assert_array_equal(results[k + 1], expected1, err_msg=path)
            np.testing.assert_array_equal(results[k + 2], np.zeros((3, 2)), err_msg=path)


def test_scalar_index_and_half_precision():
    """A 0-d index (take of one row) and float16 inputs (accumulated in float32), by hand: the
    shared runner cannot pass 0-d arrays (np.ascontiguousarray makes them 1-d)."""
    dy = RNG.standard_normal(4)
    half = RNG.standard_normal((64, 3)).astype(np.float16)
    idx = np.zeros(64, np.int64)  # 64 duplicates into one row: a float16 running sum would drift
    cases = [
        Case("gather_backward", {"dy": dy, "indices": np.array(2, np.int64)}, {"axis": 0, "dim_size": 3}),
        Case("gather_backward", {"dy": half, "indices": idx}, {"axis": 0, "dim_size": 2}),
        Case("cumsum_backward", {"dy": half}, {"axis": 0}),
    ]
    expected = [np.stack([np.zeros(4), np.zeros(4), dy]),
                np.stack([half.astype(np.float64).sum(0), np.zeros(3)]),
                np.cumsum(half.astype(np.float64)[::-1], 0)[::-1]]
    dtypes = ["float64", "float16", "float16"]
    for path in ("fused", "decomposed"):
        mods = {}
        for dt in ("float64", "float16"):
            chosen = [c for c, d in zip(cases, dtypes) if d == dt]
            mod = build_module(chosen, dt, symbolic=False)
            mod = DecomposeBackwardOps()(mod) if path == "decomposed" else mod
            mods[dt] = (relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu()), chosen)
        for case, dt, want in zip(cases, dtypes, expected):
            vm, chosen = mods[dt]
            args = [tvm.runtime.tensor(np.asarray(a)) for a in case.cast_inputs(dt).values()]
            out = vm[f"case_{chosen.index(case)}"](*args).numpy()
            assert out.dtype == np.dtype(dt)
            tol = 1e-12 if dt == "float64" else 2e-3 * max(1.0, np.abs(want).max())
            np.testing.assert_allclose(out.astype(np.float64), want, atol=tol, err_msg=f"{path} {case.op}")


# -- bad input ------------------------------------------------------------------------------------


def test_bad_input_cumsum():
    assert_op_error(lambda: ops.cumsum_backward(tensor_var("dy", (4, 5)), axis=2), "cumsum_backward", "axis", "[-2, 2)", "2")
    assert_op_error(lambda: ops.cumsum_backward(tensor_var("dy", (4, 5)), axis=-3), "cumsum_backward", "axis", "-3")
    assert_op_error(lambda: ops.cumsum_backward(tensor_var("dy", (4,), "int32"), axis=0), "cumsum_backward", "dy", "int32")
    assert_op_error(lambda: ops.cumsum_backward(tensor_var("dy", ()), axis=0), "cumsum_backward", "dy", "rank >= 1")
    assert_op_error(lambda: ops.cumsum_backward(tensor_var("dy", (4,)), axis=0, exclusive=1), "cumsum_backward", "exclusive", "bool")


def test_bad_input_gather_dtypes_and_attributes():
    dy = tensor_var("dy", (3, 4))
    assert_op_error(lambda: ops.gather_backward(dy, tensor_var("indices", (3,), "float32"), axis=0, dim_size=5),
                    "gather_backward", "indices", "float32")
    assert_op_error(lambda: ops.gather_backward(dy, tensor_var("indices", (3,), "int32"), axis=0, dim_size=0),
                    "gather_backward", "dim_size", "0")
    assert_op_error(lambda: ops.gather_backward(dy, tensor_var("indices", (3,), "int32"), axis=0, dim_size=-2),
                    "gather_backward", "dim_size", "-2")
    assert_op_error(lambda: ops.gather_backward(dy, tensor_var("indices", (3,), "int32"), axis=2, dim_size=5),
                    "gather_backward", "axis", "[-2, 2)")
    assert_op_error(lambda: ops.gather_backward(dy, tensor_var("indices", (3,), "int32"), axis=0),
                    "gather_backward", "dim_size", "required")


def test_bad_input_gather_shapes():
    idx = tensor_var("indices", (3,), "int64")
    assert_op_error(lambda: ops.gather_backward(tensor_var("dy", (4, 4)), idx, axis=0, dim_size=5),
                    "gather_backward", "dy", "[3]", "[4, 4]")
    assert_op_error(lambda: ops.gather_backward(tensor_var("dy", (4, 3, 2)), idx, axis=0, dim_size=5),
                    "gather_backward", "dy", "[4, 3, 2]")  # the index dims sit at axis 1, not 0
    assert_op_error(lambda: ops.gather_backward(tensor_var("dy", (3,)), tensor_var("indices", (3, 1), "int64"),
                                                axis=0, dim_size=5), "gather_backward", "dy", "rank >= 2")


def test_bad_input_gather_static_index_out_of_range():
    dy = tensor_var("dy", (3, 4))
    for bad in (5, -6):
        indices = relax.const(np.array([0, bad, 1], np.int32))
        assert_op_error(lambda: ops.gather_backward(dy, indices, axis=0, dim_size=5),
                        "gather_backward", "indices", "[-5, 5)", str(bad))
    # in-range constants are fine, negatives included
    emit_call(ops.gather_backward(dy, relax.const(np.array([0, -5, 4], np.int64)), axis=0, dim_size=5))


# -- gradient rules of R.cumsum and R.take (checked numerically by tests/test_gradients.py) ------


def _weighted(fn):
    return lambda x, w, *rest: op.sum(op.multiply(fn(x, *rest), w))


def _cube_sum(e):  # not quadratic, so the Hessian-vector products differentiate the decompositions
    return op.sum(op.multiply(op.multiply(e, e), e))


def _cubed(fn):
    return lambda x, *rest: _cube_sum(fn(x, *rest))


def _grad_cases():
    x = RNG.standard_normal((3, 40))
    idx = np.array([2, 0, 2, 1], np.int64)
    idx32 = np.array([[1, 1], [0, 3]], np.int32)
    scatter_idx = np.array([[0, 2, 2], [1, 1, 0]], np.int64)
    return [
        GradCase("relax.cumsum", {"x": x, "w": RNG.standard_normal((3, 40))},
                 _weighted(lambda t: op.cumsum(t, axis=1)), wrt=["x"]),
        GradCase("relax.cumsum(exclusive)", {"x": x[:, :6]},
                 _cubed(lambda t: op.cumsum(t, axis=0, exclusive=True)), wrt=["x"]),
        GradCase("relax.cumsum(axis=None)", {"x": x[:2, :3]}, _cubed(lambda t: op.cumsum(t)), wrt=["x"]),
        GradCase("relax.take(axis=0)", {"x": x[:, :4], "idx": idx}, _cubed(lambda t, i: op.take(t, i, axis=0)), wrt=["x"]),
        GradCase("relax.take(axis=1, 2-d int32 indices)", {"x": x[:, :5], "w": RNG.standard_normal((3, 2, 2)), "idx": idx32},
                 _weighted(lambda t, i: op.take(t, i, axis=1)), wrt=["x"]),
        GradCase("relax.flip", {"x": x[:, :4]}, _cubed(lambda t: op.flip(t, 1)), wrt=["x"]),
        GradCase("relax.gather_elements", {"x": x[:2, :3], "idx": scatter_idx[:, :2].copy()},
                 _cubed(lambda t, i: op.gather_elements(t, i, axis=1)), wrt=["x"]),
        GradCase("relax.scatter_elements(add)", {"x": x[:2, :3], "u": RNG.standard_normal((2, 3)), "idx": scatter_idx},
                 lambda t, u, i: _cube_sum(op.scatter_elements(t, i, u, axis=1, reduction="add")),
                 wrt=["x", "u"]),
        GradCase("relax.scatter_elements(update)",
                 {"x": x[:2, :3], "u": RNG.standard_normal((2, 2)), "idx": np.array([[2, 0], [1, 2]], np.int64)},
                 lambda t, u, i: _cube_sum(op.scatter_elements(t, i, u, axis=1)),
                 wrt=["x", "u"]),
    ]


GRAD_CASES = _grad_cases()


def test_gradient_rules_emit_the_rlx_ops():
    def adjoint_ops(build, shape, extra=()):
        bb = relax.BlockBuilder()
        x = relax.Var("x", relax.TensorType(list(shape), "float32"))
        with bb.function("main", [x, *extra]):
            with bb.dataflow():
                out = bb.emit_output(build(x, *extra))
            bb.emit_func_output(out)
        return count_rlx_calls(autodiff.grad(bb.get(), "main", wrt=["x"]))

    assert adjoint_ops(lambda x: op.sum(op.cumsum(x, axis=1, exclusive=True)), (2, 5)) == {"cumsum_backward": 1}
    idx = relax.Var("idx", relax.TensorType([3], "int32"))
    assert adjoint_ops(lambda x, i: op.sum(op.take(x, i, axis=0)), (7, 2), (idx,)) == {"gather_backward": 1}


def test_cumsum_gradient_rule_is_precise_on_length_4096():
    """autodiff of R.cumsum in float32 (the rule emits cumsum_backward, not sum - cumsum + g):
    error vs the float64 exact reverse scan within 2x of NumPy's float32 reverse scan."""
    n = 4096
    w = (RNG.standard_normal((2, n)) + 0.5).astype(np.float32)
    bb = relax.BlockBuilder()
    xv, wv = tensor_var("x", (2, n), "float32"), tensor_var("w", (2, n), "float32")
    with bb.function("main", [xv, wv]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.sum(relax.op.multiply(relax.op.cumsum(xv, axis=1), wv)))
        bb.emit_func_output(out)
    mod = autodiff.grad(bb.get(), "main", wrt=["x"])
    assert count_rlx_calls(mod).get("cumsum_backward") == 1
    vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
    _, (g,) = vm["main_adjoint"](tvm.runtime.tensor(np.zeros((2, n), np.float32)), tvm.runtime.tensor(w))
    exact = np.cumsum(w.astype(np.float64)[:, ::-1], axis=1)[:, ::-1]
    numpy32 = np.cumsum(w[:, ::-1], axis=1, dtype=np.float32)[:, ::-1]
    assert np.abs(g.numpy().astype(np.float64) - exact).max() <= 2 * np.abs(numpy32 - exact).max()
