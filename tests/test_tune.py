"""MetaSchedule tuning end to end on one small kernel (a dozen trials): database written, resumed,
reloaded by rlx_tvm.compile and applied, result equal to the NumPy reference; bad logs."""

import os
import shutil

import numpy as np
import pytest
import tvm
from tvm import relax

import rlx_tvm
from rlx_tvm.build import TuningLogError
from rlx_tvm.target import cpu_target
from rlx_tvm.tuning import SKIPPED, tune
from rlx_tvm.testing import Case, build_module

RNG = np.random.default_rng(11)
TRIALS = 12


def _case(rows):
    return Case("layer_norm_backward_input", {"x": RNG.standard_normal((rows, 128)),
                                              "gamma": RNG.standard_normal(128),
                                              "dy": RNG.standard_normal((rows, 128))})


def _run(ex, case):
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["case_0"](*[tvm.runtime.tensor(a) for a in case.cast_inputs("float32").values()]).numpy()


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("tune"))
    case = _case(32)
    results = tune(build_module([case], "float32", symbolic=False), cpu_target(), trials=TRIALS, work_dir=work)
    return work, case, results


def test_tuning_writes_a_database(tuned):
    work, _, results = tuned
    assert len(results) == 1 and results[0].status == "tuned", results
    assert results[0].trials >= TRIALS // 2 and results[0].best_us is not None and results[0].best_us > 0
    for f in ("database_workload.json", "database_tuning_record.json"):
        assert os.path.getsize(os.path.join(work, f)) > 0


def test_resume_keeps_records_and_skips_finished_tasks(tuned, capsys):
    work, case, first = tuned
    again = tune(build_module([case], "float32", symbolic=False), cpu_target(), trials=first[0].trials, work_dir=work)
    assert [r.status for r in again] == ["resumed"]
    assert again[0].trials == first[0].trials and again[0].best_us == first[0].best_us
    assert "records already" in capsys.readouterr().out


def test_spent_time_budget_skips_tasks_and_keeps_records(tuned, capsys):
    """With the time budget spent no task starts: a task with records (asked for more trials) and a
    new one are both skipped, the records stay, and the lines say why."""
    work, case, first = tuned
    mod = build_module([case, _case(16)], "float32", symbolic=False)
    again = tune(mod, cpu_target(), trials=first[0].trials + 8, work_dir=work, time_budget=0)
    assert [r.status for r in again] == [SKIPPED, SKIPPED]
    assert sorted(r.trials for r in again) == [0, first[0].trials]
    assert capsys.readouterr().out.count(SKIPPED) == 2


def test_compile_applies_the_log_and_matches_the_reference(tuned, capsys):
    work, case, _ = tuned
    mod = build_module([case], "float32", symbolic=False)
    ex = rlx_tvm.compile(mod, cpu_target(), tuning_log=work)
    assert "1 of 1 kernels tuned" in capsys.readouterr().err
    np.testing.assert_allclose(_run(ex, case), case.reference(), rtol=2e-4, atol=2e-5)

    other = _case(16)  # another shape: no record, default schedule, says so
    ex = rlx_tvm.compile(build_module([other], "float32", symbolic=False), cpu_target(), tuning_log=work)
    err = capsys.readouterr().err
    assert "0 of 1 kernels tuned" in err and "no record in the log matches" in err, err
    np.testing.assert_allclose(_run(ex, other), other.reference(), rtol=2e-4, atol=2e-5)


def test_empty_log_builds_default_schedules_and_says_why(tmp_path, capsys):
    """A log that export left empty (no record beat its default schedule) is valid: the kernels
    get default schedules, and the message says the log holds nothing rather than blaming shapes."""
    from tvm.s_tir import meta_schedule as ms

    from rlx_tvm.tuning import export_log

    case = _case(16)
    (tmp_path / "work").mkdir()
    ms.database.JSONDatabase(work_dir=str(tmp_path / "work"))  # a work database with no records
    export_log(str(tmp_path / "work"), str(tmp_path / "empty"), verbose=False)
    ex = rlx_tvm.compile(build_module([case], "float32", symbolic=False), cpu_target(), tuning_log=str(tmp_path / "empty"))
    err = capsys.readouterr().err
    assert "0 of 1 kernels tuned" in err and "the log holds no records" in err, err
    np.testing.assert_allclose(_run(ex, case), case.reference(), rtol=2e-4, atol=2e-5)


def test_missing_or_corrupt_log_is_a_clear_error(tuned, tmp_path):
    work, case, _ = tuned
    mod = build_module([case], "float32", symbolic=False)
    with pytest.raises(TuningLogError, match="missing"):
        rlx_tvm.compile(mod, cpu_target(), tuning_log=str(tmp_path / "nowhere"))
    bad = tmp_path / "bad"
    shutil.copytree(work, bad)
    (bad / "database_tuning_record.json").write_text('[0, ["not a trace"\n')
    with pytest.raises(TuningLogError, match="cannot be read"):
        rlx_tvm.compile(mod, cpu_target(), tuning_log=str(bad))


@pytest.fixture
def rpc_tracker():
    """A TVM RPC tracker with two CPU servers on loopback, stopped afterwards."""
    import time

    from tvm import rpc
    from tvm.rpc.server import Server
    from tvm.rpc.tracker import Tracker

    key = "rlx-test-cpu"
    tracker = Tracker("127.0.0.1", port=9190, port_end=9290, silent=True)
    servers = [Server("127.0.0.1", port=9300, port_end=9400, key=key, tracker_addr=("127.0.0.1", tracker.port),
                      silent=True) for _ in range(2)]
    try:
        for _ in range(60):
            if len(rpc.connect_tracker("127.0.0.1", tracker.port).summary().get("server_info", [])) == 2:
                break
            time.sleep(0.5)
        yield f"127.0.0.1:{tracker.port}", key
    finally:
        for s in servers:
            s.terminate()
        tracker.terminate()


def test_tuning_through_an_rpc_tracker(rpc_tracker, tmp_path, capsys):
    from rlx_tvm.tuning import rpc_runner

    tracker, key = rpc_tracker
    case = _case(24)
    mod = build_module([case], "float32", symbolic=False)
    results = tune(mod, cpu_target(), trials=8, work_dir=str(tmp_path), runner=rpc_runner(tracker, key))
    assert [r.status for r in results] == ["tuned"] and results[0].best_us is not None
    measured = [r for r in rlx_tvm.build.load_tuning_log(str(tmp_path)).get_all_tuning_records()
                if float(r.run_secs[0]) < 1e9]
    assert len(measured) >= 4  # run on the servers, not failed
    ex = rlx_tvm.compile(mod, cpu_target(), tuning_log=str(tmp_path))
    assert "1 of 1 kernels tuned" in capsys.readouterr().err
    np.testing.assert_allclose(_run(ex, case), case.reference(), rtol=2e-4, atol=2e-5)

    with pytest.raises(ConnectionError, match="no server with key 'other'"):
        rpc_runner(tracker, "other")


def test_rpc_tracker_errors():
    from rlx_tvm.tuning import rpc_runner

    with pytest.raises(ValueError, match="HOST:PORT"):
        rpc_runner("localhost", "k")
    with pytest.raises(ConnectionError, match="cannot reach the RPC tracker"):
        rpc_runner("127.0.0.1:1", "k")


def test_data_movement_kernels_get_copy_trials():
    """A slice (no arithmetic) is tuned with at most ``copy_trials``; a kernel with arithmetic gets
    ``trials``, and so does hand-written TIR whose flops TVM cannot estimate."""
    from tvm import te
    from tvm.script import tirx as T

    from rlx_tvm.tuning.search import is_hand_scheduled, trials_for

    a = te.placeholder((64, 128), name="a")
    sliced = tvm.IRModule({"main": te.create_prim_func([a, te.compute((64, 64), lambda i, j: a[i, j + 32])])})
    scaled = tvm.IRModule({"main": te.create_prim_func([a, te.compute((64, 128), lambda i, j: a[i, j] * 2.0)])})

    @T.prim_func
    def shuffled(x: T.Buffer((8,), "float32"), y: T.Buffer((8,), "float32")):
        y[T.Ramp(0, 1, 8)] = T.Shuffle([x[T.Ramp(0, 1, 8)]], [7, 6, 5, 4, 3, 2, 1, 0])

    assert trials_for(sliced, 200, 32) == 32 and trials_for(sliced, 16, 32) == 16
    assert trials_for(sliced, 200, None) == 200
    assert trials_for(scaled, 200, 32) == 200
    assert trials_for(tvm.IRModule({"main": shuffled}), 200, 32) == 200
    # vector expressions written by hand (the cumsum scan) mark a kernel as scheduled by hand; TE's do not
    assert is_hand_scheduled(tvm.IRModule({"main": shuffled}))
    assert not is_hand_scheduled(scaled) and not is_hand_scheduled(sliced)


def test_hand_scheduled_kernels_are_skipped(tmp_path, capsys):
    """Max-pool's routing kernel is TIR with vector loops: no design space, and MetaSchedule's
    postprocessors would break its build; it is skipped with a reason, the reshape beside it is tuned."""
    from rlx_tvm.tuning import HAND_SCHEDULED

    case = Case("max_pool2d_backward", {"x": RNG.standard_normal((1, 2, 8, 8)), "dy": RNG.standard_normal((1, 2, 4, 4))},
                {"kernel_size": (2, 2), "stride": (2, 2)})
    results = tune(build_module([case], "float32", symbolic=False), cpu_target(), trials=2, work_dir=str(tmp_path))
    statuses = {r.name: r.status for r in results}
    assert statuses.pop("rlx_max_pool2d_backward") == HAND_SCHEDULED, results
    assert statuses and all(s == "tuned" for s in statuses.values()), results
    assert "scheduled by hand" in capsys.readouterr().out


def test_long_stage_lists_are_labelled_by_their_ends():
    from tvm import te

    from rlx_tvm.tuning.export import kernel_label

    def next_stage(prev, i):
        return te.compute((16,), lambda j: prev[j] + 1.0, name=f"stage_number_{i}")

    stages = [te.placeholder((16,), name="a")]
    for i in range(12):
        stages.append(next_stage(stages[-1], i))
    label = kernel_label(tvm.IRModule({"main": te.create_prim_func([stages[0], stages[-1]])}))
    assert label == "stage_number_0/stage_number_1/... 9 more .../stage_number_11", label
    short = kernel_label(tvm.IRModule({"main": te.create_prim_func([stages[0], stages[2]])}))
    assert short == "stage_number_0/stage_number_1", short


def test_long_task_names_are_shortened_for_tables():
    """Fused task names list every fused operator; tables keep the start and the length."""
    from rlx_tvm.tuning.search import short_task_name

    name = "fused_" + "_".join(["concatenate"] * 30)
    short = short_task_name(name)
    assert len(short) <= 64 and short.startswith("fused_concatenate_") and f"({len(name)} chars)" in short, short
    assert short_task_name("rlx_layer_norm_backward_input_gamma_beta") == "rlx_layer_norm_backward_input_gamma_beta"
