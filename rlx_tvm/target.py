"""Targets: the local CPU as a TVM target, a target's tuning-log key, and what the CPU schedules
size their loops by (cores, vector width, vector registers).

The bottom layer of rlx_tvm: it imports only TVM.
"""

from __future__ import annotations

import os

import tvm
from tvm.target.codegen import llvm_get_vector_width, target_has_features

__all__ = ["as_target", "cpu_target", "has_avx512", "target_cores", "target_key", "vector_bits", "vector_lanes",
           "vector_registers"]


def cpu_target(num_cores: int | None = None) -> tvm.target.Target:
    """The local CPU as MetaSchedule wants it: explicit ``mcpu`` (``native`` is rejected) and ``num-cores``."""
    mcpu = str(tvm.target.Target.from_device("cpu").attrs["mcpu"])
    cores = num_cores or os.cpu_count() or 1
    return tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": cores})


def as_target(target) -> tvm.target.Target:
    """``target`` as a :class:`tvm.target.Target`; GPU targets get an LLVM host to launch their kernels."""
    target = target if isinstance(target, tvm.target.Target) else tvm.target.Target(target)
    if "gpu" in target.keys and target.host is None:
        target = target.with_host(tvm.target.Target("llvm"))
    return target


def target_key(target) -> str:
    """The name of a target's tuning-log directory: kind, CPU or GPU arch, and core count, e.g.
    ``llvm-znver4-2c`` or ``cuda-sm_90``. Schedules tuned for one key are not applied to another."""
    target = as_target(target)
    attrs = target.attrs
    parts = [target.kind.name]
    for k in ("mcpu", "arch"):
        if k in attrs and str(attrs[k]):
            parts.append(str(attrs[k]))
    if "num-cores" in attrs and int(attrs["num-cores"]) > 0:
        parts.append(f"{int(attrs['num-cores'])}c")
    return "-".join(parts)


def target_cores(target) -> int:
    """The cores a CPU target names (``num-cores``), else this machine's CPU count (also for no
    target)."""
    cores = target.attrs.get("num-cores") if target is not None else None
    return int(cores or os.cpu_count() or 1)


def _is_x86(target) -> bool:
    return target is not None and target.kind.name == "llvm" and bool(target_has_features("sse2", target))


def vector_bits(target) -> int:
    """Bits in one vector register of an LLVM CPU target. On x86 from its features: 512 with
    AVX-512F, 256 with AVX, else 128. (TVM 0.27's ``llvm_get_vector_width`` answers 512 for every
    x86 CPU, AVX2-only ``znver3`` and ``haswell`` and SSE-only ``x86-64`` included: schedules sized
    by it gave AVX2 vectors of two registers each, and register-blocked tiles of twice the
    registers there are.)"""
    if _is_x86(target):
        return 512 if has_avx512(target) else 256 if target_has_features("avx", target) else 128
    return llvm_get_vector_width(target)


def has_avx512(target) -> bool:
    """An LLVM x86 CPU target with AVX-512F."""
    return _is_x86(target) and bool(target_has_features("avx512f", target))


def vector_lanes(target, bits: int = 32) -> int:
    """Elements of ``bits`` bits in one vector register of an LLVM CPU target (16 float32 with
    AVX-512, 8 with AVX2; the schedules size their vector loops by float32)."""
    return max(1, vector_bits(target) // bits)


def vector_registers(target) -> int:
    """Vector registers of an LLVM CPU target: 16 on x86 without AVX-512 (ymm0-15), else 32
    (AVX-512's zmm0-31, AArch64's v0-31)."""
    return 16 if _is_x86(target) and not has_avx512(target) else 32
