"""conv2d backward ops: the references vs the exact adjoint of an independent NumPy conv2d, the
SPEC §8 traps through both paths (on the samples' outputs, checked against the references by
tests/test_ops.py), the CPU direct forms and their register tiles, the GPU forms, the
decomposition policy for symbolic shapes, bad input, and the gradient rule of R.nn.conv2d."""

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax, tirx

from rlx_tvm import build, ops
from rlx_tvm.passes import DecomposeBackwardOps, count_rlx_calls
from rlx_tvm.schedules.common import uses
from rlx_tvm.target import cpu_target
from rlx_tvm.testing import Case, build_module, compare, compile_and_run, run_cases
from rlx_tvm.testing.samples import gpu_form_outputs, outputs
from rlx_tvm.testing.samples.conv import CASE_BY_NAME, CASES, GRAD_CASES, adjoint_input, adjoint_weight, conv_cases

from .helpers import assert_op_error, tensor_var


def _outputs(dtype, symbolic, path):
    """Every conv sample's output by name (one module with every op's samples)."""
    return outputs(dtype, symbolic, path)


UNIT_STRIDE = [c for c in CASES if "unit stride" in c.label or "basic" in c.label]


def test_cpu_direct_forms_are_used_for_unit_stride():
    """The unit-stride cases legalize to the direct forms on the CPU (padded dy / channels-last x
    stages), to the gather forms for a GPU target; their values are checked by the matrix above
    and by test_gpu_form_matches_reference."""
    cpu = relax.transform.LegalizeOps()(build_module(UNIT_STRIDE, "float32", False)).script()
    assert "dy_pad" in cpu and "x_pad_nhwc" in cpu
    with tvm.target.Target("cuda"):
        gpu = relax.transform.LegalizeOps()(build_module(UNIT_STRIDE, "float32", False)).script()
    assert "dy_pad" not in gpu and "x_pad_nhwc" not in gpu


def _register_tiles(func: tirx.PrimFunc, lanes: int) -> list[tuple[str, int, int]]:
    """(block, accumulator registers, registers per tile row) of each register-blocked update
    block. A tile row is what one broadcast of the row side (the read that does not depend on the
    columns: conv2d dx's w, dw's dy) multiplies: the unrolled and vector loops of the output
    indices that this read does not depend on; the other unrolled loops make the rows."""
    loops, tiles = {}, []

    def visit_loop(loop):
        loops[loop.loop_var] = loop

    def visit_block(realize):
        block = realize.block
        spatial = {iv.var: v for iv, v in zip(block.iter_vars, realize.iter_values) if iv.iter_type == 0}
        tile = {var: [lp for lp in loops.values() if lp.kind in (tirx.ForKind.UNROLLED, tirx.ForKind.VECTORIZED)
                      and uses(v, lp.loop_var)] for var, v in spatial.items()}
        vector = [lp for lps in tile.values() for lp in lps if lp.kind == tirx.ForKind.VECTORIZED]
        if not block.name_hint.endswith("_update") or len(vector) != 1:
            return
        column = list(spatial)[-1]
        written = block.writes[0].source
        broadcast = [r for r in block.reads if not r.source.same_as(written)
                     and not any(uses(rg.min, column) for rg in r.region)]
        row_vars = {var for var in spatial if any(uses(rg.min, var) for r in broadcast for rg in r.region)}
        rows = int(np.prod([int(lp.extent) for var in row_vars for lp in tile[var]]))
        per_row = int(np.prod([int(lp.extent) for var, lps in tile.items() if var not in row_vars for lp in lps]))
        unit = lanes if int(vector[0].extent) % lanes == 0 else lanes // 2
        tiles.append((block.name_hint, rows * per_row // unit, per_row // unit))

    tvm_ffi.structural_walk(func.body, (tirx.For, visit_loop), order="pre")
    tvm_ffi.structural_walk(func.body, (tvm.s_tir.SBlockRealize, visit_block), order="post")
    return tiles


DIRECT_FORM_CASES = [*conv_cases("24-wide rows", 2, 8, 8, (6, 24), (3, 3), padding=1),
                     *conv_cases("56-wide rows", 1, 8, 8, (3, 56), (3, 3), padding=1),
                     *conv_cases("16-wide rows", 1, 8, 12, (4, 16), (2, 3), padding=(1, 1, 0, 1)),
                     *conv_cases("64 channels", 1, 64, 64, (4, 8), (3, 3), padding=1)]


@pytest.mark.parametrize("mcpu", ["znver3", "haswell", "znver4", "skylake-avx512"])
def test_direct_form_tiles_fit_the_vector_registers(mcpu):
    """The register-blocked tiles of the direct forms, as the default CPU schedule builds them for
    AVX2 (16 vector registers of 8 float32) and AVX-512 (32 of 16): accumulators at most
    TILE_ACCUMULATORS, and with one row's shared loads and a broadcast within the registers (more
    spill to the stack on every step: conv2d dw on AVX2, one thread, ran 1.5x slower with AVX-512's
    tiles)."""
    from rlx_tvm.schedules.common import vector_lanes, vector_registers
    from rlx_tvm.schedules.cpu import TILE_ACCUMULATORS

    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    lanes, registers = vector_lanes(target), vector_registers(target)
    assert (lanes, registers) == ((16, 32) if "avx512" in mcpu or mcpu == "znver4" else (8, 16))
    lowered = build.lower(build_module(DIRECT_FORM_CASES, "float32", False), target, tuning_log=None, verbose=False)
    funcs = [f for f in lowered.functions.values() if isinstance(f, tirx.PrimFunc)]
    assert len(funcs) == 8 and all('scope="local"' in f.script() for f in funcs)
    tiles = [t for f in funcs for t in _register_tiles(f, lanes)]
    assert len(tiles) == 8, tiles
    if mcpu == "znver3":  # conv2d dx's 56-wide rows on AVX2: 4 channels x 2 output rows of a vector
        assert ("conv2d_dx_acc_update", 8, 2) in tiles, tiles
    for name, accumulators, row in tiles:
        assert accumulators <= TILE_ACCUMULATORS and accumulators + row + 1 <= registers, (name, accumulators, row)
        assert accumulators >= 4, (name, accumulators, row)  # a tile, not one vector at a time


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_direct_forms_under_the_default_cpu_schedule(dtype):
    """The direct forms as rlx_tvm.compile schedules them when untuned (register-blocked tiles,
    local accumulators), on this machine's CPU."""
    lowered = build.lower(build_module(DIRECT_FORM_CASES, dtype, False), cpu_target(), tuning_log=None, verbose=False)
    funcs = [f for f in lowered.functions.values() if isinstance(f, tirx.PrimFunc)]
    assert len(funcs) == 8 and all('scope="local"' in f.script() for f in funcs)
    outs = compile_and_run(lowered, DIRECT_FORM_CASES, dtype, target=cpu_target())
    failures = [f"{c.name}: {p}" for c, o in zip(DIRECT_FORM_CASES, outs) if (p := compare(o, c.reference(dtype), dtype))]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype,symbolic", [("float64", False), ("float32", False), ("float64", True)])
def test_gpu_form_matches_reference(dtype, symbolic):
    """GPU targets keep the gather forms for every stride: those TE computes, built for the CPU."""
    outs = gpu_form_outputs(dtype, symbolic)
    selected = [c for c in CASES if c.batch is not None or not symbolic]
    failures = [f"{c.name}: {p}" for c in selected if (p := compare(outs[c.name], c.reference(dtype), dtype))]
    assert not failures, "\n".join(failures)


def test_reference_is_the_exact_adjoint_of_conv2d():
    """The op references (used by the matrix above) equal J^T dy of the independent conv2d."""
    for case in CASES:
        exact = adjoint_input(case) if case.op == "conv2d_backward_input" else adjoint_weight(case)
        np.testing.assert_allclose(case.reference(), exact, rtol=1e-12, atol=1e-12, err_msg=case.name)


def test_every_op_is_covered():
    assert {c.op for c in CASES} == {"conv2d_backward_input", "conv2d_backward_weight"}


# -- SPEC §8 traps: each runs both paths, static and symbolic batch, vs the exact adjoint ----------


def _check_trap(*labels):
    """Both paths, static and symbolic batch, vs the exact adjoint of the independent conv2d."""
    cases = [c for c in CASES if any(label in c.name for label in labels)]
    assert {c.op for c in cases} == {"conv2d_backward_input", "conv2d_backward_weight"}
    for symbolic in (False, True):
        for path in ("fused", "decomposed"):
            outs = _outputs("float64", symbolic, path)
            for case in cases:
                exact = adjoint_input(case) if case.op == "conv2d_backward_input" else adjoint_weight(case)
                np.testing.assert_allclose(outs[case.name], exact, rtol=1e-10, atol=1e-10,
                                           err_msg=f"{case.name} {path} symbolic={symbolic}")


def test_weight_gradient_batch_2_and_3_both_paths():
    """A reshape without a transpose gets the weight gradient wrong as soon as batch > 1."""
    labels = ("basic batch 2", "groups 2, batch 3")
    assert {c.inputs["x"].shape[0] for c in CASES if c.op == "conv2d_backward_weight"
            and any(label in c.name for label in labels)} == {2, 3}
    _check_trap(*labels)


def test_groups_2_and_depthwise():
    _check_trap("groups 2", "depthwise")


def test_stride_2_with_odd_input_size_gives_dropped_rows_their_gradient():
    name = "conv2d_backward_input[stride 2 odd input, groups 2, batch 3]"
    exact = adjoint_input(CASE_BY_NAME[name])
    assert np.all(exact[:, :, 6, :] == 0) and np.all(exact[:, :, :, 7] == 0)  # no window reaches them
    assert np.all(exact[:, :, 5, :7] != 0)  # (a reached row, for contrast)
    _check_trap("stride 2 odd input")
    for path in ("fused", "decomposed"):
        out = _outputs("float64", False, path)[name]
        assert np.all(out[:, :, 6, :] == 0) and np.all(out[:, :, :, 7] == 0), path


def test_dilation_2():
    _check_trap("depthwise dilation 2", "mixed stride/dilation")


def test_half_precision_accumulates_in_float32():
    """A weight gradient summing 8*31*31 = 7688 products: float16 accumulation would be off by
    ~1e-2 relative; accumulating in float32 leaves only the output's rounding (<= 4.9e-4)."""
    case = next(c for c in conv_cases("half", 8, 2, 2, (33, 33), (3, 3)) if c.op == "conv2d_backward_weight")
    ref = case.reference("float16")  # exact math on the float16-rounded inputs
    for path in ("fused", "decomposed"):
        (out,) = run_cases([case], "float16", symbolic=False, path=path)
        assert out.dtype == np.float16
        err = np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max()
        assert err < 1e-3, (path, err)


# -- decomposition policy (SPEC §7) -----------------------------------------------------------


def test_symbolic_batch_is_decomposed_and_other_symbolic_dims_keep_the_fused_kernel():
    n, m, c = tirx.Var("n", "int64"), tirx.Var("m", "int64"), tirx.Var("c", "int64")
    geometry = dict(stride=2, padding=1)
    calls = {
        "input, symbolic batch": (ops.conv2d_backward_input(tensor_var("dy", (n, 4, 3, 3)), tensor_var("w", (4, 2, 3, 3)),
                                                            input_size=(6, 6), **geometry), True),
        "input, symbolic channels": (ops.conv2d_backward_input(tensor_var("dy", (n, c, 3, 3)), tensor_var("w", (c, 2, 3, 3)),
                                                               input_size=(6, 6), **geometry), False),
        "weight, shared symbolic batch": (ops.conv2d_backward_weight(tensor_var("x", (n, 2, 6, 6)), tensor_var("dy", (n, 4, 3, 3)),
                                                                     kernel_size=3, **geometry), True),
        "weight, different batch vars": (ops.conv2d_backward_weight(tensor_var("x", (n, 2, 6, 6)), tensor_var("dy", (m, 4, 3, 3)),
                                                                    kernel_size=3, **geometry), False),
    }
    for label, (call, decomposed) in calls.items():
        bb = relax.BlockBuilder()
        params = list(call.args)
        with bb.function("main", params):
            with bb.dataflow():
                out = bb.emit_output(bb.emit(call))
            bb.emit_func_output(out)
        left = count_rlx_calls(DecomposeBackwardOps()(bb.get()))
        assert (not left) == decomposed, (label, left)


def test_fused_kernel_with_symbolic_channels():
    """A case the decomposition refuses: symbolic (output) channels, through the fused kernel."""
    case = CASE_BY_NAME["conv2d_backward_input[stride 2 odd input, groups 2, batch 3]"]
    wcase = CASE_BY_NAME["conv2d_backward_weight[stride 2 odd input, groups 2, batch 3]"]
    # (Every symbolic var must also appear bare in some input shape for the VM to bind it.)
    sym_in = Case(case.op, case.inputs, case.attrs, batch={"dy": 1, "w": 0}, label="symbolic output channels")
    sym_w = Case(wcase.op, wcase.inputs, wcase.attrs, batch={"dy": 1}, label="symbolic output channels")
    mod = DecomposeBackwardOps()(build_module([sym_in, sym_w], "float64", symbolic=True))
    assert count_rlx_calls(mod) == {"conv2d_backward_input": 1, "conv2d_backward_weight": 1}
    out_in, out_w = run_cases([sym_in, sym_w], "float64", symbolic=True, path="decomposed")
    np.testing.assert_allclose(out_in, adjoint_input(case), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(out_w, adjoint_weight(wcase), rtol=1e-10, atol=1e-10)


# -- bad input ------------------------------------------------------------------------------------


def _bwd_input(dy_shape, w_shape, dtype="float32", w_dtype=None, **attrs):
    return lambda: ops.conv2d_backward_input(tensor_var("dy", dy_shape, dtype), tensor_var("w", w_shape, w_dtype or dtype), **attrs)


def _bwd_weight(x_shape, dy_shape, dtype="float32", **attrs):
    return lambda: ops.conv2d_backward_weight(tensor_var("x", x_shape, dtype), tensor_var("dy", dy_shape, dtype), **attrs)


def test_bad_input_wrong_layout_rank():
    assert_op_error(_bwd_input((2, 4, 3), (4, 2, 3, 3), input_size=(5, 5)), "conv2d_backward_input", "dy", "rank 4", "rank 3")
    assert_op_error(_bwd_weight((2, 2, 5, 5), (2, 4, 3, 3, 1), kernel_size=3), "conv2d_backward_weight", "dy", "rank 4")


def test_bad_input_mismatched_channels_and_groups():
    assert_op_error(_bwd_input((2, 5, 3, 3), (4, 2, 3, 3), input_size=(5, 5)), "conv2d_backward_input", "dy", "output channels")
    assert_op_error(_bwd_input((2, 6, 3, 3), (6, 2, 3, 3), input_size=(5, 5), groups=4),
                    "conv2d_backward_input", "w", "divisible by groups=4")
    assert_op_error(_bwd_weight((2, 3, 5, 5), (2, 4, 3, 3), kernel_size=3, groups=2),
                    "conv2d_backward_weight", "x", "divisible by groups=2", "3")
    assert_op_error(_bwd_weight((2, 4, 5, 5), (2, 3, 3, 3), kernel_size=3, groups=2),
                    "conv2d_backward_weight", "dy", "divisible by groups=2")
    assert_op_error(_bwd_weight((2, 4, 5, 5), (3, 4, 3, 3), kernel_size=3), "conv2d_backward_weight", "dy", "batch")


def test_bad_input_kernel_larger_than_padded_input():
    assert_op_error(_bwd_input((1, 2, 1, 1), (2, 2, 5, 5), input_size=(3, 3), padding=0), "conv2d_backward_input", "w", "extent 5")
    assert_op_error(_bwd_weight((1, 2, 4, 4), (1, 2, 1, 1), kernel_size=3, dilation=2), "conv2d_backward_weight",
                    "kernel_size", "dilation 2", "extent 5")


def test_bad_input_dy_spatial_size_inconsistent_with_input_size():
    # 7x7 input, kernel 3, stride 2: the forward's output is 3x3.
    msg = assert_op_error(_bwd_input((1, 2, 4, 3), (2, 2, 3, 3), input_size=(7, 7), stride=2),
                          "conv2d_backward_input", "dy", "dim 2 == 3", "4")
    assert "input_size=(7, 7)" in msg
    assert_op_error(_bwd_weight((1, 2, 7, 7), (1, 2, 3, 4), kernel_size=3, stride=2), "conv2d_backward_weight", "dy", "dim 3 == 3")


def test_bad_input_attribute_values():
    base = dict(input_size=(5, 5))
    assert_op_error(_bwd_input((1, 2, 3, 3), (2, 2, 3, 3), stride=0, **base), "conv2d_backward_input", "stride", "[1, inf]")
    assert_op_error(_bwd_input((1, 2, 3, 3), (2, 2, 3, 3), dilation=(1, -1), **base), "conv2d_backward_input", "dilation")
    assert_op_error(_bwd_input((1, 2, 3, 3), (2, 2, 3, 3), padding=-1, **base), "conv2d_backward_input", "padding", "[0, inf]")
    assert_op_error(_bwd_input((1, 2, 3, 3), (2, 2, 3, 3), padding=(1, 1, 1), **base), "conv2d_backward_input", "padding", "4-tuple")
    assert_op_error(_bwd_input((1, 2, 3, 3), (2, 2, 3, 3), groups=0, **base), "conv2d_backward_input", "groups")
    assert_op_error(_bwd_input((1, 2, 3, 3), (2, 2, 3, 3)), "conv2d_backward_input", "input_size", "required")
    assert_op_error(_bwd_weight((1, 2, 5, 5), (1, 2, 3, 3), kernel_size=(3, 0)), "conv2d_backward_weight", "kernel_size")


def test_bad_input_dtype():
    assert_op_error(_bwd_input((1, 2, 3, 3), (2, 2, 3, 3), "int32", input_size=(5, 5)), "conv2d_backward_input", "dy", "int32")
    assert_op_error(_bwd_input((1, 2, 3, 3), (2, 2, 3, 3), w_dtype="float64", input_size=(5, 5)),
                    "conv2d_backward_input", "w", "float64")


def test_bad_input_symbolic_spatial_dims():
    h = tirx.Var("h", "int64")
    assert_op_error(_bwd_weight((1, 2, h, 5), (1, 2, 3, 3), kernel_size=3), "conv2d_backward_weight", "x", "static spatial")


# -- the gradient of R.nn.conv2d emits the two ops (checked numerically by tests/test_gradients.py) --


def test_conv2d_gradient_rule_emits_the_rlx_ops():
    from rlx_tvm import autodiff

    bb = relax.BlockBuilder()
    case = GRAD_CASES[0]
    params = [tensor_var(k, v.shape, "float64") for k, v in case.inputs.items()]
    with bb.function("f", params):
        with bb.dataflow():
            out = bb.emit_output(case.build(*params))
        bb.emit_func_output(out)
    mod = autodiff.grad(bb.get(), "f", wrt=["x", "w"])
    assert set(count_rlx_calls(mod)) == {"conv2d_backward_input", "conv2d_backward_weight"}
