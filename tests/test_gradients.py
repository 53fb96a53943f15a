"""Gradient rules: rlx_tvm.autodiff.grad on ordinary Relax models vs finite differences, and second
order (Hessian-vector products) through each op family.

Each family's test module may export ``GRAD_CASES`` (list of ``rlx_tvm.testing.GradCase``): scalar
functions of Relax forward ops whose gradients the family's rules provide. They are all checked here,
first order in float32 and float64, second order in float64.
"""

import importlib

import numpy as np
import pytest
from tvm import relax

from rlx_tvm.ops.activation import ACTIVATIONS, RELAX_ACTIVATIONS
from rlx_tvm.testing import GradCase, check_gradients, check_nth_order, check_second_order

from .helpers import away_from

RNG = np.random.default_rng(7)
op = relax.op

_RELAX_FN = {
    "relax.nn.relu": op.nn.relu, "relax.nn.gelu": op.nn.gelu, "relax.nn.gelu_tanh": op.nn.gelu_tanh,
    "relax.nn.silu": op.nn.silu, "relax.sigmoid": op.sigmoid, "relax.tanh": op.tanh, "relax.exp": op.exp,
    "relax.log": op.log, "relax.sqrt": op.sqrt, "relax.rsqrt": op.rsqrt, "relax.abs": op.abs, "relax.sin": op.sin,
    "relax.cos": op.cos, "relax.tan": op.tan, "relax.atan": op.atan, "relax.erf": op.erf,
}


def _weighted_sum(fn):
    return lambda x, w: op.sum(op.multiply(fn(x), w))


def activation_cases():
    cases = []
    for name, fn in _RELAX_FN.items():
        act = ACTIVATIONS[RELAX_ACTIVATIONS[name]]
        x = away_from(RNG, (2, 5), *act.domain, act.kinks, margin=0.1)
        cases.append(GradCase(name, {"x": x, "w": RNG.standard_normal((2, 5))}, _weighted_sum(fn), wrt=["x"]))
    x = away_from(RNG, (2, 5), -3, 3, (), margin=0.1)
    cases.append(GradCase("relax.nn.softplus", {"x": x, "w": RNG.standard_normal((2, 5))},
                          _weighted_sum(lambda t: op.nn.softplus(t, beta=1.0, threshold=20.0)), wrt=["x"]))
    cases.append(GradCase("relax.nn.softplus(beta=2)", {"x": x, "w": RNG.standard_normal((2, 5))},
                          _weighted_sum(lambda t: op.nn.softplus(t, beta=2.0, threshold=20.0)), wrt=["x"]))
    return cases


def _family_cases():
    cases = []
    for fam in ("norm", "rope", "loss", "indexing", "quantize", "conv", "pool", "attention", "scan"):
        try:
            mod = importlib.import_module(f"tests.test_{fam}")
        except ModuleNotFoundError:
            continue
        cases.extend(getattr(mod, "GRAD_CASES", []))
    return cases


GRAD_CASES = activation_cases() + _family_cases()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gradients_match_finite_differences(dtype):
    check_gradients(GRAD_CASES, dtype)


def test_every_relax_activation_rule_is_checked():
    checked = {c.label for c in GRAD_CASES}
    assert set(RELAX_ACTIVATIONS) - {"relax.round", "relax.floor", "relax.ceil", "relax.sign"} <= checked


def test_hessian_vector_products_match_finite_differences():
    check_second_order(GRAD_CASES)


def test_nth_order_gradients_match_finite_differences():
    # Orders 2 and 3 through every family (each case differentiated three times in a row, with the
    # backward ops decomposed between levels).
    check_nth_order(GRAD_CASES, order=3)
