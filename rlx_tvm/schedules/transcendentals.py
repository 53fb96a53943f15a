"""float32 exp / sigmoid / tanh / erf in vectorizable arithmetic, in every CPU kernel.

rlx_tvm's fused kernels compute these with the polynomials of :mod:`rlx_tvm.kernels.fastmath`; the
kernels TVM itself legalizes (``R.nn.softmax`` and ``log_softmax``, ``R.sigmoid``, ``R.tanh``,
``R.nn.gelu``: the forward of a model, and the decomposed graphs of the backward ops) call
``tirx.exp`` and its kin, which LLVM lowers to one scalar libm call per element (``expf``): a
vectorized loop around them runs scalar. ``R.nn.softmax`` at (256, 50256) read 3 GB/s on a machine
whose copy ran at 37 GB/s. This pass, run on the scheduled module for LLVM targets, replaces each
float32 call by the same formula the fused kernels use (within a few float32 ulps of libm; inf,
-inf and NaN as libm). Other dtypes keep the intrinsics.

The formulas repeat their argument (TIR expressions have no let bindings that TVM 0.27's
vectorizer takes safely), so a call whose argument is already large (a transcendental of a
transcendental) is left to libm, which keeps build times bounded.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx

from ..kernels.fastmath import erf_f32, exp_f32, tanh_f32, tir_sigmoid
from .common import expression_nodes

__all__ = ["VectorizableTranscendentals", "vectorizable_transcendentals"]

_FORMULAS = {"tirx.exp": exp_f32, "tirx.sigmoid": tir_sigmoid, "tirx.tanh": tanh_f32, "tirx.erf": erf_f32}

# Argument size (expression nodes) up to which a call is replaced: softmax's x - max is 5 nodes,
# an argument holding one rewritten exp several hundred.
MAX_ARGUMENT_NODES = 64


def vectorizable_transcendentals(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with its scalar float32 exp / sigmoid / tanh / erf calls written as arithmetic."""

    def rewrite(call, mutator):
        call = mutator.default_mutate(call)  # innermost calls first
        if not isinstance(call, tvm.ir.expr.Call) or not isinstance(call.op, tvm.ir.Op):
            return call
        formula = _FORMULAS.get(call.op.name)
        if formula is None or str(call.ty) != "float32" or len(call.args) != 1 \
                or expression_nodes(call.args[0]) > MAX_ARGUMENT_NODES:
            return call
        return formula(call.args[0])

    body = tvm_ffi.structural_mutate(func.body, (tvm.ir.expr.Call, rewrite))
    return func if body.same_as(func.body) else func.with_body(body)


@tvm.tirx.transform.prim_func_pass(opt_level=0, name="rlx.VectorizableTranscendentals")
def VectorizableTranscendentals(func: tirx.PrimFunc, _mod, _ctx) -> tirx.PrimFunc:  # noqa: N802 - a TVM pass
    """:func:`vectorizable_transcendentals` on every PrimFunc of a module."""
    return vectorizable_transcendentals(func)
