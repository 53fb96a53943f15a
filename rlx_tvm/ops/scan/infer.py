"""Type inference of the scan ops: the body's and the VJP's signatures against the call's types."""

from __future__ import annotations

from typing import Sequence

from tvm import relax, tirx
from tvm.sym import Analyzer

from ..registry import fmt_dim, fmt_shape
from .layout import _ScanContext, _fmt_ty, _type_of

def _func_type(ctx, name: str) -> relax.FuncType:
    expr = ctx._args.get(name)
    ty = _type_of(None, expr) if expr is not None else None
    if not isinstance(ty, relax.FuncType):
        raise ctx.error(name, "a Relax function of the module (a GlobalVar)", ty if ty is not None else type(expr).__name__)
    if not ty.purity:
        raise ctx.error(name, "a pure function", "an impure one")
    return ty


def _bind_signature(ctx, arg: str, what: str, params: Sequence, actual: Sequence[tuple[str, relax.TensorType]]):
    """Match a function's parameter types against the types the scan passes; returns the binding of
    the function's symbolic vars."""
    an = Analyzer()
    bound: dict = {}
    for i, (pty, (label, aty)) in enumerate(zip(params, actual)):
        bad = not isinstance(pty, relax.TensorType) or str(pty.dtype.dtype) != str(aty.dtype.dtype)
        bad = bad or pty.ndim != aty.ndim
        if not bad and isinstance(pty.shape, relax.ShapeExpr):
            for dp, da in zip(pty.shape.values, aty.shape.values):
                if isinstance(dp, tirx.Var) and not any(dp.same_as(k) for k in bound):
                    bound[dp] = da
                    an.bind(dp, da)
                    continue
                if ctx.provably_different(an.simplify(dp), da):
                    bad = True
                    break
        if bad:
            raise ctx.error(arg, f"{what} parameter {i} ({label}) accepts {_fmt_ty(aty)}", _fmt_ty(pty))
    return an


def _check_scan_inputs(ctx: _ScanContext):
    """Validate init/xs/params/length/num_checkpoints and the body's signature. Returns
    (init, xs, params, L, R)."""
    parts, attrs = ctx.parts, ctx.attrs
    init = ctx.tensor("init")
    xs = [ctx.tensor(n, min_ndim=1) for n in parts.xs_names()]
    ps = [ctx.tensor(n) for n in parts.param_names()]
    length = attrs["length"]
    if length is None:
        if not xs:
            raise ctx.error("length", "a value (there are no xs to take it from)", "nothing")
        L = xs[0].dim(0)
    else:
        L = tirx.IntImm("int64", length)
    for x in xs:
        if ctx.provably_different(x.dim(0), L):
            raise ctx.error(x.name, f"leading dim == length {fmt_dim(L)}", f"{fmt_dim(x.dim(0))} (shape {fmt_shape(x.shape)})")
    K = attrs["num_checkpoints"]
    Ls = int(L.value) if isinstance(L, tirx.IntImm) else None
    if Ls is not None and K > Ls:
        raise ctx.error("num_checkpoints", f"an integer in [0, length={Ls}]", K)
    fty = _func_type(ctx, "body")
    want = 1 + len(xs) + len(ps)
    if len(fty.params) != want:
        raise ctx.error(
            "body",
            f"a function of {want} parameters (carry, {len(xs)} x_t, {len(ps)} params)",
            f"{len(fty.params)} parameters ({', '.join(_fmt_ty(t) for t in fty.params)})",
        )
    actual = [("carry", init.ty)]
    actual += [(f"x_t of '{x.name}'", relax.TensorType(x.shape[1:], x.dtype)) for x in xs]
    actual += [(f"'{p.name}'", p.ty) for p in ps]
    an = _bind_signature(ctx, "body", "a function whose", fty.params, actual)
    ret = fty.ret
    ok = isinstance(ret, relax.TensorType) and str(ret.dtype.dtype) == init.dtype and ret.ndim == init.ndim
    if ok and isinstance(ret.shape, relax.ShapeExpr):
        ok = not any(ctx.provably_different(an.simplify(a), b) for a, b in zip(ret.shape.values, init.shape))
    if not ok:
        raise ctx.error("body", f"a function returning the carry type {_fmt_ty(init.ty)}", f"one returning {_fmt_ty(ret)}")
    R = tirx.IntImm("int64", K) if K > 0 else L
    return init, xs, ps, L, R


def _infer_scan(ctx: _ScanContext):
    init, xs, ps, L, R = _check_scan_inputs(ctx)
    if ctx.attrs["save_trajectory"]:
        return ctx.out([R] + init.shape, init.dtype)
    return ctx.out(init.shape, init.dtype)


def _infer_backward(which: str):
    def infer(ctx: _ScanContext):
        init, xs, ps, L, R = _check_scan_inputs(ctx)
        vty = _func_type(ctx, "vjp")
        want = 2 + len(xs) + len(ps)
        ok = len(vty.params) == want and isinstance(vty.ret, relax.TupleType) and len(vty.ret.fields) == 2
        ok = ok and isinstance(vty.ret.fields[1], relax.TupleType) and len(vty.ret.fields[1].fields) == want - 1
        if not ok:
            raise ctx.error(
                "vjp",
                f"a function (carry, {len(xs)} x_t, {len(ps)} params, cotangent) -> (loss, ({want - 1} gradients)) (see body_vjp)",
                str(vty),
            )
        traj = ctx.tensor("trajectory", ndim=init.ndim + 1)
        ctx.same_dtype(init, traj)
        want_traj = [R] + init.shape
        if any(ctx.provably_different(a, b) for a, b in zip(traj.shape, want_traj)):
            raise ctx.error("trajectory", f"shape {fmt_shape(want_traj)} (rows of the forward with the same num_checkpoints)", fmt_shape(traj.shape))
        up_shape = want_traj if ctx.attrs["save_trajectory"] else init.shape
        up = ctx.tensor("upstream", ndim=len(up_shape))
        ctx.same_dtype(init, up)
        if any(ctx.provably_different(a, b) for a, b in zip(up.shape, up_shape)):
            what = "the trajectory output" if ctx.attrs["save_trajectory"] else "the final-carry output"
            raise ctx.error("upstream", f"shape {fmt_shape(up_shape)} (cotangent of {what})", fmt_shape(up.shape))
        if which == "init":
            return ctx.out(init.shape, init.dtype)
        if which == "xs":
            j = ctx.attrs["xs_idx"]
            if j >= len(xs):
                raise ctx.error("xs_idx", f"an index in [0, {len(xs)})", j)
            return ctx.out([L] + xs[j].shape[1:], xs[j].dtype)
        j = ctx.attrs["param_idx"]
        if j >= len(ps):
            raise ctx.error("param_idx", f"an index in [0, {len(ps)})", j)
        return ctx.out(ps[j].shape, ps[j].dtype)

    return infer
