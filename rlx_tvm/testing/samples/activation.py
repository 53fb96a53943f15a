"""Samples of relu_backward and activation_backward: every activation kind on inputs away from
its kinks, and the gradient rules of Relax's activations."""

import numpy as np
from tvm import relax

from ...ops.activation import ACTIVATIONS, RELAX_ACTIVATIONS
from .. import Case, GradCase
from ._util import away_from

RNG = np.random.default_rng(1)


def _fd_forward(kind):
    f = ACTIVATIONS[kind].forward
    return lambda x: f(x)


def _cases():
    cases = []
    for kind, act in ACTIVATIONS.items():
        lo, hi = act.domain
        x = away_from(RNG, (3, 8), lo, hi, act.kinks)
        dy = RNG.standard_normal((3, 8))
        cases.append(
            Case(
                "activation_backward",
                {"x": x, "dy": dy},
                {"kind": kind},
                batch={"x": 0, "dy": 0},
                label=f"activation_backward[{kind}]",
                forward=_fd_forward(kind) if act.matches_forward else None,
                wrt="x",
            )
        )
    x = away_from(RNG, (2, 3, 5), -2, 2, (0.0,))
    cases.append(
        Case("relu_backward", {"x": x, "dy": RNG.standard_normal(x.shape)}, batch={"x": 1, "dy": 1},
             forward=ACTIVATIONS["relu"].forward, wrt="x")
    )
    return cases


CASES = _cases()


# -- gradient rules of Relax's activations --------------------------------------------------------

GRAD_RNG = np.random.default_rng(7)
op = relax.op

RELAX_FN = {
    "relax.nn.relu": op.nn.relu, "relax.nn.gelu": op.nn.gelu, "relax.nn.gelu_tanh": op.nn.gelu_tanh,
    "relax.nn.silu": op.nn.silu, "relax.sigmoid": op.sigmoid, "relax.tanh": op.tanh, "relax.exp": op.exp,
    "relax.log": op.log, "relax.sqrt": op.sqrt, "relax.rsqrt": op.rsqrt, "relax.abs": op.abs, "relax.sin": op.sin,
    "relax.cos": op.cos, "relax.tan": op.tan, "relax.atan": op.atan, "relax.erf": op.erf,
}


def _weighted_sum(fn):
    return lambda x, w: op.sum(op.multiply(fn(x), w))


def _grad_cases():
    rng = GRAD_RNG
    cases = []
    for name, fn in RELAX_FN.items():
        act = ACTIVATIONS[RELAX_ACTIVATIONS[name]]
        x = away_from(rng, (2, 5), *act.domain, act.kinks, margin=0.1)
        cases.append(GradCase(name, {"x": x, "w": rng.standard_normal((2, 5))}, _weighted_sum(fn), wrt=["x"]))
    x = away_from(rng, (2, 5), -3, 3, (), margin=0.1)
    cases.append(GradCase("relax.nn.softplus", {"x": x, "w": rng.standard_normal((2, 5))},
                          _weighted_sum(lambda t: op.nn.softplus(t, beta=1.0, threshold=20.0)), wrt=["x"]))
    cases.append(GradCase("relax.nn.softplus(beta=2)", {"x": x, "w": rng.standard_normal((2, 5))},
                          _weighted_sum(lambda t: op.nn.softplus(t, beta=2.0, threshold=20.0)), wrt=["x"]))
    return cases


GRAD_CASES = _grad_cases()
