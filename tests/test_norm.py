"""Layer / RMS / group norm backward ops: coverage of the samples, float16, the SPEC §8 traps
through both paths, bad input, Relax's own norms (rlx legalizations and gradient rules), and the
gradients of one norm computed together. Values on the samples (rlx_tvm.testing.samples.norm,
finite differences of independent NumPy forwards) are checked by tests/test_ops.py."""

import numpy as np
import pytest
import tvm
from tvm import relax, tirx
from tvm.script import tirx as T

from rlx_tvm import autodiff, ops
from rlx_tvm.ops import get_op
from rlx_tvm.testing import CHECK_TARGET, Case, check_gradients, compare, finite_difference_vjp, run_cases
from rlx_tvm.testing.samples import outputs
from rlx_tvm.testing.samples.norm import (
    CASES, GRAD_CASES, GROUP_BATCH_CASES, SQUARE_CASES, group_cases, layer_cases, layer_norm, normal,
    relax_group_norm_case, relax_layer_norm_case, relax_rms_norm_case, rms_cases, rule_cases, scales,
)
from rlx_tvm.schedules.common import vector_lanes
from rlx_tvm.schedules.prefetch import ANNOTATION as PREFETCH_ANNOTATION

from .helpers import assert_op_error, tensor_var


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
    """The samples' float64 outputs through both paths equal the finite differences."""
    for path in ("fused", "decomposed"):
        outs = outputs("float64", False, path)
        for case in cases:
            np.testing.assert_allclose(outs[case.name], _fd(case), rtol=1e-5, atol=1e-6, err_msg=f"{path}: {case.name}")


def test_square_inputs_scale_the_normalized_axis():
    """Rows == features ([8, 8], [4, 4, 4]): gamma goes along the normalized axis, not the
    leading one (nor, for axis=0, the trailing one that plain broadcasting would pick). CASES
    has the [8, 8] last-axis cases and [4, 4, 4] middle-axis ones; these are the other axes."""
    cases = SQUARE_CASES
    _both_paths_match_fd(cases)
    # The check can fail: gamma laid along the other axis of the square gives a different dx.
    case = cases[0]
    trailing = lambda x, gamma: layer_norm(x, np.ones_like(gamma), axis=0) * gamma  # noqa: E731
    wrong = Case(case.op, case.inputs, case.attrs, forward=trailing, wrt="x")
    assert not np.allclose(_fd(wrong), _fd(case), atol=1e-3), "trap case does not discriminate"


def test_group_norm_parameter_grads_reduce_over_the_batch():
    """N = 2 and 3: dgamma/dbeta sum over n too (a reshape that keeps N is wrong for N > 1)."""
    cases = GROUP_BATCH_CASES
    assert {c.inputs["x"].shape[0] for c in cases} == {2, 3}
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


# -- Relax's own norms: rlx legalizations (float16/32/64, any axes) -------------------------------

op = relax.op


# (label, build(*vars), NumPy reference(*arrays), inputs, axis of x made symbolic or None)
FORWARD_CASES = [
    relax_layer_norm_case((3, 4, 5), "axes=[-1]", [-1], sym=0),
    relax_layer_norm_case((3, 4, 5), "axes=[1, 2], offset 100", [1, 2], sym=0, offset=100.0, epsilon=1e-3),
    relax_layer_norm_case((3, 4, 5), "axes=[2, 0]", [2, 0]),
    relax_layer_norm_case((3, 4, 5), "axes=[0]", [0], sym=2),
    relax_layer_norm_case((2, 3, 4, 5), "axes=[-1, 1]", [-1, 1], sym=0),
    relax_layer_norm_case((3, 4, 5), "center=False", [-1], sym=0, center=False),
    relax_layer_norm_case((3, 4, 5), "scale=False axes=[1]", [1], scale=False),
    relax_layer_norm_case((3, 4, 5), "center=scale=False axes=[-1, -2]", [-1, -2], center=False, scale=False),
    relax_layer_norm_case((6,), "rank 1", [0]),
    relax_layer_norm_case((3, 4, 5), "all axes", [0, 1, 2]),
    relax_rms_norm_case((3, 4, 5), "axes=[-1]", [-1], sym=0, epsilon=1e-6),
    relax_rms_norm_case((3, 4, 5), "axes=[1]", [1], sym=0),
    relax_rms_norm_case((3, 4, 5), "axes=[2, 0]", [2, 0], epsilon=1e-3),
    relax_rms_norm_case((2, 3, 4), "axes=[-2, -1]", [-2, -1], sym=0),
    relax_group_norm_case((2, 4, 3, 2), "NCHW", sym=0, num_groups=2, channel_axis=1, axes=[2, 3]),
    relax_group_norm_case((2, 3, 2, 4), "NHWC", sym=0, num_groups=2, channel_axis=-1, axes=[1, 2]),
    relax_group_norm_case((2, 3, 2, 6), "NHWC axes=[-3, -2] center=False, offset 100", offset=100.0, num_groups=3,
           channel_axis=-1, axes=[-3, -2], center=False, epsilon=1e-3),
    relax_group_norm_case((2, 6, 3), "instance-like scale=False", sym=0, num_groups=6, channel_axis=1, axes=[2], scale=False),
    relax_group_norm_case((2, 3, 4, 6), "two batch axes", num_groups=3, channel_axis=3, axes=[2]),
    relax_group_norm_case((3, 6), "no spatial, center=scale=False", sym=0, num_groups=2, channel_axis=1, axes=[],
           center=False, scale=False),
    relax_group_norm_case((2, 4, 5), "one group", num_groups=1, channel_axis=1, axes=[2]),
]


def _forward_module(dtype):
    """One function per case, plus a symbolic-batch variant where the case has one."""
    bb = relax.BlockBuilder()
    funcs = []
    for label, build, _, ins, sym in FORWARD_CASES:
        for symbolic in (False, True) if sym is not None else (False,):
            shapes = {k: list(v.shape) for k, v in ins.items()}
            if symbolic:
                shapes["x"][sym] = tirx.Var("n", "int64")
            params = [tensor_var(k, s, dtype) for k, s in shapes.items()]
            name = f"fwd{len(funcs)}"
            with bb.function(name, params):
                with bb.dataflow():
                    out = bb.emit_output(build(*params))
                bb.emit_func_output(out)
            funcs.append((name, f"{label}{' (symbolic)' if symbolic else ''}"))
    return bb.get(), funcs


FORWARD_TOL = {"float16": (1e-2, 1e-2), "float32": (1e-4, 5e-5), "float64": (1e-12, 1e-12)}


@pytest.mark.parametrize("dtype,build", [("float16", "tvm"), ("float32", "tvm"), ("float64", "tvm"),
                                         ("float32", "rlx scheduled")])
def test_relax_norms_compile_and_match_numpy(dtype, build):
    """R.nn.layer_norm/rms_norm/group_norm through tvm.compile's default pipeline (so through the
    registered FLegalize), or rlx_tvm.compile (dlight + rlx CPU schedules), vs NumPy in float64 on
    the same (dtype-rounded) inputs. Tolerances (rtol, atol relative to max |ref|): float64 needs
    float64 accumulation (TVM's own float64 rms_norm is only ~1e-7 accurate); the offset-100
    cases need the two-pass variance in float32 (one pass, E[x^2] - mean^2: ~2e-3 error)."""
    from rlx_tvm.build import compile as rlx_compile

    mod, funcs = _forward_module(dtype)
    target = tvm.target.Target(CHECK_TARGET)
    ex = tvm.compile(mod, target) if build == "tvm" else rlx_compile(mod, target)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    names = iter(funcs)
    rtol, atol = FORWARD_TOL[dtype]
    failures = []
    for label, _, reference, ins, sym in FORWARD_CASES:
        cast = {k: v.astype(dtype) for k, v in ins.items()}
        ref = reference(*[v.astype(np.float64) for v in cast.values()])
        for _ in (False, True) if sym is not None else (False,):
            fname, flabel = next(names)
            out = vm[fname](*[tvm.runtime.tensor(v) for v in cast.values()]).numpy()
            err = np.abs(out.astype(np.float64) - ref)
            if out.dtype != dtype or not np.all(err <= atol * max(1.0, np.abs(ref).max()) + rtol * np.abs(ref)):
                failures.append(f"{flabel}: dtype {out.dtype}, max abs err {err.max():.3g}")
    assert not failures, "\n".join(failures)


def test_relax_norms_legalize_to_rlx_kernels():
    """The rlx legalizations win over TVM's (level 20 > 10), also after reloading the module
    (registration is idempotent), and lower every op in float64 to plain TE stages."""
    import importlib

    from rlx_tvm.ops import norm

    importlib.reload(norm)
    importlib.reload(norm)
    for dtype in ("float16", "float32", "float64"):
        mod, _ = _forward_module(dtype)
        lowered = relax.transform.LegalizeOps()(mod)
        kernels = {gv.name_hint for gv, f in lowered.functions.items() if isinstance(f, tirx.PrimFunc)}
        assert {k.rstrip("0123456789") for k in kernels} == {"rlx_layer_norm", "rlx_rms_norm", "rlx_group_norm"}, kernels


# -- gradient rules of Relax's own norms ----------------------------------------------------------


def _rule_module(rules):
    bb = relax.BlockBuilder()
    for i, (_, build, ins) in enumerate(rules):
        params = [tensor_var(k, v.shape) for k, v in ins.items()]
        with bb.function(f"f{i}", params):
            with bb.dataflow():
                out = bb.emit_output(op.sum(op.multiply(build(*params[:-1]), params[-1])))
            bb.emit_func_output(out)
    return bb.get()


def test_relax_norm_gradients_emit_rlx_ops():
    rules = rule_cases()
    mod = _rule_module(rules)
    for i, (label, *_) in enumerate(rules):
        text = autodiff.grad(mod, f"f{i}")[f"f{i}_adjoint"].script()
        family = label.split()[0].replace("_norm", "")
        assert f"R.rlx.{family}_norm_backward_input(" in text, (label, text)
        if "scale=False" not in label:
            assert f"R.rlx.{family}_norm_backward_gamma(" in text, (label, text)




def test_grad_cases_cover_the_relax_norm_rules():
    labels = {c.label.split()[0] for c in GRAD_CASES}
    assert {"relax.nn.layer_norm", "relax.nn.rms_norm", "relax.nn.group_norm"} <= labels


def test_decompositions_differentiate_correctly():
    """float64 autodiff of every decomposition (each primitive's gradient rule: second order of
    the norms) vs finite differences of the compiled decomposition."""
    check_gradients([c for c in GRAD_CASES if c.label.startswith("decomposed")], "float64")


# -- dx, dgamma and dbeta of one norm computed together (FuseSiblingBackwardOps, rlx_tvm.compile on CPU) --


# (cases of one norm sharing x and dy; fused into one kernel): 2-D rows long enough for the
# merged row schedule, row counts that 64 chunks leave short or empty when symbolic, the square
# trap, rank 3 (reshaped to rows), a normalized axis that is not last (left apart), a pair of
# group-norm gradients.
SIBLING_GROUPS = [
    layer_cases((256, 64), "256 rows"),
    layer_cases((100, 48), "100 rows"),
    rms_cases((3, 40), "3 rows", which=("input", "gamma")),
    layer_cases((5, 7, 40), "rank 3, 35 rows"),
    layer_cases((8, 8), "square 8x8"),
    layer_cases((4, 6, 16), "rank 3"),
    layer_cases((6, 5), "axis 0", axis=0),
    rms_cases((64, 32), "64 rows", eps=1e-3),
    rms_cases((8, 8), "square, input+beta", which=("input", "beta")),
    rms_cases((2, 8, 24), "rank 3, gamma+beta", which=("gamma", "beta")),
    group_cases((3, 6, 3, 2), "N=3, 2d", num_groups=3, eps=1e-3),
    group_cases((2, 64, 5, 6), "N=2, G=32", num_groups=32),
    group_cases((3, 6), "no spatial, gamma+beta", which=("gamma", "beta"), num_groups=2),
    group_cases((2, 4, 2, 3, 2), "3d, input+gamma", which=("input", "gamma"), num_groups=4),
]


@pytest.mark.parametrize("dtype,symbolic", [("float32", False), ("float64", False), ("float64", True)])
def test_gradients_of_one_norm_computed_together(dtype, symbolic):
    from rlx_tvm.testing import check_sibling_groups

    groups = [g for g in SIBLING_GROUPS if not symbolic or g[0].batch is not None]
    lowered = check_sibling_groups(groups, dtype, symbolic)
    names = {gv.name_hint for gv, f in lowered.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}
    # layer / RMS norm with the last axis normalized (a symbolic row count too) and every group
    # norm: one kernel each
    assert {"rlx_layer_norm_backward_input_gamma", "rlx_rms_norm_backward_input_gamma_beta",
            "rlx_rms_norm_backward_input_gamma", "rlx_rms_norm_backward_input_beta",
            "rlx_rms_norm_backward_gamma_beta", "rlx_group_norm_backward_input_gamma_beta",
            "rlx_group_norm_backward_gamma_beta", "rlx_group_norm_backward_input_gamma"} <= names, sorted(names)
    # the normalized axis 0 is left apart
    assert {"rlx_layer_norm_backward_input", "rlx_layer_norm_backward_gamma"} <= names, sorted(names)


@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "symbolic"])
def test_merged_row_schedule_runs_every_stage_in_one_parallel_loop(symbolic):
    """The fused norm kernels at shapes the suite uses (smaller): statistics, dx and the partial
    sums of dgamma / dbeta inside one parallel loop (over chunks of rows; over (n, group) for
    group norm), row reductions in local vector partial sums; no reads out of bounds. A symbolic
    batch too (until 2026-12-05 its layer / RMS norm gradients were separate kernels, one pass
    over memory per stage: 7.2 vs 3.6 ms at 8192 x 768)."""
    from rlx_tvm import build
    from rlx_tvm.target import cpu_target
    from rlx_tvm.testing import sibling_groups_module

    # (group norm's 12 x 12 planes: whole vectors only over both axes, fused)
    groups = [layer_cases((512, 256), "512 rows"), rms_cases((128, 256), "128 rows"),
              group_cases((2, 8, 12, 12), "N=2 G=4", num_groups=4)]
    lowered = build.lower(sibling_groups_module(groups, "float32", symbolic), cpu_target(), tuning_log=None,
                          verbose=False)
    for name in ("rlx_layer_norm_backward_input_gamma", "rlx_rms_norm_backward_input_gamma_beta",
                 "rlx_group_norm_backward_input_gamma_beta"):
        func = lowered[name]
        script = func.script()
        assert script.count("T.parallel") == 1 and 'scope="local"' in script, name
        # dx, the elementwise stage, in vectors (not a row statistic of the same domain)
        sch = tvm.s_tir.Schedule(func)
        dx_loops = [sch.get(lp) for lp in sch.get_loops(sch.get_sblock("dx"))]
        assert any(lp.kind == tvm.tirx.ForKind.VECTORIZED for lp in dx_loops), name
        if name.startswith("rlx_group_norm"):
            # dx's group means come from the per-channel partial sums of dgamma / dbeta (no pass of
            # their own over x and dy)
            reads = {r.source.name for r in sch.get(sch.get_sblock("mean_s")).reads}
            assert not reads & {"x", "dy"}, reads
            lanes = vector_lanes(cpu_target())
            vector = [lp for lp in dx_loops if lp.kind == tvm.tirx.ForKind.VECTORIZED]
            assert [int(lp.extent) for lp in vector] == [lanes], (vector, lanes)
        else:
            # passes over a row that do not depend on each other share one loop: dx with the
            # partial sums of dgamma (and dbeta); layer norm's two sums after the statistics
            row_pass = sch.get_loops(sch.get_sblock("dx"))[2]
            together = {sch.get(b).name_hint for b in sch.get_child_blocks(row_pass)}
            assert together >= {"dx", "dgamma_update"}, (name, together)
            if name.startswith("rlx_layer_norm"):
                sums = sch.get_loops(sch.get_sblock("mean_g_rf"))[2]
                assert {sch.get(b).name_hint for b in sch.get_child_blocks(sums)} == {"mean_g_rf", "mean_gxh_rf"}
            _assert_prefetches_next_row(func, script, name)
        if name.startswith("rlx_group_norm"):  # 4-d planes, not rows: nothing to prefetch
            assert "llvm.prefetch" not in script and PREFETCH_ANNOTATION not in script
        tvm.s_tir.analysis.OOBChecker()(tvm.IRModule({"main": func}))
    from rlx_tvm.testing import check_sibling_groups
    check_sibling_groups(groups, "float32", symbolic, target=cpu_target())


def _assert_prefetches_next_row(func, script, name):
    """Layer / RMS norm's merged kernel prefetches the next row (chunk * rows per chunk + row in
    chunk + 1, clamped to the last) of x and dy for reading and of dx for writing, in the pass that
    computes dx, and nothing else (not the chunk's partial sums)."""
    from rlx_tvm.schedules.prefetch import prefetch_next_row

    sch = tvm.s_tir.Schedule(func)
    chunk, row, dx_pass = (sch.get(lp) for lp in sch.get_loops(sch.get_sblock("dx"))[:3])
    assert (chunk.kind, row.kind) == (tirx.ForKind.PARALLEL, tirx.ForKind.SERIAL), name
    rows = sch.get(sch.get_sblock("dx")).writes[0].source.shape[0]
    nxt = str(tvm.sym.Analyzer().simplify(tirx.min(chunk.loop_var * row.extent + row.loop_var + 1, rows - 1)))
    prefetches = [line.strip() for line in script.splitlines() if "llvm.prefetch" in line]
    read = {p.split("address_of(")[1].split("[")[0] for p in prefetches if p.endswith("0, 3, 1)")}
    written = {p.split("address_of(")[1].split("[")[0] for p in prefetches if p.endswith("1, 3, 1)")}
    assert (read, written) == ({"x", "dy"}, {"dx"}), (name, prefetches)
    assert all(f"[{nxt}," in p for p in prefetches), (name, nxt, prefetches)
    assert "llvm.prefetch" in dx_pass.script() and PREFETCH_ANNOTATION not in script, name
    assert prefetch_next_row(func).same_as(func)  # nothing left to rewrite


def test_prefetch_annotation_names_loops_that_exist():
    """The annotation's value counts the loops whose fused index is the row; more than there are
    is a clear error, not a wrong address."""
    from rlx_tvm.schedules.prefetch import prefetch_next_row

    @T.prim_func(private=True, s_tir=True)
    def rows(x: T.Buffer((8, 64), "float32"), y: T.Buffer((8, 64), "float32")):
        for i in T.serial(8, annotations={PREFETCH_ANNOTATION: 2}):
            for j in range(64):
                with T.sblock("y"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    y[vi, vj] = x[vi, vj]

    with pytest.raises(ValueError, match="row index would take 2 loops .* but only 1 are there"):
        prefetch_next_row(rows)


def test_merged_row_schedule_with_a_batch_of_one():
    """Group norm with N = 1: the normalized blocks have no iterator for the unit batch while its
    buffers keep the dim; the stages still merge into one parallel loop over the groups (they
    were left to per-stage schedules, twice as slow), and the results match."""
    from rlx_tvm.target import cpu_target
    from rlx_tvm.testing import check_sibling_groups

    groups = [group_cases((1, 16, 8, 8), "N=1 G=8", num_groups=8)]
    lowered = check_sibling_groups(groups, "float32", False, target=cpu_target())
    func = lowered["rlx_group_norm_backward_input_gamma_beta"]
    assert func.script().count("T.parallel") == 1
    tvm.s_tir.analysis.OOBChecker()(tvm.IRModule({"main": func}))


def test_gradients_are_not_computed_together_before_an_operand_exists():
    """A dx whose gamma is bound after the dgamma of the same x and dy stays apart (computing both
    at the dgamma would read gamma before it exists)."""
    from rlx_tvm.passes import FuseSiblingBackwardOps

    x, dy, g = tensor_var("x", (4, 8)), tensor_var("dy", (4, 8)), tensor_var("g", (8,))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, dy, g]):
        with bb.dataflow():
            dgamma = bb.emit(ops.layer_norm_backward_gamma(x, dy))
            gamma = bb.emit(relax.op.exp(g))
            dx = bb.emit(ops.layer_norm_backward_input(x, gamma, dy))
            out = bb.emit_output(relax.Tuple([dx, dgamma]))
        bb.emit_func_output(out)
    mod = bb.get()
    fused = FuseSiblingBackwardOps()(mod)
    relax.analysis.well_formed(fused)  # raises when ill-formed
    tvm.ir.assert_structural_equal(fused, mod)
    # Bound before both: computed together.
    bb = relax.BlockBuilder()
    with bb.function("main", [x, dy, g]):
        with bb.dataflow():
            gamma = bb.emit(relax.op.exp(g))
            dgamma = bb.emit(ops.layer_norm_backward_gamma(x, dy))
            dx = bb.emit(ops.layer_norm_backward_input(x, gamma, dy))
            out = bb.emit_output(relax.Tuple([dx, dgamma]))
        bb.emit_func_output(out)
    fused = FuseSiblingBackwardOps()(bb.get())
    calls = []
    relax.analysis.post_order_visit(fused["main"], lambda e: calls.append(e.op.name) if isinstance(e, relax.Call) else None)
    assert "relax.call_tir" in calls and not any(c.startswith("relax.rlx.") for c in calls), calls


def test_dx_computed_together_uses_its_own_gamma():
    """RMS norm's dgamma op takes a gamma too (which does not enter it): computed together with a
    dx, the kernel uses the dx call's gamma, whichever call comes first."""
    import rlx_tvm
    from rlx_tvm.testing import as_tensors

    x, dy, g_dx, g_other, beta = normal(16, 32), normal(16, 32), scales(32), scales(32), normal(32)
    params = [tensor_var(n, a.shape, "float64") for n, a in
              (("x", x), ("dy", dy), ("g_dx", g_dx), ("g_other", g_other), ("beta", beta))]
    px, pdy, pg, po, pb = params
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            dx = bb.emit(ops.rms_norm_backward_input(px, pg, pb, pdy))
            dgamma = bb.emit(ops.rms_norm_backward_gamma(px, po, pb, pdy))
            out = bb.emit_output(relax.Tuple([dx, dgamma]))
        bb.emit_func_output(out)
    lowered = rlx_tvm.build.lower(bb.get(), CHECK_TARGET, tuning_log=None, verbose=False)
    assert "rlx_rms_norm_backward_input_gamma" in [gv.name_hint for gv in lowered.get_global_vars()]
    vm = relax.VirtualMachine(tvm.compile(lowered, target=tvm.target.Target(CHECK_TARGET)), tvm.cpu())
    got_dx, got_dgamma = vm["main"](*as_tensors([x, dy, g_dx, g_other, beta]))
    ref_dx = get_op("rms_norm_backward_input").reference_fn(x, g_dx, beta, dy)
    ref_dgamma = get_op("rms_norm_backward_gamma").reference_fn(x, g_other, beta, dy)
    assert compare(got_dx.numpy(), ref_dx, "float64") is None
    assert compare(got_dgamma.numpy(), ref_dgamma, "float64") is None


def test_plain_sum_of_dy_is_computed_with_the_norm_gradients():
    """A norm's dbeta written as a plain ``sum(dy)`` over every axis but the parameters' (layer
    norm has no dbeta op; its gradient rule and the benchmark suite write it so) joins the group:
    one kernel also gives dbeta, which matches the sum, before or after the ops in the block.
    A sum over other axes, or of another tensor, stays a sum of its own."""
    from rlx_tvm import build
    from rlx_tvm.passes import FuseSiblingBackwardOps
    from rlx_tvm.target import cpu_target

    def module(cases, sum_axes, sum_first, summed="dy"):
        ins = cases[0].inputs | {k: v for c in cases for k, v in c.inputs.items()}
        params = {k: tensor_var(k, v.shape) for k, v in ins.items()}
        bb = relax.BlockBuilder()
        with bb.function("main", list(params.values())):
            with bb.dataflow():
                total = relax.op.sum(params[summed], axis=sum_axes)
                outs = [bb.emit(total)] if sum_first else []
                outs += [bb.emit(ops.get_op(c.op)(**{k: params[k] for k in c.inputs}, **c.attrs)) for c in cases]
                outs += [] if sum_first else [bb.emit(total)]
                gv = bb.emit_output(relax.Tuple(outs))
            bb.emit_func_output(gv)
        return bb.get(), ins

    layer = layer_cases((4, 6, 32), "rank 3")
    rms = rms_cases((24, 16), "no beta op", which=("input", "gamma"))
    group = group_cases((2, 8, 4, 4), "N=2 G=4", which=("input", "gamma"), num_groups=4)
    for cases, axes, first, fused in ((layer, [0, 1], True, "rlx_layer_norm_backward_input_gamma_beta"),
                                      (layer, [-3, -2], False, "rlx_layer_norm_backward_input_gamma_beta"),
                                      (rms, [0], False, "rlx_rms_norm_backward_input_gamma_beta"),
                                      (group, [0, 2, 3], True, "rlx_group_norm_backward_input_gamma_beta")):
        mod, ins = module(cases, axes, first)
        relax.analysis.well_formed(FuseSiblingBackwardOps()(mod))
        lowered = build.lower(mod, cpu_target(), tuning_log=None, verbose=False)
        assert fused in [g.name_hint for g in lowered.functions], fused
        vm = relax.VirtualMachine(tvm.compile(lowered, target=cpu_target()), tvm.cpu())
        outs = [o.numpy() for o in vm["main"](*[tvm.runtime.tensor(v.astype("float32")) for v in ins.values()])]
        dbeta, grads = (outs[0], outs[1:]) if first else (outs[-1], outs[:-1])
        np.testing.assert_allclose(dbeta, ins["dy"].sum(axis=tuple(axes)), rtol=1e-4, atol=1e-4, err_msg=fused)
        for case, out in zip(cases, grads):
            assert not compare(out, case.reference("float32"), "float32"), case.name
    # not dbeta: a sum over the normalized axis, or of x
    for axes, summed in (([2], "dy"), ([0, 1], "x")):
        mod, _ = module(layer, axes, False, summed)
        fused = FuseSiblingBackwardOps()(mod)
        names = [g.name_hint for g in fused.functions]
        assert "rlx_layer_norm_backward_input_gamma" in names and not any(n.endswith("_beta") for n in names), names
