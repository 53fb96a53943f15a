"""Default GPU schedules (CUDA, Metal, Vulkan, WebGPU) for kernels that have no tuning record.

Every schedule is made of TensorIR schedule primitives on the same compute that the CPU tests
check, so it computes the same values by construction; what can go wrong is only that a rule
produces something the target cannot run (an unbound loop, too many threads, too much shared
memory). So each kernel is given the first candidate that lowers for the target and passes TVM's
``verify_gpu_code`` with the target's limits:

1. dlight's GPU rules in their usual order (``Matmul``, ``GEMV``, ``Reduction`` -- shared-memory /
   warp reductions for norms, softmax-CE and column sums --, ``GeneralReduction``, ``Fallback``);
   a rule that raises on a kernel it does not understand is treated as "does not apply";
2. :class:`ThreadPerOutput`: one thread per output element, reductions serial inside the thread.
   Race-free: the pooling backward is written as a gather, and the gather (embedding) backward's
   GPU form is a reduction block per block of output rows (``scatter_add_kernel`` in
   ops/indexing.py), so no two threads write the same element.

Kernels that TVM's own legalization already wrote with thread bindings (``topi.gpu``'s
scatter_elements, which the decomposed gather backward uses) are kept as they are when they lower.
"""

from __future__ import annotations

import importlib

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule
from tvm.target import Target

from .common import inlined_blocks

__all__ = ["ThreadPerOutput", "gpu_limits", "schedule_gpu"]


class ThreadPerOutput(GPUScheduleRule):
    """Inline injective stages; for each remaining block, fuse its leading spatial loops and bind
    them to ``blockIdx.x`` x ``threadIdx.x``; reduction loops run serially in each thread."""

    def __init__(self, threads: int = 256):
        self.threads = threads

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        found = inlined_blocks(self, func, target)
        if found is None:
            return None
        sch, blocks = found
        threads = min(self.threads, int(target.attrs.get("max_num_threads", self.threads)))
        for info in blocks:
            block = info.block_rv
            loops = sch.get_loops(block)
            kinds = info.dom_kind()
            if len(kinds) != len(loops):
                return None
            spatial = [lp for lp, k in zip(loops, kinds) if k == "S"]
            rest = [lp for lp, k in zip(loops, kinds) if k != "S"]
            if not spatial:  # a full reduction (e.g. max|x|): one thread does it
                spatial = [sch.add_unit_loop(loops[0])]
            elif rest and kinds.index("R") < len(spatial):
                # spatial loops first (e.g. a scatter-add over indices, outer loop a reduction): each
                # thread then owns distinct output elements and runs the reduction serially
                sch.reorder(*spatial, *rest)
            fused = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
            bx, tx = sch.split(fused, factors=[None, threads])
            sch.bind(bx, "blockIdx.x")
            sch.bind(tx, "threadIdx.x")
        return sch


def _dlight_rules() -> list:
    return [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]


def gpu_limits(target: Target) -> dict[str, int]:
    """The limits ``verify_gpu_code`` checks, from the target (Vulkan/WebGPU: 256 threads, 16 KiB)."""
    attrs = target.attrs
    return {
        "max_threads_per_block": int(attrs.get("max_num_threads", 256)),
        "max_shared_memory_per_block": int(attrs.get("max_shared_memory_per_block", 16384)),
    }


def _lowers_for(func: tirx.PrimFunc, target: Target) -> bool:
    """Does ``func`` lower to device code that fits ``target``'s limits?"""
    split_host_device = importlib.import_module("tvm.tirx.build").split_host_device_mods
    try:
        mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
        mod = tirx.transform.BindTarget(target.with_host(Target("llvm")))(mod)
        pipeline = tirx.get_default_tir_pipeline(target)
        mod = (pipeline[0] if isinstance(pipeline, tuple) else pipeline)(mod)  # 0.27: (passes, host, device)
        _, device_mods = split_host_device(mod)
        limits = gpu_limits(target)
        for dmod in device_mods.values():
            for f in dmod.functions.values():
                if isinstance(f, tirx.PrimFunc) and not s_tir.analysis.verify_gpu_code(f, limits):
                    return False
        return True
    except Exception:  # noqa: BLE001 - a rule's output that cannot be lowered is just not a candidate
        return False


def _binds_threads(func: tirx.PrimFunc) -> bool:
    """Whether ``func`` launches its own threads (``thread_extent`` attributes in its body)."""
    found = []

    def visit(attr):
        if attr.attr_key == "thread_extent":
            found.append(attr)

    tvm_ffi.structural_walk(func.body, (tirx.AttrStmt, visit))
    return bool(found)


def schedule_gpu(mod: tvm.IRModule, target: Target) -> tuple[tvm.IRModule, dict[str, str]]:
    """Schedule every unscheduled PrimFunc of ``mod`` for the GPU ``target``; returns the module
    and, per kernel, the rule that scheduled it."""
    mod = tvm.IRModule(dict(mod.functions), attrs=mod.attrs)  # the caller's module stays as it was
    chosen: dict[str, str] = {}
    updates = {}
    for gv, func in mod.functions.items():
        if not isinstance(func, tirx.PrimFunc) or (func.attrs is not None and "tirx.is_scheduled" in func.attrs):
            continue
        if _binds_threads(func) and _lowers_for(func, target):
            # TVM's own GPU kernels written with thread bindings (relax.scatter_elements legalizes
            # to topi.gpu.scatter_elements on GPU targets: the decomposed gather backward)
            updates[gv] = func.with_attr("tirx.is_scheduled", True)
            chosen[gv.name_hint] = "bound by TVM's legalization"
            continue
        for rule in [*_dlight_rules(), ThreadPerOutput()]:
            try:
                with target:
                    sch = rule.apply(func, target, False)
            except Exception:  # noqa: BLE001 - dlight rules raise on kernels they do not understand
                sch = None
            if sch is None:
                continue
            candidate = sch.mod["main"].with_attr("tirx.is_scheduled", True)
            if _lowers_for(candidate, target):
                updates[gv] = candidate
                chosen[gv.name_hint] = type(rule).__name__
                break
        else:
            raise NotImplementedError(
                f"rlx_tvm: no GPU schedule for kernel {gv.name_hint} on {target.kind.name}: neither dlight's rules "
                "nor ThreadPerOutput give code that lowers for this target (e.g. a scatter whose data-dependent "
                "writes are neither a complete nor a reduction block: thread binding refuses it)")
    for gv, func in updates.items():
        mod.update_func(gv, func)
    return mod, chosen
