"""Default GPU schedules (CUDA, Metal, Vulkan, WebGPU) for kernels that have no tuning record.

Every schedule is made of TensorIR schedule primitives on the same compute that the CPU tests
check, so it computes the same values by construction; what can go wrong is only that a rule
produces something the target cannot run (an unbound loop, too many threads, too much shared
memory). So each kernel is given the first candidate that lowers for the target and passes TVM's
``verify_gpu_code`` with the target's limits:

1. dlight's GPU rules (``Matmul``, ``GEMV``, ``Reduction`` -- shared-memory / warp reductions
   for norms, softmax-CE and single-stage column sums --, ``GeneralReduction``); a rule that
   raises on a kernel it does not understand is treated as "does not apply";
2. :class:`StagedReduction`, for multi-stage kernels with few, long sums (gamma gradients,
   conv2d dw) or matrix products (attention) that dlight's rules do not take: cooperative column
   sums over ``threadIdx.y`` and row sums over ``threadIdx.x``, reduced in shared memory, and
   products tiled in shared memory;
3. dlight's ``Fallback``, then :class:`ThreadPerOutput`: one thread per output element,
   reductions serial inside the thread. Race-free: the pooling backward is written as a gather, and the gather (embedding) backward's
   GPU form is a reduction block per block of output rows (``scatter_add_kernel`` in
   ops/indexing.py), so no two threads write the same element.

Kernels that TVM's own legalization already wrote with thread bindings (``topi.gpu``'s
scatter_elements, which the decomposed gather backward uses) are kept as they are when they lower.
"""

from __future__ import annotations

import importlib
from functools import partial
from math import prod

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule
from tvm.target import Target

from ..ops.registry import static_int
from .common import fuse_loops, inlined_blocks, is_column_reduction

__all__ = ["StagedReduction", "ThreadPerOutput", "gpu_limits", "schedule_gpu"]


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
            _bind_thread_per_output(sch, spatial, threads)
        return sch


def _bind_thread_per_output(sch: s_tir.Schedule, outputs: list, threads: int) -> None:
    """The output loops fused and split over ``blockIdx.x`` x ``threadIdx.x`` (``threads`` each)."""
    bx, tx = sch.split(fuse_loops(sch, outputs), factors=[None, threads])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")


class StagedReduction(GPUScheduleRule):
    """Multi-stage kernels that dlight's rules do not take (several stages, or the reduced axis
    outside the contiguous one) and that have few, long sums (a norm's gamma gradient: a sum over
    rows per column; conv2d's weight gradient) or matrix products (attention's scores, dp, dq, dk,
    dv). Every stage gets a cooperative schedule of its own:

    * matrix products with many outputs: shared-memory tiles (see ``_tiled_product``);
    * column sums ``out[.., j] = sum_r f(r, j)``: a warp takes 32 adjacent columns (reads along the
      contiguous axis coalesce) and ``ty`` warps split the rows; each thread sums its rows, then
      the ``ty`` partial sums are added across ``threadIdx.y`` in shared memory (TVM lowers a
      reduction loop bound to a thread axis to that);
    * row reductions (the statistics): a thread block per row, ``threadIdx.x`` across the row;
    * other sums: a thread per output;
    * elementwise stages: a thread per element.

    Applies only where some stage is a product or a sum with too few outputs to give every thread
    one (see ``_few_long_sums``); the rest go to dlight's fallback (a thread per output element,
    its sum serial in the thread: for a dgamma, 768 threads each walking 8192 rows)."""

    def __init__(self, warp: int = 32, row_splits: int = 16, row_threads: int = 256, max_outputs: int = 1 << 16,
                 min_reduction: int = 64, tile: int = 16):
        self.warp, self.row_splits, self.row_threads = warp, row_splits, row_threads
        self.max_outputs, self.min_reduction, self.tile = max_outputs, min_reduction, tile

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        found = inlined_blocks(self, func, target)
        if found is None:
            return None
        sch, blocks = found
        threads = int(target.attrs.get("max_num_threads", 256))
        plans, cooperative = [], False
        for info in blocks:
            kinds = info.dom_kind()
            n_spatial = len(kinds) - len(kinds.lstrip("S"))
            if len(kinds) != len(sch.get_loops(info.block_rv)) or n_spatial == 0 \
                    or kinds[n_spatial:] != "R" * (len(kinds) - n_spatial):
                return None
            if n_spatial == len(kinds):  # elementwise
                plans.append((self._thread_per_output, info.block_rv, n_spatial))
                continue
            product = _product_roles(sch, info, n_spatial)
            if product is not None and self._many_outputs(info, n_spatial):
                plans.append((partial(self._tiled_product, roles=product), info.block_rv, n_spatial))
                cooperative = True
            elif not self._few_long_sums(info, n_spatial):
                plans.append((self._thread_per_output, info.block_rv, n_spatial))
            elif is_column_reduction(sch, info.block_rv, n_spatial):
                plans.append((self._column_sum, info.block_rv, n_spatial))
                cooperative = True
            else:
                plans.append((self._row_reduction, info.block_rv, n_spatial))
                cooperative = True
        if not cooperative:
            return None
        for plan, block, n_spatial in plans:
            sch = plan(sch, block, n_spatial, threads) or sch
        return sch

    def _many_outputs(self, info, n_spatial: int) -> bool:
        extents = [it.dom for it in info.iters[:n_spatial]]
        return not all(isinstance(e, int) for e in extents) or prod(extents) >= self.max_outputs

    def _tiled_product(self, sch, block, n_spatial, threads, roles):
        """A (batched) matrix product stage (attention's scores, dv, dp, dq, dk): a thread block
        per ``tile x tile`` outputs, a thread per output summing in a register, and the two
        operands' ``tile x tile`` slices for each step of the sum staged in shared memory,
        fetched by all the block's threads together (each loaded element is used ``tile``
        times). Where a primitive refuses (e.g. a window read that does not tile), the stage
        keeps a thread per output."""
        batch, rows, cols, reduced, operands = roles
        tile = self.tile
        while tile > 1 and tile * tile > threads:  # 8 x 8 under Vulkan's 64 threads
            tile //= 2
        trial = sch.copy()
        try:
            loops = {str(it.var): it.loop_rv for it in _iters(trial, block)}
            order = [*(loops[v] for v in batch), *(loops[v] for v in rows), *(loops[v] for v in cols),
                     *(loops[v] for v in reduced)]
            trial.reorder(*order)
            b = fuse_loops(trial, [loops[v] for v in batch]) if batch else trial.add_unit_loop(loops[rows[0]])
            r, c = fuse_loops(trial, [loops[v] for v in rows]), fuse_loops(trial, [loops[v] for v in cols])
            k = fuse_loops(trial, [loops[v] for v in reduced])
            ro, ri = trial.split(r, factors=[None, tile])
            co, ci = trial.split(c, factors=[None, tile])
            ko, _ = trial.split(k, factors=[None, tile])
            trial.reorder(b, ro, co, ri, ci)
            trial.bind(trial.fuse(b, ro, co), "blockIdx.x")
            trial.bind(ri, "threadIdx.y")
            trial.bind(ci, "threadIdx.x")
            # the sum in a register, stored once after it
            trial.reverse_compute_at(trial.cache_write(block, 0, "local"), ci)
            depth = 1 + next(i for i, lp in enumerate(trial.get_loops(block)) if trial.get(lp).same_as(trial.get(ko)))
            for index in operands:
                staged = trial.cache_read(block, index, "shared", consumer_blocks=[block])  # not the buffer's other readers
                trial.compute_at(staged, ko)
                fetch = trial.get_loops(staged)[depth:]
                _, ty, tx = trial.split(fuse_loops(trial, fetch), factors=[None, tile, tile])
                trial.bind(ty, "threadIdx.y")
                trial.bind(tx, "threadIdx.x")
        except s_tir.ScheduleError:
            self._thread_per_output(sch, block, n_spatial, threads)
            return sch
        return trial

    def _few_long_sums(self, info, n_spatial: int) -> bool:
        """Too few outputs to fill a GPU with a thread each, and long enough sums to share: a
        norm's dgamma (768 columns over 8192 rows; group norm: 64 channels over 8 x 3136),
        conv2d dw (36864 over 25088). Not attention's dk/dv (a million outputs) or conv2d dx (sums
        of 576): a thread per output fills the GPU there, and splitting the sums would only add
        the shared-memory step. A symbolic sum length counts as long, a symbolic output count as
        many."""
        if self._many_outputs(info, n_spatial):
            return False
        reduced = [it.dom for it in info.iters[n_spatial:]]
        return not all(isinstance(e, int) for e in reduced) or prod(reduced) >= self.min_reduction

    @staticmethod
    def _thread_per_output(sch, block, n_spatial, threads):
        """The output loops over blocks of ``threads`` threads; a sum, if any, serial in each."""
        _bind_thread_per_output(sch, sch.get_loops(block)[:n_spatial], threads)

    def _row_reduction(self, sch, block, n_spatial, threads):
        loops = sch.get_loops(block)
        row, reduced = fuse_loops(sch, loops[:n_spatial]), fuse_loops(sch, loops[n_spatial:])
        length = static_int(sch.get(reduced).extent)
        lanes = min(threads, self.row_threads, -(-length // self.warp) * self.warp if length else self.row_threads)
        _, lane = sch.split(reduced, factors=[None, lanes])
        sch.bind(row, "blockIdx.x")
        sch.bind(lane, "threadIdx.x")

    def _column_sum(self, sch, block, n_spatial, threads):
        loops = sch.get_loops(block)
        columns, reduced = fuse_loops(sch, loops[:n_spatial]), fuse_loops(sch, loops[n_spatial:])
        bx, tx = sch.split(columns, factors=[None, self.warp])
        steps, ty = sch.split(reduced, factors=[None, max(1, min(self.row_splits, threads // self.warp))])
        sch.reorder(bx, tx, ty, steps)
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        sch.bind(ty, "threadIdx.y")


def _iters(sch: s_tir.Schedule, block) -> list:
    """dlight's iter infos (block var, kind, extent, loop) of ``block`` in ``sch``."""
    from tvm.s_tir.dlight.analysis import get_sblock_info

    return get_sblock_info(sch, block).iters


def _product_roles(sch: s_tir.Schedule, info, n_spatial: int):
    """For a reduction block that multiplies two operands into a (batched) matrix product: the
    names of its batch, row, column and reduced block vars and the read indices of the two
    operands (the row operand uses the rows but not the columns, the column operand the
    reverse, both the reduced vars; other reads, e.g. a per-row scale, ride along); None
    otherwise."""
    stmt = sch.get(info.block_rv)
    spatial = [str(it.var) for it in info.iters[:n_spatial]]
    reduced = [str(it.var) for it in info.iters[n_spatial:]]
    if not reduced:
        return None

    def used(region):
        return {str(v) for rg in region.region for v in tirx.analysis.undefined_vars(rg.min)}

    # reads of at least two dims that run along the sum: index -> the output vars they use
    operands = [(i, used(r) & set(spatial)) for i, r in enumerate(stmt.reads)
                if len(r.region) >= 2 and used(r) & set(reduced)]
    for a_index, a_vars in operands:
        for b_index, b_vars in operands:
            rows, cols = a_vars - b_vars, b_vars - a_vars
            if a_index != b_index and rows and cols and a_vars | b_vars == set(spatial):
                return ([v for v in spatial if v in a_vars & b_vars], [v for v in spatial if v in rows],
                        [v for v in spatial if v in cols], reduced, [a_index, b_index])
    return None


def _rules() -> list:
    """The candidates, in order: dlight's specific rules, ours for staged kernels with few, long
    sums or matrix products, then the fallbacks (dlight's, and ThreadPerOutput where even that
    does not lower)."""
    return [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), StagedReduction(),
            dl.gpu.Fallback(), ThreadPerOutput()]


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
                if isinstance(f, tirx.PrimFunc) and not _fits(f, limits):
                    return False
        return True
    except Exception:  # noqa: BLE001 - a rule's output that cannot be lowered is just not a candidate
        return False


def _fits(device_func: tirx.PrimFunc, limits: dict[str, int]) -> bool:
    """TVM's ``verify_gpu_code``, which fails an internal check on a launch extent that is not a
    constant: a grid that grows with a symbolic batch (until 2026-12-06 every kernel with a
    dynamic batch was refused for every GPU target). For those, what it checks that matters here:
    constant thread extents, threads per block and shared memory within the limits."""
    try:
        return bool(s_tir.analysis.verify_gpu_code(device_func, limits))
    except tvm.error.InternalError:
        pass
    threads = {tag: extent for tag, extent in _launch_extents(device_func) if tag.startswith("threadIdx")}
    shared = [0]

    def alloc(node):
        if node.buffer.scope().startswith("shared"):  # "shared" and "shared.dyn"
            dims = [static_int(d) for d in node.buffer.shape]
            shared[0] += (1 << 40) if None in dims else prod(dims) * tvm.DataType(node.buffer.dtype).bits // 8

    tvm_ffi.structural_walk(device_func.body, (tirx.AllocBuffer, alloc))
    if None in threads.values():
        return False
    return prod(threads.values()) <= limits["max_threads_per_block"] and shared[0] <= limits["max_shared_memory_per_block"]


def _launch_extents(func: tirx.PrimFunc) -> list[tuple[str, int | None]]:
    """(thread tag, static extent or None) of every ``thread_extent`` attribute in ``func``."""
    found = []

    def visit(attr):
        if attr.attr_key == "thread_extent":
            found.append((str(attr.node.thread_tag), static_int(attr.value)))

    tvm_ffi.structural_walk(func.body, (tirx.AttrStmt, visit))
    return found


def _binds_threads(func: tirx.PrimFunc) -> bool:
    """Whether ``func`` launches its own threads (``thread_extent`` attributes in its body)."""
    return bool(_launch_extents(func))


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
        for rule in _rules():
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
                f"rlx_tvm: no GPU schedule for kernel {gv.name_hint} on {target.kind.name}: none of the rules (dlight's, "
                "StagedReduction, ThreadPerOutput) gives code that lowers for this target (e.g. a scatter whose "
                "data-dependent writes are neither a complete nor a reduction block: thread binding refuses it)")
    for gv, func in updates.items():
        mod.update_func(gv, func)
    return mod, chosen
