"""Legalization of the scan ops: each loop over an index range is three private Relax functions
(run, split, step) calling each other by divide and conquer, so that the call depth is about
2 log2(L) and the module is the same size for every length (docs/scan.md)."""

from __future__ import annotations

from typing import Sequence

import tvm_ffi
from tvm import relax, tirx

from .decomposition import _static_length
from .kernels import _kernel
from .layout import _TT, _Parts, _Slots, _Vars, _ceildiv, _i64

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
        m = len(p.xs)
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
            up = ps[2]
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
