"""GPU targets without a GPU: the suite's kernels (fused and decomposed) get GPU schedules, build to
CUDA (compiled by nvcc) and Metal source, and pass TVM's GPU verification with Vulkan limits."""

import importlib
import re
import shutil

import pytest
import tvm
from tvm import tirx

import rlx_tvm
from rlx_tvm.build import lower
from rlx_tvm.passes import DecomposeBackwardOps
from rlx_tvm.schedules.gpu import gpu_limits, schedule_gpu
from rlx_tvm.bench.suite import SUITE, suite_ir_module, suite_kernel, suite_module

GPU_SUITE = list(SUITE)
CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host="llvm")
METAL = tvm.target.Target("apple/m2-gpu", host={"kind": "llvm", "mtriple": "arm64-apple-macos"})
VULKAN = tvm.target.Target({"kind": "vulkan"}, host="llvm")
# kernels with row reductions: their GPU schedules must reduce cooperatively (shared memory / shuffles)
ROW_REDUCTIONS = ("rlx_layer_norm_backward_input", "rlx_rms_norm_backward_input", "rlx_softmax_cross_entropy_backward")


def _device_source(ex, kind: str) -> str:
    def walk(m):
        if m.kind == kind:
            return m.inspect_source()
        for i in m.imports:
            found = walk(i)
            if found:
                return found
        return None

    return walk(ex.mod)


def _kernels(src: str, marker: str) -> dict[str, str]:
    """Device source split into kernels: name -> body."""
    parts = re.split(marker, src)[1:]
    return {re.match(r"\s*(?:void\s+)?(?:__launch_bounds__\(\d+\)\s*)?(?:void\s+)?(\w+)", p).group(1): p for p in parts}


@pytest.fixture(scope="module")
def suite_mod():
    return suite_ir_module(GPU_SUITE, "small")


def _prim_funcs(mod):
    return {gv.name_hint: f for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc)}


def test_cuda_builds_every_suite_kernel(suite_mod, tmp_path):
    lowered = lower(suite_mod, CUDA, tuning_log=None)
    funcs = _prim_funcs(lowered)
    assert all("tirx.is_scheduled" in f.attrs for f in funcs.values())
    src = _device_source(tvm.compile(lowered, target=CUDA), "cuda")
    kernels = _kernels(src, r'extern "C" __global__')
    for name in funcs:  # every kernel has device code, bound to threads
        mine = [body for k, body in kernels.items() if k.startswith(name + "_kernel")]
        assert mine and all("threadIdx.x" in b or "blockIdx.x" in b for b in mine), name
    for name in ROW_REDUCTIONS:
        body = "".join(b for k, b in kernels.items() if k.startswith(name + "_kernel"))
        assert "__shared__" in body or "__shfl" in body, name
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed: CUDA source generated but not compiled")
    with CUDA:  # nvcc takes the arch from the current target
        cubin = tvm.support.nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")
    assert len(cubin) > 1000


def test_few_long_sums_reduce_cooperatively_on_cuda():
    """At the suite's shapes, kernels whose sums are few and long (dgamma: 768 columns over 8192
    rows; group norm's 64 channels; conv2d dw) split each sum over a thread block and add the
    partial sums in shared memory, instead of one thread walking a whole sum; the norms'
    per-row statistics in the same kernels take a thread block per row. Built with nvcc."""
    kernels = ["layer_norm_backward", "rms_norm_backward", "group_norm_backward", "conv2d_backward_weight"]
    mod = lower(suite_ir_module([suite_kernel(k) for k in kernels], "full"), CUDA, schedule=False, tuning_log=None)
    _, chosen = schedule_gpu(mod, CUDA)
    cooperative = ["rlx_layer_norm_backward_gamma", "rlx_rms_norm_backward_gamma", "rlx_group_norm_backward_gamma",
                   "rlx_conv2d_backward_weight"]
    assert all(chosen[name] == "StagedReduction" for name in cooperative), chosen
    src = _device_source(rlx_tvm.compile(mod, CUDA, tuning_log=None), "cuda")
    bodies = _kernels(src, r'extern "C" __global__')
    for name in cooperative:
        mine = "".join(b for k, b in bodies.items() if k.startswith(name + "_kernel"))
        if name == "rlx_group_norm_backward_gamma":  # [N, C, H, W]: each channel's sum runs along rows of H x W
            assert "__shfl" in mine or "__shared__" in mine, name
        else:  # sums down columns: warps side by side along the columns, partial sums across threadIdx.y
            assert "__shared__" in mine and "threadIdx.y" in mine, name
    if shutil.which("nvcc") is not None:
        with CUDA:
            assert len(tvm.support.nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")) > 1000


def test_attention_products_are_tiled_in_shared_memory_on_cuda():
    """At the suite's shapes, the matrix products inside the fused attention backward kernels
    (scores, dp, dq, dk, dv) run as shared-memory tiled products: a thread block per 16 x 16
    outputs, operand tiles fetched by the block together, the sum in a register; the softmax
    statistics by a thread block per row. Built with nvcc."""
    mod = lower(suite_ir_module([suite_kernel("attention_backward")], "full"), CUDA, schedule=False, tuning_log=None)
    scheduled, chosen = schedule_gpu(mod, CUDA)
    names = [n for n in chosen if n.startswith("rlx_attention_backward")]
    assert names and all(chosen[n] == "StagedReduction" for n in names), chosen
    # both operands of each product staged: dq's kernel has scores, dp and dq, dk's scores, dp and
    # dk, dv's scores and dv
    products = {"rlx_attention_backward_q": 3, "rlx_attention_backward_k": 3, "rlx_attention_backward_v": 2}
    for name in names:
        script = scheduled[name].script()
        assert script.count('scope="shared")') == 2 * products[name], (name, script.count('scope="shared")'))
        assert script.count('scope="local")') >= products[name], name
    src = _device_source(tvm.compile(scheduled, target=CUDA), "cuda")
    bodies = _kernels(src, r'extern "C" __global__')
    tiled = [k for k, b in bodies.items() if k.startswith("rlx_attention_backward") and "_shared_ptr[" in b
             and "__syncthreads" in b]
    assert len(tiled) >= 5, sorted(bodies)  # scores in each of the three kernels, and dv, dp, dq, dk
    if shutil.which("nvcc") is not None:
        with CUDA:
            assert len(tvm.support.nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")) > 1000


def test_staged_reductions_build_for_metal_at_suite_shapes():
    """The cooperative sums and tiled products build to Metal Shading Language too, with their
    shared memory as threadgroup memory."""
    names = ["attention_backward", "layer_norm_backward", "conv2d_backward_weight"]
    mod = lower(suite_ir_module([suite_kernel(n) for n in names], "full"), METAL, schedule=False, tuning_log=None)
    scheduled, chosen = schedule_gpu(mod, METAL)
    staged = [n for n, rule in chosen.items() if rule == "StagedReduction"]
    assert {"rlx_attention_backward_q", "rlx_layer_norm_backward_gamma", "rlx_conv2d_backward_weight"} <= set(staged)
    kernels = _kernels(_device_source(tvm.compile(scheduled, target=METAL), "metal"), r"kernel void")
    for name in staged:
        assert any("threadgroup float" in b for k, b in kernels.items() if k.startswith(name + "_kernel")), name


def test_decomposed_suite_schedules_and_builds_for_cuda(suite_mod):
    lowered = lower(DecomposeBackwardOps()(suite_mod), CUDA, tuning_log=None)
    funcs = _prim_funcs(lowered)
    assert len(funcs) > 3 * len(GPU_SUITE) and all("tirx.is_scheduled" in f.attrs for f in funcs.values())
    src = _device_source(tvm.compile(lowered, target=CUDA), "cuda")
    assert src.count("__global__") >= len(funcs)


def test_metal_builds_every_suite_kernel(suite_mod):
    lowered = lower(suite_mod, METAL, tuning_log=None)
    funcs = _prim_funcs(lowered)
    src = _device_source(tvm.compile(lowered, target=METAL), "metal")
    kernels = _kernels(src, r"kernel void")
    for name in funcs:
        assert any(k.startswith(name + "_kernel") for k in kernels), name
    for name in ROW_REDUCTIONS:
        body = "".join(b for k, b in kernels.items() if k.startswith(name + "_kernel"))
        assert "threadgroup" in body or "simd_shuffle" in body, name


def _device_funcs(func, target):
    split = importlib.import_module("tvm.tirx.build").split_host_device_mods
    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    mod = tirx.transform.BindTarget(target)(mod)
    pipeline = tirx.get_default_tir_pipeline(target)
    mod = (pipeline[0] if isinstance(pipeline, tuple) else pipeline)(mod)
    return [f for d in split(mod)[1].values() for f in d.functions.values() if isinstance(f, tirx.PrimFunc)]


@pytest.mark.parametrize("threads", [256, 64])
def test_vulkan_schedules_pass_gpu_verification_with_its_limits(suite_mod, threads):
    target = tvm.target.Target({"kind": "vulkan", "max_num_threads": threads, "max_threads_per_block": threads,
                                "max_shared_memory_per_block": 16384}, host="llvm")
    lowered = lower(suite_mod, target, tuning_log=None)
    limits = gpu_limits(target)
    assert limits["max_threads_per_block"] == threads
    checked = 0
    for name, func in _prim_funcs(lowered).items():
        for dev in _device_funcs(func, target):
            assert tvm.s_tir.analysis.verify_gpu_code(dev, limits), name
            checked += 1
    assert checked >= len(GPU_SUITE)


def _symbolic_batch_module():
    """relu, layer norm (dx and dgamma), softmax-CE and attention backward with a symbolic batch."""
    from tvm import relax

    from rlx_tvm import ops

    n = tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    x, dy = (relax.Var(v, relax.TensorType([n, 768], "float32")) for v in ("x", "dy"))
    g = relax.Var("g", relax.TensorType([768], "float32"))
    labels = relax.Var("labels", relax.TensorType([n], "int64"))
    q = relax.Var("q", relax.TensorType([n, 128, 4, 32], "float32"))
    with bb.function("main", [x, g, dy, labels, q]):
        with bb.dataflow():
            outs = [bb.emit(e) for e in (
                ops.relu_backward(x, dy), ops.layer_norm_backward_input(x, g, dy, axis=-1, eps=1e-5),
                ops.layer_norm_backward_gamma(x, dy, axis=-1, eps=1e-5),
                ops.softmax_cross_entropy_backward(x, labels, relax.op.sum(dy, axis=[1])),
                ops.attention_backward(q, q, q, q, wrt="v", causal_mask="TopLeft"))]
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    return bb.get()


def test_symbolic_batch_kernels_build_for_gpus():
    """A dynamic batch makes the grid size symbolic, which TVM's GPU verifier cannot check (an
    internal error): until 2026-12-06 every such kernel was refused for every GPU target. Now CUDA
    (nvcc) and Vulkan (verified with its limits) build them, with the same rules as static ones."""
    mod = _symbolic_batch_module()
    lowered = lower(mod, CUDA, schedule=False, tuning_log=None)
    _, chosen = schedule_gpu(lowered, CUDA)
    assert chosen["rlx_layer_norm_backward_gamma"] == "StagedReduction", chosen
    src = _device_source(rlx_tvm.compile(mod, CUDA, tuning_log=None), "cuda")
    if shutil.which("nvcc") is not None:
        with CUDA:
            assert len(tvm.support.nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")) > 1000
    vulkan, _ = schedule_gpu(lower(mod, VULKAN, schedule=False, tuning_log=None), VULKAN)  # within its limits
    assert all("tirx.is_scheduled" in f.attrs for f in _prim_funcs(vulkan).values())


def test_limits_are_checked_for_symbolic_grids():
    """What the verifier would check, checked without it: threads per block and shared memory."""
    from rlx_tvm.schedules.gpu import _fits

    scheduled, _ = schedule_gpu(lower(_symbolic_batch_module(), CUDA, schedule=False, tuning_log=None), CUDA)
    devices = _device_funcs(scheduled["rlx_layer_norm_backward_gamma"], CUDA)
    limits = gpu_limits(CUDA)
    with pytest.raises(tvm.error.InternalError):  # what TVM's verifier does with a symbolic grid
        tvm.s_tir.analysis.verify_gpu_code(devices[0], limits)
    assert all(_fits(f, limits) for f in devices)
    assert not all(_fits(f, {**limits, "max_threads_per_block": 16}) for f in devices)  # blocks of 256 or 512
    assert not all(_fits(f, {**limits, "max_shared_memory_per_block": 0}) for f in devices)  # the column sum's


def test_vulkan_spirv_emission():
    if tvm.get_global_func("target.build.vulkan", allow_missing=True) is None:
        pytest.skip("this TVM build has no Vulkan (SPIR-V) codegen (USE_VULKAN OFF): schedules are verified, "
                    "SPIR-V is not emitted")
    ex = rlx_tvm.compile(suite_module(suite_kernel("relu_backward"), "small"), VULKAN, tuning_log=None)
    assert _device_source(ex, "vulkan") is not None


def test_gather_backward_gpu_kernels_bind_threads():
    """The fused gather backward's GPU form is a reduction block per block of output rows, which a
    rule binds to threads; the decomposed one's scatter_elements is TVM's own GPU kernel (written
    with thread bindings), kept as it is."""
    fused = lower(suite_module(suite_kernel("gather_backward"), "small"), CUDA, schedule=False, tuning_log=None)
    scheduled, chosen = schedule_gpu(fused, CUDA)
    assert chosen["rlx_gather_backward"] in ("Fallback", "ThreadPerOutput"), chosen
    script = scheduled["rlx_gather_backward"].script()
    assert 'T.thread_binding' in script and '"threadIdx.x"' in script
    decomposed = lower(DecomposeBackwardOps()(suite_module(suite_kernel("gather_backward"), "small")), CUDA,
                       schedule=False, tuning_log=None)
    _, chosen = schedule_gpu(decomposed, CUDA)
    assert chosen["scatter_elements"] == "bound by TVM's legalization", chosen


def test_kernel_without_a_gpu_schedule_says_so():
    """A scatter-add whose index loop is a reduction iterator but whose rows are zeroed by a
    separate block (the gather backward's GPU form until 2026-12-06) is neither a complete nor a
    reduction block: no rule binds it, and the error names the kernel."""
    from tvm.script import tirx as T

    @T.prim_func(private=True, s_tir=True)
    def scatter(dy: T.Buffer((8, 4), "float32"), idx: T.Buffer((8,), "int64"), out: T.Buffer((10, 4), "float32")):
        for d, i in T.grid(10, 4):
            with T.sblock("init"):
                vd, vi = T.axis.remap("SS", [d, i])
                out[vd, vi] = T.float32(0)
        for j, i in T.grid(8, 4):
            with T.sblock("accumulate"):
                vj, vi = T.axis.remap("RS", [j, i])
                T.reads(idx[vj], dy[vj, vi], out[0:10, vi])
                T.writes(out[0:10, vi])
                out[idx[vj], vi] = out[idx[vj], vi] + dy[vj, vi]

    with pytest.raises(NotImplementedError, match="no GPU schedule for kernel scatter_add on cuda"):
        schedule_gpu(tvm.IRModule({"scatter_add": scatter}), CUDA)


# --------------------------------------------------------------------------------------------
# MetaSchedule on GPU targets: design spaces generate and build here; measuring needs a device
# --------------------------------------------------------------------------------------------


def _tasks(name, target):
    from tvm.s_tir import meta_schedule as ms

    mod = lower(suite_module(suite_kernel(name), "small"), target, schedule=False, tuning_log=None)
    return ms.relax_integration.extract_tasks(mod, target)


@pytest.mark.parametrize("target", [CUDA, METAL, VULKAN], ids=["cuda", "metal", "vulkan"])
def test_gpu_design_spaces_generate_and_build(target):
    from tvm.s_tir import meta_schedule as ms

    from rlx_tvm.tuning.search import design_spaces, tuning_target

    target = tuning_target(target)
    assert int(target.attrs["max_threads_per_block"]) > 0 and int(target.attrs["max_shared_memory_per_block"]) > 0
    built = 0
    for name in ("rms_norm_backward", "softmax_cross_entropy_backward", "conv2d_backward_weight"):
        for task in _tasks(name, target):
            for _, space in design_spaces(target):  # the fallback space where the first one fails
                try:
                    ctx = ms.TuneContext(mod=task.dispatched[0], target=target, space_generator=space,
                                         task_name=task.task_name)
                    schedules = ctx.generate_design_space()
                    break
                except Exception:  # noqa: BLE001 - mirrors tune(): try the next space
                    continue
            assert schedules, task.task_name
            mod = schedules[0].mod
            if target.kind.name == "vulkan":  # no SPIR-V codegen here: lower and verify
                for dev in _device_funcs(mod["main"], target):
                    assert tvm.s_tir.analysis.verify_gpu_code(dev, gpu_limits(target)), task.task_name
            else:
                assert _device_source(tvm.compile(mod, target=target), target.kind.name), task.task_name
            built += 1
    assert built >= 4


def test_tune_on_cuda_records_candidates_for_a_device(tmp_path):
    from rlx_tvm.tuning import tune

    results = tune(suite_ir_module([suite_kernel("rms_norm_backward")], "small"), CUDA, trials=4,
                   work_dir=str(tmp_path), trials_per_iter=4)
    assert len(results) == 2
    for r in results:
        assert r.status.startswith("tuned") and "nothing measured" in r.status and r.trials == 4, r
        assert r.best_us is None
