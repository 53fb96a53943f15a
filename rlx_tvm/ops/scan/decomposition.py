"""Decomposition of short static scans: unrolled, with the body and its VJP inlined."""

from __future__ import annotations

from typing import Sequence

import tvm
import tvm_ffi
from tvm import relax, tirx

from ...passes import DecomposeBackwardOps
from ..registry import get_op
from .body import _reachable
from .layout import MAX_UNROLL, _Parts, _ceildiv, row_steps

@relax.expr_functor.mutator
class _Subst(relax.PyExprMutator):
    """Rewrites expressions through its var remap (the default visitor behaviour)."""


def _inline(bb, func: relax.Function, args: Sequence[relax.Expr]) -> relax.Expr:
    """Emit ``func``'s bindings into ``bb`` with the parameters replaced by ``args``."""
    args = [a if isinstance(a, relax.Var) else bb.emit(a) for a in args]
    symbols = {}
    for p, a in zip(func.params, args):
        pty, aty = p.ty, a.ty
        if isinstance(pty, relax.TensorType) and isinstance(pty.shape, relax.ShapeExpr) and isinstance(aty.shape, relax.ShapeExpr):
            for dp, da in zip(pty.shape.values, aty.shape.values):
                if isinstance(dp, tirx.Var) and not any(dp.same_as(k) for k in symbols):
                    symbols[dp] = da
    if symbols:
        func = func.bind_symbolic_vars(symbols)
    m = _Subst()
    for p, a in zip(func.params, args):
        m.set_var_remap(p, a)
    body = func.body
    for block in body.blocks:
        for binding in block.bindings:
            value = m.visit_expr(binding.value)
            if isinstance(binding, relax.MatchCast):
                new = bb.match_cast(value, binding.ty)
            else:
                new = bb.emit(value, name_hint=binding.var.name)
            m.set_var_remap(binding.var, new)
    return m.visit_expr(body.body)


_PRIMITIVE_CACHE: dict = {}


def _primitive(bb, gv: relax.GlobalVar) -> relax.Function:
    """``gv``'s function with its rlx backward ops decomposed: what the unrolled decompositions
    inline, so they never emit rlx backward ops themselves (the module's own body/VJP keep their
    fused ops for the loop lowering)."""
    func = bb.get()[gv]
    key = tvm_ffi.structural_hash(func)
    hit = _PRIMITIVE_CACHE.get(key)
    if hit is not None and tvm_ffi.structural_equal(hit[0], func):
        return hit[1]
    funcs = _reachable(bb.get(), gv)
    out = DecomposeBackwardOps()(tvm.IRModule(funcs))[gv]
    _PRIMITIVE_CACHE[key] = (func, out)
    return out


def _rows(bb, x, n: int) -> list:
    """The n rows of x ([n, ...]) as separate tensors (split + reshape: both differentiable)."""
    row_shape = list(x.ty.shape.values)[1:]
    if n == 1:
        return [bb.emit(relax.op.reshape(x, row_shape))]
    pieces = bb.emit(relax.op.split(x, n, axis=0))
    return [bb.emit(relax.op.reshape(relax.TupleGetItem(pieces, i), row_shape)) for i in range(n)]


def _stack(bb, rows: list):
    return bb.emit(relax.op.concat([bb.emit(relax.op.expand_dims(r, 0)) for r in rows], axis=0))


def _static_length(parts: _Parts, attrs) -> int | None:
    if attrs["length"] is not None:
        return attrs["length"]
    if parts.xs:
        d = parts.xs[0].ty.shape.values[0]
        if isinstance(d, tirx.IntImm):
            return int(d.value)
    return None


def _keep_fused(call: relax.Call) -> bool:
    opdef = get_op(call.op.name)
    parts, attrs = opdef.decode(call)
    L = _static_length(parts, attrs)
    return L is None or L > MAX_UNROLL


def _decompose_scan(bb, call, parts: _Parts, attrs):
    L = _static_length(parts, attrs)
    if L is None:
        raise ValueError("rlx.scan: only scans of static length decompose (symbolic length keeps the loop)")
    body = _primitive(bb, parts.body)
    xrows = [_rows(bb, x, L) for x in parts.xs]
    c = parts.init
    carries = []
    for t in range(L):
        c = _inline(bb, body, [c] + [r[t] for r in xrows] + list(parts.params))
        carries.append(c)
    if not attrs["save_trajectory"]:
        return c
    K = attrs["num_checkpoints"]
    return _stack(bb, [carries[t] for t in row_steps(L, K if K > 0 else L)])


def _decompose_backward(which: str):
    def decompose(bb, call, parts: _Parts, attrs):
        L = _static_length(parts, attrs)
        if L is None:
            raise ValueError("rlx.scan_backward: only scans of static length decompose")
        K, save = attrs["num_checkpoints"], attrs["save_trajectory"]
        R = K if K > 0 else L
        body, vjp = _primitive(bb, parts.body), _primitive(bb, parts.vjp)
        m = len(parts.xs)
        xrows = [_rows(bb, x, L) for x in parts.xs]
        trows = _rows(bb, parts.trajectory, R) if R > 1 else [None]
        urows = _rows(bb, parts.upstream, R) if save else None
        init = parts.init
        dc = None if save else parts.upstream
        dxs = [[None] * L for _ in parts.xs]
        dps = [None] * len(parts.params)
        for r in reversed(range(R)):
            if save:
                dc = urows[r] if dc is None else bb.emit(relax.op.add(dc, urows[r]))
            a, b = _ceildiv(r * L, R), _ceildiv((r + 1) * L, R)
            seg = [init if r == 0 else trows[r - 1]]
            for t in range(a, b - 1):
                seg.append(_inline(bb, body, [seg[-1]] + [xr[t] for xr in xrows] + list(parts.params)))
            for t in reversed(range(a, b)):
                res = _inline(bb, vjp, [seg[t - a]] + [xr[t] for xr in xrows] + list(parts.params) + [dc])
                grads = bb.emit(relax.TupleGetItem(res, 1))
                dc = bb.emit(relax.TupleGetItem(grads, 0))
                for j in range(m):
                    dxs[j][t] = bb.emit(relax.TupleGetItem(grads, 1 + j))
                for j in range(len(parts.params)):
                    g = bb.emit(relax.TupleGetItem(grads, 1 + m + j))
                    dps[j] = g if dps[j] is None else bb.emit(relax.op.add(dps[j], g))
        if which == "init":
            return dc
        if which == "xs":
            return _stack(bb, dxs[attrs["xs_idx"]])
        j = attrs["param_idx"]
        return dps[j]

    return decompose
