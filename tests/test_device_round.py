"""Tuning rounds measured on a machine without TVM's compiler (rlx_tvm/tuning/device_round.py):
candidates searched and built here, timed by the pack's device_time.py with TVM's runtime alone,
stored back in the MetaSchedule database, exported against the default schedule's time there."""

import json
import lzma
import re
import shutil
import subprocess
import sys

import pytest
import tvm
from tvm.s_tir import meta_schedule as ms

from rlx_tvm import cli
from rlx_tvm.build import lower_with_report
from rlx_tvm.bench.suite import suite_ir_module, suite_kernels, suite_module
from rlx_tvm.target import cpu_target
from rlx_tvm.tuning import export_log
from rlx_tvm.tuning.device_round import DEFAULT_FUNC, commit_round, device_defaults, make_round

KERNELS = "relu_backward,layer_norm_backward"


def test_cpu_round_trip_measures_stores_and_applies(tmp_path, capsys):
    """A pack for this CPU with a round: the timer (a separate Python, runtime only) measures each
    candidate and the default schedule; a candidate whose child process dies, or that does not
    report in time, is recorded as failed and the rest of its task still runs; a task whose library
    does not load is given up; `rlx-tvm tune --device-results` stores every measurement as a tuning
    record and the defaults' times, for the pack's target only; the exported log applies; a second
    round's model learns from the first, and a round in a new clone from the committed log;
    results of another round, or of a round stored already, are refused."""
    pack, work, log = tmp_path / "pack", tmp_path / "work", tmp_path / "log"
    assert cli.main(["device-pack", "--target", "local", "--scale", "small", "--out", str(pack), "--kernels", KERNELS,
                     "--tuning-round", "3", "--work-dir", str(work)]) == 0
    assert "tuning round: up to 3 candidates per task" in capsys.readouterr().out
    rnd = json.loads((pack / "round" / "round.json").read_text())
    assert json.loads((pack / "spec.json").read_text())["round"]["id"] == rnd["id"]
    assert rnd["device"] == "cpu" and len(rnd["tasks"]) >= 2
    for task in rnd["tasks"]:
        assert (pack / "round" / task["library"]).exists() and task["default"] == DEFAULT_FUNC
        assert 1 <= len(task["candidates"]) <= 3
    (broken,) = [t for t in rnd["tasks"] if t["name"] == "rlx_relu_backward"]
    broken["library"] = "missing.so.xz"  # every child dies at once: the task is given up
    victim = max(rnd["tasks"], key=lambda t: len(t["candidates"]))
    assert len(victim["candidates"]) >= 2 and victim is not broken
    victim["candidates"][0]["function"] = "not_in_the_library"  # its child process dies on it
    (pack / "round" / "round.json").write_text(json.dumps(rnd))

    out = tmp_path / "r.json"
    result = subprocess.run([sys.executable, str(pack / "device_time.py"), "--out", str(out), "--no-torch",
                             "--repeats", "1", "--min-ms", "1"], cwd=tmp_path, capture_output=True, text=True,
                            env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "not_in_the_library: failed (process died)" in result.stdout
    assert re.search(rf"{broken['name']}: \d+ left unmeasured \(two processes in a row failed", result.stdout)
    measured = json.loads(out.read_text())["round"]
    assert measured["id"] == rnd["id"] and len(measured["tasks"]) == len(rnd["tasks"])
    for task, got in zip(rnd["tasks"], measured["tasks"]):
        names = [c["function"] for c in task["candidates"]]
        assert set(got["secs"]) == {DEFAULT_FUNC, *names}
        if task is broken:
            assert all(v is None for v in got["secs"].values())
            continue
        assert len(got["secs"][DEFAULT_FUNC]) == 2  # first and last
        for name in names:
            if name == "not_in_the_library":
                assert got["secs"][name] is None
            else:
                assert all(s > 0 for s in got["secs"][name])

    hung = subprocess.run([sys.executable, str(pack / "device_time.py"), "--out", str(tmp_path / "hung.json"),
                           "--no-torch", "--kernels", "relu_backward", "--repeats", "1", "--min-ms", "1",
                           "--candidate-timeout", "0.001"], cwd=tmp_path, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}, timeout=300)
    assert hung.returncode == 0, hung.stderr[-2000:]
    assert "default: failed (timed out)" in hung.stdout  # no child reports within 1 ms: each counts as hung
    assert all(v is None for t in json.loads((tmp_path / "hung.json").read_text())["round"]["tasks"]
               for v in t["secs"].values())

    with pytest.raises(SystemExit, match="--target is cuda-sm_90, but the pack .* was built for llvm-"):
        cli.main(["tune", "--target", '{"kind": "cuda", "arch": "sm_90"}', "--device-results", str(out),
                  "--pack", str(pack)])  # GPU records must not land in a CPU's log, nor the reverse
    assert cli.main(["tune", "--kernels", KERNELS, "--scale", "small", "--log-dir", str(log),
                     "--device-results", str(out), "--pack", str(pack), "--keep-all"]) == 0  # target, work dir: the pack's
    text = capsys.readouterr().out
    n = sum(len(t["candidates"]) for t in rnd["tasks"])
    assert f"stored {n} measured candidates of {len(rnd['tasks'])} tasks" in text
    assert "measured on a device" in (log / "TUNING.md").read_text()
    records = ms.database.JSONDatabase(work_dir=str(work)).get_all_tuning_records()
    assert len(records) == n
    stored = sorted(float(r.run_secs[0]) for r in records)
    sent = sorted(got["secs"][c["function"]][0] if got["secs"][c["function"]] else 1e10
                  for task, got in zip(rnd["tasks"], measured["tasks"]) for c in task["candidates"])
    assert stored == pytest.approx(sent)
    defaults = device_defaults(str(work))
    assert sorted(defaults.values()) == pytest.approx(
        sorted(min(got["secs"][DEFAULT_FUNC]) * 1e6 for got in measured["tasks"] if got["secs"][DEFAULT_FUNC]))
    assert len(defaults) == len(rnd["tasks"]) - 1  # not the broken task's
    # the log (every task's best, --keep-all) tunes layer norm's kernels; relu's one record failed
    report = lower_with_report(suite_module(suite_kernels(["layer_norm_backward"])[0], "small"), cpu_target(),
                               tuning_log=str(log), verbose=False)[1]
    assert report.tuned and len(report.tuned) == report.kernels, report.note
    report = lower_with_report(suite_module(suite_kernels(["relu_backward"])[0], "small"), cpu_target(),
                               tuning_log=str(log), verbose=False)[1]
    assert not report.tuned, report.note

    again = make_round(suite_ir_module(suite_kernels(KERNELS.split(",")), "small"), cpu_target(), str(work),
                       str(tmp_path / "round2"), trials=2, progress=print)
    text = capsys.readouterr().out
    assert len(again["tasks"]) == len(rnd["tasks"])
    for task, got in zip(rnd["tasks"], measured["tasks"]):  # each task's model learnt from its measured records
        ran = sum(got["secs"][c["function"]] is not None for c in task["candidates"])
        assert re.search(rf"\] {task['name']}: \d+ candidate\(s\).*, model trained on {ran} measured", text), text

    # a new clone has the committed log but not the git-ignored work database: a round starts from the log
    make_round(suite_ir_module(suite_kernels(KERNELS.split(",")), "small"), cpu_target(), str(tmp_path / "new"),
               str(tmp_path / "round3"), trials=2, progress=print, seed_log=str(log))
    text = capsys.readouterr().out
    in_log = len(ms.database.JSONDatabase(work_dir=str(log)).get_all_tuning_records())
    assert f"is empty: starting from the {in_log} records of {log}" in text
    for task in rnd["tasks"]:  # a record per task in the log (--keep-all), but none that ran for relu
        assert re.search(rf"\] {task['name']}: .*model trained on {0 if task is broken else 1} measured", text), text

    with pytest.raises(ValueError, match=f"results are of round 'elsewhere', but .* holds round '{rnd['id']}'"):
        commit_round(str(pack / "round"), {"id": "elsewhere", "tasks": []}, str(work))
    with pytest.raises(ValueError, match=f"round {rnd['id']} is already stored in"):  # records would count twice
        commit_round(str(pack / "round"), measured, str(work))
    with pytest.raises(SystemExit, match="holds no tuning round"):
        (tmp_path / "plain.json").write_text(json.dumps({"kernels": []}))
        cli.main(["tune", "--kernels", KERNELS, "--log-dir", str(log),
                  "--device-results", str(tmp_path / "plain.json"), "--pack", str(pack)])


def test_gpu_round_keeps_only_records_that_beat_the_default_on_the_device(tmp_path):
    """For a GPU target the export cannot time anything here: it keeps a record only when it ran at
    least 5% faster on the device than the default schedule timed beside it. The same CUDA round,
    given two sets of device times (made up here: no GPU), gives a log that tunes the kernel and
    one that leaves it to the default schedule."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed: CUDA candidates cannot be built")
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host="llvm")
    kernel = suite_kernels(["relu_backward"])[0]  # one task, whose candidates always build
    mod = suite_ir_module([kernel], "small")
    rnd = make_round(mod, target, str(tmp_path / "searched"), str(tmp_path / "round"), trials=2, progress=print)
    assert rnd["device"] == "cuda" and rnd["tasks"]
    with lzma.open(tmp_path / "round" / rnd["tasks"][0]["library"]) as f:  # a library holding a CUDA module
        assert b"cuda" in f.read()

    def device_times(ratio):  # every candidate at `ratio` times the default's 100 us
        return {"id": rnd["id"], "tasks": [
            {"task": i, "secs": {DEFAULT_FUNC: [100e-6, 101e-6], **{c["function"]: [ratio * 100e-6]
                                                                      for c in t["candidates"]}}}
            for i, t in enumerate(rnd["tasks"])]}

    kernels = {"relu_backward (small)": suite_module(kernel, "small")}
    for ratio, kept in ((0.5, True), (0.97, False)):
        work, log = tmp_path / f"work{ratio}", tmp_path / f"log{ratio}"
        summary = commit_round(str(tmp_path / "round"), device_times(ratio), str(work))
        assert [x for s in summary for x in s[2:]] == pytest.approx([ratio * 100, 100] * len(rnd["tasks"]))
        export = export_log(str(work), str(log), target, kernels=kernels, verbose=False)
        assert [x for r in export.rows for x in (r.tuned_us, r.default_us)] == pytest.approx(
            [ratio * 100, 100] * len(rnd["tasks"]))
        assert [r.kept for r in export.rows] == [kept] * len(rnd["tasks"])
        report = lower_with_report(suite_module(kernel, "small"), target, tuning_log=str(log), verbose=False)[1]
        assert bool(report.tuned) == kept and ("holds no records" in report.note) != kept, report.note


def test_sparse_tiling_spaces_are_still_searched_on_cuda():
    """At full shapes most samples of CUDA layer norm dgamma's multi-level-tiling space exceed the
    shared-memory limit; the search still draws its candidates from that space (with MetaSchedule's
    default of 50 valid first samples it gave up and fell back to the space without tiling)."""
    from rlx_tvm.build import lower
    from rlx_tvm.tuning import tuning_target
    from rlx_tvm.tuning.device_round import round_candidates

    target = tuning_target(tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host="llvm"))
    mod = lower(suite_ir_module(suite_kernels(["layer_norm_backward"]), "full"), target, schedule=False)
    (task,) = [t for t in ms.relax_integration.extract_tasks(mod, target)
               if t.task_name == "rlx_layer_norm_backward_gamma"]
    found, how, _ = round_candidates(task.dispatched[0], target, task.task_name, 16, ms.database.MemoryDatabase(), 0)
    assert found and how == "", (len(found), how)  # "": the first space, with multi-level tiling
