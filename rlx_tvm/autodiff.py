"""Differentiating Relax functions: ``grad``, ``hvp`` and ``nth_order_grad``.

These wrap ``relax.transform.Gradient`` and fix what makes it unsafe to call directly in TVM 0.27:

* it returns all-zero adjoints, silently, when the function calls another Relax function: we inline
  private callees first and refuse functions that still call one;
* it needs a single dataflow block: we convert and canonicalize first;
* its adjoint graphs contain rlx backward ops that have no gradient of their own: before
  differentiating again (``hvp``, ``nth_order_grad``) we decompose them into primitives with
  :class:`~rlx_tvm.passes.DecomposeBackwardOps`.
"""

from __future__ import annotations

from typing import Sequence

import tvm
from tvm import relax

from .passes import DecomposeBackwardOps
from .registry import all_ops

__all__ = ["grad", "hvp", "nth_order_grad", "AutodiffError"]


class AutodiffError(ValueError):
    """The function cannot be differentiated as asked; the message says why."""


def _relax_callees(func: relax.Function) -> set[str]:
    names: set[str] = set()

    def visit(e):
        if isinstance(e, relax.Call) and isinstance(e.op, relax.GlobalVar):
            names.add(e.op.name_hint)

    relax.analysis.post_order_visit(func, visit)
    return names


def prepare(mod: tvm.IRModule, func: str) -> tvm.IRModule:
    """Inline every Relax function ``func`` calls and bring it to one dataflow block."""
    if func not in [gv.name_hint for gv in mod.get_global_vars()]:
        raise AutodiffError(f"rlx.autodiff: argument 'func' expected a function of the module, got {func!r}")
    mod = tvm.IRModule(dict(mod.functions), attrs=mod.attrs)
    for _ in range(16):  # callees may call further functions
        callees = {n for n in _relax_callees(mod[func]) if isinstance(mod[n], relax.Function)}
        if not callees:
            break
        for name in callees:
            callee = mod[name]
            if callee.attrs is not None and "global_symbol" in callee.attrs:
                callee = callee.without_attr("global_symbol")
            mod[name] = callee
        mod = relax.transform.InlinePrivateFunctions()(mod)
    left = {n for n in _relax_callees(mod[func]) if isinstance(mod[n], relax.Function)}
    if left:
        raise AutodiffError(
            f"rlx.autodiff: function {func!r} still calls Relax functions {sorted(left)} after inlining "
            "(recursive?); relax.transform.Gradient would return zero gradients for them"
        )
    mod = relax.transform.ConvertToDataflow(min_size=1)(mod)
    mod = relax.transform.CanonicalizeBindings()(mod)
    return mod


def _resolve_wrt(f: relax.Function, wrt, func: str) -> list[relax.Var]:
    params = list(f.params)
    if wrt is None:
        chosen = [p for p in params if isinstance(p.ty, relax.TensorType) and str(p.ty.dtype.dtype).startswith(("float", "bfloat"))]
        if not chosen:
            raise AutodiffError(f"rlx.autodiff: argument 'wrt' expected float parameters of {func!r}, got none")
        return chosen
    if isinstance(wrt, (str, relax.Var)):
        wrt = [wrt]
    by_name = {p.name: p for p in params}
    chosen = []
    for w in wrt:
        if isinstance(w, str):
            if w not in by_name:
                raise AutodiffError(
                    f"rlx.autodiff: argument 'wrt' expected parameter names of {func!r} {sorted(by_name)}, got {w!r}"
                )
            chosen.append(by_name[w])
        else:
            match = [p for p in params if p.same_as(w) or p.name == w.name]
            if not match:
                raise AutodiffError(f"rlx.autodiff: argument 'wrt' expected parameters of {func!r}, got {w.name!r}")
            chosen.append(match[0])
    return chosen


def _check_scalar(f: relax.Function, func: str, target_index: int) -> None:
    ret = f.ret_ty if hasattr(f, "ret_ty") else f.body.ty
    ty = ret.fields[target_index] if isinstance(ret, relax.TupleType) else ret
    if not (isinstance(ty, relax.TensorType) and ty.ndim == 0):
        raise AutodiffError(
            f"rlx.autodiff: argument 'func' expected {func!r} to return a scalar (0-d tensor) to differentiate, got {ty}"
        )


def grad(mod: tvm.IRModule, func: str = "main", wrt=None, target_index: int = 0) -> tvm.IRModule:
    """Add ``<func>_adjoint`` returning ``(loss, (grads...))`` (TVM's convention) to ``mod``.

    ``wrt`` is None (every float parameter), or parameter Vars / names.
    """
    mod = prepare(mod, func)
    f = mod[func]
    _check_scalar(f, func, target_index)
    require = _resolve_wrt(f, wrt, func)
    try:
        return relax.transform.Gradient(func, require_grads=require, target_index=target_index)(mod)
    except Exception as err:  # TVM reports missing rules etc. as TVMError: keep the message
        raise AutodiffError(f"rlx.autodiff: cannot differentiate {func!r}: {err}") from err


def _emit_call_unpack(bb, gv, args, n_grads):
    """Call an adjoint ``(loss, (g...))`` function and return (loss, [g...])."""
    res = bb.emit(relax.Call(gv, args))
    loss = bb.emit(relax.TupleGetItem(res, 0))
    grads_t = bb.emit(relax.TupleGetItem(res, 1))
    grads = [bb.emit(relax.TupleGetItem(grads_t, i)) for i in range(n_grads)]
    return loss, grads


def hvp(mod: tvm.IRModule, func: str = "main", wrt=None) -> tvm.IRModule:
    """Add ``<func>_hvp(params..., v...) -> (loss, (grads...), (H v...))`` to ``mod``, where ``v`` holds
    one direction per ``wrt`` parameter (same shapes) and ``H v`` is the Hessian-vector product
    ``d/dp <grad f(p), v>``."""
    base = grad(mod, func, wrt)
    base = _decompose_between_levels(base)
    adj_name = f"{func}_adjoint"
    f = base[func]
    require = _resolve_wrt(f, wrt, func)
    idx = [list(f.params).index(p) for p in require]

    # <grad, v> as a function of the primal parameters (the directions are extra parameters).
    bb = relax.BlockBuilder()
    params = [relax.Var(p.name, p.ty) for p in f.params]
    dirs = [relax.Var(f"v_{p.name}", p.ty) for p in require]
    inner = f"{func}_grad_dot_v"
    with bb.function(inner, params + dirs, private=True):
        with bb.dataflow():
            loss, grads = _emit_call_unpack(bb, base.get_global_var(adj_name), params, len(require))
            dot = None
            for g, v in zip(grads, dirs):
                term = bb.emit(relax.op.sum(relax.op.multiply(g, v)))
                dot = term if dot is None else bb.emit(relax.op.add(dot, term))
            # Gradient picks its target from a literal return tuple.
            outs = [bb.emit_output(e) for e in (dot, loss, relax.Tuple(grads))]
        bb.emit_func_output(relax.Tuple(outs))
    built = bb.get()
    work = tvm.IRModule(dict(base.functions))
    work = _add_function(work, inner, built[inner].with_attr("global_symbol", inner))
    work = prepare(work, inner)
    inner_params = list(work[inner].params)
    try:
        work = relax.transform.Gradient(inner, require_grads=[inner_params[i] for i in idx], target_index=0)(work)
    except Exception as err:
        raise AutodiffError(f"rlx.autodiff: cannot take the Hessian-vector product of {func!r}: {err}") from err

    # Public entry: (loss, grads, hv).
    bb = relax.BlockBuilder()
    params = [relax.Var(p.name, p.ty) for p in f.params]
    dirs = [relax.Var(f"v_{p.name}", p.ty) for p in require]
    with bb.function(f"{func}_hvp", params + dirs):
        with bb.dataflow():
            res = bb.emit(relax.Call(work.get_global_var(f"{inner}_adjoint"), params + dirs))
            primal = bb.emit(relax.TupleGetItem(res, 0))
            hv_t = bb.emit(relax.TupleGetItem(res, 1))
            loss = bb.emit(relax.TupleGetItem(primal, 1))
            grads = bb.emit(relax.TupleGetItem(primal, 2))
            out = bb.emit_output(relax.Tuple([loss, grads, hv_t]))
        bb.emit_func_output(out)
    work[f"{func}_hvp"] = bb.get()[f"{func}_hvp"]
    return _finish(work, helpers=[inner, f"{inner}_adjoint"])


def _decompose_between_levels(mod: tvm.IRModule) -> tvm.IRModule:
    """Decompose backward ops (and forward ops such as a scan, whose body must be inlined to be
    differentiated again), keeping forward ops whose gradient rule is a surrogate (an STE): their
    decomposition's derivative would silently replace the estimator."""
    keep = tuple(o.name for o in all_ops() if o.extra.get("surrogate_gradient"))
    return DecomposeBackwardOps(preserve=keep, include_forward=True)(mod)


def _add_function(mod: tvm.IRModule, name: str, func: relax.Function) -> tvm.IRModule:
    """Add ``func`` under ``name`` with a typed GlobalVar, so later builders can call it."""
    bb = relax.BlockBuilder(mod)
    bb.add_func(func, name)
    return bb.get()


def _private(f: relax.Function) -> relax.Function:
    return f.without_attr("global_symbol") if f.attrs is not None and "global_symbol" in f.attrs else f


def _finish(mod: tvm.IRModule, helpers: Sequence[str]) -> tvm.IRModule:
    """Make the intermediate levels private, inline them into the public entry points, drop the rest."""
    present = {gv.name_hint: gv for gv in mod.get_global_vars()}
    for name in helpers:
        if name in present:  # earlier levels may already be inlined
            mod[present[name]] = _private(mod[present[name]])
    mod = relax.transform.InlinePrivateFunctions()(mod)
    mod = relax.transform.DeadCodeElimination()(mod)
    return relax.transform.CanonicalizeBindings()(mod)


def nth_order_grad(mod: tvm.IRModule, func: str = "main", wrt=None, order: int = 2) -> tvm.IRModule:
    """Add ``<func>_grad<order>(params...) -> (g_1, ..., g_order)`` where ``g_1 = d f / d p`` and
    ``g_{k+1} = d sum(g_k) / d p``, for the one parameter ``wrt`` of a scalar-valued ``f``.

    For a function of a scalar (or a separable, elementwise function of a tensor) ``g_k`` is the
    k-th derivative. Backward ops are decomposed between levels so every level differentiates.
    """
    if not isinstance(order, int) or order < 1:
        raise AutodiffError(f"rlx.autodiff: argument 'order' expected an integer >= 1, got {order!r}")
    work = prepare(mod, func)
    f = work[func]
    _check_scalar(f, func, 0)
    (p,) = _resolve_wrt(f, wrt if wrt is not None else None, func)[:1] if wrt is None else _resolve_wrt(f, wrt, func)
    pidx = list(f.params).index(p)

    # level_k(params) -> (s_k, g_1..g_k) where s_k = sum(g_k) (s_0 = f).
    level = func
    n_prev = 0
    levels: list[str] = []
    for k in range(1, order + 1):
        work = _decompose_between_levels(work)
        work = prepare(work, level)
        lp = list(work[level].params)
        try:
            work = relax.transform.Gradient(level, require_grads=[lp[pidx]], target_index=0)(work)
        except Exception as err:
            raise AutodiffError(f"rlx.autodiff: cannot take derivative {k} of {func!r}: {err}") from err
        adj = work.get_global_var(f"{level}_adjoint")
        bb = relax.BlockBuilder()
        params = [relax.Var(q.name, q.ty) for q in f.params]
        name = f"{func}_grad{k}_level"
        with bb.function(name, params, private=True):
            with bb.dataflow():
                res = bb.emit(relax.Call(adj, params))
                primal = bb.emit(relax.TupleGetItem(res, 0))
                g = bb.emit(relax.TupleGetItem(bb.emit(relax.TupleGetItem(res, 1)), 0))
                prev = [bb.emit(relax.TupleGetItem(primal, 1 + i)) for i in range(n_prev)]
                s = bb.emit(relax.op.sum(g))
                outs = [bb.emit_output(e) for e in [s] + prev + [g]]
            bb.emit_func_output(relax.Tuple(outs))
        work = _add_function(work, name, bb.get()[name].with_attr("global_symbol", name))
        level, n_prev = name, k
        levels += [name, f"{name}_adjoint"] if k < order else [name]

    bb = relax.BlockBuilder()
    params = [relax.Var(q.name, q.ty) for q in f.params]
    with bb.function(f"{func}_grad{order}", params):
        with bb.dataflow():
            res = bb.emit(relax.Call(work.get_global_var(level), params))
            gs = [bb.emit(relax.TupleGetItem(res, 1 + i)) for i in range(order)]
            out = bb.emit_output(relax.Tuple(gs))
        bb.emit_func_output(out)
    work[f"{func}_grad{order}"] = bb.get()[f"{func}_grad{order}"]
    return _finish(work, helpers=levels)
