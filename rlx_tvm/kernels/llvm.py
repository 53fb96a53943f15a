"""LLVM intrinsics that hand-written CPU kernels call where TIR has no working equivalent
(TVM 0.27: ``tirx.prefetch`` fails in LLVM code generation, and no schedule primitive clears a
buffer with a string store). Only for targets whose code generator is LLVM (not ``c``)."""

from __future__ import annotations

import tvm
from tvm import tirx


def has_llvm_intrinsics(target: tvm.target.Target | None) -> bool:
    """Whether kernels built for ``target`` may call LLVM intrinsics (no target: the host, LLVM)."""
    return target is None or target.kind.name == "llvm"


def prefetch(address: tirx.PrimExpr, write: bool = False) -> tirx.PrimExpr:
    """Prefetch the cache line at ``address`` into all cache levels, for writing when ``write``."""
    return tirx.call_llvm_intrin("void", "llvm.prefetch.p0", address, tirx.IntImm("int32", int(write)),
                                 tirx.IntImm("int32", 3), tirx.IntImm("int32", 1))


def zero_bytes(address: tirx.PrimExpr, nbytes: tirx.PrimExpr) -> tirx.PrimExpr:
    """Clear ``nbytes`` from ``address`` (``llvm.memset``, a libc memset call for large sizes):
    whole cache lines written without reading them first, where a vector store loop reads every
    line it writes (a write-allocate). For a buffer that is then accumulated into (gather
    backward's rows); where every element is stored once anyway the clear costs more than the
    write-allocate it saves."""
    return tirx.call_llvm_intrin("void", "llvm.memset.p0.i64", address, tirx.IntImm("int8", 0),
                                 tirx.Cast("int64", nbytes), tirx.IntImm("bool", 0))
