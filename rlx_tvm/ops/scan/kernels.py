"""The TIR kernels the scan loops call: read a row of a stacked tensor at a runtime index, write
one in place, zeros, and an elementwise sum; one per (kind, rank, dtype), every dim symbolic.

Built with TVMScript's IR builder, so that one builder serves every rank (a loop nest of ``rank``
loops, none for a scalar carry)."""

from __future__ import annotations

from tvm import relax, tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

# Parameters of each kind: (name, "handle" or "index").
_PARAMS = {
    "take_row": (("src_h", "handle"), ("i", "index"), ("out_h", "handle")),
    "write_row": (("buf_h", "handle"), ("val_h", "handle"), ("i", "index")),
    "zeros": (("out_h", "handle"),),
    "add": (("a_h", "handle"), ("b_h", "handle"), ("out_h", "handle")),
}
# Buffers of each kind: (name, parameter, stacked: with a leading row axis R).
_BUFFERS = {
    "take_row": (("src", "src_h", True), ("out", "out_h", False)),
    "write_row": (("buf", "buf_h", True), ("val", "val_h", False)),
    "zeros": (("out", "out_h", False),),
    "add": (("a", "a_h", False), ("b", "b_h", False), ("out", "out_h", False)),
}


def _store(kind: str, bufs: dict, i, js: list) -> None:
    """The kernel's one statement at element ``js`` (row ``i`` of the stacked buffer)."""
    at = tuple(js)
    if kind == "take_row":
        T.buffer_store(bufs["out"], bufs["src"][(i, *at)], list(at))
    elif kind == "write_row":
        T.buffer_store(bufs["buf"], bufs["val"][at], [i, *at])
    elif kind == "zeros":
        T.buffer_store(bufs["out"], tirx.const(0, bufs["out"].dtype), list(at))
    else:
        T.buffer_store(bufs["out"], bufs["a"][at] + bufs["b"][at], list(at))


def row_kernel(kind: str, rank: int, dtype: str) -> tirx.PrimFunc:
    """The ``kind`` kernel ("take_row", "write_row", "zeros", "add") over rank-``rank`` rows of
    ``dtype``; stacked buffers have ``R`` rows, the index ``i`` is a runtime int64."""
    with IRBuilder() as ib:
        with T.prim_func(is_private=True):
            args = {n: T.arg(n, T.handle() if t == "handle" else T.int64()) for n, t in _PARAMS[kind]}
            T.func_attr({"tirx.noalias": True})
            rows = tirx.Var("R", "int64")
            dims = [tirx.Var(f"d{k}", "int64") for k in range(rank)]
            bufs = {}
            for name, param, stacked in _BUFFERS[kind]:
                bufs[name] = T.match_buffer(args[param], ((rows,) if stacked else ()) + tuple(dims), dtype)
                IRBuilder.name(name, bufs[name])
            if rank:
                with T.grid(*dims) as js:
                    js = [js] if isinstance(js, tirx.Var) else list(js)
                    for k, j in enumerate(js):
                        IRBuilder.name(f"j{k}", j)
                    _store(kind, bufs, args.get("i"), js)
            else:
                _store(kind, bufs, args.get("i"), [])
    return ib.get()


_KERNELS: dict = {}


def _kernel(bb, kind: str, rank: int, dtype: str) -> relax.GlobalVar:
    key = (kind, rank, dtype)
    if key not in _KERNELS:
        _KERNELS[key] = row_kernel(kind, rank, dtype)
    return bb.add_func(_KERNELS[key], f"rlx_scan_{kind}_{dtype}_r{rank}")  # add_func dedups
