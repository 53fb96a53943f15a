"""The backward-op registry: every ``relax.rlx.<name>`` operator is declared here once.

An op is an :class:`OpDef`. Its module (one per op family) declares the signature with
:func:`define_op` and then attaches the remaining parts with decorators::

    relu_backward = define_op("relu_backward", inputs=("x", "dy"), doc="...")

    @relu_backward.infer          # validation + output type (becomes FInferType)
    def _(ctx): ...
    @relu_backward.reference      # NumPy reference used by the tests
    def _(x, dy): ...
    @relu_backward.decomposition  # primitive Relax ops, differentiable again
    def _(bb, x, dy): ...
    @relu_backward.fused          # fused TE/TensorIR kernel (becomes FLegalize)
    def _(bb, x, dy): ...

The registry lives below the op families, the passes and autodiff (which work on any declared op),
so that an op family may use those (scan differentiates its body with autodiff);
:mod:`rlx_tvm.ops.registry` is the same API under the ops package.

Registration with TVM happens when the module is imported and is idempotent: the Relax op is
created only if it does not exist yet and the attributes point at thin dispatchers that look the
OpDef up by name, so re-importing (or reloading) a family module simply swaps the Python parts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import tvm
import tvm_ffi
from tvm import relax
from tvm.sym import Analyzer

from .overrides import set_op_attr

__all__ = [
    "OpError",
    "Attr",
    "OpDef",
    "InferContext",
    "TensorArg",
    "define_op",
    "get_op",
    "all_ops",
    "is_rlx_call",
    "SiblingFusion",
    "fuse_siblings",
    "FLOAT_DTYPES",
    "INT_DTYPES",
    "OP_PREFIX",
    "op_error",
    "check_bool",
    "check_choice",
    "check_float",
    "check_int",
    "check_int_tuple",
    "check_optional",
    "fmt_dim",
    "fmt_shape",
    "static_int",
]

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
INT_DTYPES = ("int32", "int64")

OP_PREFIX = "relax.rlx."

_REGISTRY: dict[str, "OpDef"] = {}
_REQUIRED = object()


@tvm_ffi.register_error
class OpError(ValueError):
    """Bad input to an rlx op. The message names the op, the argument, what was expected and
    what was given. Registered with the FFI so it keeps its type when raised inside type
    inference (which runs behind C++ ``bb.emit``/normalization)."""


def op_error(op: str, arg: str, expected: str, got: Any) -> OpError:
    return OpError(f"rlx.{op}: argument '{arg}' expected {expected}, got {got}")


# --------------------------------------------------------------------------------------------
# Attributes
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Attr:
    """One attribute: its default (``Attr("eps", 1e-5)``; no default means required) and a
    ``check(op_name, value) -> value`` that validates and normalizes it (e.g. list -> tuple)."""

    name: str
    default: Any = _REQUIRED
    check: Callable[[str, str, Any], Any] | None = None

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED


def _describe(value: Any) -> str:
    return repr(value)


def check_int(lo: int | None = None, hi: int | None = None):
    def check(op: str, name: str, v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, (int, tvm.tirx.IntImm)):
            raise op_error(op, name, "an integer", _describe(v))
        v = int(v)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            rng = f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
            raise op_error(op, name, f"an integer in {rng}", v)
        return v

    return check


def check_float(lo: float | None = None, lo_open: bool = False, hi: float | None = None):
    def check(op: str, name: str, v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float, tvm.tirx.FloatImm, tvm.tirx.IntImm)):
            raise op_error(op, name, "a number", _describe(v))
        v = float(v)
        bad = not math.isfinite(v)
        if lo is not None:
            bad = bad or (v <= lo if lo_open else v < lo)
        if hi is not None:
            bad = bad or v > hi
        if bad:
            parts = []
            if lo is not None:
                parts.append(f"{'>' if lo_open else '>='} {lo}")
            if hi is not None:
                parts.append(f"<= {hi}")
            raise op_error(op, name, "a finite number " + " and ".join(parts), v)
        return v

    return check


def check_choice(*choices: Any):
    def check(op: str, name: str, v: Any) -> Any:
        if isinstance(v, str):
            v = str(v)
        if v not in choices:
            raise op_error(op, name, f"one of {list(choices)}", _describe(v))
        return v

    return check


def check_bool(op: str, name: str, v: Any) -> bool:
    if isinstance(v, tvm.tirx.IntImm):
        v = bool(v.value)
    if not isinstance(v, bool):
        raise op_error(op, name, "a bool", _describe(v))
    return v


def check_int_tuple(length: int, lo: int | None = None):
    """An int or a sequence of ``length`` ints (an int is broadcast, as PyTorch allows)."""
    elem = check_int(lo=lo)

    def check(op: str, name: str, v: Any) -> tuple[int, ...]:
        if isinstance(v, (int, tvm.tirx.IntImm)) and not isinstance(v, bool):
            v = (v,) * length
        if not isinstance(v, (list, tuple, tvm.ir.Array)) or len(v) != length:
            raise op_error(op, name, f"an int or a sequence of {length} ints", _describe(v))
        return tuple(elem(op, name, e) for e in v)

    return check


def check_optional(inner: Callable[[str, str, Any], Any]):
    def check(op: str, name: str, v: Any) -> Any:
        return None if v is None else inner(op, name, v)

    return check


# --------------------------------------------------------------------------------------------
# Type inference context
# --------------------------------------------------------------------------------------------


@dataclass
class TensorArg:
    """A tensor argument as seen by type inference."""

    name: str
    ty: relax.TensorType

    @property
    def dtype(self) -> str:
        return str(self.ty.dtype.dtype)

    @property
    def ndim(self) -> int:
        return int(self.ty.ndim)

    @property
    def shape(self) -> list:
        """The shape as a list of PrimExprs (IntImm for static dims)."""
        return list(self.ty.shape.values)

    def dim(self, axis: int):
        return self.shape[axis]

    def static_dim(self, axis: int) -> int | None:
        d = self.shape[axis]
        return int(d.value) if isinstance(d, tvm.tirx.IntImm) else None


def fmt_dim(d) -> str:
    """A dim as users write it: ``6``, ``n``, ``n * 8`` (not ``T.int64(6)``)."""
    return str(int(d)) if isinstance(d, (int, tvm.tirx.IntImm)) else str(d)


def fmt_shape(shape: Sequence) -> str:
    return "[" + ", ".join(fmt_dim(d) for d in shape) + "]"


def static_int(d) -> int | None:
    """A shape dim or loop extent as an int when it is a constant (an int or ``IntImm``), else
    None (symbolic)."""
    if isinstance(d, int):
        return d
    return int(d.value) if isinstance(d, tvm.tirx.IntImm) else None


class InferContext:
    """What an op's ``infer`` function receives: named tensor arguments, decoded attributes,
    and helpers that raise :class:`OpError` with a uniform message."""

    def __init__(self, opdef: "OpDef", args: dict[str, Any], attrs: dict[str, Any]):
        self.opdef = opdef
        self.op = opdef.name
        self._args = args
        self.attrs = attrs
        self.analyzer = Analyzer()

    # -- errors -------------------------------------------------------------------------------
    def error(self, arg: str, expected: str, got: Any) -> OpError:
        return op_error(self.op, arg, expected, got)

    # -- arguments ----------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return self._args.get(name) is not None

    def tensor(
        self,
        name: str,
        ndim: int | Sequence[int] | None = None,
        min_ndim: int | None = None,
        dtypes: Sequence[str] = FLOAT_DTYPES,
    ) -> TensorArg:
        """Fetch argument ``name`` as a tensor with known rank, checking rank and dtype."""
        expr = self._args[name]
        ty = expr.ty
        if not isinstance(ty, relax.TensorType):
            raise self.error(name, "a tensor", ty)
        if ty.ndim < 0 or ty.shape is None or not isinstance(ty.shape, relax.ShapeExpr):
            raise self.error(name, "a tensor with known rank and shape", ty)
        t = TensorArg(name, ty)
        if t.dtype in ("", "void"):
            raise self.error(name, "a tensor with a known dtype", ty)
        if dtypes is not None and t.dtype not in dtypes:
            raise self.error(name, f"dtype in {list(dtypes)}", t.dtype)
        if ndim is not None:
            allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
            if t.ndim not in allowed:
                want = f"rank {allowed[0]}" if len(allowed) == 1 else f"rank in {list(allowed)}"
                raise self.error(name, want, f"rank {t.ndim} (shape {fmt_shape(t.shape)})")
        if min_ndim is not None and t.ndim < min_ndim:
            raise self.error(name, f"rank >= {min_ndim}", f"rank {t.ndim} (shape {fmt_shape(t.shape)})")
        return t

    def axis(self, attr: str, ndim: int) -> int:
        """Normalize an axis attribute against a rank, rejecting out-of-range values."""
        a = self.attrs[attr]
        if not -ndim <= a < ndim:
            raise self.error(attr, f"an axis in [{-ndim}, {ndim})", a)
        return a % ndim

    # -- shape relations ----------------------------------------------------------------------
    def provably_different(self, a, b) -> bool:
        a = tvm.tirx.IntImm("int64", a) if isinstance(a, int) else a
        b = tvm.tirx.IntImm("int64", b) if isinstance(b, int) else b
        return bool(self.analyzer.can_prove(a != b))

    def provably_equal(self, a, b) -> bool:
        a = tvm.tirx.IntImm("int64", a) if isinstance(a, int) else a
        b = tvm.tirx.IntImm("int64", b) if isinstance(b, int) else b
        return bool(self.analyzer.can_prove_equal(a, b))

    def same_dtype(self, ref: TensorArg, *others: TensorArg) -> None:
        for o in others:
            if o.dtype != ref.dtype:
                raise self.error(o.name, f"dtype {ref.dtype} (same as '{ref.name}')", o.dtype)

    def same_shape(self, ref: TensorArg, *others: TensorArg) -> None:
        """Each of ``others`` has ``ref``'s shape (symbolic dims accepted unless provably
        different)."""
        for o in others:
            if o.ndim != ref.ndim or any(
                self.provably_different(a, b) for a, b in zip(ref.shape, o.shape)
            ):
                raise self.error(
                    o.name, f"shape {fmt_shape(ref.shape)} (same as '{ref.name}')", fmt_shape(o.shape)
                )

    def dim_equals(self, t: TensorArg, axis: int, value, what: str) -> None:
        if self.provably_different(t.dim(axis), value):
            raise self.error(
                t.name, f"dim {axis} == {fmt_dim(value)} ({what})", f"{fmt_dim(t.dim(axis))} (shape {fmt_shape(t.shape)})"
            )

    # -- output -------------------------------------------------------------------------------
    @staticmethod
    def out(shape: Sequence, dtype: str) -> relax.TensorType:
        return relax.TensorType(list(shape), dtype)


# --------------------------------------------------------------------------------------------
# Op definitions
# --------------------------------------------------------------------------------------------


@dataclass
class OpDef:
    """Everything about one ``relax.rlx.<name>`` operator."""

    name: str
    inputs: tuple[str, ...]
    attrs: tuple[Attr, ...] = ()
    optional_inputs: tuple[str, ...] = ()
    backward: bool = True
    doc: str = ""
    infer_fn: Callable[[InferContext], relax.Type] | None = None
    reference_fn: Callable[..., Any] | None = None
    decompose_fn: Callable[..., relax.Expr] | None = None
    fused_fn: Callable[..., relax.Expr] | None = None
    siblings: "SiblingFusion | None" = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        sig = ", ".join(list(self.inputs) + [f"{n}=None" for n in self.optional_inputs])
        sig += "".join(f", {a.name}" + ("" if a.required else f"={a.default!r}") for a in self.attrs)
        return f"<rlx op {self.op_name}({sig})>"

    # -- decorators ---------------------------------------------------------------------------
    def infer(self, fn):
        self.infer_fn = fn
        return fn

    def reference(self, fn):
        self.reference_fn = fn
        return fn

    def decomposition(self, fn):
        self.decompose_fn = fn
        return fn

    def fused(self, fn):
        self.fused_fn = fn
        return fn

    # -- identity -----------------------------------------------------------------------------
    @property
    def op_name(self) -> str:
        return OP_PREFIX + self.name

    @property
    def op(self) -> tvm.ir.Op:
        return tvm.ir.Op.get(self.op_name)

    @property
    def all_inputs(self) -> tuple[str, ...]:
        return self.inputs + self.optional_inputs

    # -- attributes ---------------------------------------------------------------------------
    def normalize_attrs(self, given: dict[str, Any]) -> dict[str, Any]:
        """Validate user attributes, fill defaults. Unknown names are an error."""
        known = {a.name: a for a in self.attrs}
        for k in given:
            if k not in known:
                raise op_error(self.name, k, f"an attribute in {sorted(known)}", "unknown attribute")
        out = {}
        for a in self.attrs:
            if a.name in given:
                v = given[a.name]
            elif a.required:
                raise op_error(self.name, a.name, "a value (required attribute)", "nothing")
            else:
                v = a.default
            if a.check is not None and v is not None:
                v = a.check(self.name, a.name, v)
            out[a.name] = v
        return out

    def call_attrs(self, call: relax.Call) -> dict[str, Any]:
        """Decode a call's attributes back into Python values (absent means None)."""
        raw = dict(call.attrs) if call.attrs is not None else {}
        return self.normalize_attrs({k: v for k, v in raw.items()})

    def call_args(self, call: relax.Call) -> list[relax.Expr]:
        args = list(call.args)
        return args + [None] * (len(self.all_inputs) - len(args))

    # -- the Python builder -------------------------------------------------------------------
    def __call__(self, *args, **kwargs) -> relax.Call:
        """Build ``R.rlx.<name>(inputs..., **attrs)`` (inputs may also be passed by name)."""
        names = self.all_inputs
        if len(args) > len(names):
            raise op_error(self.name, "*args", f"at most {len(names)} inputs {list(names)}", f"{len(args)} inputs")
        values = dict(zip(names, args))
        for n in names:
            if n in kwargs:
                if n in values:
                    raise op_error(self.name, n, "one value", "given twice")
                values[n] = kwargs.pop(n)
        for n in self.inputs:
            if values.get(n) is None:
                raise op_error(self.name, n, "a tensor (required input)", "nothing")
        attrs = self.normalize_attrs(kwargs)
        # None-valued attributes are left out: they print nothing and parse back to the default.
        stored = {k: v for k, v in attrs.items() if v is not None}
        call_args = [values[n] for n in self.inputs]
        present_opt = [values.get(n) for n in self.optional_inputs]
        while present_opt and present_opt[-1] is None:
            present_opt.pop()
        if any(v is None for v in present_opt):
            raise op_error(self.name, "inputs", "optional inputs given in order", "a gap")
        call_args += present_opt
        call_args = [_as_expr(a) for a in call_args]
        return relax.Call(self.op, call_args, tvm.ir.make_node("ir.DictAttrs", **stored))

    # -- TVM attribute implementations --------------------------------------------------------
    def _infer_type(self, call: relax.Call, bb) -> relax.Type:
        attrs = self.call_attrs(call)
        args = dict(zip(self.all_inputs, self.call_args(call)))
        return self.infer_fn(InferContext(self, args, attrs))

    def _legalize(self, bb, call: relax.Call) -> relax.Expr:
        return self.fused_fn(bb, *self.call_args(call), **self.call_attrs(call))

    def decompose(self, bb, call: relax.Call) -> relax.Expr:
        return self.decompose_fn(bb, *self.call_args(call), **self.call_attrs(call))


@dataclass(frozen=True)
class SiblingFusion:
    """Backward ops that one kernel computes together when a graph asks for several of them on
    the same operands, sharing their common stages (attention's dq, dk and dv share the scores,
    probabilities and dS). ``key(opdef, call)``: what calls must agree on to be fused (their
    operands and the attributes other than the one that selects the output), None when a call
    cannot be; ``fuse(bb, members)``: given ``[(opdef, call), ...]``, emit the shared kernel and
    return one expression per member, in order (or None to leave them apart). ``absorb(opdef,
    call, other)``, optional: whether the plain Relax call ``other`` computes one more result of
    the group of ``(opdef, call)`` (layer norm's dbeta, ``sum(dy)``, has no op of its own); it
    then joins the group as the member ``(None, other)``. Applied by
    :class:`rlx_tvm.passes.FuseSiblingBackwardOps`."""

    name: str
    key: Callable[["OpDef", relax.Call], Any]
    fuse: Callable[..., list]
    absorb: Callable[["OpDef", relax.Call, relax.Call], bool] | None = None


def fuse_siblings(*opdefs: "OpDef", key: Callable[["OpDef", relax.Call], Any], absorb=None):
    """Decorator: ``fuse(bb, members)`` computes calls of ``opdefs`` that share ``key`` together
    (and the plain Relax calls that ``absorb`` recognizes, see :class:`SiblingFusion`)."""

    def register(fuse):
        group = SiblingFusion("+".join(o.name for o in opdefs), key, fuse, absorb)
        for o in opdefs:
            o.siblings = group
        return fuse

    return register


def _as_expr(a):
    if isinstance(a, relax.Expr):
        return a
    raise TypeError(f"expected a relax.Expr input, got {type(a).__name__}")


def _dispatch(key: str):
    """A module-level dispatcher for TVM attribute ``key``: looks the OpDef up by op name at call
    time, so reloading a family module never re-registers attributes."""

    if key == "FInferType":

        def infer(call, bb):
            return _REGISTRY[call.op.name[len(OP_PREFIX):]]._infer_type(call, bb)

        return infer
    if key == "FLegalize":

        def legalize(bb, call):
            return _REGISTRY[call.op.name[len(OP_PREFIX):]]._legalize(bb, call)

        return legalize
    raise KeyError(key)


_DISPATCHERS = {k: _dispatch(k) for k in ("FInferType", "FLegalize")}


def define_op(
    name: str,
    inputs: Sequence[str],
    attrs: Sequence[Attr] = (),
    *,
    optional_inputs: Sequence[str] = (),
    backward: bool = True,
    doc: str = "",
) -> OpDef:
    """Declare ``relax.rlx.<name>`` (creating the Relax op on first import) and return its OpDef;
    attach the other parts with the OpDef's decorators."""
    opdef = OpDef(name, tuple(inputs), tuple(attrs), tuple(optional_inputs), backward, doc)
    op_name = OP_PREFIX + name
    if op_name not in tvm.ir.Op.list_op_names():
        tvm.ir._ffi_api.RegisterOp(op_name, doc or name)
    for key, fn in _DISPATCHERS.items():
        set_op_attr(op_name, key, fn)
    set_op_attr(op_name, "FPurity", True)
    _REGISTRY[name] = opdef
    return opdef


def get_op(name: str) -> OpDef:
    """The OpDef for ``name`` (``"relu_backward"`` or ``"relax.rlx.relu_backward"``)."""
    if name.startswith(OP_PREFIX):
        name = name[len(OP_PREFIX):]
    return _REGISTRY[name]


def all_ops() -> list[OpDef]:
    return list(_REGISTRY.values())


def is_rlx_call(expr) -> bool:
    return (
        isinstance(expr, relax.Call)
        and isinstance(expr.op, tvm.ir.Op)
        and expr.op.name.startswith(OP_PREFIX)
        and expr.op.name[len(OP_PREFIX):] in _REGISTRY
    )
