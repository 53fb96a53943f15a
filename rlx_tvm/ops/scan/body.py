"""The body function of a scan call and its VJP (built with :mod:`rlx_tvm.autodiff`)."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax

from ... import autodiff
from ...passes import DecomposeBackwardOps
from ..registry import op_error
from .layout import ScanBody, _fresh_types, _type_of

def _materialize_body(op: str, bb, body, init, xs, params) -> relax.GlobalVar:
    if isinstance(body, relax.GlobalVar):
        return body
    if not isinstance(body, (relax.Function, ScanBody)) and (isinstance(body, relax.Expr) or not callable(body)):
        raise op_error(op, "body", "a Relax function (GlobalVar, relax.Function, ScanBody or Python callable)", type(body).__name__)
    if bb is None:
        raise op_error(
            op, "body", "a GlobalVar of the module (a relax.Function or Python body needs an active BlockBuilder)", type(body).__name__
        )
    if isinstance(body, relax.Function):
        name = "scan_body"
        if body.attrs is not None and "global_symbol" in body.attrs:
            name = str(body.attrs["global_symbol"])
            body = body.without_attr("global_symbol")
        return bb.add_func(body, name)
    fn = body.relax_fn if isinstance(body, ScanBody) else body
    if not callable(fn):
        raise op_error(op, "body", "a GlobalVar, relax.Function, ScanBody or callable", type(body).__name__)
    name = body.name if isinstance(body, ScanBody) else getattr(fn, "__name__", "scan_body").strip("<>")
    row_tys = []
    for j, x in enumerate(xs):
        ty = _type_of(bb, x)
        if not isinstance(ty, relax.TensorType) or ty.ndim < 1 or not isinstance(ty.shape, relax.ShapeExpr):
            raise op_error(op, "xs" if len(xs) == 1 else f"xs[{j}]", "a tensor with a leading (time) axis", ty)
        row_tys.append(relax.TensorType(list(ty.shape.values)[1:], str(ty.dtype.dtype)))
    types = _fresh_types([_type_of(bb, init)] + row_tys + [_type_of(bb, p) for p in params])
    names = ["carry"] + [f"x{j}" for j in range(len(xs))] + [f"p{j}" for j in range(len(params))]
    fvars = [relax.Var(n, t) for n, t in zip(names, types)]
    fb = relax.BlockBuilder()
    with fb.function(name, fvars, private=True):
        with fb.dataflow():
            out = fb.emit_output(fn(*fvars))
        fb.emit_func_output(out)
    return bb.add_func(fb.get()[name], name)


def _reachable(mod: tvm.IRModule, root: relax.GlobalVar) -> dict:
    """``root`` and every function it (transitively) refers to."""
    out = {}
    todo = [root]
    while todo:
        gv = todo.pop()
        if any(gv.same_as(k) for k in out):
            continue
        func = mod[gv]
        out[gv] = func
        if isinstance(func, relax.Function):
            refs = []

            def visit(e, refs=refs):
                if isinstance(e, relax.GlobalVar):
                    refs.append(e)

            relax.analysis.post_order_visit(func, visit)
            names = {g.name_hint for g in mod.get_global_vars()}
            todo.extend(r for r in refs if r.name_hint in names)
    return out


_VJP_CACHE: dict = {}
_VJP_ATTR = "rlx.scan_vjp_of"


def body_vjp(bb, body_gv: relax.GlobalVar, num_xs: int) -> relax.GlobalVar:
    """Add (once) and return the VJP of ``body``:
    ``vjp(carry, *x_t, *params, ct) -> (loss, (d carry, *d x_t, *d params))``, built by
    :func:`rlx_tvm.autodiff.grad` on ``sum(body(...) * ct)`` after decomposing rlx backward ops in
    the body (so any body made of ops that have gradient rules works)."""
    mod = bb.get()
    tag = f"{body_gv.name_hint}/{num_xs}"
    for g, f in mod.functions.items():  # built already (by an earlier call or gradient rule)
        if isinstance(f, relax.Function) and f.attrs is not None and str(f.attrs.get(_VJP_ATTR, "")) == tag:
            return g
    funcs = _reachable(mod, body_gv)
    body = funcs[body_gv]
    key = None
    if len(funcs) == 1:
        key = (tvm_ffi.structural_hash(body), num_xs)
        hit = _VJP_CACHE.get(key)
        if hit is not None and tvm_ffi.structural_equal(hit[0], body):
            return bb.add_func(hit[1].with_attr(_VJP_ATTR, tag), f"{body_gv.name_hint}_vjp")
    fty = body_gv.ty
    n = len(fty.params)
    types = _fresh_types(list(fty.params) + [fty.ret])
    names = ["c"] + [f"x{j}" for j in range(num_xs)] + [f"p{j}" for j in range(n - 1 - num_xs)] + ["ct"]
    gvars = [relax.Var(nm, t) for nm, t in zip(names, types)]
    target = "rlx_scan_vjp_target"
    fb = relax.BlockBuilder(tvm.IRModule(funcs))
    with fb.function(target, gvars):
        with fb.dataflow():
            y = fb.emit(relax.Call(body_gv, gvars[:-1]))
            loss = fb.emit_output(relax.op.sum(relax.op.multiply(y, gvars[-1])))
        fb.emit_func_output(loss)
    mini = DecomposeBackwardOps()(fb.get())
    mini = autodiff.grad(mini, target, wrt=names[:-1])
    adj = mini[f"{target}_adjoint"].without_attr("global_symbol")
    known = {g.name_hint for g in mod.get_global_vars()}
    extra = {g: f for g, f in _reachable(mini, mini.get_global_var(f"{target}_adjoint")).items() if g.name_hint not in known}
    for g, f in extra.items():  # functions added by nested rules (e.g. the VJP of an inner scan)
        if g.name_hint != f"{target}_adjoint":
            bb.update_func(g, f)
    if key is not None and len(extra) == 1:
        _VJP_CACHE[key] = (body, adj)
    return bb.add_func(adj.with_attr(_VJP_ATTR, tag), f"{body_gv.name_hint}_vjp")
