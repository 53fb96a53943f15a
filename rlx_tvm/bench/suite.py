"""The backward-kernel benchmark suite: what ``rlx-tvm tune`` tunes and ``rlx-tvm bench`` times.

Each :class:`SuiteKernel` is one training-time backward computation (float32) at the shapes of
a transformer or CNN training step, and carries everything needed to build and compare it:

* ``inputs(scale)``: NumPy inputs at ``"full"`` (benchmark) or ``"small"`` (tests) shapes;
* ``rlx(vars)``: the rlx backward ops, one Relax function ``main`` returning a tuple;
* ``tvm(vars)``: TVM 0.27's own formulation where it has one (``relax.op.grad.*``); otherwise the
  TVM baseline is the rlx decomposition into primitive Relax ops, built by plain ``tvm.compile``;
* ``torch(tensors)``: PyTorch eager (``suite_torch.py``), returning ``(output, leaves,
  cotangent)`` so that only the backward (``torch.autograd.grad``) is timed;
* ``bytes`` / ``flops``: the minimal traffic (inputs read once, outputs written once) and the
  useful floating-point work, for GB/s and GFLOP/s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import tvm
from tvm import relax

from .. import ops
from ..ops.registry import get_op
from . import suite_torch

__all__ = ["SUITE", "SuiteKernel", "suite_ir_module", "suite_kernel", "suite_kernels", "suite_module", "suite_reference"]


@dataclass(frozen=True)
class SuiteKernel:
    name: str
    shapes: Callable[[str], dict]  # scale -> {input name: (shape, kind)}; kind picks the generator
    rlx: Callable[..., tuple]
    tvm: Callable[..., tuple] | None = None
    flops: Callable[[dict], float] | None = None  # shapes -> useful flops (compute-bound kernels)
    shape_only: tuple[str, ...] = ()  # inputs that only give a shape (not read: no memory traffic)

    @property
    def torch(self) -> Callable[..., tuple]:
        """PyTorch eager: see :mod:`rlx_tvm.bench.suite_torch`."""
        return suite_torch.BY_KERNEL[self.name]

    def inputs(self, scale: str = "full", seed: int = 0) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        out = {}
        for name, (shape, kind) in self.shapes(scale).items():
            if kind.startswith("int<"):  # "int<N": integers in [0, N)
                out[name] = rng.integers(0, int(kind[4:]), size=shape, dtype=np.int64)
            elif kind == "positive":
                out[name] = rng.uniform(0.5, 1.5, size=shape).astype(np.float32)
            else:
                out[name] = rng.standard_normal(shape, dtype=np.float32)
        return out

    def bytes_moved(self, inputs: dict[str, np.ndarray], outputs) -> int:
        read = sum(a.nbytes for n, a in inputs.items() if n not in self.shape_only)
        return read + sum(int(np.prod(o.shape)) * 4 for o in outputs)


def _shape_table(**by_scale):
    return lambda scale: by_scale[scale]


SUITE: list[SuiteKernel] = []


def _register(k: SuiteKernel) -> SuiteKernel:
    SUITE.append(k)
    return k


def suite_kernel(name: str) -> SuiteKernel:
    for k in SUITE:
        if k.name == name:
            return k
    raise KeyError(f"no suite kernel {name!r}; the suite has {[k.name for k in SUITE]}")


def _dims(var: relax.Var) -> list[int]:
    return [int(d) for d in var.ty.shape.values]


# ------------------------------------------------------------------------------------------------
# elementwise activations: 8M elements
# ------------------------------------------------------------------------------------------------

_EW = _shape_table(full={"x": ((8192, 1024), "normal"), "dy": ((8192, 1024), "normal")},
                   small={"x": ((16, 96), "normal"), "dy": ((16, 96), "normal")})


def _activation(kind: str, torch_fn: str) -> SuiteKernel:
    def rlx(x, dy):
        return (ops.relu_backward(x, dy) if kind == "relu" else ops.activation_backward(x, dy, kind=kind),)

    return SuiteKernel(f"{kind}_backward", _EW, rlx)


RELU = _register(_activation("relu", "relu"))
GELU = _register(_activation("gelu", "gelu"))
SILU = _register(_activation("silu", "silu"))


# ------------------------------------------------------------------------------------------------
# norms
# ------------------------------------------------------------------------------------------------

_ROWS = _shape_table(
    full={"x": ((8192, 768), "normal"), "gamma": ((768,), "positive"), "beta": ((768,), "normal"),
          "dy": ((8192, 768), "normal")},
    small={"x": ((24, 64), "normal"), "gamma": ((64,), "positive"), "beta": ((64,), "normal"),
           "dy": ((24, 64), "normal")},
)


def _layer_norm_rlx(x, gamma, beta, dy):
    return (ops.layer_norm_backward_input(x, gamma, dy, axis=-1, eps=1e-5),
            ops.layer_norm_backward_gamma(x, dy, axis=-1, eps=1e-5),
            relax.op.sum(dy, axis=[0]))


def _rms_norm_rlx(x, gamma, beta, dy):
    return (ops.rms_norm_backward_input(x, gamma, beta, dy, axis=-1, eps=1e-6),
            ops.rms_norm_backward_gamma(x, gamma, beta, dy, axis=-1, eps=1e-6))


LAYER_NORM = _register(SuiteKernel("layer_norm_backward", _ROWS, _layer_norm_rlx))
RMS_NORM = _register(SuiteKernel("rms_norm_backward", _ROWS, _rms_norm_rlx))

_GROUPS = suite_torch.GROUP_NORM_GROUPS
_GN = _shape_table(
    full={"x": ((8, 64, 56, 56), "normal"), "gamma": ((64,), "positive"), "beta": ((64,), "normal"),
          "dy": ((8, 64, 56, 56), "normal")},
    small={"x": ((2, 64, 5, 6), "normal"), "gamma": ((64,), "positive"), "beta": ((64,), "normal"),
           "dy": ((2, 64, 5, 6), "normal")},
)


def _group_norm_rlx(x, gamma, beta, dy):
    return (ops.group_norm_backward_input(x, gamma, beta, dy, num_groups=_GROUPS, eps=1e-5),
            ops.group_norm_backward_gamma(x, dy, num_groups=_GROUPS, eps=1e-5),
            ops.group_norm_backward_beta(x, dy, num_groups=_GROUPS, eps=1e-5))


GROUP_NORM = _register(SuiteKernel("group_norm_backward", _GN, _group_norm_rlx))


# ------------------------------------------------------------------------------------------------
# softmax cross-entropy (per-row loss, cotangent per row)
# ------------------------------------------------------------------------------------------------

_CE = _shape_table(
    full={"logits": ((2048, 8192), "normal"), "labels": ((2048,), "int<8192"), "d_loss": ((2048,), "normal")},
    small={"logits": ((12, 40), "normal"), "labels": ((12,), "int<40"), "d_loss": ((12,), "normal")},
)


CROSS_ENTROPY = _register(SuiteKernel(
    "softmax_cross_entropy_backward", _CE,
    lambda logits, labels, d_loss: (ops.softmax_cross_entropy_backward(logits, labels, d_loss),)))


# ------------------------------------------------------------------------------------------------
# conv2d backward: N8 C64 56x56, K64 3x3, pad 1
# ------------------------------------------------------------------------------------------------

_CONV = _shape_table(
    full={"x": ((8, 64, 56, 56), "normal"), "w": ((64, 64, 3, 3), "normal"), "dy": ((8, 64, 56, 56), "normal")},
    small={"x": ((2, 8, 7, 6), "normal"), "w": ((4, 8, 3, 3), "normal"), "dy": ((2, 4, 7, 6), "normal")},
)


def _conv_flops(shapes):
    (n, c, h, w), (k, _, kh, kw) = shapes["x"][0], shapes["w"][0]
    return 2.0 * n * k * c * h * w * kh * kw  # stride 1, 'same' padding: Ho = H, Wo = W


CONV_INPUT = _register(SuiteKernel(
    "conv2d_backward_input", _CONV,
    lambda x, w, dy: (ops.conv2d_backward_input(dy, w, input_size=tuple(_dims(x)[2:]), padding=1),),
    flops=_conv_flops))
CONV_WEIGHT = _register(SuiteKernel(
    "conv2d_backward_weight", _CONV,
    lambda x, w, dy: (ops.conv2d_backward_weight(x, dy, kernel_size=tuple(_dims(w)[2:]), padding=1),),
    flops=_conv_flops))


# ------------------------------------------------------------------------------------------------
# max_pool2d backward: (8, 64, 112, 112), k3 s2 p1
# ------------------------------------------------------------------------------------------------

_POOL = _shape_table(
    full={"x": ((8, 64, 112, 112), "normal"), "dy": ((8, 64, 56, 56), "normal")},
    small={"x": ((2, 3, 9, 8), "normal"), "dy": ((2, 3, 5, 4), "normal")},
)


MAX_POOL = _register(SuiteKernel(
    "max_pool2d_backward", _POOL,
    lambda x, dy: (ops.max_pool2d_backward(x, dy, kernel_size=(3, 3), stride=(2, 2), padding=(1, 1)),),
    tvm=lambda x, dy: (relax.op.grad.max_pool2d_backward(dy, x, pool_size=(3, 3), strides=(2, 2),
                                                          padding=(1, 1, 1, 1)),)))


# ------------------------------------------------------------------------------------------------
# causal attention backward: B4 S512 H8 D64 (dq, dk, dv)
# ------------------------------------------------------------------------------------------------

_ATTN = _shape_table(
    full={n: ((4, 512, 8, 64), "normal") for n in ("q", "k", "v", "dy")},
    small={n: ((1, 12, 2, 8), "normal") for n in ("q", "k", "v", "dy")},
)


def _attention_rlx(q, k, v, dy):
    return tuple(ops.attention_backward(q, k, v, dy, wrt=w, causal_mask="TopLeft") for w in ("q", "k", "v"))


def _attention_flops(shapes):
    b, s, h, d = shapes["q"][0]
    # backward of causal attention: S = QK^T recomputed, dV, dP, dQ, dK: 5 matmuls, half masked
    return 5 * 2.0 * b * h * s * s * d / 2


ATTENTION = _register(SuiteKernel("attention_backward", _ATTN, _attention_rlx,
                                  flops=_attention_flops))


# ------------------------------------------------------------------------------------------------
# embedding (take/gather) backward: 32000 x 768 table, 8192 indices
# ------------------------------------------------------------------------------------------------

_GATHER = _shape_table(
    full={"table": ((32000, 768), "normal"), "indices": ((8192,), "int<32000"), "dy": ((8192, 768), "normal")},
    small={"table": ((50, 16), "normal"), "indices": ((30,), "int<50"), "dy": ((30, 16), "normal")},
)


GATHER = _register(SuiteKernel(
    "gather_backward", _GATHER,
    lambda table, indices, dy: (ops.gather_backward(dy, indices, axis=0,
                                                    dim_size=_dims(table)[0]),),
    tvm=lambda table, indices, dy: (relax.op.grad.take_backward(dy, table, indices, axis=0),),
    shape_only=("table",)))


# ------------------------------------------------------------------------------------------------
# cumsum, fake-quantize, rope
# ------------------------------------------------------------------------------------------------

_CUMSUM = _shape_table(full={"x": ((64, 4096), "normal"), "dy": ((64, 4096), "normal")},
                       small={"x": ((5, 33), "normal"), "dy": ((5, 33), "normal")})


CUMSUM = _register(SuiteKernel("cumsum_backward", _CUMSUM, lambda x, dy: (ops.cumsum_backward(dy, axis=1),)))


FAKE_QUANT = _register(SuiteKernel(
    "fake_quantize_backward", _EW,
    lambda x, dy: (ops.fake_quantize_backward(x, dy, bits=8, ste="clipped"),)))

_ROPE = _shape_table(
    full={"x": ((4, 512, 8, 64), "normal"), "cos": ((512, 32), "normal"), "sin": ((512, 32), "normal"),
          "dy": ((4, 512, 8, 64), "normal")},
    small={"x": ((2, 5, 2, 8), "normal"), "cos": ((5, 4), "normal"), "sin": ((5, 4), "normal"),
           "dy": ((2, 5, 2, 8), "normal")},
)


ROPE = _register(SuiteKernel(
    "rope_backward", _ROPE,
    lambda x, cos, sin, dy: (ops.rope_backward(dy, cos, sin, head_dim=_dims(x)[-1]),),
))


# ------------------------------------------------------------------------------------------------


def suite_module(kernel: SuiteKernel, scale: str = "full", formulation: str = "rlx") -> tvm.IRModule:
    """``main(inputs...) -> tuple`` for one suite kernel: its rlx ops (``formulation="rlx"``) or
    TVM's own ops (``"tvm"``, only where the kernel has them)."""
    build = kernel.rlx if formulation == "rlx" else kernel.tvm
    if build is None:
        raise ValueError(f"suite kernel {kernel.name!r} has no TVM formulation")
    bb = relax.BlockBuilder()
    params = [relax.Var(n, relax.TensorType(list(a.shape), str(a.dtype))) for n, a in kernel.inputs(scale).items()]
    with bb.function("main", params):
        with bb.dataflow():
            outs = [bb.emit(e) for e in build(*params)]
            gv = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(gv)
    return bb.get()


def suite_reference(kernel: SuiteKernel, scale: str = "small", seed: int = 0) -> list[np.ndarray]:
    """The kernel's outputs on ``kernel.inputs(scale, seed)``, in float64 from the ops' NumPy
    references, evaluated binding by binding over its Relax function (rlx ops, plus the plain
    ``relax.sum`` some kernels use)."""
    func = suite_module(kernel, scale)["main"]
    inputs = kernel.inputs(scale, seed)
    env = {p: (a.astype(np.float64) if np.issubdtype(a.dtype, np.floating) else a)
           for p, a in zip(func.params, inputs.values())}
    for block in func.body.blocks:
        for binding in block.bindings:
            call = binding.value
            if isinstance(call, relax.Tuple):
                env[binding.var] = [env[f] for f in call.fields]
            elif call.op.name == "relax.sum":
                env[binding.var] = env[call.args[0]].sum(axis=tuple(int(a) for a in call.attrs.axis))
            else:
                opdef = get_op(call.op.name)
                args = [None if a is None else env[a] for a in opdef.call_args(call)]
                env[binding.var] = opdef.reference_fn(**dict(zip(opdef.all_inputs, args)), **opdef.call_attrs(call))
    return [np.asarray(o) for o in env[func.body.body]]


def suite_kernels(names: list[str] | None = None) -> list[SuiteKernel]:
    return list(SUITE) if not names else [suite_kernel(n) for n in names]


def flops_of(kernel: SuiteKernel, scale: str = "full") -> float | None:
    return kernel.flops(kernel.shapes(scale)) if kernel.flops else None


def suite_ir_module(kernels: list[SuiteKernel] | None = None, scale: str = "full") -> tvm.IRModule:
    """Every kernel of the suite (or of ``kernels``) as one module, one function per kernel (named
    after it): what ``rlx-tvm tune`` gives :func:`rlx_tvm.tuning.tune` to tune the suite."""
    out = tvm.IRModule()
    for k in kernels if kernels is not None else SUITE:
        out[k.name] = suite_module(k, scale)["main"].with_attr("global_symbol", k.name)
    return out
