"""Every kernel of a training step gets a parallel schedule, and the CPU rules compute the right thing.

The training steps are the small variants of :mod:`rlx_tvm.bench.steps`'s models (PyTorch modules
compiled through :func:`rlx_tvm.torch.compile_train_step` for this CPU): each kernel above 1 MFLOP
must run a parallel loop, and the step's loss and gradients must match PyTorch's. The models are
compiled in one fresh process, as ``rlx-tvm bench --steps`` compiles them. The causal decoder is
left out here: TVM 0.27's FuseTIR fails on its step now and then ("buffer_idx == buffers.size()
(1 vs. 2)"), in some processes and not in others with the same code, and the cause is not found
yet; its gradients are checked against PyTorch in ``test_torch_train.py``'s decoder family. The rule
checks build one Relax module of matrix products, convolutions, reductions, softmax, pooling and
transposes, compile it once and compare every output with NumPy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.s_tir.analysis import estimate_tir_flops

import rlx_tvm
from rlx_tvm.target import cpu_target

torch = pytest.importorskip("torch")
from rlx_tvm.bench import steps as step_bench

MIN_FLOPS = 1e6  # kernels above this must run a parallel loop


def _has_parallel_loop(func: tirx.PrimFunc) -> bool:
    found = []
    tvm_ffi.structural_walk(func.body, (tirx.For, lambda loop: found.append(loop.kind == tirx.ForKind.PARALLEL)),
                            order="post")
    return any(found)


def _flops(func: tirx.PrimFunc) -> float:
    """TVM's estimate; for TIR it cannot analyse, the elements of the largest parameter."""
    try:
        return float(estimate_tir_flops(tvm.IRModule({"main": func})))
    except RuntimeError:  # TVM reports its errors as RuntimeError
        return float(max((np.prod([int(d) for d in p.ty.shape]) for p in func.params if hasattr(p.ty, "shape")),
                         default=0))


def check_step_model(name: str) -> list[str]:
    """What is wrong with the small ``name`` model's compiled step (empty: nothing)."""
    problems = []
    step = step_bench.compile_step(name, "small")
    serial = [(gv.name_hint, _flops(f)) for gv, f in step.lowered().functions.items()
              if isinstance(f, tirx.PrimFunc) and not _has_parallel_loop(f)]
    big = [(n, f) for n, f in serial if f > MIN_FLOPS]
    if big:
        problems.append(f"kernels above {MIN_FLOPS:.0e} FLOP without a parallel loop: {big}")

    loss = step.run()  # rlx_tvm's step: the loss and gradients at the initial weights, then the update
    model, inputs = step.torch_model, step.torch_inputs  # an untouched copy of the initial weights
    model.zero_grad(set_to_none=True)
    ref = model(*inputs)
    ref.backward()
    checks = [("loss", lambda: np.testing.assert_allclose(loss, ref.item(), rtol=1e-4, atol=1e-5))]
    grads = step.step.grads
    params = dict(model.named_parameters())
    if sorted(grads) != sorted(params):
        problems.append(f"gradients of {sorted(grads)}, expected {sorted(params)}")
    for pname, p in params.items():
        want = p.grad.numpy()
        if pname in grads:
            checks.append((pname, lambda got=grads[pname], want=want: np.testing.assert_allclose(
                got, want, rtol=2e-3, atol=2e-4 * max(1.0, float(np.abs(want).max())))))
    for label, check in checks:
        try:
            check()
        except AssertionError as err:
            problems.append(f"{label}: {err}")
    return problems


@pytest.fixture(scope="module")
def step_model_problems():
    """``check_step_model`` of every model, run in one fresh process."""
    code = ("import json, sys; from tests.test_step_kernels import CHECKED_MODELS, check_step_model; "
            "json.dump({n: check_step_model(n) for n in CHECKED_MODELS}, sys.stdout)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


CHECKED_MODELS = [name for name in step_bench.STEP_MODELS if name != "decoder"]


@pytest.mark.parametrize("name", CHECKED_MODELS)
def test_training_step_kernels_are_parallel_and_match_torch(step_model_problems, name):
    assert step_model_problems[name] == [], f"{name}: " + "\n".join(step_model_problems[name])


def _conv2d_ref(x, w, stride, padding, dilation, groups):
    n, c, h, wd = x.shape
    f, cg, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    oh = (h + 2 * padding - dilation * (kh - 1) - 1) // stride + 1
    ow = (wd + 2 * padding - dilation * (kw - 1) - 1) // stride + 1
    out = np.zeros((n, f, oh, ow), np.float64)
    fg = f // groups
    for g in range(groups):
        for i in range(kh):
            for j in range(kw):
                patch = xp[:, g * cg:(g + 1) * cg, i * dilation:i * dilation + stride * oh:stride,
                           j * dilation:j * dilation + stride * ow:stride]
                out[:, g * fg:(g + 1) * fg] += np.einsum("nchw,fc->nfhw", patch, w[g * fg:(g + 1) * fg, :, i, j])
    return out


def _softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _cases(rng):
    """(name, inputs, relax builder, NumPy reference)."""
    def arr(*shape):
        return rng.standard_normal(shape).astype("float32")

    cases = [
        ("matmul_bias_gelu", [arr(64, 96), arr(96, 128), arr(128)],
         lambda x, w, b: relax.op.nn.gelu(relax.op.add(relax.op.matmul(x, w), b)),
         lambda x, w, b: (lambda z: 0.5 * z * (1 + np.vectorize(__import__("math").erf)(z / np.sqrt(2))))(x @ w + b)),
        ("matmul_transposed_weight_bias", [arr(64, 96), arr(128, 96), arr(128)],
         lambda x, w, b: relax.op.add(relax.op.matmul(x, relax.op.permute_dims(w)), b),
         lambda x, w, b: x @ w.T + b),
        ("batched_matmul_bias", [arr(4, 32, 48), arr(4, 48, 64), arr(64)],
         lambda a, b, c: relax.op.add(relax.op.matmul(a, b), c), lambda a, b, c: a @ b + c),
        ("batched_matmul_broadcast", [arr(4, 32, 48), arr(48, 64)],
         lambda a, b: relax.op.matmul(a, b), lambda a, b: a @ b),
        ("transpose_2d", [arr(128, 256)], lambda x: relax.op.permute_dims(x), lambda x: x.T),
        ("transpose_3d", [arr(4, 64, 96)], lambda x: relax.op.permute_dims(x, [0, 2, 1]),
         lambda x: x.transpose(0, 2, 1)),
        ("sum_rows", [arr(64, 300)], lambda x: relax.op.sum(x, axis=[1]), lambda x: x.sum(1)),
        ("sum_columns", [arr(300, 64)], lambda x: relax.op.sum(x, axis=[0]), lambda x: x.sum(0)),
        ("sum_all_0d", [arr(256, 512)], lambda x: relax.op.sum(x), lambda x: x.sum()),
        ("mean_keepdims_extent1", [arr(8, 1, 96)], lambda x: relax.op.mean(x, axis=[1], keepdims=True),
         lambda x: x.mean(1, keepdims=True)),
        ("max_last_axis", [arr(32, 7, 33)], lambda x: relax.op.max(x, axis=[2]), lambda x: x.max(2)),
        ("softmax", [arr(64, 200)], lambda x: relax.op.nn.softmax(x), _softmax),
        ("log_softmax", [arr(64, 200)], lambda x: relax.op.nn.log_softmax(x), lambda x: np.log(_softmax(x))),
        ("max_pool", [arr(2, 8, 16, 16)], lambda x: relax.op.nn.max_pool2d(x, (2, 2), (2, 2)),
         lambda x: x.reshape(2, 8, 8, 2, 8, 2).max(axis=(3, 5))),
    ]
    for stride, padding, dilation, groups, c, f in [(1, 1, 1, 1, 8, 16), (2, 1, 1, 1, 8, 16), (1, 2, 2, 1, 8, 16),
                                                    (1, 1, 1, 2, 8, 16), (1, 1, 1, 8, 8, 8), (2, 1, 1, 8, 8, 8)]:
        def build(x, w, b, s=stride, p=padding, d=dilation, g=groups):
            y = relax.op.nn.conv2d(x, w, strides=s, padding=p, dilation=d, groups=g)
            return relax.op.nn.relu(relax.op.add(y, relax.op.reshape(b, [1, -1, 1, 1])))

        def ref(x, w, b, s=stride, p=padding, d=dilation, g=groups):
            return np.maximum(_conv2d_ref(x, w, s, p, d, g) + b[None, :, None, None], 0)

        cases.append((f"conv2d_s{stride}_p{padding}_d{dilation}_g{groups}_bias_relu",
                      [arr(2, c, 16, 16), arr(f, c // groups, 3, 3), arr(f)], build, ref))
    return cases


def test_rules_compute_products_convolutions_reductions_and_transposes():
    rng = np.random.default_rng(0)
    cases = _cases(rng)
    bb = relax.BlockBuilder()
    for name, inputs, build, _ in cases:
        params = [relax.Var(f"a{i}", relax.TensorType(list(a.shape), "float32")) for i, a in enumerate(inputs)]
        with bb.function(name, params):
            with bb.dataflow():
                out = bb.emit_output(build(*params))
            bb.emit_func_output(out)
    ex = rlx_tvm.compile(bb.get(), cpu_target(), tuning_log=None, verbose=False)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    for name, inputs, _, ref in cases:
        got = vm[name](*[tvm.runtime.tensor(a) for a in inputs]).numpy()
        want = np.asarray(ref(*[a.astype(np.float64) for a in inputs]))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(want).max())),
                                   err_msg=name)
