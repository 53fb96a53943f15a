"""Samples of conv2d_backward_input and conv2d_backward_weight (finite differences and exact
adjoints of an independent NumPy conv2d), and the gradient rule of R.nn.conv2d."""

from functools import partial

import numpy as np
from tvm import relax

from .. import Case, GradCase
from ._util import pair, pads

RNG = np.random.default_rng(11)


# -- an independent NumPy conv2d (float64), straight from the definition ------------------------




def conv2d(x, w, *, stride=1, padding=0, dilation=1, groups=1):
    """y[n, co, oy, ox] = sum_{c, i, j} x[n, g*Cig + c, oy*s - pt + i*d, ox*s - pl + j*d] * w[co, c, i, j],
    zero outside x, with g = co // (Co/G): one term per kernel tap (i, j)."""
    (sh, sw), (dh, dw) = pair(stride), pair(dilation)
    pt, pl, pb, pr = pads(padding)
    n, ci, h, wd = x.shape
    co, cig, kh, kw = w.shape
    xp = np.zeros((n, groups, cig, h + pt + pb, wd + pl + pr))
    xp[..., pt:pt + h, pl:pl + wd] = x.reshape(n, groups, cig, h, wd)
    wg = w.reshape(groups, co // groups, cig, kh, kw)
    ho = (h + pt + pb - dh * (kh - 1) - 1) // sh + 1
    wo = (wd + pl + pr - dw * (kw - 1) - 1) // sw + 1
    y = np.zeros((n, groups, co // groups, ho, wo))
    for i in range(kh):
        for j in range(kw):
            # x rows i*d, i*d + s, ..., one per output row (in padded coordinates)
            patch = xp[..., i * dh::sh, j * dw::sw][..., :ho, :wo]
            y += np.einsum("ngcyx,goc->ngoyx", patch, wg[..., i, j])
    return y.reshape(n, co, ho, wo)


def exact_vjp(f, primal, dy):
    """For f linear in ``primal``: J^T dy with J built column by column from basis vectors (exact,
    unlike finite differences)."""
    out = np.zeros(primal.size)
    basis = np.zeros(primal.size)
    for k in range(primal.size):
        basis[k] = 1.0
        out[k] = np.sum(f(basis.reshape(primal.shape)) * dy)
        basis[k] = 0.0
    return out.reshape(primal.shape)


def _geometry(case):
    return {k: v for k, v in case.attrs.items() if k not in ("input_size", "kernel_size")}


def adjoint_input(case):
    return exact_vjp(lambda x: conv2d(x, case.inputs["w"], **_geometry(case)), case.fd_extra["x"], case.inputs["dy"])


def adjoint_weight(case):
    return exact_vjp(lambda w: conv2d(case.inputs["x"], w, **_geometry(case)), case.fd_extra["w"], case.inputs["dy"])


# -- cases ----------------------------------------------------------------------------------------


def conv_cases(label, n, ci, co, hw, kernel, **geometry):
    """Both ops for one forward conv2d(x[n, ci, *hw], w[co, ci/G, *kernel]; geometry)."""
    groups = geometry.get("groups", 1)
    x = RNG.standard_normal((n, ci, *hw))
    w = RNG.standard_normal((co, ci // groups, *kernel))
    dy = RNG.standard_normal(conv2d(x, w, **geometry).shape)
    return [
        Case(
            "conv2d_backward_input", {"dy": dy, "w": w}, {"input_size": hw, **geometry}, batch={"dy": 0},
            label=f"conv2d_backward_input[{label}]", wrt="x", fd_extra={"x": x},
            forward=partial(lambda w, x, g: conv2d(x, w, **g), g=geometry),
        ),
        Case(
            "conv2d_backward_weight", {"x": x, "dy": dy}, {"kernel_size": kernel, **geometry}, batch={"x": 0, "dy": 0},
            label=f"conv2d_backward_weight[{label}]", wrt="w", fd_extra={"w": w},
            forward=partial(lambda x, w, g: conv2d(x, w, **g), g=geometry),
        ),
    ]


CASES = [
    *conv_cases("basic batch 2", 2, 3, 4, (6, 5), (3, 3), padding=1),
    # operators.md §8: stride 2 with an odd input size; row 6 and column 7 are dropped by the floor division.
    *conv_cases("stride 2 odd input, groups 2, batch 3", 3, 4, 6, (7, 8), (2, 3), stride=2, groups=2),
    *conv_cases("depthwise dilation 2", 2, 4, 4, (7, 7), (3, 3), stride=2, padding=1, dilation=2, groups=4),
    *conv_cases("rect, 4-tuple padding, mixed stride/dilation", 2, 2, 4, (8, 7), (3, 2),
                stride=(2, 1), padding=(1, 0, 2, 1), dilation=(1, 2), groups=2),
    *conv_cases("1x1 stride 3 drops rows", 1, 3, 2, (8, 7), (1, 1), stride=3),
    *conv_cases("kernel = padded input", 2, 2, 3, (3, 4), (5, 4), padding=(1, 0)),
    # Unit stride and dilation take the direct (correlation) forms on the CPU: grouped, and with
    # channels and rows wide enough for the register-blocked vector schedule, with padding past
    # the kernel (windows of only padding) and asymmetric.
    *conv_cases("unit stride, groups 2, 4-tuple padding", 2, 4, 6, (6, 7), (3, 2), padding=(0, 1, 2, 1), groups=2),
    *conv_cases("unit stride, 8 channels, 16-wide rows, padding past the kernel", 2, 8, 8, (5, 16), (2, 3),
                padding=(2, 3, 1, 3)),
]
CASE_BY_NAME = {c.name: c for c in CASES}


# -- the gradient of R.nn.conv2d ----------------------------------------------------------------


def conv_loss(stride, padding, dilation, groups):
    def build(x, w, c):
        y = relax.op.nn.conv2d(x, w, strides=stride, padding=padding, dilation=dilation, groups=groups)
        return relax.op.sum(relax.op.multiply(relax.op.multiply(y, y), c))  # quadratic in y: H != 0

    return build


def grad_case(label, n, ci, co, hw, k, stride, padding, dilation, groups):
    x = RNG.standard_normal((n, ci, *hw))
    w = RNG.standard_normal((co, ci // groups, k, k)) * 0.5
    y = conv2d(x, w, stride=stride, padding=padding, dilation=dilation, groups=groups)
    return GradCase(label, {"x": x, "w": w, "c": RNG.standard_normal(y.shape)},
                    conv_loss(stride, padding, dilation, groups), wrt=["x", "w"])


# For tests/test_gradients.py: first order in float32/float64 and Hessian-vector products (second
# order differentiates the decompositions: conv2d_transpose and the permuted conv2d).
GRAD_CASES = [
    grad_case("conv2d groups 2 stride 2 odd", 2, 4, 4, (5, 6), 3, 2, 1, 1, 2),
    grad_case("conv2d dilation 2", 3, 2, 3, (6, 6), 2, 1, 0, 2, 1),
]
