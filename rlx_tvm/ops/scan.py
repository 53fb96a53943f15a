"""Scan with checkpointing: ``rlx.scan`` and its backward ops (SPEC §6).

Usage (a tanh RNN over 4096 steps, trained with 64 checkpoints)::

    @I.ir_module
    class RNN:
        @R.function(private=True)
        def cell(h: R.Tensor((8, 16), "float32"), x: R.Tensor((8, 16), "float32"), W: R.Tensor((16, 16), "float32")):
            return R.tanh(R.matmul(h, W) + x)

        @R.function
        def main(h0: R.Tensor((8, 16), "float32"), xs: R.Tensor((4096, 8, 16), "float32"), W: R.Tensor((16, 16), "float32")):
            cls = RNN
            hT = R.rlx.scan(cls.cell, h0, xs, W, num_xs=1, num_checkpoints=64)  # final carry
            return R.sum(hT * hT)

    mod = rlx_tvm.autodiff.grad(RNN, "main")  # main_adjoint -> (loss, (d h0, d xs, d W))
    vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())

From Python: ``rlx_tvm.ops.scan(h0, xs, body=gv_or_callable, params=[W], num_checkpoints=64)``.

Ops
---
``scan(body, init, xs..., params...; num_xs, length, save_trajectory, num_checkpoints)``
    ``body`` is a Relax function of the module ``(carry, x_t..., params...) -> next_carry``, passed as a
    GlobalVar argument (so passes that rename or drop unused functions keep it). ``xs`` are stacked
    per-step inputs ``[L, ...]``; ``params`` are broadcast to every step (a weight matrix), so their
    gradient is the sum over steps. Output: the final carry, or with ``save_trajectory`` the stacked
    carries ``[R, *carry]`` with ``R = K`` rows if ``K = num_checkpoints > 0`` else ``L``; row ``r``
    holds the carry after step ``t_r = ceil((r+1) L / R) - 1`` (with ``R = L``: row t = after step t).
``scan_backward`` / ``scan_backward_xs(xs_idx)`` / ``scan_backward_params(param_idx)``
    ``(body, vjp, init, trajectory, upstream, xs..., params...)`` -> d init / stacked d xs[j] /
    d params[j]. ``trajectory`` is the ``[R, *carry]`` output of a ``save_trajectory`` scan with the
    same ``K``; ``upstream`` is the cotangent of the forward's output (``[R, *carry]`` with
    ``save_trajectory``, else ``[*carry]``). ``vjp`` is the body's VJP built by :mod:`rlx_tvm.autodiff`
    (:func:`body_vjp`); the builders create it when not given, and the gradient rule of ``scan`` emits
    all of them.

Backward (SPEC §6): ``dc = upstream`` (final-carry output) or 0; for the rows ``r = R-1 .. 0``: add
``upstream[r]`` (trajectory output), recompute the carries of segment r (steps
``ceil(rL/R) .. ceil((r+1)L/R) - 1``) from its checkpoint (``init`` for r = 0, else
``trajectory[r-1]``), then sweep the segment backwards through the VJP. With ``R = L`` a segment is
one step and nothing is recomputed. Live memory: R trajectory rows + one segment of ``ceil(L/R)``
carries + O(log L) carries in flight, i.e. O(K + L/K) (Griewank's checkpointing with uniform
segments).

Lowering (FLegalize): a loop, never an unrolled graph
-----------------------------------------------------
Relax has no loop construct, but TVM 0.27's VM runs recursive Relax functions. Each loop over an
index range ``[lo, hi)`` is three private Relax functions::

    run(bnd, *state, *consts)   = if hi - lo == 1: step(...) elif hi - lo <= 0: state else split(...)
    split(bnd, *state, *consts) = run([mid, hi], *run([lo, mid], *state, ...), ...)   # (reversed for backward)
    step(bnd, *state, *consts)  = one scan step at index lo

``bnd`` is a ``R.Shape([lo, hi, L, R, base])`` whose symbolic values carry the loop bounds, the
length and the row count; the step reads x_t with a TIR kernel that takes the index as a
``PrimValue``. Divide and conquer (instead of tail recursion, which the VM does not eliminate) keeps
the call depth at ~2 log2(L) frames, so 10^5 steps are as fine as 10, and the frames hold O(log L)
carries. Trajectories and stacked d xs are written in place (``call_tir_inplace``) into one buffer
allocated by a small entry function that does nothing after the loop returns (so memory planning
never reuses the buffer's storage while its alias is alive). The generated functions depend only on
the types (length and row count are runtime shape values), so the compiled module is the same size
for every L. The body and its VJP are ordinary module functions, legalized by ``LegalizeOps`` like
any other; the loop functions only use the kernels generated here.

Decomposition (DecomposeBackwardOps): short static scans (``L <= MAX_UNROLL``) are unrolled with the
body and its VJP inlined (rows read with split + reshape, stacked with expand_dims + concat: all
differentiable), so the decomposed backward can be differentiated again (second order). The
inlined copies are themselves decomposed first, so a decomposition never emits rlx backward ops
(even ones the pass was asked to preserve). Longer or symbolic-length scans keep their fused loop
(``extra["keep_fused"]``).

Limitations: the carry is a single tensor (not a tuple); xs and params must be float tensors;
second order only through short static scans; d init, d xs and d params are three ops, each
running its own reverse sweep (with recomputation); the generated TIR kernels are plain loops
(fine for CPU; GPU targets would need a schedule for them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.relax.op.grad import no_grad
from tvm.sym import Analyzer

from .. import autodiff
from ..overrides import override_gradient, set_op_attr
from ..passes import DecomposeBackwardOps
from .registry import (
    Attr,
    InferContext,
    OpDef,
    check_bool,
    check_int,
    check_optional,
    define_op,
    fmt_dim,
    fmt_shape,
    get_op,
    op_error,
)

__all__ = ["ScanBody", "body_vjp", "MAX_UNROLL", "row_steps"]

MAX_UNROLL = 64  # static scans up to this length decompose by unrolling; longer ones keep the loop

_HEADS = {
    "scan": ("body", "init"),
    "scan_backward": ("body", "vjp", "init", "trajectory", "upstream"),
    "scan_backward_xs": ("body", "vjp", "init", "trajectory", "upstream"),
    "scan_backward_params": ("body", "vjp", "init", "trajectory", "upstream"),
}


def _i64(v):
    return tirx.IntImm("int64", v) if isinstance(v, int) else v


def _ceildiv(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return -(-a // b)
    return tirx.floordiv(_i64(a) + _i64(b) - _i64(1), _i64(b))


def row_steps(length: int, rows: int) -> list[int]:
    """The step after which each of ``rows`` trajectory rows is taken: ``ceil((r+1) L / R) - 1``."""
    return [_ceildiv((r + 1) * length, rows) - 1 for r in range(rows)]


# --------------------------------------------------------------------------------------------
# Bodies given as Python (tests, quick experiments)
# --------------------------------------------------------------------------------------------


class ScanBody:
    """A scan body written in Python.

    ``relax_fn(carry, *x_t, *params) -> next_carry`` builds Relax expressions; the op builders turn it
    into a private Relax function typed after the actual inputs (so one ScanBody serves every dtype
    and shape) and add it to the module being built. ``numpy_fn`` (same signature, NumPy) and
    ``numpy_vjp(carry, *x_t, *params, ct) -> (d carry, *d x_t, *d params)`` are what the NumPy
    references of the ops run.
    """

    def __init__(
        self,
        relax_fn: Callable[..., relax.Expr],
        numpy_fn: Callable[..., np.ndarray] | None = None,
        numpy_vjp: Callable[..., Sequence[np.ndarray]] | None = None,
        name: str = "scan_body",
    ):
        self.relax_fn = relax_fn
        self.numpy_fn = numpy_fn
        self.numpy_vjp = numpy_vjp
        self.name = name

    def __repr__(self) -> str:
        return f"ScanBody({self.name})"


# --------------------------------------------------------------------------------------------
# Symbolic-shape templates
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _TT:
    """A tensor type template: each dim is an int (static) or a slot name (symbolic)."""

    dims: tuple
    dtype: str

    def row(self) -> "_TT":
        return _TT(self.dims[1:], self.dtype)

    def lead(self, d) -> "_TT":
        return _TT((d,) + tuple(self.dims), self.dtype)

    @property
    def rank(self) -> int:
        return len(self.dims)


class _Slots:
    """Maps the symbolic dims of call-site types to slot names (structurally equal expressions
    share a slot); every generated function instantiates the slots with its own tirx.Vars."""

    def __init__(self):
        self.exprs: list[tuple[Any, str]] = []

    def dim(self, d):
        if isinstance(d, (int, tirx.IntImm)):
            return int(d)
        for e, s in self.exprs:
            if tvm_ffi.structural_equal(e, d):
                return s
        s = f"s{len(self.exprs)}"
        self.exprs.append((d, s))
        return s

    def tensor(self, ty) -> _TT:
        return _TT(tuple(self.dim(d) for d in ty.shape.values), str(ty.dtype.dtype))


class _Vars(dict):
    """slot -> tirx.Var, created on first use."""

    def __missing__(self, key):
        v = tirx.Var(key, "int64")
        self[key] = v
        return v

    def d(self, dim):
        return tirx.IntImm("int64", dim) if isinstance(dim, int) else self[dim]

    def ty(self, tt: _TT) -> relax.TensorType:
        return relax.TensorType([self.d(d) for d in tt.dims], tt.dtype)


def _fresh_types(types: Sequence[relax.Type]) -> list[relax.Type]:
    """The same tensor types with every symbolic dim replaced by a fresh var (shared where equal)."""
    slots, v = _Slots(), _Vars()
    out = []
    for t in types:
        if isinstance(t, relax.TensorType) and t.shape is not None and isinstance(t.shape, relax.ShapeExpr):
            out.append(v.ty(slots.tensor(t)))
        else:
            out.append(t)
    return out


def _fmt_ty(ty) -> str:
    if isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr):
        return f"{ty.dtype.dtype}{fmt_shape(ty.shape.values)}"
    return str(ty)


# --------------------------------------------------------------------------------------------
# Call layout
# --------------------------------------------------------------------------------------------


@dataclass
class _Parts:
    body: Any
    init: Any
    xs: list
    params: list
    vjp: Any = None
    trajectory: Any = None
    upstream: Any = None

    def flat(self, op: str) -> list:
        head = [getattr(self, n) for n in _HEADS[op]]
        return head + list(self.xs) + list(self.params)

    def xs_names(self) -> list[str]:
        return ["xs"] if len(self.xs) == 1 else [f"xs[{j}]" for j in range(len(self.xs))]

    def param_names(self) -> list[str]:
        return ["params"] if len(self.params) == 1 else [f"params[{j}]" for j in range(len(self.params))]


def _split_args(op: str, args: Sequence, num_xs: int | None) -> _Parts:
    head = _HEADS[op]
    args = list(args)
    if len(args) < len(head):
        raise op_error(op, head[len(args)], "an input (required)", "nothing")
    vals = dict(zip(head, args[: len(head)]))
    rest = args[len(head):]
    if num_xs is None:
        num_xs = len(rest)
    if num_xs > len(rest):
        raise op_error(op, "num_xs", f"at most {len(rest)} (the inputs after '{head[-1]}')", num_xs)
    return _Parts(xs=rest[:num_xs], params=rest[num_xs:], **vals)


def _as_list(v) -> list:
    if v is None:
        return []
    if isinstance(v, (list, tuple)):
        return list(v)
    return [v]


def _type_of(bb, e) -> relax.Type:
    try:
        ty = e.ty
    except Exception:  # not normalized yet
        ty = None
    if ty is None and bb is not None:
        ty = bb.normalize(e).ty
    return ty


class _ScanOpDef(OpDef):
    """OpDef for the variadic scan ops: inputs ``(body, [vjp, ...], init, ..., xs..., params...)``
    with ``num_xs`` telling xs from params; ``body``/``vjp`` are GlobalVars of the module."""

    # -- the Python builder --------------------------------------------------------------------
    def __call__(self, *args, body=None, vjp=None, init=None, trajectory=None, upstream=None, xs=None, params=None, **attrs):
        """Two forms:

        * ``scan(init, xs, body=..., params=..., **attrs)`` (backward ops:
          ``(init, trajectory, upstream, xs, params, body=..., vjp=None)``): ``xs``/``params`` an
          Expr or a list; ``body`` a GlobalVar, a relax.Function, a :class:`ScanBody` or a Python
          callable (the latter three are added to the module being built);
        * the flat form TVMScript prints: ``R.rlx.scan(cls.body, init, *xs, *params, num_xs=...)``.
        """
        head = _HEADS[self.name]
        if body is None and args and isinstance(args[0], relax.GlobalVar):
            named = dict(vjp=vjp, init=init, trajectory=trajectory, upstream=upstream, xs=xs, params=params)
            for k, v in named.items():
                if v is not None:
                    raise op_error(self.name, k, "no keyword input in the flat form (body, ...)", "a value")
            attrs = self.normalize_attrs(attrs)
            parts = _split_args(self.name, args, attrs["num_xs"])
            attrs["num_xs"] = len(parts.xs)
        else:
            names = [n for n in head if n not in ("body", "vjp")] + ["xs", "params"]
            if len(args) > len(names):
                raise op_error(self.name, "*args", f"at most {len(names)} inputs {names}", f"{len(args)} inputs")
            given = dict(zip(names, args))
            for n, v in dict(init=init, trajectory=trajectory, upstream=upstream, xs=xs, params=params).items():
                if v is not None:
                    if n not in names:
                        raise op_error(self.name, n, f"an input in {names}", "an unknown input")
                    if n in given:
                        raise op_error(self.name, n, "one value", "given twice")
                    given[n] = v
            for n in names[:-2]:
                if given.get(n) is None:
                    raise op_error(self.name, n, "a tensor (required input)", "nothing")
            if body is None:
                raise op_error(self.name, "body", "a Relax function (GlobalVar, relax.Function, ScanBody or callable)", "nothing")
            xs_l, ps_l = _as_list(given.get("xs")), _as_list(given.get("params"))
            if attrs.get("num_xs") is not None and attrs["num_xs"] != len(xs_l):
                raise op_error(self.name, "num_xs", f"{len(xs_l)} (the number of xs given)", attrs["num_xs"])
            attrs["num_xs"] = len(xs_l)
            attrs = self.normalize_attrs(attrs)
            bb = relax.BlockBuilder.current()
            body_gv = _materialize_body(self.name, bb, body, given["init"], xs_l, ps_l)
            if "vjp" in head and vjp is None:
                if bb is None:
                    raise op_error(self.name, "vjp", "a GlobalVar (or an active BlockBuilder to build it in)", "nothing")
                vjp = body_vjp(bb, body_gv, len(xs_l))
            parts = _Parts(body_gv, given["init"], xs_l, ps_l, vjp, given.get("trajectory"), given.get("upstream"))
        stored = {k: v for k, v in attrs.items() if v is not None}
        call_args = []
        for a in parts.flat(self.name):
            if not isinstance(a, relax.Expr):
                raise TypeError(f"rlx.{self.name}: expected relax.Expr inputs, got {type(a).__name__}")
            call_args.append(a)
        return relax.Call(self.op, call_args, tvm.ir.make_node("ir.DictAttrs", **stored))

    def normalize_attrs(self, given: dict[str, Any]) -> dict[str, Any]:
        """As OpDef's, but ``body``/``vjp`` (Python-level, e.g. a ScanBody in a test Case) pass
        through unchanged, so NumPy references receive them."""
        given = dict(given)
        passthrough = {k: given.pop(k) for k in ("body", "vjp") if k in given}
        return {**super().normalize_attrs(given), **passthrough}

    # -- decoding calls ------------------------------------------------------------------------
    def call_args(self, call: relax.Call) -> list:
        return list(call.args)

    def decode(self, call: relax.Call) -> tuple[_Parts, dict]:
        attrs = self.call_attrs(call)
        parts = _split_args(self.name, call.args, attrs["num_xs"])
        return parts, attrs

    def _infer_type(self, call: relax.Call, bb) -> relax.Type:
        parts, attrs = self.decode(call)
        return self.infer_fn(_ScanContext(self, parts, attrs))

    def _legalize(self, bb, call: relax.Call) -> relax.Expr:
        parts, attrs = self.decode(call)
        return self.fused_fn(bb, call, parts, attrs)

    def decompose(self, bb, call: relax.Call) -> relax.Expr:
        parts, attrs = self.decode(call)
        return self.decompose_fn(bb, call, parts, attrs)


class _ScanContext(InferContext):
    def __init__(self, opdef, parts: _Parts, attrs):
        args = {"body": parts.body, "vjp": parts.vjp, "init": parts.init, "trajectory": parts.trajectory, "upstream": parts.upstream}
        args.update(zip(parts.xs_names(), parts.xs))
        args.update(zip(parts.param_names(), parts.params))
        super().__init__(opdef, args, attrs)
        self.parts = parts


# --------------------------------------------------------------------------------------------
# Building the body function and its VJP
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Type inference
# --------------------------------------------------------------------------------------------


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
        parts = ctx.parts
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


# --------------------------------------------------------------------------------------------
# NumPy references
# --------------------------------------------------------------------------------------------


def _np_body(body, what: str):
    fn = getattr(body, "numpy_fn" if what == "fn" else "numpy_vjp", None)
    if fn is None:
        raise ValueError(f"rlx.scan reference: the body {body!r} has no NumPy {'function' if what == 'fn' else 'VJP'}")
    return fn


def _np_setup(init, xs, params, length, num_checkpoints):
    xs = [np.asarray(x, dtype=np.float64) for x in _as_list(xs)]
    params = [np.asarray(p, dtype=np.float64) for p in _as_list(params)]
    L = length if length is not None else xs[0].shape[0]
    R = num_checkpoints if num_checkpoints > 0 else L
    return np.asarray(init, dtype=np.float64), xs, params, L, R


def _scan_reference(init, xs=None, params=None, *, body, length=None, save_trajectory=False, num_checkpoints=0, num_xs=None):
    f = _np_body(body, "fn")
    c, xs, params, L, R = _np_setup(init, xs, params, length, num_checkpoints)
    carries = []
    for t in range(L):
        c = np.asarray(f(c, *[x[t] for x in xs], *params), dtype=np.float64)
        carries.append(c)
    if not save_trajectory:
        return c
    return np.stack([carries[t] for t in row_steps(L, R)])


def _backward_reference(init, trajectory, upstream, xs, params, body, length, save_trajectory, num_checkpoints):
    """SPEC §6 literally (recomputing each segment from its checkpoint): (dc, [dxs], [dps])."""
    f, vjp = _np_body(body, "fn"), _np_body(body, "vjp")
    init, xs, params, L, R = _np_setup(init, xs, params, length, num_checkpoints)
    traj = np.asarray(trajectory, dtype=np.float64)
    up = np.asarray(upstream, dtype=np.float64)
    dc = np.zeros_like(init) if save_trajectory else up.copy()
    dxs = [np.zeros_like(x) for x in xs]
    dps = [np.zeros_like(p) for p in params]
    for r in reversed(range(R)):
        if save_trajectory:
            dc = dc + up[r]
        a, b = _ceildiv(r * L, R), _ceildiv((r + 1) * L, R)
        seg = [init if r == 0 else traj[r - 1]]
        for t in range(a, b - 1):
            seg.append(np.asarray(f(seg[-1], *[x[t] for x in xs], *params), dtype=np.float64))
        for t in reversed(range(a, b)):
            g = [np.asarray(v, dtype=np.float64) for v in vjp(seg[t - a], *[x[t] for x in xs], *params, dc)]
            dc = g[0]
            for j in range(len(xs)):
                dxs[j][t] = g[1 + j]
            for j in range(len(params)):
                dps[j] = dps[j] + g[1 + len(xs) + j]
    return dc, dxs, dps


def _backward_reference_for(which):
    def ref(init, trajectory, upstream, xs=None, params=None, *, body, length=None, save_trajectory=False,
            num_checkpoints=0, num_xs=None, xs_idx=0, param_idx=0):
        dc, dxs, dps = _backward_reference(init, trajectory, upstream, xs, params, body, length, save_trajectory, num_checkpoints)
        return {"init": dc, "xs": dxs[xs_idx] if dxs else None, "params": dps[param_idx] if dps else None}[which]

    return ref


# --------------------------------------------------------------------------------------------
# Decomposition: unrolled, body and VJP inlined (short static scans)
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Fused lowering: loops as divide-and-conquer recursive Relax functions
# --------------------------------------------------------------------------------------------


def _kernel_source(kind: str, rank: int, dtype: str) -> str:
    dims = [f"d{k}" for k in range(rank)]
    js = [f"j{k}" for k in range(rank)]
    idx = ", ".join(js) if rank else "()"
    ridx = ("i, " + ", ".join(js)) if rank else "i"
    shp = "(" + "".join(f"{d}, " for d in dims) + ")"
    rshp = "(R, " + "".join(f"{d}, " for d in dims) + ")"
    sig = {
        "take_row": "src_h: T.handle, i: T.int64, out_h: T.handle",
        "write_row": "buf_h: T.handle, val_h: T.handle, i: T.int64",
        "zeros": "out_h: T.handle",
        "add": "a_h: T.handle, b_h: T.handle, out_h: T.handle",
    }[kind]
    lines = ["@T.prim_func(private=True)", f"def {kind}({sig}):", "    T.func_attr({'tirx.noalias': True})"]
    if kind in ("take_row", "write_row"):
        lines.append("    R = T.int64()")
    lines += [f"    {d} = T.int64()" for d in dims]
    if kind == "take_row":
        lines += [f"    src = T.match_buffer(src_h, {rshp}, '{dtype}')", f"    out = T.match_buffer(out_h, {shp}, '{dtype}')"]
        stmt = f"out[{idx}] = src[{ridx}]"
    elif kind == "write_row":
        lines += [f"    buf = T.match_buffer(buf_h, {rshp}, '{dtype}')", f"    val = T.match_buffer(val_h, {shp}, '{dtype}')"]
        stmt = f"buf[{ridx}] = val[{idx}]"
    elif kind == "zeros":
        lines += [f"    out = T.match_buffer(out_h, {shp}, '{dtype}')"]
        stmt = f"out[{idx}] = T.{dtype}(0)"
    else:
        lines += [f"    {n} = T.match_buffer({n}_h, {shp}, '{dtype}')" for n in ("a", "b", "out")]
        stmt = f"out[{idx}] = a[{idx}] + b[{idx}]"
    if rank:
        lines.append(f"    for {', '.join(js)} in T.grid({', '.join(dims)}):")
        lines.append("        " + stmt)
    else:
        lines.append("    " + stmt)
    return "\n".join(lines) + "\n"


_KERNELS: dict = {}


def _kernel(bb, kind: str, rank: int, dtype: str) -> relax.GlobalVar:
    key = (kind, rank, dtype)
    if key not in _KERNELS:
        _KERNELS[key] = tvm.script.from_source(_kernel_source(kind, rank, dtype))
    return bb.add_func(_KERNELS[key], f"rlx_scan_{kind}_{dtype}_r{rank}")  # add_func dedups


_BND = ("lo", "hi", "L", "R", "base")
_KEY_ATTR = "rlx.scan_key"


class _Lowering:
    """Generates the loop functions of one lowered scan call into ``bb`` (the LegalizeOps
    builder) and returns the call that replaces it."""

    def __init__(self, bb, call, parts: _Parts, attrs):
        self.bb, self.call, self.parts, self.attrs = bb, call, parts, attrs
        self.slots = _Slots()
        s = self.slots
        self.C = s.tensor(parts.init.ty)
        self.XS_site = [s.tensor(x.ty) for x in parts.xs]
        self.X = [t.row() for t in self.XS_site]
        self.XS = [t.lead("L") for t in self.X]
        self.P = [s.tensor(p.ty) for p in parts.params]
        K = attrs["num_checkpoints"]
        self.K = K
        self.save = attrs["save_trajectory"]
        L_static = _static_length(parts, attrs)
        self.full = K == 0 or (L_static is not None and K == L_static)  # one row per step
        self.TRAJ = self.C.lead("R")
        mod = bb.get()
        self.names_used = {g.name_hint for g in mod.get_global_vars()}
        # Identical scans (same body, types and attributes) share their generated functions.
        self.existing = {}
        for g, f in mod.functions.items():
            if isinstance(f, relax.Function) and f.attrs is not None and _KEY_ATTR in f.attrs:
                self.existing[str(f.attrs[_KEY_ATTR])] = g
        vjp = parts.vjp.name_hint if isinstance(parts.vjp, relax.GlobalVar) else None
        # Loops depend on the body, the VJP and the types only (L, R are runtime shape values).
        self.sig = repr((parts.body.name_hint, vjp, self.C, self.X, self.P))

    def _lookup(self, key: str):
        return self.existing.get(key)

    def _tag(self, gv, key: str):
        self.bb.update_func(gv, self.bb.get()[gv].with_attr(_KEY_ATTR, key))
        self.existing[key] = gv

    # -- small helpers ---------------------------------------------------------------------
    def _name(self, prefix: str) -> str:
        while True:
            name = self.bb.get_unique_name(prefix)
            if name not in self.names_used:
                self.names_used.add(name)
                return name

    def k(self, kind, tt: _TT):
        return _kernel(self.bb, kind, tt.rank, tt.dtype)

    def take_row(self, fb, src, tt_row: _TT, i, v: _Vars):
        return fb.emit(relax.call_tir(self.k("take_row", tt_row), [src, relax.prim_value(_i64(i))], v.ty(tt_row)))

    def write_row(self, fb, buf, val, tt_row: _TT, i):
        return fb.emit(relax.op.call_tir_inplace(self.k("write_row", tt_row), [buf, val, relax.prim_value(_i64(i))], [0], buf.ty))

    def zeros(self, fb, ty: relax.TensorType, tt: _TT):
        return fb.emit(relax.call_tir(self.k("zeros", tt), [], ty))

    def add(self, fb, a, b, tt: _TT):
        return fb.emit(relax.call_tir(self.k("add", tt), [a, b], a.ty))

    @staticmethod
    def cast(fb, e, ty):
        e = fb.normalize(e)
        if not isinstance(e, relax.Var):
            e = fb.emit(e)
        if not tvm_ffi.structural_equal(e.ty, ty):
            e = fb.match_cast(e, ty)
        return e

    @staticmethod
    def shape(*vals):
        return relax.ShapeExpr([_i64(x) for x in vals])

    def x_rows(self, fb, xs, t, v):
        return [self.take_row(fb, x, tt, t, v) for x, tt in zip(xs, self.X)]

    # -- function definitions ----------------------------------------------------------------
    def declare(self, prefix: str, param_tts: Sequence, ret_tts: Sequence):
        """A typed GlobalVar for a function ``(bnd, *params) -> Tuple(rets)`` (defined later)."""
        v = _Vars()
        ptys = [relax.ShapeType([v[n] for n in _BND])] + [v.ty(t) for t in param_tts]
        gv = relax.GlobalVar(self._name(prefix))
        relax.expr._update_type(gv, relax.FuncType(ptys, relax.TupleType([v.ty(t) for t in ret_tts]), True))
        return gv

    def define(self, gv, param_tts, ret_tts, build, with_bnd=True):
        """Define ``gv`` as straight-line code: ``build(fb, v, params) -> [ret exprs]`` or one
        expression of the return type; ``params[0]`` is the ``bnd`` shape when ``with_bnd``."""
        v = _Vars()
        params = [relax.Var(f"a{i}", v.ty(t)) for i, t in enumerate(param_tts)]
        if with_bnd:
            params = [relax.Var("bnd", relax.ShapeType([v[n] for n in _BND]))] + params
        ret_tys = [v.ty(t) for t in ret_tts]
        fb = relax.BlockBuilder()
        with fb.function("f", params, private=True):
            outs = build(fb, v, params)
            if isinstance(outs, list):
                outs = [self.cast(fb, e, t) for e, t in zip(outs, ret_tys)]
                out = relax.Tuple(outs) if with_bnd else outs[0]
            else:
                out = outs
            fb.emit_func_output(out)
        f = fb.get()["f"]
        ret_ty = relax.TupleType(ret_tys) if with_bnd else ret_tys[0]
        self.bb.update_func(gv, relax.Function(f.params, f.body, ret_ty, True, f.attrs))
        return gv

    def loop(self, prefix: str, state_tts: list, const_tts: list, step, reverse: bool = False, key_extra=()):
        """``run(bnd, *state, *consts) -> Tuple(state)`` applying ``step`` to every index in
        ``[lo, hi)`` (descending if ``reverse``) by divide and conquer (call depth ~2 log2(hi-lo)).
        ``step(fb, v, lo, state, consts) -> [new state]``."""
        key = repr(("loop", prefix, state_tts, const_tts, reverse, key_extra, self.sig))
        hit = self._lookup(key)
        if hit is not None:
            return hit
        ptts = list(state_tts) + list(const_tts)
        ns = len(state_tts)
        run = self.declare(f"{prefix}_run", ptts, state_tts)
        split = self.declare(f"{prefix}_split", ptts, state_tts)
        stepf = self.declare(f"{prefix}_step", ptts, state_tts)
        one, zero, two = (tirx.IntImm("int64", k) for k in (1, 0, 2))

        def build_step(fb, v, ps):
            return step(fb, v, v["lo"], ps[1 : 1 + ns], ps[1 + ns :])

        def build_split(fb, v, ps):
            lo, hi = v["lo"], v["hi"]
            mid = tirx.floordiv(lo + hi, two)
            first, second = ((lo, mid), (mid, hi)) if not reverse else ((mid, hi), (lo, mid))
            rest = [v["L"], v["R"], v["base"]]
            r1 = fb.emit(relax.Call(run, [self.shape(*first, *rest)] + ps[1:]))
            s1 = [fb.emit(relax.TupleGetItem(r1, i)) for i in range(ns)]
            return fb.emit(relax.Call(run, [self.shape(*second, *rest)] + s1 + ps[1 + ns :]))

        def build_run(fb, v, ps):
            lo, hi = v["lo"], v["hi"]
            rest = relax.If(relax.prim_value(hi - lo <= zero), relax.Tuple(ps[1 : 1 + ns]), relax.Call(split, ps))
            return fb.emit(relax.If(relax.prim_value(hi - lo == one), relax.Call(stepf, ps), rest))

        self.define(stepf, ptts, state_tts, build_step)
        self.define(split, ptts, state_tts, build_split)
        self.define(run, ptts, state_tts, build_run)
        self._tag(run, key)
        return run

    # -- forward -----------------------------------------------------------------------------
    def body_call(self, fb, v, c, xrows, params):
        out = fb.emit(relax.Call(self.parts.body, [c] + xrows + list(params)))
        return self.cast(fb, out, v.ty(self.C))

    def fwd_plain(self):
        m = len(self.X)

        def step(fb, v, t, state, consts):
            return [self.body_call(fb, v, state[0], self.x_rows(fb, consts[:m], t, v), consts[m:])]

        return self.loop("rlx_scan_fwd", [self.C], self.XS + self.P, step)

    def fwd_rows(self, shift: int):
        """Loop writing the carry after step t into row ``t - base + shift`` of a buffer."""
        m = len(self.X)

        def step(fb, v, t, state, consts):
            c = self.body_call(fb, v, state[0], self.x_rows(fb, consts[:m], t, v), consts[m:])
            buf = self.write_row(fb, state[1], c, self.C, t - v["base"] + shift)
            return [c, buf]

        return self.loop("rlx_scan_fwd_rows", [self.C, self.C.lead("S")], self.XS + self.P, step, key_extra=(shift,))

    def fwd_checkpoints(self):
        """Loop over rows r: run segment r's steps, write its last carry into row r."""
        plain = self.fwd_plain()

        def step(fb, v, r, state, consts):
            L, R = v["L"], v["R"]
            a, b = _ceildiv(r * L, R), _ceildiv((r + 1) * L, R)
            res = fb.emit(relax.Call(plain, [self.shape(a, b, L, R, 0), state[0]] + consts))
            c = fb.emit(relax.TupleGetItem(res, 0))
            return [c, self.write_row(fb, state[1], c, self.C, r)]

        return self.loop("rlx_scan_fwd_ckpt", [self.C, self.TRAJ], self.XS + self.P, step)

    def entry(self, prefix, arg_exprs, ret_ty_site, build):
        """A private function over the call's arguments (typed like the call site) that runs
        ``build(fb, v, params, L, R) -> result``; returns the call replacing the op."""
        arg_tts = [self.slots.tensor(a.ty) for a in arg_exprs]
        ret_tt = self.slots.tensor(ret_ty_site)
        key = repr(("entry", prefix, arg_tts, ret_tt, self.sig, sorted(self.attrs.items())))
        hit = self._lookup(key)
        if hit is not None:
            return relax.Call(hit, list(arg_exprs))
        gv = relax.GlobalVar(self._name(prefix))
        v0 = _Vars()
        relax.expr._update_type(gv, relax.FuncType([v0.ty(t) for t in arg_tts], v0.ty(ret_tt), True))

        def body(fb, v, ps):
            length = self.attrs["length"]
            if length is not None:
                L = _i64(length)
            else:
                L = v.d(arg_tts[self._xs_pos].dims[0])
            R = _i64(self.K) if self.K > 0 else L
            return [build(fb, v, ps, L, R)]

        self.define(gv, arg_tts, [ret_tt], body, with_bnd=False)
        self._tag(gv, key)
        return relax.Call(gv, list(arg_exprs))

    def forward(self):
        p = self.parts
        args = [p.init] + list(p.xs) + list(p.params)
        self._xs_pos = 1
        m = len(p.xs)

        def build(fb, v, ps, L, R):
            init, xs, prm = ps[0], ps[1 : 1 + m], ps[1 + m :]
            if not self.save:
                res = fb.emit(relax.Call(self.fwd_plain(), [self.shape(0, L, L, R, 0), init] + xs + prm))
                return fb.emit(relax.TupleGetItem(res, 0))
            buf = self.zeros(fb, relax.TensorType([R] + [v.d(d) for d in self.slots.tensor(p.init.ty).dims], self.C.dtype), self.TRAJ)
            if self.full:
                res = fb.emit(relax.Call(self.fwd_rows(0), [self.shape(0, L, L, R, 0), init, buf] + xs + prm))
            else:
                res = fb.emit(relax.Call(self.fwd_checkpoints(), [self.shape(0, R, L, R, 0), init, buf] + xs + prm))
            return fb.emit(relax.TupleGetItem(res, 1))

        return self.entry("rlx_scan", args, self.call.ty, build)

    # -- backward ----------------------------------------------------------------------------
    def backward(self, which: str):
        p = self.parts
        m, n = len(p.xs), len(p.params)
        j = self.attrs["xs_idx"] if which == "xs" else self.attrs["param_idx"] if which == "params" else None
        extra_tts = [self.X[j].lead("L")] if which == "xs" else [self.P[j]] if which == "params" else []
        UP = self.TRAJ if self.save else self.C

        def vjp_step(fb, v, t, c_t, state, xs, prm):
            """One VJP step at index t from carry c_t: new [dc, *extra]."""
            res = fb.emit(relax.Call(p.vjp, [c_t] + self.x_rows(fb, xs, t, v) + list(prm) + [state[0]]))
            grads = fb.emit(relax.TupleGetItem(res, 1))
            dc = fb.emit(relax.TupleGetItem(grads, 0))
            out = [dc]
            if which == "xs":
                dx = self.cast(fb, relax.TupleGetItem(grads, 1 + j), v.ty(self.X[j]))
                out.append(self.write_row(fb, state[1], dx, self.X[j], t))
            elif which == "params":
                dp = self.cast(fb, relax.TupleGetItem(grads, 1 + m + j), v.ty(self.P[j]))
                out.append(self.add(fb, state[1], dp, self.P[j]))
            return out

        def checkpoint(fb, v, r, init, traj):
            """init for r == 0 else traj[r - 1]."""
            prev = relax.call_tir(self.k("take_row", self.C), [traj, relax.prim_value(r - tirx.IntImm("int64", 1))], v.ty(self.C))
            return self.cast(fb, relax.If(relax.prim_value(r == tirx.IntImm("int64", 0)), init, prev), v.ty(self.C))

        state_tts = [self.C] + extra_tts
        ns = len(state_tts)
        consts_tts = [self.C, self.TRAJ, UP] + self.XS + self.P

        if not self.full:
            # Reverse sweep over the steps of one segment, reading carries from the segment buffer.
            SEG = self.C.lead("S")

            def seg_step(fb, v, t, state, consts):
                seg, xs, prm = consts[0], consts[1 : 1 + m], consts[1 + m :]
                c_t = self.take_row(fb, seg, self.C, t - v["base"], v)
                return vjp_step(fb, v, t, c_t, state, xs, prm)

            seg_loop = self.loop("rlx_scan_bwd_seg", state_tts, [SEG] + self.XS + self.P, seg_step, reverse=True, key_extra=(which, j))
            recompute = self.fwd_rows(1)

        def row_step(fb, v, r, state, consts):
            init, traj, up, xs, prm = consts[0], consts[1], consts[2], consts[3 : 3 + m], consts[3 + m :]
            state = list(state)
            if self.save:
                state[0] = self.add(fb, state[0], self.take_row(fb, up, self.C, r, v), self.C)
            c0 = checkpoint(fb, v, r, init, traj)
            if self.full:
                return vjp_step(fb, v, r, c0, state, xs, prm)
            L, R = v["L"], v["R"]
            a, b = _ceildiv(r * L, R), _ceildiv((r + 1) * L, R)
            rows = tirx.max(b - a, tirx.IntImm("int64", 1))
            seg = self.zeros(fb, relax.TensorType([rows] + [v.d(d) for d in self.C.dims], self.C.dtype), SEG)
            seg = self.write_row(fb, seg, c0, self.C, 0)
            rec = fb.emit(relax.Call(recompute, [self.shape(a, tirx.max(b - 1, a), L, R, a), c0, seg] + xs + prm))
            seg = fb.emit(relax.TupleGetItem(rec, 1))
            res = fb.emit(relax.Call(seg_loop, [self.shape(a, b, L, R, a)] + state + [seg] + xs + prm))
            return [fb.emit(relax.TupleGetItem(res, i)) for i in range(ns)]

        rows_loop = self.loop(
            "rlx_scan_bwd", state_tts, consts_tts, row_step, reverse=True, key_extra=(which, j, self.save, self.full)
        )

        args = [p.init, p.trajectory, p.upstream] + list(p.xs) + list(p.params)
        self._xs_pos = 3

        def build(fb, v, ps, L, R):
            init, traj, up = ps[0], ps[1], ps[2]
            C_ty = relax.TensorType([v.d(d) for d in self.slots.tensor(p.init.ty).dims], self.C.dtype)
            dc0 = self.zeros(fb, C_ty, self.C) if self.save else up
            state = [dc0]
            if which == "xs":
                xty = ps[3 + j].ty
                state.append(self.zeros(fb, relax.TensorType([L] + list(xty.shape.values)[1:], self.X[j].dtype), self.X[j].lead("L")))
            elif which == "params":
                state.append(self.zeros(fb, ps[3 + m + j].ty, self.P[j]))
            res = fb.emit(relax.Call(rows_loop, [self.shape(0, R, L, R, 0)] + state + ps))
            return fb.emit(relax.TupleGetItem(res, 0 if which == "init" else 1))

        return self.entry(f"rlx_scan_backward_{which}", args, self.call.ty, build)


def _fused_scan(bb, call, parts, attrs):
    return _Lowering(bb, call, parts, attrs).forward()


def _fused_backward(which):
    def fused(bb, call, parts, attrs):
        return _Lowering(bb, call, parts, attrs).backward(which)

    return fused


# --------------------------------------------------------------------------------------------
# Op declarations
# --------------------------------------------------------------------------------------------

_COMMON_ATTRS = (
    Attr("num_xs", None, check_optional(check_int(lo=0))),
    Attr("length", None, check_optional(check_int(lo=1))),
    Attr("save_trajectory", False, check_bool),
    Attr("num_checkpoints", 0, check_int(lo=0)),
)


def _declare(name: str, inputs, attrs, backward: bool, doc: str) -> _ScanOpDef:
    opdef = define_op(name, inputs=inputs, attrs=attrs, backward=backward, doc=doc)
    # The scan ops are variadic (xs..., params...) and take functions as inputs: same OpDef, with
    # the builder, decoding and dispatch overridden.
    opdef.__class__ = _ScanOpDef
    opdef.extra["keep_fused"] = _keep_fused
    # LegalizeOps skips calls whose arguments' shapes are not all known; the body/vjp GlobalVar
    # arguments have function types, so opt out of that check (the tensors' shapes are checked by
    # type inference).
    set_op_attr(opdef.op.name, "RequiresArgumentShapes", False)
    return opdef


scan = _declare(
    "scan",
    ("body", "init", "*xs", "*params"),
    _COMMON_ATTRS,
    backward=False,
    doc="Scan a Relax function over the leading axis of xs (SPEC §6).",
)
scan.infer(_infer_scan)
scan.reference(_scan_reference)
scan.decomposition(_decompose_scan)
scan.fused(_fused_scan)

_BWD_INPUTS = ("body", "vjp", "init", "trajectory", "upstream", "*xs", "*params")

scan_backward = _declare("scan_backward", _BWD_INPUTS, _COMMON_ATTRS, True, "d init of rlx.scan (SPEC §6).")
scan_backward_xs = _declare(
    "scan_backward_xs", _BWD_INPUTS, _COMMON_ATTRS + (Attr("xs_idx", 0, check_int(lo=0)),), True,
    "Stacked d xs[xs_idx] of rlx.scan (SPEC §6).",
)
scan_backward_params = _declare(
    "scan_backward_params", _BWD_INPUTS, _COMMON_ATTRS + (Attr("param_idx", 0, check_int(lo=0)),), True,
    "d params[param_idx] of rlx.scan, summed over the steps (SPEC §6).",
)
for _op, _which in ((scan_backward, "init"), (scan_backward_xs, "xs"), (scan_backward_params, "params")):
    _op.infer(_infer_backward(_which))
    _op.reference(_backward_reference_for(_which))
    _op.decomposition(_decompose_backward(_which))
    _op.fused(_fused_backward(_which))


# --------------------------------------------------------------------------------------------
# Gradient rule: relax.transform.Gradient emits the backward ops
# --------------------------------------------------------------------------------------------

def _scan_gradient(orig_var, orig_call, output_grad, ctx):
    parts, attrs = scan.decode(orig_call)
    fwd_attrs = {k: v for k, v in attrs.items() if v is not None}
    if attrs["save_trajectory"]:
        traj = orig_var
    else:  # the checkpoints (or the whole trajectory when K == 0) for the backward
        traj = ctx.emit(scan(parts.body, parts.init, *parts.xs, *parts.params, **{**fwd_attrs, "save_trajectory": True}))
    vjp = body_vjp(ctx, parts.body, len(parts.xs))
    args = [parts.body, vjp, parts.init, traj, output_grad] + list(parts.xs) + list(parts.params)
    grads = [no_grad(parts.body), scan_backward(*args, **fwd_attrs)]
    grads += [scan_backward_xs(*args, **fwd_attrs, xs_idx=j) for j in range(len(parts.xs))]
    grads += [scan_backward_params(*args, **fwd_attrs, param_idx=j) for j in range(len(parts.params))]
    return grads


override_gradient("relax.rlx.scan", _scan_gradient)

