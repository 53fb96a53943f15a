"""Gradients of one norm computed together (:class:`~rlx_tvm.passes.FuseSiblingBackwardOps`)."""

from __future__ import annotations

from functools import reduce
from operator import mul

import numpy as np
import tvm
from tvm import relax

from ...kernels.common import acc_dtype, tensor_dtype
from ..registry import fuse_siblings, static_int
from .common import cast
from .declarations import (group_norm_backward_beta, group_norm_backward_gamma, group_norm_backward_input,
                           layer_norm_backward_gamma, layer_norm_backward_input, rms_norm_backward_beta,
                           rms_norm_backward_gamma, rms_norm_backward_input)
from .kernels import fused_kernel

_op = relax.op

_ROLES = ("input", "gamma", "beta")  # output order of a family's kernel


# Chunks of rows for layer / RMS norm's partial dgamma / dbeta (the parallel loop of the CPU
# schedule): the most of these that divides the rows and leaves at least 4 rows per chunk.
ROW_CHUNKS = (64, 32, 16, 8, 4, 2)


def _role(opdef) -> str:
    return "beta" if opdef is None else opdef.name.rsplit("_", 1)[1]  # None: an absorbed sum(dy)


def _absorbs_dbeta(opdef, call, other) -> bool:
    """``other`` is ``sum(dy)`` over every axis but the parameters' (a norm's dbeta without an
    op, as the layer-norm gradient rule and the suite write it) for the norm gradient ``call``."""
    if not (isinstance(other.op, tvm.ir.Op) and other.op.name == "relax.sum"):
        return False
    args = dict(zip(opdef.all_inputs, opdef.call_args(call)))
    dy, ndim = args["dy"], args["dy"].ty.ndim
    if not other.args[0].same_as(dy) or other.attrs.axis is None or other.attrs.keepdims or ndim < 1:
        return False
    kept = 1 if opdef.name.startswith("group_norm") else opdef.call_attrs(call)["axis"] % ndim
    return sorted(int(a) % ndim for a in other.attrs.axis) == [a for a in range(ndim) if a != kept]


def _norm_sibling_key(opdef, call):
    """The gradients of one norm: same x, dy and attributes."""
    args = dict(zip(opdef.all_inputs, opdef.call_args(call)))
    return (args["x"], args["dy"], *sorted((k, repr(v)) for k, v in opdef.call_attrs(call).items()))


def _fuse_norm_gradients(family, *opdefs):
    @fuse_siblings(*opdefs, key=_norm_sibling_key, absorb=_absorbs_dbeta)
    def together(bb, members):
        """dx, dgamma (and dbeta) of one norm in one kernel: the row (block) statistics, two
        passes over x, are computed once, and dgamma and dbeta come out as partial sums (per chunk
        of rows; per sample for group norm) that the CPU schedule computes in the row loop of dx,
        so that x and dy are read from memory once; their sum over the chunks (samples) follows.
        Layer and RMS norm: normalized axis last and of static size (else left apart); the row
        count may be symbolic."""
        calls = {}
        for opdef, call in members:
            first_op, first = calls.setdefault(_role(opdef), (opdef, call))
            if None not in (opdef, first_op) and (len(first.args) != len(call.args)
                                                  or not all(a.same_as(b) for a, b in zip(first.args, call.args))):
                return None  # two dx of one x and dy with different gammas: left apart
        roles = tuple(r for r in _ROLES if r in calls)
        if len(roles) == 1:
            return None
        opdef, call = next((o, c) for o, c in members if o is not None)
        attrs = opdef.call_attrs(call)
        args = dict(zip(opdef.all_inputs, opdef.call_args(call)))
        x, dy = args["x"], args["dy"]
        # gamma enters dx only: the dx call's (the RMS dgamma/dbeta calls take a gamma of their own)
        gamma = dict(zip(calls["input"][0].all_inputs, calls["input"][0].call_args(calls["input"][1])))["gamma"] \
            if "input" in calls else None
        full_shape = list(x.ty.shape.values)
        shape = [static_int(d) for d in full_shape]
        dtype = tensor_dtype(x)
        if family == "group_norm":
            partial, sum_axes, flat = True, [0], None
        else:
            if shape[-1] is None or attrs["axis"] % len(shape) != len(shape) - 1:
                return None
            if None in shape:  # symbolic rows: the most chunks, the last ones short or empty
                rows = reduce(mul, full_shape[:-1])
                partial = ROW_CHUNKS[0]
            else:
                rows = int(np.prod(shape[:-1]))
                partial = next((c for c in ROW_CHUNKS if rows % c == 0 and rows // c >= 4), 1)
            sum_axes, flat = [0], ([rows, shape[-1]] if len(shape) != 2 else None)
            if flat is not None:
                x, dy = bb.emit(_op.reshape(x, flat)), bb.emit(_op.reshape(dy, flat))
                attrs = {**attrs, "axis": -1}
        out = bb.emit(fused_kernel(bb, family, roles, x, gamma, dy, partial=partial, **attrs))
        results = {}
        for k, role in enumerate(roles):
            value = relax.TupleGetItem(out, k)
            if role == "input":
                results[role] = bb.emit(_op.reshape(value, full_shape) if flat is not None else value)
            else:
                results[role] = bb.emit(cast(_op.sum(value, axis=sum_axes), acc_dtype(dtype), dtype))
        return [results[_role(opdef)] for opdef, _ in members]

    return together


_fuse_norm_gradients("layer_norm", layer_norm_backward_input, layer_norm_backward_gamma)
_fuse_norm_gradients("rms_norm", rms_norm_backward_input, rms_norm_backward_gamma, rms_norm_backward_beta)
_fuse_norm_gradients("group_norm", group_norm_backward_input, group_norm_backward_gamma, group_norm_backward_beta)
