"""The benchmark suite under default schedules (every kernel, small shapes, vs NumPy), the TVM
baseline formulations, tuning-log lookup by target, and smoke tests of ``rlx-tvm tune``,
``compile`` and ``bench`` (a tiny real tuning run, its log applied)."""

import dataclasses
import json
import os
import platform
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tvm
from tvm import relax

import rlx_tvm
from rlx_tvm import build, cli
from rlx_tvm.passes import DecomposeBackwardOps
from rlx_tvm.bench.suite import SUITE, suite_ir_module, suite_kernel, suite_module, suite_reference
from rlx_tvm.target import cpu_target, vector_bits
from rlx_tvm.testing import as_tensors, compare
from rlx_tvm.tuning import ExportTimer, export_log
from rlx_tvm.tuning.report import read_report, render_markdown

def _close(got, ref, what):
    """float32 outputs against the float64 references, at the tests' float32 tolerance."""
    assert len(got) == len(ref), what
    for i, (g, r) in enumerate(zip(got, ref)):
        problem = compare(g, r, "float32")
        assert problem is None, f"{what}, output {i}: {problem}"


def _run(ex, kernel, scale="small"):
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return [o.numpy() for o in vm["main"](*as_tensors(kernel.inputs(scale).values()))]


def test_suite_covers_the_issue_shapes():
    names = {k.name for k in SUITE}
    assert names == {
        "relu_backward", "gelu_backward", "silu_backward", "layer_norm_backward", "rms_norm_backward",
        "group_norm_backward", "softmax_cross_entropy_backward", "conv2d_backward_input", "conv2d_backward_weight",
        "max_pool2d_backward", "attention_backward", "gather_backward", "cumsum_backward",
        "fake_quantize_backward", "rope_backward"}
    full = {k.name: {n: s for n, (s, _) in k.shapes("full").items()} for k in SUITE}
    assert np.prod(full["gelu_backward"]["x"]) == 8 << 20 and np.prod(full["fake_quantize_backward"]["x"]) == 8 << 20
    assert full["layer_norm_backward"]["x"] == (8192, 768) and full["softmax_cross_entropy_backward"]["logits"] == (2048, 8192)
    assert full["attention_backward"]["q"] == (4, 512, 8, 64) and full["gather_backward"]["table"] == (32000, 768)
    assert full["max_pool2d_backward"]["x"] == (8, 64, 112, 112) and full["rope_backward"]["x"] == (4, 512, 8, 64)
    with pytest.raises(KeyError, match="relu_backward"):
        suite_kernel("no_such_kernel")


def test_default_schedules_cover_every_suite_kernel():
    """One module with every suite kernel at small shapes: each kernel gets a parallel schedule, and
    every output matches the NumPy references."""
    mod = suite_ir_module(scale="small")
    lowered = build.lower(mod, cpu_target(), tuning_log=None)
    prims = {gv.name_hint: f for gv, f in lowered.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}
    assert len(prims) >= len(SUITE)
    unscheduled = [n for n, f in prims.items() if "tirx.is_scheduled" not in (f.attrs or {})]
    serial = [n for n, f in prims.items() if "T.parallel" not in f.script()]
    assert not unscheduled and not serial, (unscheduled, serial)
    _assert_in_bounds(prims)
    vm = relax.VirtualMachine(tvm.compile(lowered, target=cpu_target()), tvm.cpu())
    for k in SUITE:
        got = [o.numpy() for o in vm[k.name](*as_tensors(k.inputs("small").values()))]
        _close(got, suite_reference(k, "small"), k.name)


def _assert_in_bounds(prims: dict) -> None:
    """No scheduled kernel reads or writes outside its buffers (TVM's OOBChecker, on the bounds of
    every index): a select evaluates both sides, so a load it discards must be in bounds too. (Not
    for TVM's own kernels: their padding reads sit under ``if_then_else``, which evaluates lazily
    but which the checker bounds all the same.)"""
    for name, f in prims.items():
        try:
            tvm.s_tir.analysis.OOBChecker()(tvm.IRModule({"main": f}))
        except Exception as err:  # noqa: BLE001 - the checker raises a plain TVM error
            raise AssertionError(f"{name}: {str(err).strip().splitlines()[-1]}") from None


def test_max_pool_padding_reads_stay_in_bounds():
    """The CPU max-pool kernel copies the input's real columns into a frame whose border holds NaN
    (padding never wins), so no read of x needs a clamp or a select, and no read leaves its
    buffer; the result matches the reference. (The frame used to be a select of a clamped read,
    whose clamp TVM's simplifier dropped: the kernel read a row and a column before the input, and
    crashed when that memory was unmapped.)"""
    shapes = {"x": ((2, 3, 32, 32), "normal"), "dy": ((2, 3, 16, 16), "normal")}  # rows of 16 windows
    k = dataclasses.replace(suite_kernel("max_pool2d_backward"), shapes=lambda scale: shapes)
    lowered = build.lower(suite_module(k, "small"), cpu_target(), tuning_log=None, verbose=False)
    prims = {gv.name_hint: f for gv, f in lowered.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}
    script = prims["rlx_max_pool2d_backward"].script()
    assert "rlx_max_pool2d_argmax" not in prims and "if_then_else" not in script and "T.Select(" in script
    _assert_in_bounds(prims)
    _close(_run(tvm.compile(lowered, target=cpu_target()), k), suite_reference(k, "small"), k.name)


def test_multi_stage_row_kernels_run_in_one_parallel_loop():
    """Norm and softmax-CE backward kernels at rows long enough to matter: every stage (the
    statistics, the gradient, the norms' parameter-gradient partial sums) runs inside one parallel
    loop over the rows (chunks of rows), or over (n, group) for group norm, so a row is read from
    memory once (softmax-CE: its chunked kernel's rows, parallel); group norm's long rows are summed in several
    vector accumulators, partial sums in local buffers. Outputs match NumPy."""
    shapes = {
        "layer_norm_backward": {"x": ((16, 768), "normal"), "gamma": ((768,), "positive"),
                                "beta": ((768,), "normal"), "dy": ((16, 768), "normal")},
        "group_norm_backward": {"x": ((2, 64, 28, 56), "normal"), "gamma": ((64,), "positive"),
                                "beta": ((64,), "normal"), "dy": ((2, 64, 28, 56), "normal")},
        # 1000 classes, not a whole number of vectors: the chunked TIR kernel with a short last
        # chunk (the TE kernel's row schedule is tested in test_loss.py, with float16 logits)
        "softmax_cross_entropy_backward": {"logits": ((8, 1000), "normal"), "labels": ((8,), "int<1000"),
                                           "d_loss": ((8,), "normal")},
    }
    kernels = [dataclasses.replace(suite_kernel(n), shapes=lambda scale, s=s: s) for n, s in shapes.items()]
    lowered = build.lower(suite_ir_module(kernels, "small"), cpu_target(), tuning_log=None, verbose=False)
    scripts = {gv.name_hint: f.script() for gv, f in lowered.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}
    # The norms' gradients are computed together (one kernel per norm: statistics, dx, and the
    # partial sums of dgamma / dbeta, merged into one row loop; layer norm's dbeta is the suite's
    # plain sum(dy), taken in); softmax-CE's one block per row, in the parallel row loop.
    for name in ("rlx_layer_norm_backward_input_gamma_beta", "rlx_group_norm_backward_input_gamma_beta"):
        script = scripts[name]
        assert script.count("T.parallel") == 1 and script.count("_rf") >= 2 and 'scope="local"' in script, name
    script = scripts["rlx_softmax_cross_entropy_backward"]
    assert script.count("T.parallel") == 1 and "chunk_max" in script
    # several vector accumulators per row (2 of 16 lanes on AVX-512: the 28 x 56 planes fused into
    # whole vectors; 4 of 8 where they are 56-lane rows of half vectors)
    assert re.search(r"T\.unroll\(T\.int64\([24]\)\)", scripts["rlx_group_norm_backward_input_gamma_beta"])
    vm = relax.VirtualMachine(tvm.compile(lowered, target=cpu_target()), tvm.cpu())
    for k in kernels:
        got = [o.numpy() for o in vm[k.name](*as_tensors(k.inputs("small").values()))]
        _close(got, suite_reference(k, "small"), k.name)


def test_pass_merging_skips_passes_with_unrolled_outer_loops():
    """Two independent passes under one row loop whose outer loops are unrolled (as partial-sum
    chain loops are): nothing to merge, and the merging returns (it used to retry the same pair
    forever); a watchdog turns a hang into a failure."""
    import signal

    from tvm import te, tirx

    from rlx_tvm.schedules.cpu import _merge_independent_passes

    x = te.placeholder((tirx.IntImm("int64", 8), tirx.IntImm("int64", 4), tirx.IntImm("int64", 16)), "float32", name="x")
    y = te.compute(x.shape, lambda i, a, b: x[i, a, b] * 2.0, name="y")
    z = te.compute(x.shape, lambda i, a, b: x[i, a, b] + 1.0, name="z")
    sch = tvm.s_tir.Schedule(te.create_prim_func([x, y, z]))
    rows = sch.merge(sch.get_loops(sch.get_sblock("y"))[0], sch.get_loops(sch.get_sblock("z"))[0])
    for name in ("y", "z"):
        sch.unroll(sch.get_loops(sch.get_sblock(name))[1])
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("pass merging did not return"))
    signal.alarm(30)
    try:
        _merge_independent_passes(sch, rows, 1)
    finally:
        signal.alarm(0)
    assert len(sch.get_child_blocks(rows)) == 2
    assert all(sch.get(sch.get_loops(sch.get_sblock(n))[1]).kind == tirx.ForKind.UNROLLED for n in ("y", "z"))


def test_default_schedules_cover_the_decomposed_suite():
    """The primitives the decompositions produce get default schedules too (all of them parallel
    where they have a spatial loop), and compute the same values."""
    mod = DecomposeBackwardOps()(suite_ir_module(scale="small"))
    lowered = build.lower(mod, cpu_target(), tuning_log=None)
    prims = {gv.name_hint: f for gv, f in lowered.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}
    assert len(prims) > 2 * len(SUITE)
    parallel = [n for n, f in prims.items() if "T.parallel" in f.script()]
    # scheduled by us, or TOPI's hand-written kernels (scatter_elements), which come parallel
    assert all("tirx.is_scheduled" in (f.attrs or {}) or n in parallel for n, f in prims.items())
    assert len(parallel) >= 0.9 * len(prims), sorted(set(prims) - set(parallel))
    vm = relax.VirtualMachine(tvm.compile(lowered, target=cpu_target()), tvm.cpu())
    for k in SUITE:
        got = [o.numpy() for o in vm[k.name](*as_tensors(k.inputs("small").values()))]
        _close(got, suite_reference(k, "small"), k.name + " (decomposed)")


def test_tvm_baselines_match_the_rlx_kernels():
    """The bench's TVM column computes the same thing: relax.op.grad ops where TVM has them, the
    decomposition into primitives elsewhere (one kernel of each kind is enough here)."""
    for name in ("max_pool2d_backward", "gather_backward", "layer_norm_backward"):
        k = suite_kernel(name)
        mod = suite_module(k, "small")
        base = suite_module(k, "small", "tvm") if k.tvm else DecomposeBackwardOps()(mod)
        _close(_run(tvm.compile(base, target="llvm"), k), suite_reference(k, "small"), name)
    with pytest.raises(ValueError, match="no TVM formulation"):
        suite_module(suite_kernel("relu_backward"), "small", "tvm")


def test_default_reduction_schedules_are_vectorized_and_correct():
    """Column sums over one and two leading axes, a column count that is not a multiple of the
    chunk, a row reduction long enough for vector partial sums, and a max: each kernel gets a
    vectorized parallel schedule and matches NumPy."""
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal(s).astype("float32") for s in [(96, 64), (4, 6, 64), (128, 48), (8, 1024), (8, 1024)]]
    bb = relax.BlockBuilder()
    params = [relax.Var(f"a{i}", relax.TensorType(list(a.shape), "float32")) for i, a in enumerate(arrays)]
    with bb.function("main", params):
        outs = [relax.op.sum(params[0], axis=[0]), relax.op.sum(params[1], axis=[0, 1]),
                relax.op.sum(params[2], axis=[0]), relax.op.sum(params[3], axis=[1]),
                relax.op.max(params[4], axis=[1])]
        bb.emit_func_output(relax.Tuple([bb.emit(o) for o in outs]))
    lowered = build.lower(bb.get(), cpu_target(), tuning_log=None, verbose=False)
    prims = [f for f in lowered.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(prims) == 5 and all("T.vectorized" in f.script() and "T.parallel" in f.script() for f in prims)
    vm = relax.VirtualMachine(tvm.compile(lowered, target=cpu_target()), tvm.cpu())
    got = [o.numpy() for o in vm["main"](*as_tensors(arrays))]
    refs = [arrays[0].sum(0), arrays[1].sum((0, 1)), arrays[2].sum(0), arrays[3].sum(1), arrays[4].max(1)]
    for g, r, name in zip(got, refs, ["sum axis 0", "sum axes 0,1", "sum axis 0 (48 columns)", "row sum", "row max"]):
        _close([g], [r], name)


def test_short_rows_take_half_vectors():
    """A row sum over several short axes (group norm's channels x H x W with W = 56) and
    elementwise kernels over rows of 56 and of 20 take the widest whole or half vector that
    divides the row: for AVX-512 (16 lanes) 8-lane partial sums, 8-lane vectors, and a row of 20
    stays scalar; for AVX2 (8 lanes) whole 8-lane vectors and 4-lane halves for the row of 20.
    Built for this machine's CPU, all three match NumPy."""
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal(s).astype("float32") for s in [(4, 3, 8, 56), (6, 56), (6, 20)]]
    bb = relax.BlockBuilder()
    params = [relax.Var(f"a{i}", relax.TensorType(list(a.shape), "float32")) for i, a in enumerate(arrays)]
    with bb.function("main", params):
        outs = [relax.op.sum(params[0], axis=[1, 2, 3]), relax.op.exp(params[1]), relax.op.exp(params[2])]
        bb.emit_func_output(relax.Tuple([bb.emit(o) for o in outs]))
    shapes = ("T.int64(3), T.int64(8)", "T.int64(6), T.int64(56)", "T.int64(6), T.int64(20)")
    for mcpu, widths in (("znver4", (8, 8, None)), ("znver3", (8, 8, 4))):
        target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
        lowered = build.lower(bb.get(), target, tuning_log=None, verbose=False)
        scripts = {name.name_hint: f.script() for name, f in lowered.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}
        assert len(scripts) == 3, sorted(scripts)
        by_shape = [next(v for v in scripts.values() if s in v) for s in shapes]
        assert "_rf" in by_shape[0], mcpu
        for script, width in zip(by_shape, widths):
            vectorized = re.findall(r"T\.vectorized\(T\.int64\((\d+)\)\)", script)
            assert vectorized == ([] if width is None else [str(width)] * len(vectorized)) and bool(vectorized) == bool(width), \
                (mcpu, width, vectorized)
    lowered = build.lower(bb.get(), cpu_target(), tuning_log=None, verbose=False)
    vm = relax.VirtualMachine(tvm.compile(lowered, target=cpu_target()), tvm.cpu())
    got = [o.numpy() for o in vm["main"](*as_tensors(arrays))]
    _close(got, [arrays[0].sum((1, 2, 3)), np.exp(arrays[1]), np.exp(arrays[2])], "short rows")


def test_default_matmul_schedule_is_register_blocked_and_correct():
    """A batched product whose right operand is shared by the rows of the left gets a tile of
    rows x vectors of accumulators in a local buffer; a row count that is not a multiple of the
    tile falls back to the plain column schedule. Both match NumPy."""
    scripts = _default_matmuls([(2, 12, 16), (2, 16, 64), (2, 10, 16), (2, 16, 48)], "T.int64(10)", "matmul")
    assert 'scope="local"' in scripts[0] and "T.unroll(T.int64(4))" in scripts[0], "12 rows: tiled"
    assert 'scope="local"' not in scripts[1] and "T.vectorized" in scripts[1], "10 rows: not a multiple of 4"


def _default_matmuls(shapes, second, what) -> list[str]:
    """Two products (of arrays of ``shapes``, taken in pairs) in one module under default CPU
    schedules for this CPU as a 2-core target (the tiles' grouping depends on the core count),
    checked against NumPy; their kernels' TVMScript, the one containing ``second`` last."""
    rng = np.random.default_rng(4)
    arrays = [rng.standard_normal(s).astype("float32") for s in shapes]
    bb = relax.BlockBuilder()
    params = [relax.Var(f"a{i}", relax.TensorType(list(a.shape), "float32")) for i, a in enumerate(arrays)]
    with bb.function("main", params):
        outs = [relax.op.matmul(params[0], params[1]), relax.op.matmul(params[2], params[3])]
        bb.emit_func_output(relax.Tuple([bb.emit(o) for o in outs]))
    target = cpu_target(num_cores=2)
    lowered = build.lower(bb.get(), target, tuning_log=None, verbose=False)
    vm = relax.VirtualMachine(tvm.compile(lowered, target=target), tvm.cpu())
    got = [o.numpy() for o in vm["main"](*as_tensors(arrays))]
    _close(got, [arrays[0] @ arrays[1], arrays[2] @ arrays[3]], what)
    scripts = sorted((f.script() for f in lowered.functions.values() if isinstance(f, tvm.tirx.PrimFunc)),
                     key=lambda s: second in s)
    assert len(scripts) == 2
    return scripts


def test_default_product_tiles_take_turns_on_reduction_blocks():
    """Cache blocking of the register-blocked tile: a product whose reduction (32 steps) holds two
    blocks of 16 runs a block at a time for a group of 8 tiles of rows in turn (the block's loads
    of the shared operand then come from L1); conv2d dx (32 output channels, the reduction) gets
    the same, and its padding stage keeps its 640 rows of 18 (no whole number of vectors) as a
    loop of their own under the parallel loop. A reduction of one block (16) is not split. All
    match NumPy."""
    scripts = _default_matmuls([(8, 64, 32), (8, 32, 64), (2, 64, 16), (2, 16, 64)], "T.int64(16), T.int64(64)",
                               "blocked matmul")
    # 64 rows = 2 groups of 8 tiles of 4 rows (8 x 2 = 16 parallel iterations, 8 per core); 32
    # steps = 2 blocks of 16, the group loop between
    assert re.search(r"T\.grid\(T\.int64\(2\), T\.int64\(8\), T\.int64\(16\)\)", scripts[0]), scripts[0]
    assert 'scope="local"' in scripts[1] and "T.int64(8), T.int64(16)" not in scripts[1], "one block: not split"

    conv = suite_kernel("conv2d_backward_input")
    shapes = {"x": ((2, 32, 8, 16), "normal"), "w": ((32, 32, 3, 3), "normal"), "dy": ((2, 32, 8, 16), "normal")}
    conv = dataclasses.replace(conv, shapes=lambda scale: shapes)
    target = cpu_target(num_cores=2)
    lowered = build.lower(suite_module(conv, "small"), target, tuning_log=None, verbose=False)
    (script,) = [f.script() for f in lowered.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    # 32 channels = one group of 8 tiles of 4 rows (16 columns: one vector), 2 blocks of 16 channels
    assert re.search(r"T\.grid\(T\.int64\(2\), T\.int64\(8\), T\.int64\(16\), T\.int64\(3\), T\.int64\(3\)\)",
                     script), script
    assert re.search(r"T\.parallel\(T\.int64\(640\)\):\n\s+for \w+ in range\(T\.int64\(18\)\)", script), script
    _close(_run(tvm.compile(lowered, target=target), conv), suite_reference(conv, "small"), "blocked conv2d dx")


def test_target_key_names_cpu_and_cores():
    assert build.target_key(cpu_target(num_cores=2)) == f"llvm-{cpu_target().attrs['mcpu']}-2c"
    assert build.target_key("llvm") == "llvm"
    assert build.target_key(tvm.target.Target({"kind": "cuda", "arch": "sm_90"})) == "cuda-sm_90"


def test_import_runs_tvm_kernels_on_every_cpu_of_the_process():
    """TVM's pool alone runs half the hardware threads on x86 (1 on a 2-vCPU machine); after
    ``import rlx_tvm`` it runs on every CPU the process may use, unless TVM_NUM_THREADS or
    OMP_NUM_THREADS is set (then theirs)."""
    # Every CPU first (a TVM pool of one thread pins the thread that started it to one CPU, and a
    # child inherits the mask), counted before the child's own pool starts.
    probe = ("import os, tvm_ffi; os.sched_setaffinity(0, range(os.cpu_count())); "
             "cpus = len(os.sched_getaffinity(0)); import rlx_tvm; "
             "print(tvm_ffi.get_global_func('runtime.NumThreads')(), cpus, os.environ.get('TVM_NUM_THREADS', '-'))")
    env = {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", "OMP_NUM_THREADS")}

    def pool_and_cpus(**extra):
        out = subprocess.run([sys.executable, "-c", probe], env={**env, **extra}, capture_output=True, text=True,
                             check=True).stdout.split()
        return int(out[0]), int(out[1]), out[2]

    pool, cpus, variable = pool_and_cpus()
    assert pool == cpus and variable == str(cpus), (pool, cpus, variable)
    assert pool_and_cpus(TVM_NUM_THREADS="1")[0] == 1
    assert pool_and_cpus(OMP_NUM_THREADS="1")[0] == 1


@pytest.fixture(scope="module")
def cli_tuned(tmp_path_factory):
    """``rlx-tvm tune`` on one small suite kernel, a handful of trials."""
    root = tmp_path_factory.mktemp("cli")
    work, log = root / "work", root / "log"
    rc = cli.main(["tune", "--kernels", "rms_norm_backward", "--scale", "small", "--trials", "8", "--keep-all",
                   "--work-dir", str(work), "--log-dir", str(log)])
    return rc, work, log


def test_cli_tune_writes_a_pruned_log(cli_tuned, capsys):
    rc, work, log = cli_tuned
    assert rc == 0
    full = build.load_tuning_log(str(work)).get_all_tuning_records()
    best = build.load_tuning_log(str(log)).get_all_tuning_records()
    assert len(full) > len(best) == 2  # rms_norm_backward: the dx and dgamma kernels, one record each
    record = (log / "TUNING.md").read_text()  # the budget and outcome, next to the log
    assert "up to 8 measured candidates per kernel" in record
    task_rows = [line for line in record.splitlines() if line.startswith("| rms_norm_backward |")]
    assert len(task_rows) == 2 and all("| tuned |" in row for row in task_rows), record
    assert record.count("| yes |") == 2, record


def test_cli_tune_of_other_kernels_keeps_the_earlier_rows(cli_tuned, tmp_path, capsys):
    """``tune --kernels`` with a subset: TUNING.md keeps the task rows of the kernels it did not
    take (marked as from an earlier run), in the suite's order, next to its own."""
    _, work, log = cli_tuned
    shutil.copytree(work, tmp_path / "work")
    shutil.copytree(log, tmp_path / "log")
    (tmp_path / "log" / "TUNING.md").unlink()  # the earlier run's rows come from TUNING.json, not the Markdown
    rc = cli.main(["tune", "--kernels", "relu_backward", "--scale", "small", "--trials", "4", "--time-budget", "0",
                   "--keep-all", "--work-dir", str(tmp_path / "work"), "--log-dir", str(tmp_path / "log")])
    record = (tmp_path / "log" / "TUNING.md").read_text()
    rows = [line for line in record.splitlines() if line.startswith(("| relu_backward |", "| rms_norm_backward |"))]
    assert rc == 0 and len(rows) == 3, record
    assert rows[0].startswith("| relu_backward |") and "| skipped: time budget spent |" in rows[0]
    assert all("| earlier run: tuned |" in row for row in rows[1:]), record
    assert "Rows marked `earlier run:`" in record
    state = json.loads((tmp_path / "log" / "TUNING.json").read_text())
    assert [(t[0], t[4]) for t in state["tasks"]] == [
        ("relu_backward", "skipped: time budget spent"), *[("rms_norm_backward", "earlier run: tuned")] * 2]
    assert record == render_markdown(read_report(str(tmp_path / "log")))


def test_cli_tune_stops_at_its_time_budget(tmp_path, capsys):
    rc = cli.main(["tune", "--kernels", "relu_backward", "--scale", "small", "--trials", "4", "--time-budget", "0",
                   "--work-dir", str(tmp_path / "work"), "--log-dir", str(tmp_path / "log")])
    out = capsys.readouterr().out
    assert rc == 0 and "skipped: time budget spent" in out and "run the command again to resume" in out


def test_export_keeps_only_records_faster_than_the_default_schedule(cli_tuned, tmp_path):
    _, work, _ = cli_tuned
    rows = export_log(str(work), str(tmp_path), cpu_target(), verbose=False).rows
    assert len(rows) == 2 and all(r.tuned_us > 0 and r.default_us > 0 for r in rows)
    assert all(r.kept == (r.tuned_us * 1.05 <= r.default_us) for r in rows)  # tuned.MIN_SPEEDUP
    assert len(build.load_tuning_log(str(tmp_path)).get_all_tuning_records()) == sum(r.kept for r in rows)
    rows = export_log(str(work), str(tmp_path), cpu_target(), compare_default=False, verbose=False).rows  # replaces
    assert [r.kept for r in rows] == [True, True] and all(r.tuned_us is None for r in rows)
    assert len(build.load_tuning_log(str(tmp_path)).get_all_tuning_records()) == 2


def test_export_drops_records_of_kernels_that_changed(cli_tuned, tmp_path):
    _, work, _ = cli_tuned
    same = export_log(str(work), str(tmp_path / "same"), cpu_target(), compare_default=False, verbose=False,
                      kernels=suite_module(suite_kernel("rms_norm_backward"), "small")).rows
    assert [(r.kept, r.stale) for r in same] == [(True, False)] * 2
    # The same kernels at other shapes stand for kernels whose TensorIR changed since tuning.
    other = export_log(str(work), str(tmp_path / "other"), cpu_target(), compare_default=False, verbose=False,
                       kernels=suite_module(suite_kernel("rms_norm_backward"), "full")).rows
    assert [(r.kept, r.stale) for r in other] == [(False, True)] * 2
    assert build.load_tuning_log(str(tmp_path / "other")).get_all_tuning_records() == []


def _conv_dx_module(n=2, c=32, hw=28):
    bb = relax.BlockBuilder()
    dy = relax.Var("dy", relax.TensorType((n, c, hw, hw), "float32"))
    w = relax.Var("w", relax.TensorType((c, c, 3, 3), "float32"))
    with bb.function("main", [dy, w]):
        with bb.dataflow():
            gv = bb.emit_output(rlx_tvm.ops.conv2d_backward_input(dy, w, input_size=(hw, hw), padding=1))
        bb.emit_func_output(gv)
    return bb.get()


class GivenTimes(ExportTimer):
    """Export's checks fed given times: each record's kernel and each module take the next
    (tuned, default) pair given."""

    def __init__(self, kernel_us, module_ms):
        self.kernel_times, self.module_times = list(kernel_us), list(module_ms)

    def kernel_us(self, tuned, default, target, rounds=5):
        return self.kernel_times.pop(0)

    def module_ms(self, mod, target, log_dir, rounds=7, min_ms=50.0):
        assert build.load_tuning_log(log_dir).get_all_tuning_records()  # the module is checked with its records
        return self.module_times.pop(0)


def _naive_conv_log(tmp_path, mod, target):
    """A work database with one record for the conv kernel of ``mod``: a trace that leaves it as
    serial loops (one lookup: the database ignores empty traces)."""
    from tvm.s_tir import meta_schedule as ms

    from rlx_tvm.tuning.export import kernel_workloads

    (workload,) = kernel_workloads([mod], target)
    naive = tvm.s_tir.Schedule(workload)
    naive.get_sblock("conv2d_dx_acc")
    (tmp_path / "work").mkdir()
    work = ms.database.JSONDatabase(work_dir=str(tmp_path / "work"))
    work.commit_tuning_record(ms.database.TuningRecord(
        naive.trace, work.commit_workload(workload), [1e-6], target,
        ms.arg_info.ArgInfo.from_prim_func(workload["main"])))
    return str(tmp_path / "work")


def test_export_drops_records_that_make_their_module_slower(tmp_path):
    """The export rule on given times: a record at least 5% faster than the default schedule alone
    passes the per-kernel check, and stays only if its module, built with it, is at least 5%
    faster than without; otherwise it leaves the log, named with the module that dropped it. A
    record that only ties alone never reaches the module check."""
    mod, target = _conv_dx_module(), cpu_target()
    work = _naive_conv_log(tmp_path, mod, target)
    cases = [  # (kernel us, module ms) -> kept, module checked
        (((10.0, 20.0), (12.0, 10.0)), False, True),  # faster alone, slower as a module
        (((10.0, 20.0), (9.6, 10.0)), False, True),  # 4% faster as a module: not enough
        (((10.0, 20.0), (9.5, 10.0)), True, True),  # 5% faster as a module
        (((10.0, 10.4), (1.0, 10.0)), False, False),  # 4% faster alone: dropped before the module check
    ]
    for i, ((kernel, module), kept, checked) in enumerate(cases):
        timer = GivenTimes([kernel], [module])
        export = export_log(work, str(tmp_path / f"log{i}"), target, verbose=False, kernels={"conv dx": mod},
                            timer=timer)
        (row,) = export.rows
        assert (row.tuned_us, row.default_us) == kernel and row.kept == kept, (i, row)
        assert [(m.name, m.records, m.tuned_ms, m.default_ms, m.kept) for m in export.modules] == (
            [("conv dx", 1, *module, kept)] if checked else []), (i, export.modules)
        assert row.dropped_with_module == ("conv dx" if checked and not kept else None), (i, row)
        assert len(build.load_tuning_log(str(tmp_path / f"log{i}")).get_all_tuning_records()) == int(kept), i
        assert timer.kernel_times == [] and timer.module_times == ([] if checked else [module]), i
    # Without compare_default nothing is timed, alone or as a module: the record stays.
    export = export_log(work, str(tmp_path / "all"), target, compare_default=False, verbose=False,
                        kernels={"conv dx": mod}, timer=GivenTimes([], []))
    assert export.modules == [] and export.kept == 1


def test_compiled_log_is_applied_and_correct(cli_tuned, tmp_path, capsys):
    _, _, log = cli_tuned
    k = suite_kernel("rms_norm_backward")
    ex = rlx_tvm.compile(suite_module(k, "small"), cpu_target(), tuning_log=str(log))
    assert "2 of 2 kernels tuned" in capsys.readouterr().err
    _close(_run(ex, k), suite_reference(k, "small"), "tuned rms_norm_backward")

    # tuned for another target (here: another core count): not applied, and said
    ex = rlx_tvm.compile(suite_module(k, "small"), cpu_target(num_cores=1), tuning_log=str(log))
    err = capsys.readouterr().err
    assert "was tuned for" in err and "not applied" in err
    _close(_run(ex, k), suite_reference(k, "small"), "default rms_norm_backward")


def test_auto_log_lookup_by_target(cli_tuned, tmp_path, monkeypatch, capsys):
    _, _, log = cli_tuned
    shutil.copytree(log, tmp_path / build.target_key(cpu_target()))
    monkeypatch.setattr(build, "TUNING_LOGS", str(tmp_path))
    k = suite_kernel("rms_norm_backward")
    rlx_tvm.compile(suite_module(k, "small"), cpu_target())
    assert "2 of 2 kernels tuned from" in capsys.readouterr().err
    rlx_tvm.compile(suite_module(k, "small"), "llvm")  # plain llvm: no log of that name
    assert "no tuning log for target llvm" in capsys.readouterr().err


def test_default_target_is_this_cpu_and_plain_llvm_says_what_it_loses(monkeypatch, capsys):
    """No target: the kernels are built for this CPU (as with ``cpu_target()``), silently. A plain
    ``llvm`` on an x86 machine: one line on stderr, once per process, says what it loses and how
    to ask for this CPU; an ``llvm`` target naming its CPU says nothing."""
    k = suite_kernel("relu_backward")
    mod = suite_module(k, "small")
    monkeypatch.setattr(build, "_generic_llvm_noted", False)
    assert build.lower(mod, tuning_log=None).script() == build.lower(mod, cpu_target(), tuning_log=None).script()
    _close(_run(rlx_tvm.compile(mod, tuning_log=None), k), suite_reference(k, "small"), "relu, no target")
    rlx_tvm.compile(mod, {"kind": "llvm", "mcpu": "x86-64"}, tuning_log=None)
    assert capsys.readouterr().err == ""
    for _ in range(2):
        rlx_tvm.compile(mod, "llvm", tuning_log=None)
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rlx_tvm: target 'llvm'")]
    if platform.machine().lower() not in ("x86_64", "amd64"):
        assert notes == []
        return
    (note,) = notes
    assert "generic x86-64" in note and "no tuning log" in note and "rlx_tvm.target.cpu_target()" in note, note
    assert f"{vector_bits(cpu_target())}-bit" in note and "128-bit" in note, note


def test_cli_compile_exports_a_library(cli_tuned, tmp_path, capsys):
    _, _, log = cli_tuned
    out = tmp_path / "rms.so"
    assert cli.main(["compile", "suite:rms_norm_backward", "--scale", "small", "--tuning-log", str(log),
                     "-o", str(out)]) == 0
    assert "2 of 2 kernels tuned" in capsys.readouterr().err
    k = suite_kernel("rms_norm_backward")
    _close(_run(tvm.runtime.load_module(str(out)), k), suite_reference(k, "small"), "exported library")

    # a TVMScript file with an R.rlx op, default schedules
    src = tmp_path / "relu.py"
    src.write_text(suite_module(suite_kernel("relu_backward"), "small").script())
    assert cli.main(["compile", str(src), "--target", "llvm", "-o", str(tmp_path / "relu.so")]) == 0
    _close(_run(tvm.runtime.load_module(str(tmp_path / "relu.so")), suite_kernel("relu_backward")),
           suite_reference(suite_kernel("relu_backward"), "small"), "relu from TVMScript")


def test_cli_bench_prints_a_table_and_writes_json(cli_tuned, tmp_path, capsys):
    _, _, log = cli_tuned
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--scale", "small", "--kernels", "rms_norm_backward,relu_backward", "--repeats", "2",
                     "--min-ms", "1", "--settle-ms", "5", "--tuning-log", str(log), "--no-torch", "--json", str(out),
                     "--markdown", str(tmp_path / "bench.md")]) == 0
    text = capsys.readouterr().out
    assert "rms_norm_backward" in text and "copy bandwidth" in text and "TVM ms" in text
    report = json.loads(out.read_text())
    assert [k["name"] for k in report["kernels"]] == ["rms_norm_backward", "relu_backward"]
    rms, relu = report["kernels"]
    assert rms["tuned_kernels"] == "2/2" and relu["tuned_kernels"] == "0/1"
    assert set(rms["ms"]) == {"tuned", "default", "tvm"} and all(v > 0 for v in rms["ms"].values())
    assert rms["max_rel_diff"] < 1e-4 and report["copy_gbps"] > 0 and report["settle_ms"] == 5
    # relu has no record: its tuned build is the default build, reported with the default's timings
    assert relu["ms"]["tuned"] == relu["ms"]["default"] and rms["ms"]["tuned"] != rms["ms"]["default"]
    # the copy kernel is timed in each kernel's rounds, and each kernel's share is against its own
    low, high = report["copy_gbps_range"]
    assert all(low <= k["copy_gbps"] <= high and k["copy_gbps"] > 0 for k in report["kernels"])
    assert low <= report["copy_gbps"] <= high and "copy" not in rms["ms"]
    md = (tmp_path / "bench.md").read_text().splitlines()
    assert md[0].startswith("| kernel |") and md[2].startswith("| rms_norm_backward |") and len(md) == 4


@pytest.mark.parametrize("command", ["tune", "bench", "compile", "device-pack"])
def test_cli_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "--target" in text or "--kernels" in text


def test_cli_rejects_unknown_kernels():
    with pytest.raises(SystemExit, match="no suite kernel 'nope'; the suite has .*relu_backward"):
        cli.main(["bench", "--kernels", "nope", "--scale", "small"])


def test_device_pack_runs_without_the_compiler(tmp_path, capsys):
    """A pack built for this CPU (the GPU packs take the same path, built for CUDA) holds the
    kernels, TVM's runtime without its compiler and the timer; the timer, run as a separate Python
    on the pack alone, loads the pack's runtime and times every kernel (and PyTorch, when
    installed, whose gradients the TVM outputs match)."""
    import subprocess
    import sys

    pack = tmp_path / "pack"
    assert cli.main(["device-pack", "--target", "local", "--scale", "small", "--out", str(pack),
                     "--kernels", "layer_norm_backward,gather_backward"]) == 0
    assert "device_time.py" in capsys.readouterr().out
    assert not (pack / "tvm_runtime" / "tvm" / "lib" / "libtvm_compiler.so").exists()
    spec = json.loads((pack / "spec.json").read_text())
    assert [k["name"] for k in spec["kernels"]] == ["layer_norm_backward", "gather_backward"]
    assert spec["kernels"][0]["inputs"][0] == {"name": "x", "shape": [24, 64], "dtype": "float32", "kind": "normal"}
    assert spec["kernels"][0]["bytes"] == 4 * (2 * 24 * 64 + 2 * 64) + 4 * (24 * 64 + 2 * 64)  # x, dy, gamma, beta; dx, dgamma, dbeta
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="not empty and holds no device pack"):  # never wipes a directory
        cli.main(["device-pack", "--target", "local", "--scale", "small", "--out", str(other), "--kernels", "relu_backward"])
    assert (other / "notes.txt").exists()
    result = subprocess.run([sys.executable, str(pack / "device_time.py"), "--out", str(tmp_path / "r.json"),
                             "--repeats", "2", "--min-ms", "1"], cwd=tmp_path, capture_output=True, text=True,
                            env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"TVM runtime from {pack / 'tvm_runtime' / 'tvm'}" in result.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert [k["name"] for k in report["kernels"]] == ["layer_norm_backward", "gather_backward"]
    for k in report["kernels"]:
        assert k["ms"]["tvm"] > 0
        if "torch" in k["ms"]:  # the optional extra: outputs checked against PyTorch's gradients
            assert k["max_rel_diff"] < 1e-5, k


def test_cuda_device_pack_builds_and_stops_at_the_driver(tmp_path, capsys):
    """The CUDA pack: kernels compiled with nvcc into libraries holding CUDA modules; its timer,
    run here (no GPU driver), gets as far as loading TVM's CUDA runtime and says what is missing."""
    import shutil
    import subprocess
    import sys

    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed: CUDA kernels cannot be compiled into a pack")
    pack = tmp_path / "pack"
    assert cli.main(["device-pack", "--scale", "small", "--out", str(pack), "--kernels", "rms_norm_backward"]) == 0
    spec = json.loads((pack / "spec.json").read_text())
    assert spec["device"] == "cuda" and '"arch":"sm_90"' in spec["target"].replace(" ", "")
    assert b"cuda" in (pack / "rms_norm_backward.so").read_bytes()
    result = subprocess.run([sys.executable, str(pack / "device_time.py"), "--no-torch", "--out", str(tmp_path / "r.json")],
                            cwd=tmp_path, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, timeout=300)
    if result.returncode == 0:  # a machine with a GPU: the kernel ran there
        assert json.loads((tmp_path / "r.json").read_text())["kernels"][0]["ms"]["tvm"] > 0
    else:
        assert "libcuda.so.1" in result.stderr or "libcudart.so.13 not found" in result.stderr, result.stderr[-2000:]


def test_bench_pause_waits_for_busy_threads():
    """The pause before a timing lasts until the process's threads stop using the CPU (as TVM's
    pool spins for 150-180 ms after its last call), not just its minimum; an idle process waits
    its minimum and the quiet window, and never more than the cap. On a simulated clock: a thread
    that keeps one CPU busy until ``busy_s``."""
    from rlx_tvm.timing import settle

    def pause(busy_s, **kw):
        now = [0.0]

        def sleep(s):
            now[0] += s

        return settle(clock=lambda: now[0], cpu_seconds=lambda: min(now[0], busy_s), sleep=sleep, **kw)

    step = 20 / 4  # ms: the quiet window is checked in quarters
    waited = pause(0.3, min_ms=10, quiet_ms=20, max_ms=2000)
    assert 300 + 20 <= waited <= 300 + 20 + step + 1e-6, waited  # quiet for 20 ms after the thread stopped
    assert pause(0.0, min_ms=10, quiet_ms=20, max_ms=2000) == pytest.approx(10 + 20)  # minimum, then quiet
    capped = pause(0.5, min_ms=10, quiet_ms=20, max_ms=100)
    assert 100 <= capped <= 100 + step + 1e-6, capped
