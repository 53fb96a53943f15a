"""Default CPU schedule rules decline kernels they do not fit instead of raising."""

import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I, relax as R

import rlx_tvm
from rlx_tvm.target import cpu_target


@I.ir_module
class BroadcastReductions:
    @R.function
    def main(x: R.Tensor((4, 16), "float32"), c: R.Tensor((4, 1), "float32"), r: R.Tensor((1, 16), "float32")):
        with R.dataflow():
            rows = R.sum(x * c, axis=[1])
            cols = R.sum(x / r, axis=[0])
            kept = R.collapse_sum_to(-x * c / r, (4, 1))
            R.output(rows, cols, kept)
        return (rows, cols, kept)


def test_reductions_of_broadcast_products_compile_and_match_numpy():
    ex = rlx_tvm.compile(BroadcastReductions, cpu_target(), verbose=False)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 16)).astype("float32")
    c = rng.standard_normal((4, 1)).astype("float32")
    r = rng.uniform(0.5, 2.0, (1, 16)).astype("float32")
    rows, cols, kept = vm["main"](*(tvm.runtime.tensor(a) for a in (x, c, r)))
    np.testing.assert_allclose(rows.numpy(), (x * c).sum(1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cols.numpy(), (x / r).sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(kept.numpy(), (-x * c / r).sum(1, keepdims=True), rtol=1e-5, atol=1e-5)
