"""softmax_cross_entropy and its backward: the forward's reference vs an independent NumPy loss,
the SPEC §8 traps (ignore_index, label smoothing, scalar and per-row d_loss), the CPU kernels, bad
input, and the gradient rule of the forward op. Values on the samples
(rlx_tvm.testing.samples.loss) are checked by tests/test_ops.py."""

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from rlx_tvm import autodiff, ops
from rlx_tvm.passes import count_rlx_calls
from rlx_tvm.testing import Case, build_module, finite_difference_vjp, run_cases
from rlx_tvm.testing.samples.loss import (
    CASES, SYMBOLIC_N, SYMBOLIC_N_BW, backward_case, labels_for, per_row_loss,
)

from .helpers import CaseGroups, assert_op_error, emit_call, tensor_var

RNG = np.random.default_rng(5)
op = relax.op


def test_forward_matches_independent_loss():
    """The forward's reference (the oracle of the per-op tests) agrees with the finite-difference
    forward written here independently."""
    for case in CASES:
        if case.op == "softmax_cross_entropy":
            ins = case.cast_inputs("float64")
            np.testing.assert_allclose(case.reference(), per_row_loss(**case.attrs)(**ins), rtol=1e-12, atol=1e-12)


# -- SPEC §8 traps ------------------------------------------------------------------------------


# The inputs of the trap tests; every test's cases are compiled together per (dtype, path).
IGNORED_LOGITS = RNG.standard_normal((4, 5))
IGNORED_LABELS = np.array([2, -100, 0, -100])
IGNORED_D_LOSS = np.array([1.0, 5.0, -2.0, 3.0])
KEPT = np.array([0, 2])
SMOOTH_N, SMOOTH_C = 3, 4
SMOOTH_LABELS = np.array([0, 3, 1])
SMOOTH_D_LOSS = np.array([1.0, 2.0, -1.0])
SMOOTH_LS = (0.0, 0.25, 1.0)
SCALAR_LOGITS = RNG.standard_normal((4, 3))
SCALAR_LABELS = np.array([1, -100, 2, 0])
SCALAR_ATTRS = {"label_smoothing": 0.2}
SCALAR = np.array(0.75)
HALF_LOGITS = RNG.standard_normal((6, 40)).astype(np.float16)
HALF_LABELS = labels_for(6, 40, ignored=(2,), rng=RNG)


def _ignored_cases():
    logits, labels, d_loss, kept = IGNORED_LOGITS, IGNORED_LABELS, IGNORED_D_LOSS, KEPT
    return [
        Case("softmax_cross_entropy", {"logits": logits, "labels": labels}),
        Case("softmax_cross_entropy_backward", {"logits": logits, "labels": labels, "d_loss": d_loss}),
        # the kept rows alone
        Case("softmax_cross_entropy", {"logits": logits[kept], "labels": labels[kept]}),
        Case("softmax_cross_entropy_backward", {"logits": logits[kept], "labels": labels[kept], "d_loss": d_loss[kept]}),
    ]


def _smoothing_cases():
    labels, d_loss, c = SMOOTH_LABELS, SMOOTH_D_LOSS, SMOOTH_C
    zeros = np.zeros((SMOOTH_N, c))
    z = RNG.standard_normal((SMOOTH_N, c))
    cases = [Case("softmax_cross_entropy", {"logits": zeros, "labels": labels}, {"label_smoothing": ls}) for ls in SMOOTH_LS]
    cases += [Case("softmax_cross_entropy_backward", {"logits": zeros, "labels": labels, "d_loss": d_loss},
                   {"label_smoothing": ls}) for ls in SMOOTH_LS]
    cases += [Case("softmax_cross_entropy", {"logits": z, "labels": lab}, {"label_smoothing": 1.0})
              for lab in (labels, (labels + 1) % c)]
    return cases


def _scalar_cases():
    ins = {"logits": SCALAR_LOGITS, "labels": SCALAR_LABELS}
    return [
        Case("softmax_cross_entropy_backward", {**ins, "d_loss": SCALAR}, SCALAR_ATTRS),
        Case("softmax_cross_entropy_backward", {**ins, "d_loss": np.full(4, 0.75)}, SCALAR_ATTRS),
    ]


def _large_cases():
    logits = np.array([[100.0, 0.0, -100.0], [-90.0, 95.0, 80.0]])
    labels = np.array([0, 2])
    return [
        Case("softmax_cross_entropy", {"logits": logits, "labels": labels}),
        Case("softmax_cross_entropy_backward", {"logits": logits, "labels": labels, "d_loss": np.ones(2)}),
    ]


def _half_cases():
    ins = {"logits": HALF_LOGITS, "labels": HALF_LABELS}
    return [
        Case("softmax_cross_entropy", ins, {"label_smoothing": 0.1}),
        Case("softmax_cross_entropy_backward", {**ins, "d_loss": np.ones(6)}, {"label_smoothing": 0.1}),
    ]


TRAPS = CaseGroups({
    "ignored": (_ignored_cases(), ("float64",)),
    "smoothing": (_smoothing_cases(), ("float64",)),
    "scalar": (_scalar_cases(), ("float32", "float64")),
    "large": (_large_cases(), ("float32",)),
    "half": (_half_cases(), ("float16",)),
})


def test_ignored_rows_are_zero_and_do_not_disturb_the_others():
    kept = KEPT
    for path, (loss, grad, loss_kept, grad_kept) in TRAPS.outputs("ignored").items():
        assert np.all(loss[[1, 3]] == 0.0) and np.all(grad[[1, 3]] == 0.0), path
        np.testing.assert_allclose(loss[kept], loss_kept, rtol=1e-13, err_msg=path)
        np.testing.assert_allclose(grad[kept], grad_kept, rtol=1e-13, err_msg=path)
        assert np.all(loss_kept > 0), path


def test_label_smoothing_closed_forms():
    """Uniform logits: loss = log C for every ls, and d logits = (1 - ls) * (1/C - onehot) * d_loss.
    ls = 1: the label does not matter."""
    n, c = SMOOTH_N, SMOOTH_C
    onehot = np.eye(c)[SMOOTH_LABELS]
    for path, outs in TRAPS.outputs("smoothing").items():
        for i, ls in enumerate(SMOOTH_LS):
            np.testing.assert_allclose(outs[i], np.full(n, np.log(c)), rtol=1e-13, err_msg=path)
            want = (1 - ls) * (1.0 / c - onehot) * SMOOTH_D_LOSS[:, None]
            np.testing.assert_allclose(outs[3 + i], want, rtol=1e-12, atol=1e-15, err_msg=path)
        np.testing.assert_allclose(outs[6], outs[7], rtol=1e-13, err_msg=path)


def test_scalar_and_per_row_d_loss():
    """A scalar (0-d) d_loss scales every row: same as the per-row d_loss filled with it, and the
    finite-difference gradient of d * sum(loss)."""
    fd = finite_difference_vjp(per_row_loss(**SCALAR_ATTRS), {"logits": SCALAR_LOGITS, "labels": SCALAR_LABELS},
                               "logits", SCALAR)
    assert _scalar_cases()[0].inputs["d_loss"].ndim == 0
    for dtype, tol in (("float64", 1e-7), ("float32", 1e-5)):
        for path, (from_scalar, from_rows) in TRAPS.outputs("scalar", dtype).items():
            np.testing.assert_allclose(from_scalar, from_rows, rtol=1e-6, err_msg=path)
            np.testing.assert_allclose(from_scalar, fd, atol=tol, err_msg=f"{dtype} {path}")


def test_large_logits_stay_finite_in_float32():
    """exp(100) overflows float32: the kernels subtract the row max first."""
    for path, (loss, grad) in TRAPS.outputs("large", "float32").items():
        np.testing.assert_allclose(loss, [0.0, 15.0], atol=1e-4, err_msg=path)
        np.testing.assert_allclose(grad, [[0.0, 0.0, 0.0], [0.0, 1.0, -1.0]], atol=1e-5, err_msg=path)


def test_half_precision():
    cases = TRAPS.groups["half"][0]
    for path, outs in TRAPS.outputs("half", "float16").items():
        for case, out in zip(cases, outs):
            assert out.dtype == np.float16
            np.testing.assert_allclose(out.astype(np.float64), case.reference("float16"), atol=3e-3, err_msg=f"{path} {case.op}")


# -- bad input ------------------------------------------------------------------------------------


def _serial_loops_around(func, names):
    """The serial loops whose body holds blocks of all ``names``, with the prefetch calls in each."""
    found = []

    def visit(loop):
        if loop.kind != tvm.tirx.ForKind.SERIAL:
            return None
        blocks, calls = set(), []
        tvm_ffi.structural_walk(loop.body, (tvm.s_tir.SBlock, lambda b: blocks.add(b.name_hint)), order="post")
        tvm_ffi.structural_walk(loop.body, (tvm.tirx.Evaluate, lambda c: calls.append(c) if "prefetch" in str(c) else None),
                                order="post")
        if set(names) <= blocks:
            found.append((loop, calls))
        return None

    tvm_ffi.structural_walk(func.body, (tvm.tirx.For, visit), order="post")
    return found


def _te_kernel_module(cases, dtype, symbolic):
    """The cases legalized outside any target: the TE kernel (the chunked CPU kernel needs an
    LLVM target in scope; on CPU the TE kernel is otherwise only taken by rows shorter than a
    vector and by symbolic class counts)."""
    return relax.transform.LegalizeOps()(build_module(cases, dtype, symbolic))


def test_cpu_row_kernel_prefetches_the_next_row():
    """With default CPU schedules the TE kernel runs its passes per row in one parallel row loop;
    its exp pass also sums the exponentials (no pass of its own that reads them back) and
    prefetches the next row of logits (for reading) and of the output (for writing), never an
    intermediate: rows of 8-wide vectors, rows that end mid cache line, static and symbolic row
    counts; results unchanged."""
    from rlx_tvm import build
    from rlx_tvm.schedules.prefetch import ANNOTATION, prefetch_next_row
    from rlx_tvm.target import cpu_target

    cases = [backward_case(9, 1000, batch=SYMBOLIC_N_BW), backward_case(3, 520, batch=SYMBOLIC_N_BW)]
    for symbolic in (False, True):
        lowered = build.lower(_te_kernel_module(cases, "float32", symbolic), cpu_target(), tuning_log=None,
                              verbose=False)
        kernels = [f for g, f in lowered.functions.items() if g.name_hint.startswith("rlx_softmax_cross_entropy_backward")]
        assert len(kernels) == 2  # one per row length
        for f in kernels:
            script = f.script()
            assert "chunk_max" not in script and "shifted_exp" in script  # the TE kernel
            assert script.count("T.parallel") == 1, script  # every pass inside the one row loop
            prefetches = [line for line in script.splitlines() if "llvm.prefetch" in line]
            assert any("address_of(logits[" in p and p.rstrip().endswith("0, 3, 1)") for p in prefetches), prefetches
            assert any("address_of(softmax_cross_entropy_backward[" in p and p.rstrip().endswith("1, 3, 1)")
                       for p in prefetches), prefetches
            assert not [p for p in prefetches if "logits[" not in p and "softmax_cross_entropy_backward[" not in p]
            exp_and_sum = _serial_loops_around(f, ["shifted_exp", "row_sum_exp_rf"])
            assert exp_and_sum, script  # the partial sums in the exp pass
            assert any(calls for _, calls in exp_and_sum), script  # where the prefetches are
            assert ANNOTATION not in script
            assert prefetch_next_row(f).same_as(f)  # nothing left to rewrite
        vm = relax.VirtualMachine(tvm.compile(lowered, target=cpu_target()), tvm.cpu())
        for i, case in enumerate(cases):
            args = [tvm.runtime.tensor(a) for a in case.cast_inputs("float32").values()]
            got = vm[f"case_{i}"](*args).numpy()
            np.testing.assert_allclose(got, case.reference("float32"), rtol=1e-5, atol=1e-6, err_msg=case.name)


def test_cpu_kernel_label_on_every_class_and_out_of_range():
    """A label on every class and labels past either end (C, C + 16, -1, -17, 2^40: an empty
    one-hot row), static and symbolic rows, in both CPU kernels: the TE kernel, which compares
    class and label as (vector block, place in block), on both sides of each block edge; and the
    chunked kernel (float16 / float32 / float64), which corrects the label's one element after the
    row, also where it lies past the last whole vector (44 classes: 2 AVX-512 vectors and 12
    single classes, or 5 AVX2 vectors and 4; float16 only there, 48 float16 classes, whole
    vectors for both, take the TE kernel)."""
    from rlx_tvm import build
    from rlx_tvm.schedules.common import vector_lanes
    from rlx_tvm.target import cpu_target

    lanes = vector_lanes(cpu_target())
    for c in (44, 48):
        labels = np.array([*range(c), c, c + 16, -1, -17, 1 << 40, -100], np.int64)
        n = len(labels)
        case = Case("softmax_cross_entropy_backward",
                    {"logits": RNG.standard_normal((n, c)), "labels": labels, "d_loss": RNG.standard_normal(n)},
                    {"label_smoothing": 0.1}, batch=SYMBOLIC_N_BW, label=f"labels over {c} classes")
        for dtype, symbolic, te in [("float32", False, True), ("float64", True, True), ("float16", False, False),
                                    ("float32", False, False), ("float64", True, False)]:
            mod = _te_kernel_module([case], dtype, symbolic) if te else build_module([case], dtype, symbolic)
            lowered = build.lower(mod, cpu_target(), tuning_log=None, verbose=False)
            (kernel,) = [f for g, f in lowered.functions.items() if g.name_hint.startswith("rlx_softmax_cross_entropy")]
            # (half precision takes the chunked kernel for rows that are no whole number of vectors)
            assert ("chunk_max" in kernel.script()) != (te or (dtype == "float16" and c % lanes == 0)), (c, dtype)
            vm = relax.VirtualMachine(tvm.compile(lowered, target=cpu_target()), tvm.cpu())
            got = vm["case_0"](*[tvm.runtime.tensor(a) for a in case.cast_inputs(dtype).values()]).numpy()
            want = case.reference(dtype)
            tol = {"float16": 2e-3, "float32": 1e-5, "float64": 1e-12}[dtype]
            np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol, err_msg=f"{c} classes {dtype} {te}")
            # the label's own class gets p - (1 - ls) - ls / C < 0 times d_loss: each label is seen
            hit = (got[np.arange(c), np.arange(c)] * case.inputs["d_loss"][:c].astype(dtype))
            assert (hit < 0).all(), f"{c} classes {dtype}"


def _chunked_kernel_rows(c):
    """Rows that take the chunked CPU kernel's special ways, over ``c`` classes (its first chunk
    the first 16-wide vector at least): ordinary rows (logits up to +-40), a NaN logit, a +inf
    logit, a first vector of -inf (a chunk of -inf when the chunk is one vector), a row of -inf,
    an ignored row with a NaN logit (0, not NaN), a label past the end; a NaN and a +inf on the
    last class (in the short last chunk, where the row has one)."""
    n = 12
    logits = RNG.standard_normal((n, c)) * 10
    logits[0, :] *= 4
    logits[1, c // 2] = np.nan
    logits[2, 3] = np.inf
    logits[3, :16] = -np.inf
    logits[4, :] = -np.inf
    logits[5, 1] = np.nan
    labels = RNG.integers(0, c, n)
    labels[3] = 2  # on the -inf vector: its own p is 0
    labels[5] = -100
    labels[6] = c + 3
    logits[10, -1] = np.nan
    logits[11, -1] = np.inf
    return logits, labels


def test_cpu_chunked_kernel_matches_reference():
    """The chunked CPU kernel on 1-, 2- and 16-vector chunks, several chunks a row, and on rows
    that are not a whole number of chunks (a short last chunk of whole vectors and single
    classes, of single classes only, of vectors only; 1000 classes in float32: 3 chunks of 16
    vectors, 14 vectors, 8 classes): the same numbers as the reference (NaN where it has NaN),
    label smoothing, per-row and scalar d_loss, int64 and int32 labels, fp32 and fp64, static and
    symbolic rows; and the kernel is the chunked one (no row-sized intermediate)."""
    from rlx_tvm import build
    from rlx_tvm.target import cpu_target

    target = cpu_target()
    cases = []  # every class count in one module per (dtype, shape mode)
    for c in (48, 160, 768, 17, 50, 1000):
        logits, labels = _chunked_kernel_rows(c)
        cases += [
            Case("softmax_cross_entropy_backward", {"logits": logits, "labels": labels, "d_loss": RNG.standard_normal(len(labels))},
                 {"label_smoothing": ls}, batch=SYMBOLIC_N_BW, label=f"{c} classes, ls={ls}")
            for ls in (0.0, 0.1)
        ] + [Case("softmax_cross_entropy_backward", {"logits": logits, "labels": labels.astype(np.int32), "d_loss": np.float64(0.7)},
                  {"label_smoothing": 0.2}, batch=SYMBOLIC_N, label=f"{c} classes, scalar d_loss, int32 labels")]
    for dtype, symbolic in [("float32", False), ("float64", True)]:
        lowered = build.lower(build_module(cases, dtype, symbolic), target, tuning_log=None, verbose=False)
        kernels = [f for g, f in lowered.functions.items() if g.name_hint.startswith("rlx_softmax_cross_entropy_backward")]
        assert kernels and all("chunk_max" in f.script() and "shifted_exp" not in f.script() for f in kernels)
        vm = relax.VirtualMachine(tvm.compile(lowered, target=target), tvm.cpu())
        for i, case in enumerate(cases):
            args = [tvm.runtime.tensor(np.asarray(a)) for a in case.cast_inputs(dtype).values()]
            got = vm[f"case_{i}"](*args).numpy()
            want = case.reference(dtype)
            assert np.isnan(want[[1, 2, 4, 10, 11]]).all() and (want[5] == 0).all() and np.isfinite(want[3]).all()
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{case.name} {dtype}")
            tol = 1e-5 if dtype == "float32" else 1e-12
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want[np.isfinite(want)]).max(),
                                       err_msg=f"{case.name} {dtype}")


def test_cpu_chunked_kernel_half_precision():
    """float16 / bfloat16 logits over class counts that are no whole number of vectors (where the
    TE kernel runs scalar) take the chunked kernel too, computed in float32 (the exp row in a
    float32 buffer of its own) and rounded once: each element within half an ulp of its output
    type (plus float32 noise) of the float64 reference on the rounded inputs, the label's
    element included (it is recomputed with the one-hot term, not corrected after rounding);
    NaN where the reference has NaN; one and several whole chunks before the short one; the
    result has the input dtype. Whole vectors (48 classes) keep the TE kernel."""
    from rlx_tvm import build
    from rlx_tvm.target import cpu_target

    target = cpu_target()
    whole = build.lower(build_module([backward_case(4, 48)], "bfloat16", False), target, tuning_log=None, verbose=False)
    assert all("chunk_max" not in f.script() for g, f in whole.functions.items() if isinstance(f, tvm.tirx.PrimFunc))
    for c in (44, 1004):  # no whole number of 8- or 16-lane vectors
        logits, labels = _chunked_kernel_rows(c)
        logits[7] = RNG.standard_normal(c)
        logits[7, labels[7]] = 12.0  # p of the label near 1: its gradient is small, rounding shows
        case = Case("softmax_cross_entropy_backward", {"logits": logits, "labels": labels, "d_loss": RNG.standard_normal(len(labels))},
                    {"label_smoothing": 0.1}, batch=SYMBOLIC_N_BW, label=f"{c} classes")
        for dtype, symbolic, ulp in [("float16", False, 2.0**-11), ("bfloat16", True, 2.0**-8)]:
            lowered = build.lower(build_module([case], dtype, symbolic), target, tuning_log=None, verbose=False)
            (kernel,) = [f for g, f in lowered.functions.items() if g.name_hint.startswith("rlx_softmax_cross_entropy")]
            assert "chunk_max" in kernel.script(), dtype
            (got,) = run_cases([case], dtype, symbolic=symbolic, path="fused")
            assert str(got.dtype) == dtype
            got, want = got.astype(np.float64), case.reference(dtype)
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{c} {dtype}")
            ok = np.isfinite(want)
            err = np.abs(got[ok] - want[ok]) - ulp * np.abs(want[ok])
            assert (err <= 1e-6 * np.abs(want[ok]).max()).all(), (c, dtype, err.max())


def test_bad_input_labels():
    z = tensor_var("logits", (4, 5))
    assert_op_error(lambda: ops.softmax_cross_entropy(z, tensor_var("labels", (4,), "float32")),
                    "softmax_cross_entropy", "labels", "float32")
    assert_op_error(lambda: ops.softmax_cross_entropy(z, tensor_var("labels", (3,), "int64")),
                    "softmax_cross_entropy", "labels", "[3]")
    assert_op_error(lambda: ops.softmax_cross_entropy(z, tensor_var("labels", (4, 1), "int64")),
                    "softmax_cross_entropy", "labels", "rank 1")
    assert_op_error(lambda: ops.softmax_cross_entropy(z, relax.const(np.array([0, 4, 5, -100], np.int64))),
                    "softmax_cross_entropy", "labels", "[0, 5)", "5")
    emit_call(ops.softmax_cross_entropy(z, relax.const(np.array([0, 4, -1, 2], np.int64)), ignore_index=-1))


def test_bad_input_logits_and_d_loss():
    labels = tensor_var("labels", (4,), "int32")
    assert_op_error(lambda: ops.softmax_cross_entropy(tensor_var("logits", (4, 5, 2)), labels),
                    "softmax_cross_entropy", "logits", "rank 2", "rank 3")
    assert_op_error(lambda: ops.softmax_cross_entropy(tensor_var("logits", (4, 5), "int32"), labels),
                    "softmax_cross_entropy", "logits", "int32")
    z = tensor_var("logits", (4, 5))
    assert_op_error(lambda: ops.softmax_cross_entropy_backward(z, labels, tensor_var("d_loss", (5,))),
                    "softmax_cross_entropy_backward", "d_loss", "[5]")
    assert_op_error(lambda: ops.softmax_cross_entropy_backward(z, labels, tensor_var("d_loss", (4, 1))),
                    "softmax_cross_entropy_backward", "d_loss", "rank")
    assert_op_error(lambda: ops.softmax_cross_entropy_backward(z, labels, tensor_var("d_loss", (4,), "float64")),
                    "softmax_cross_entropy_backward", "d_loss", "float64")


def test_bad_input_attributes():
    z, labels = tensor_var("logits", (4, 5)), tensor_var("labels", (4,), "int64")
    for bad in (1.5, -0.1, float("nan")):
        assert_op_error(lambda: ops.softmax_cross_entropy(z, labels, label_smoothing=bad),
                        "softmax_cross_entropy", "label_smoothing", "<= 1.0")
    assert_op_error(lambda: ops.softmax_cross_entropy_backward(z, labels, tensor_var("d_loss", ()), ignore_index=0.5),
                    "softmax_cross_entropy_backward", "ignore_index", "integer")


# -- gradient rule of rlx.softmax_cross_entropy (checked numerically by tests/test_gradients.py) --


def test_gradient_rule_emits_the_backward_op():
    bb = relax.BlockBuilder()
    z, t = tensor_var("logits", (6, 3)), tensor_var("labels", (6,), "int64")
    with bb.function("main", [z, t]):
        with bb.dataflow():
            loss = bb.emit_output(op.mean(ops.softmax_cross_entropy(z, t, label_smoothing=0.1)))
        bb.emit_func_output(loss)
    adjoint = autodiff.grad(bb.get(), "main", wrt=["logits"])
    in_adjoint = count_rlx_calls(tvm.IRModule({"main_adjoint": adjoint["main_adjoint"]}))
    assert in_adjoint == {"softmax_cross_entropy": 1, "softmax_cross_entropy_backward": 1}
