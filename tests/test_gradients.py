"""Gradient rules: rlx_tvm.autodiff.grad on ordinary Relax models vs finite differences, and second
and third order through each op family.

Each family's sample module (``rlx_tvm.testing.samples.<family>``) may declare ``GRAD_CASES``
(list of ``rlx_tvm.testing.GradCase``): scalar functions of Relax forward ops whose gradients the
family's rules provide. They are all checked here, first order in float32 and float64, second and
third order in float64.
"""

import pytest

from rlx_tvm.ops.activation import RELAX_ACTIVATIONS
from rlx_tvm.testing import check_gradients, check_nth_order, check_second_order
from rlx_tvm.testing.samples import grad_samples

GRAD_CASES = grad_samples()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gradients_match_finite_differences(dtype):
    check_gradients(GRAD_CASES, dtype, with_second_order=True)


def test_every_relax_activation_rule_is_checked():
    checked = {c.label for c in GRAD_CASES}
    assert set(RELAX_ACTIVATIONS) - {"relax.round", "relax.floor", "relax.ceil", "relax.sign"} <= checked


def test_attention_rules_are_checked():
    checked = {c.label for c in GRAD_CASES}
    assert {"R.nn.attention(TopLeft, scale, bias)", "rlx.attention(GQA, softcap, window, bias)"} <= checked


def test_hessian_vector_products_match_finite_differences():
    check_second_order(GRAD_CASES)


def test_nth_order_gradients_match_finite_differences():
    # Orders 2 and 3 through every family (each case differentiated three times in a row, with the
    # backward ops decomposed between levels).
    check_nth_order(GRAD_CASES, order=3)
