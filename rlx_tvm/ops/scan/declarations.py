"""The scan ops: ``rlx.scan`` and its three backward ops, declared with a variadic OpDef, and the
gradient rule of ``rlx.scan``."""

from __future__ import annotations

from typing import Any

import tvm
from tvm import relax
from tvm.relax.op.grad import no_grad

from ...overrides import override_gradient, set_op_attr
from ..registry import Attr, OpDef, check_bool, check_int, check_optional, define_op, op_error
from .body import _materialize_body, body_vjp
from .decomposition import _decompose_backward, _decompose_scan, _keep_fused
from .infer import _infer_backward, _infer_scan
from .layout import _HEADS, _Parts, _ScanContext, _as_list, _split_args
from .lowering import _fused_backward, _fused_scan
from .reference import _backward_reference_for, _scan_reference

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
    doc="Scan a Relax function over the leading axis of xs (docs/operators.md §6).",
)
scan.infer(_infer_scan)
scan.reference(_scan_reference)
scan.decomposition(_decompose_scan)
scan.fused(_fused_scan)

_BWD_INPUTS = ("body", "vjp", "init", "trajectory", "upstream", "*xs", "*params")

scan_backward = _declare("scan_backward", _BWD_INPUTS, _COMMON_ATTRS, True, "d init of rlx.scan (docs/operators.md §6).")
scan_backward_xs = _declare(
    "scan_backward_xs", _BWD_INPUTS, _COMMON_ATTRS + (Attr("xs_idx", 0, check_int(lo=0)),), True,
    "Stacked d xs[xs_idx] of rlx.scan (docs/operators.md §6).",
)
scan_backward_params = _declare(
    "scan_backward_params", _BWD_INPUTS, _COMMON_ATTRS + (Attr("param_idx", 0, check_int(lo=0)),), True,
    "d params[param_idx] of rlx.scan, summed over the steps (docs/operators.md §6).",
)
for _op, _which in ((scan_backward, "init"), (scan_backward_xs, "xs"), (scan_backward_params, "params")):
    _op.infer(_infer_backward(_which))
    _op.reference(_backward_reference_for(_which))
    _op.decomposition(_decompose_backward(_which))
    _op.fused(_fused_backward(_which))


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
