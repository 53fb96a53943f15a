"""rlx_tvm.autodiff: grad / hvp / nth_order_grad against finite differences."""

import math

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from rlx_tvm import autodiff
from rlx_tvm.passes import count_rlx_calls
from rlx_tvm.testing import CHECK_TARGET


def _vm(mod):
    return relax.VirtualMachine(tvm.compile(mod, tvm.target.Target(CHECK_TARGET)), tvm.cpu())


def _t(a):
    return tvm.runtime.tensor(np.ascontiguousarray(a))


def _erf(x):
    return np.vectorize(math.erf)(x)


def _fd_grad(f, a, eps=1e-6):
    g = np.zeros_like(a)
    for j in range(a.size):
        e = np.zeros(a.size)
        e[j] = eps
        e = e.reshape(a.shape)
        g.reshape(-1)[j] = (f(a + e) - f(a - e)) / (2 * eps)
    return g


@I.ir_module
class TwoFunctions:
    """main calls another Relax function: TVM's Gradient alone returns zeros here."""

    @R.function
    def helper(x: R.Tensor((3, 4), "float64")) -> R.Tensor((3, 4), "float64"):
        return R.nn.gelu(x)

    @R.function
    def main(x: R.Tensor((3, 4), "float64"), w: R.Tensor((4, 4), "float64")) -> R.Tensor((), "float64"):
        with R.dataflow():
            h = TwoFunctions.helper(x)
            y = R.matmul(h, w)
            t = R.tanh(y)
            loss = R.sum(t * t)
            R.output(loss)
        return loss


def _two_functions_np(x, w):
    g = 0.5 * x * (1 + _erf(x / np.sqrt(2)))
    return np.sum(np.tanh(g @ w) ** 2)


RNG = np.random.default_rng(0)
X = RNG.standard_normal((3, 4))
W = RNG.standard_normal((4, 4))


def test_grad_through_a_called_function_matches_finite_differences():
    mod = autodiff.grad(TwoFunctions)
    assert count_rlx_calls(mod, ["activation_backward"]), "Gradient should emit the rlx op for gelu"
    loss, (gx, gw) = _vm(mod)["main_adjoint"](_t(X), _t(W))
    np.testing.assert_allclose(loss.numpy(), _two_functions_np(X, W), rtol=1e-12)
    np.testing.assert_allclose(gx.numpy(), _fd_grad(lambda a: _two_functions_np(a, W), X), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(gw.numpy(), _fd_grad(lambda a: _two_functions_np(X, a), W), rtol=1e-6, atol=1e-8)
    assert np.abs(gx.numpy()).max() > 1e-3  # not the silent zeros


def test_wrt_by_name_and_errors():
    mod = autodiff.grad(TwoFunctions, wrt=["w"])
    _, grads = _vm(mod)["main_adjoint"](_t(X), _t(W))
    assert len(grads) == 1
    with pytest.raises(autodiff.AutodiffError, match="'wrt'.*'nope'"):
        autodiff.grad(TwoFunctions, wrt=["nope"])
    with pytest.raises(autodiff.AutodiffError, match="'func'"):
        autodiff.grad(TwoFunctions, func="missing")


def test_non_scalar_target_is_rejected():
    with pytest.raises(autodiff.AutodiffError, match="scalar"):
        autodiff.grad(TwoFunctions, func="helper")


def test_hvp_matches_finite_differences_of_the_gradient():
    hv_mod = autodiff.hvp(TwoFunctions, "main", ["x"])
    g_vm = _vm(autodiff.grad(TwoFunctions, wrt=["x"]))
    v = RNG.standard_normal(X.shape)
    loss, grads, hv = _vm(hv_mod)["main_hvp"](_t(X), _t(W), _t(v))

    def grad_x(a):
        return g_vm["main_adjoint"](_t(a), _t(W))[1][0].numpy()

    eps = 1e-5
    hv_fd = (grad_x(X + eps * v) - grad_x(X - eps * v)) / (2 * eps)
    np.testing.assert_allclose(hv[0].numpy(), hv_fd, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(grads[0].numpy(), grad_x(X), rtol=1e-12)
    np.testing.assert_allclose(loss.numpy(), _two_functions_np(X, W), rtol=1e-12)


@I.ir_module
class Elementwise:
    @R.function
    def main(x: R.Tensor((5,), "float64")) -> R.Tensor((), "float64"):
        with R.dataflow():
            loss = R.sum(R.nn.gelu(R.tanh(x)))
            R.output(loss)
        return loss


def test_nth_order_grad_matches_finite_differences_of_the_previous_order():
    xs = RNG.standard_normal(5)
    vm = _vm(autodiff.nth_order_grad(Elementwise, "main", ["x"], 3))
    g = [a.numpy() for a in vm["main_grad3"](_t(xs))]

    def order(k):
        return lambda t: vm["main_grad3"](_t(t))[k].numpy()

    def f(t):
        u = np.tanh(t)
        return np.sum(0.5 * u * (1 + _erf(u / np.sqrt(2))))

    eps = 1e-5
    eye = np.eye(5) * eps
    np.testing.assert_allclose(g[0], _fd_grad(f, xs), rtol=1e-6, atol=1e-8)
    for k in (1, 2):  # elementwise: the k-th derivative is the FD of the (k-1)-th, diagonal
        prev = order(k - 1)
        fd = np.array([(prev(xs + e)[i] - prev(xs - e)[i]) / (2 * eps) for i, e in enumerate(eye)])
        np.testing.assert_allclose(g[k], fd, rtol=1e-5, atol=1e-7)


@I.ir_module
class Relu:
    @R.function
    def main(x: R.Tensor((4,), "float64")) -> R.Tensor((), "float64"):
        with R.dataflow():
            loss = R.sum(R.nn.relu(x))
            R.output(loss)
        return loss


def test_relu_gradient_at_zero_is_zero():
    _, (g,) = _vm(autodiff.grad(Relu))["main_adjoint"](_t(np.array([-1.0, 0.0, 0.0, 2.0])))
    np.testing.assert_array_equal(g.numpy(), [0.0, 0.0, 0.0, 1.0])
