"""Registry-wide checks over every op and its samples: parts present, TVMScript round trip,
decomposition pass, decomposed graphs differentiable again."""

import importlib

import pytest
import tvm
from tvm import relax

import rlx_tvm
from rlx_tvm.ops import all_ops, get_op
from rlx_tvm.passes import DecomposeBackwardOps, count_rlx_calls
from rlx_tvm.testing import build_loss_module, build_module
from rlx_tvm.testing.samples import all_samples

ALL_CASES = all_samples()


def _first_case_per_op():
    seen = {}
    for c in ALL_CASES:
        seen.setdefault(c.op, c)
    return list(seen.values())


def test_every_op_has_every_part():
    for opdef in all_ops():
        for part in ("infer_fn", "reference_fn", "decompose_fn", "fused_fn"):
            assert getattr(opdef, part) is not None, f"{opdef.name} lacks {part}"
        op = opdef.op
        for key in ("FInferType", "FPurity", "FLegalize"):
            assert op.get_attr(key) is not None, f"{opdef.name} lacks {key}"


def test_registration_is_idempotent():
    before = {o.name: o.op.get_attr("FInferType") for o in all_ops()}
    for fam in ("activation",):
        importlib.reload(importlib.import_module(f"rlx_tvm.ops.{fam}"))
    importlib.reload(importlib.import_module("rlx_tvm.gradients.elementwise"))
    after = {o.name: o.op.get_attr("FInferType") for o in all_ops()}
    assert before.keys() == after.keys()


@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "symbolic"])
def test_tvmscript_round_trip(symbolic):
    cases = [c for c in _first_case_per_op() if c.batch is not None or not symbolic]
    mod = build_module(cases, "float32", symbolic)
    text = mod.script()
    for c in cases:
        assert f"R.rlx.{c.op}(" in text
    parsed = tvm.script.from_source(text)
    tvm.ir.assert_structural_equal(mod, parsed)


def test_decompose_removes_backward_ops_and_keeps_preserved():
    mod = build_module(ALL_CASES, "float32", False)
    backward = {o.name for o in all_ops() if o.backward}
    present = set(count_rlx_calls(mod))
    out = DecomposeBackwardOps()(mod)
    left = count_rlx_calls(out)
    assert not (set(left) & backward), left
    assert set(left) <= {o.name for o in all_ops() if not o.backward}
    assert not count_rlx_calls(DecomposeBackwardOps(include_forward=True)(mod))
    for name in sorted(present & backward):
        kept = count_rlx_calls(DecomposeBackwardOps(preserve=[name])(mod))
        assert kept.get(name) == count_rlx_calls(mod)[name], (name, kept)
        assert not (set(kept) & (backward - {name})), (name, kept)


def test_decompose_rejects_unknown_preserve_name():
    with pytest.raises(KeyError):
        DecomposeBackwardOps(preserve=["no_such_op"])


def test_decompose_reports_a_decomposition_that_does_not_converge(monkeypatch):
    """A decomposition that emits its own op again would loop forever: the pass stops after
    MAX_ROUNDS rounds and names what is left."""
    relu_backward = get_op("relu_backward")
    monkeypatch.setattr(relu_backward, "decompose_fn", lambda bb, x, dy: rlx_tvm.ops.relu_backward(x, dy))
    mod = build_module([c for c in ALL_CASES if c.op == "relu_backward"][:1], "float32", False)
    with pytest.raises(RuntimeError, match=r"did not converge after \d+ rounds.*relu_backward"):
        DecomposeBackwardOps()(mod)


def _ops_in(func):
    names = set()

    def visit(e):
        if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op):
            names.add(e.op.name)

    relax.analysis.post_order_visit(func, visit)
    return names


def test_decomposed_graphs_are_differentiable_again():
    """Every primitive a decomposition emits has a gradient, and Gradient runs on each case's
    decomposed graph (loss = sum(out * out), so the rule of every primitive is exercised)."""
    failures, no_grad = [], set()
    for case in ALL_CASES:
        mod = DecomposeBackwardOps(include_forward=True)(build_loss_module(case, "float64"))
        for name in _ops_in(mod["main"]):
            if tvm.ir.Op.get(name).get_attr("FPrimalGradient") is None:
                no_grad.add(name)
        floats = [p for p in mod["main"].params if str(p.ty.dtype.dtype).startswith("float")]
        try:
            relax.transform.Gradient("main", require_grads=floats)(mod)
        except Exception as e:  # collect, report all at once
            failures.append(f"{case.name}: {type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}")
    assert not no_grad, f"primitives without gradients: {sorted(no_grad)}"
    assert not failures, "\n".join(failures)
