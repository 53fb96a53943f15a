"""Samples of scan and its backward ops: linear, tanh-RNN and rlx-op bodies, with and without the
trajectory, with 0 or 2 checkpoints over non-uniform segments; the bodies (Relax builder, NumPy
forward, NumPy VJP) are shared with tests/test_scan.py."""

import numpy as np
from tvm import relax

from ... import ops
from ...ops import get_op
from ...ops.scan import ScanBody
from .. import Case

RNG = np.random.default_rng(5)
SCAN = get_op("scan")


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _sum_to(g, shape):
    """Sum a broadcast gradient back to ``shape`` (leading axes)."""
    return g.reshape((-1,) + tuple(shape)).sum(axis=0)


def const_like(v, like):
    return relax.const(v, str(like.ty.dtype.dtype))


# -- bodies: (Relax builder, NumPy forward, NumPy VJP) ------------------------------------------

LINEAR = ScanBody(
    lambda c, x, a: c * a + x,
    lambda c, x, a: c * a + x,
    lambda c, x, a, ct: (ct * a, ct, _sum_to(ct * c, a.shape)),
    name="linear",
)


def rnn_vjp(h, x, W, ct):
    d = ct * (1.0 - np.tanh(h @ W + x) ** 2)
    return d @ W.T, d, h.T @ d


RNN = ScanBody(
    lambda h, x, W: relax.op.tanh(relax.op.matmul(h, W) + x),
    lambda h, x, W: np.tanh(h @ W + x),
    rnn_vjp,
    name="rnn",
)


def _act_vjp(c, x, p, ct):
    s = _sigmoid(c)
    d1, d2 = s * (1 - s), s * (1 - s) * (1 - 2 * s)
    return ct * (p + x * d2), ct * d1, _sum_to(ct * c, p.shape)


# A body containing an rlx op: c' = p * c + activation_backward(c, x, sigmoid) = p c + x sigma'(c).
RLX_OP = ScanBody(
    lambda c, x, p: c * p + ops.activation_backward(c, x, kind="sigmoid"),
    lambda c, x, p: c * p + x * _sigmoid(c) * (1 - _sigmoid(c)),
    _act_vjp,
    name="rlx_op_cell",
)

TWO_XS = ScanBody(
    lambda c, x, y, a: c * a + x * y,
    lambda c, x, y, a: c * a + x * y,
    lambda c, x, y, a, ct: (ct * a, ct * y, ct * x, _sum_to(ct * c, a.shape)),
    name="two_xs",
)


def _ode_vjp(c, W, ct):
    t = np.tanh(c @ W)
    d = ct * 0.1 * (1 - t**2)
    return ct + d @ W.T, c.T @ d


# No xs: an explicit-Euler-like integrator over a fixed number of steps (``length``).
ODE = ScanBody(
    lambda c, W: c + const_like(0.1, c) * relax.op.tanh(relax.op.matmul(c, W)),
    lambda c, W: c + 0.1 * np.tanh(c @ W),
    _ode_vjp,
    name="ode",
)

BODIES = {"linear": LINEAR, "rnn": RNN, "rlx_op": RLX_OP}


def scan_param(name, H=3):
    return 0.5 * RNG.standard_normal((H, H) if name == "rnn" else (H,)) + (0.0 if name == "rnn" else 0.3)


def _cases():
    cases = []
    L = 3  # with K = 2: segments of 2 and 1 steps (non-uniform)
    for (bname, body), (save, K) in zip(
        BODIES.items(), [(True, 2), (False, 0), (True, 0)]
    ):
        H = 3
        init, xs, p = RNG.standard_normal((2, H)), 0.5 * RNG.standard_normal((L, 2, H)), scan_param(bname)
        attrs = {"body": body, "save_trajectory": save, "num_checkpoints": K}
        cases.append(
            Case("scan", {"init": init, "xs": xs, "params": p}, attrs, batch={"init": 0, "xs": 1}, label=f"scan[{bname},{save},{K}]")
        )
    for bname, save, K in [("rnn", False, 2), ("linear", True, 0), ("rlx_op", True, 2)]:
        body = BODIES[bname]
        init, xs, p = RNG.standard_normal((2, 3)), 0.5 * RNG.standard_normal((L, 2, 3)), scan_param(bname)
        traj = SCAN.reference_fn(init, xs, p, body=body, save_trajectory=True, num_checkpoints=K)
        up = RNG.standard_normal(traj.shape if save else init.shape)
        ins = {"init": init, "trajectory": traj, "upstream": up, "xs": xs, "params": p}
        batch = {"init": 0, "trajectory": 1, "upstream": 1 if save else 0, "xs": 1}
        attrs = {"body": body, "save_trajectory": save, "num_checkpoints": K}
        for op in ("scan_backward", "scan_backward_xs", "scan_backward_params"):
            cases.append(Case(op, ins, attrs, batch=batch, label=f"{op}[{bname},{save},{K}]"))
    return cases


CASES = _cases()
