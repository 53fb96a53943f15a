"""cumsum_backward and gather_backward: the GPU and CPU forms, the SPEC §8 traps, bad input, and
the gradient rules of R.cumsum / R.take. Values on the samples (rlx_tvm.testing.samples.indexing,
finite differences of np.cumsum and np.take) are checked by tests/test_ops.py."""

import numpy as np
import pytest
import tvm
from tvm import relax

from rlx_tvm import autodiff, ops
from rlx_tvm.ops.indexing import SCAN_BLOCK
from rlx_tvm.passes import count_rlx_calls
from rlx_tvm.testing import Case, build_module, compare
from rlx_tvm.testing.samples import gpu_form_outputs
from rlx_tvm.testing.samples.indexing import CASES

from .helpers import CaseGroups, assert_op_error, emit_call, tensor_var

RNG = np.random.default_rng(11)
op = relax.op


def _check_gpu_form(cases, dtype, symbolic):
    """The cases' outputs in the GPU form (built for the CPU) match their references."""
    outs = gpu_form_outputs(dtype, symbolic)
    selected = [c for c in cases if c.batch is not None or not symbolic]
    assert selected
    failures = [f"{c.name}: {p}" for c in selected if (p := compare(outs[c.name], c.reference(dtype), dtype))]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype,symbolic", [("float64", False), ("float32", False), ("float64", True)])
def test_gpu_form_of_cumsum_matches_reference(dtype, symbolic):
    """GPU targets legalize cumsum_backward to blocked reductions (the CPU gets a serial scan):
    that TE compute, built for the CPU here, on every cumsum case."""
    cases = [c for c in CASES if c.op == "cumsum_backward"]
    mod = build_module(cases[:1], dtype, False)
    with tvm.target.Target("cuda"):
        gpu = relax.transform.LegalizeOps()(mod)
    assert "cumsum_backward_in_block" in gpu.script()  # the blocked form, not the scan
    _check_gpu_form(cases, dtype, symbolic)


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
    _check_gpu_form(cases, dtype, symbolic)


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


LONG_LENGTHS = (4096, 5000)
LONG_DYS = [RNG.standard_normal((2, n)) + 0.5 for n in LONG_LENGTHS]  # a drift makes the sums large
EXCLUSIVE_DY = np.array([[1.0, 2.0, 3.0, 4.0]])
RANK3_DY = RNG.standard_normal((SCAN_BLOCK + 3, SCAN_BLOCK + 2, 3))
RANK3_AXES = (0, 1)
GATHER_DY0 = np.arange(8.0).reshape(4, 2)  # rows r0..r3 of take(x[3, 2], [1, 1, -1, 0], 0)
GATHER_DY1 = np.arange(12.0).reshape(2, 3, 2)  # take(x[2, 4, 2], [2, -4, 2], axis=1)
GATHER_DY2 = np.ones((3, 2))
SCALAR_INDEX_DY = RNG.standard_normal(4)
HALF_DY = RNG.standard_normal((64, 3)).astype(np.float16)


def _gather_trap_cases():
    cases = []
    for dt in (np.int32, np.int64):
        cases.append(Case("gather_backward", {"dy": GATHER_DY0, "indices": np.array([1, 1, -1, 0], dt)}, {"axis": 0, "dim_size": 3}))
        cases.append(Case("gather_backward", {"dy": GATHER_DY1, "indices": np.array([2, -4, 2], dt)}, {"axis": 1, "dim_size": 4}))
        cases.append(Case("gather_backward", {"dy": GATHER_DY2, "indices": np.array([3, -4, 9], dt)}, {"axis": 0, "dim_size": 3}))
    return cases


# The trap tests' cases, compiled together per (dtype, path).
TRAPS = CaseGroups({
    "long": ([Case("cumsum_backward", {"dy": dy}, {"axis": 1}) for dy in LONG_DYS], ("float32",)),
    "exclusive": ([Case("cumsum_backward", {"dy": EXCLUSIVE_DY}, {"axis": 1, "exclusive": e}) for e in (False, True)],
                  ("float64",)),
    "rank3": ([Case("cumsum_backward", {"dy": RANK3_DY}, {"axis": a}) for a in RANK3_AXES], ("float64",)),
    "gather": (_gather_trap_cases(), ("float64",)),
    "scalar index": ([Case("gather_backward", {"dy": SCALAR_INDEX_DY, "indices": np.array(2, np.int64)},
                           {"axis": 0, "dim_size": 3})], ("float64",)),
    # 64 duplicates into one row: a float16 running sum would drift
    "half": ([Case("gather_backward", {"dy": HALF_DY, "indices": np.zeros(64, np.int64)}, {"axis": 0, "dim_size": 2}),
              Case("cumsum_backward", {"dy": HALF_DY}, {"axis": 0})], ("float16",)),
})


def test_long_cumsum_float32_error_is_no_worse_than_flip_cumsum_flip():
    """No length cap (the reference design had 256), and no precision loss: lengths 4096 and 5000
    (not a multiple of the block) keep the float32 error within 2x of NumPy's float32 reverse scan."""
    outs = TRAPS.outputs("long", "float32")
    for i, dy in enumerate(LONG_DYS):
        exact = np.cumsum(dy[:, ::-1], axis=1)[:, ::-1]  # float64
        d32 = dy.astype(np.float32)
        numpy32 = np.cumsum(d32[:, ::-1], axis=1, dtype=np.float32)[:, ::-1]
        budget = 2 * np.abs(numpy32 - exact).max()
        for path, results in outs.items():
            err = np.abs(results[i].astype(np.float64) - exact).max()
            assert err <= budget, (path, LONG_LENGTHS[i], err, budget)


def test_exclusive_cumsum_is_strictly_after():
    for path, (incl, excl) in TRAPS.outputs("exclusive").items():
        np.testing.assert_array_equal(incl, [[10.0, 9.0, 7.0, 4.0]], err_msg=path)
        np.testing.assert_array_equal(excl, [[9.0, 7.0, 4.0, 0.0]], err_msg=path)


def test_cumsum_on_axis_0_and_middle_axis_of_rank_3():
    """dx along each axis equals an explicit upper-triangular matrix product (an independent oracle)."""
    dy = RANK3_DY
    for path, results in TRAPS.outputs("rank3").items():
        for a, out in zip(RANK3_AXES, results):
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
    dy0, dy1 = GATHER_DY0, GATHER_DY1
    expected0 = np.array([dy0[3], dy0[0] + dy0[1], dy0[2]])
    expected1 = np.zeros((2, 4, 2))
    expected1[:, 0] = dy1[:, 1]
    expected1[:, 2] = dy1[:, 0] + dy1[:, 2]
    for path, results in TRAPS.outputs("gather").items():
        for k in range(0, len(results), 3):
            np.testing.assert_array_equal(results[k], expected0, err_msg=path)
            np.testing.assert_array_equal(results[k + 1], expected1, err_msg=path)
            np.testing.assert_array_equal(results[k + 2], np.zeros((3, 2)), err_msg=path)


def test_scalar_index_and_half_precision():
    """A 0-d index (take of one row) and float16 inputs (accumulated in float32)."""
    dy, half = SCALAR_INDEX_DY, HALF_DY
    scalar_cases, half_cases = TRAPS.groups["scalar index"][0], TRAPS.groups["half"][0]
    assert scalar_cases[0].inputs["indices"].ndim == 0
    expected = [np.stack([np.zeros(4), np.zeros(4), dy]),
                np.stack([half.astype(np.float64).sum(0), np.zeros(3)]),
                np.cumsum(half.astype(np.float64)[::-1], 0)[::-1]]
    for path in ("fused", "decomposed"):
        outs = TRAPS.outputs("scalar index", "float64")[path] + TRAPS.outputs("half", "float16")[path]
        for case, dt, out, want in zip(scalar_cases + half_cases, ["float64", "float16", "float16"], outs, expected):
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
