"""How scan calls are laid out (body, [vjp, ...], init, ..., xs..., params...) and typed: the
parts of a call, Python bodies, and symbolic-shape templates for the generated functions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import tvm_ffi
from tvm import relax, tirx

from ..registry import InferContext, fmt_shape, op_error

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


class _ScanContext(InferContext):
    def __init__(self, opdef, parts: _Parts, attrs):
        args = {"body": parts.body, "vjp": parts.vjp, "init": parts.init, "trajectory": parts.trajectory, "upstream": parts.upstream}
        args.update(zip(parts.xs_names(), parts.xs))
        args.update(zip(parts.param_names(), parts.params))
        super().__init__(opdef, args, attrs)
        self.parts = parts
