"""Gradients of every op TVM's torch importer emits, against torch.autograd.

Each case of ``rlx_tvm.gradients.coverage_cases`` is a small torch module; the cases are exported
in groups (one ``torch.export`` and one ``from_exported_program`` per group), differentiated with
``rlx_tvm.autodiff.grad`` and compiled once, all together, with ``rlx_tvm.compile`` for this CPU.
Torch is the oracle: every float input's and parameter's gradient must match ``torch.autograd``
(float64 cases to 1e-9 relative; float32 where the importer computes in float32: its matmul,
linear and conv force it).
"""

import os
import re

import pytest

torch = pytest.importorskip("torch")

from rlx_tvm.gradients import coverage, torch_check  # noqa: E402
from rlx_tvm.gradients.coverage_cases import CASES  # noqa: E402

TABLE = os.path.join(os.path.dirname(__file__), "..", "docs", "gradient_coverage.md")


@pytest.fixture(scope="module")
def checked():
    return torch_check.check_all(CASES)


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_gradient_matches_torch(checked, name):
    _, errors = checked
    assert errors[name] is None, f"{name}: {errors[name]}"


@pytest.mark.parametrize("relax_op", sorted(coverage.FUSED))
def test_fused_backward_ops_in_gradient(checked, relax_op):
    """Where a rule lowers onto fused rlx backward ops, the imported models' gradients use them."""
    groups, _ = checked
    using = [g for g in groups if relax_op in g.relax_ops and g.adjoint is not None]
    assert using, f"no case's imported module contains {relax_op}"
    for g in using:
        missing = set(coverage.FUSED[relax_op]) - g.grad_ops
        assert not missing, f"{relax_op} in {[c.name for c in g.cases]}: gradient lacks {sorted(missing)}"


def test_coverage_table_is_current_and_every_row_names_a_test(checked):
    groups, _ = checked
    aten = {}
    for g in groups:
        aten.update(g.aten_ops)
    text = coverage.render(aten)
    with open(TABLE) as f:
        assert f.read() == text, "docs/gradient_coverage.md is stale: python -m rlx_tvm.gradients.coverage --write docs/gradient_coverage.md"
    names = {c.name for c in CASES}
    named = set(re.findall(rf"{coverage.TEST_FUNCTION}\[(\w+)\]", text))
    assert named and named <= names
    # Every Relax op the importer emits has a gradient, or is listed as not differentiable.
    assert "MISSING" not in text
