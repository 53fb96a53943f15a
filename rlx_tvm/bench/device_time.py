"""Time a device pack's kernels on the machine it was carried to (see ``rlx_tvm/bench/device_pack.py``).

Standalone: ``rlx-tvm device-pack`` copies this file into the pack, and it runs there with the
machine's own Python (PyTorch, NumPy), importing only the pack's TVM runtime (no compiler:
``TVM_USE_RUNTIME_LIB=1``) and the pack's ``suite_torch.py``::

    python3 PACK/device_time.py --out results.json

For each kernel of ``PACK/spec.json``: the inputs (same generators and seed as
``SuiteKernel.inputs``) on the device, the TVM build (``PACK/<kernel>.so``, a Relax VM
executable) and PyTorch eager's backward, timed interleaved in rounds (median), each call count set
so a timing lasts ``--min-ms``; a device-to-device copy gives the memory bandwidth of the moment;
the TVM outputs are compared with PyTorch's gradients (max relative difference, reported, not
asserted: the semantics differ at the edges for fake-quantize). Prints a table, writes JSON.

A pack made with ``--tuning-round N`` also holds ``round/``: a MetaSchedule tuning round
(``rlx_tvm/tuning/device_round.py``), one library per task with its candidate schedules and
its default one. Those are timed first, each task in a child process (a candidate that faults
or hangs costs only itself: it is recorded as failed, as MetaSchedule's runner records one),
under ``--round-budget`` seconds; the times go into the results' ``"round"``, which
``rlx-tvm tune --device-results`` stores in the tuning database here. The results file is
rewritten after every task and kernel, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _import_runtime():
    os.environ["TVM_USE_RUNTIME_LIB"] = "1"  # libtvm_runtime only: the compiler is not in the pack
    sys.path.insert(0, os.path.join(HERE, "tvm_runtime"))
    sys.path.insert(0, HERE)
    import tvm

    return tvm


def _load_cuda_runtime(tvm) -> None:
    """TVM's CUDA runtime (``libtvm_runtime_cuda``, which registers the loader of CUDA modules):
    ``import tvm`` loads it only with the compiler, and it needs ``libcudart.so.13``, which a
    PyTorch install keeps in its ``nvidia`` packages rather than on the library path."""
    import ctypes
    import glob

    from tvm.base import _LOADED_LIBS
    from tvm_ffi.libinfo import load_lib_ctypes

    from pathlib import Path

    runtime_dir = Path(_LOADED_LIBS["tvm_runtime"]._name).resolve().parent

    def load():
        _LOADED_LIBS["tvm_runtime_cuda"] = load_lib_ctypes(
            package="tvm", target_name="tvm_runtime_cuda", extra_lib_paths=[runtime_dir], mode="RTLD_LOCAL")

    try:
        return load()
    except (OSError, RuntimeError):
        pass
    # PyTorch's CUDA wheels (nvidia/cu13/lib, nvidia/cuda_runtime/lib), then a CUDA toolkit
    found = [f for r in sys.path for f in glob.glob(os.path.join(r, "nvidia", "**", "libcudart.so.13*"), recursive=True)]
    found += [f for r in ("/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib")
              for f in glob.glob(os.path.join(r, "libcudart.so.13*"))]
    if not found:
        raise RuntimeError("libcudart.so.13 not found (TVM's CUDA runtime needs it): install PyTorch cu13x or CUDA 13")
    ctypes.CDLL(found[0], mode=ctypes.RTLD_GLOBAL)
    load()


def _inputs(spec, rng_seed: int = 0):
    """What ``SuiteKernel.inputs(scale, seed)`` makes, from the spec's shapes and generators."""
    import numpy as np

    rng = np.random.default_rng(rng_seed)
    out = {}
    for item in spec["inputs"]:
        shape, kind = tuple(item["shape"]), item["kind"]
        if kind.startswith("int<"):
            out[item["name"]] = rng.integers(0, int(kind[4:]), size=shape, dtype=np.int64)
        elif kind == "positive":
            out[item["name"]] = rng.uniform(0.5, 1.5, size=shape).astype(np.float32)
        else:
            out[item["name"]] = rng.standard_normal(shape, dtype=np.float32)
    return out


def _calibrated(run, sync, min_ms: float):
    run()
    sync()
    one = []
    for _ in range(3):
        t = time.perf_counter()
        run()
        sync()
        one.append(time.perf_counter() - t)
    calls = max(1, int(min_ms / 1e3 / max(min(one), 1e-7)))

    def timer() -> float:
        sync()
        t = time.perf_counter()
        for _ in range(calls):
            run()
        sync()
        return (time.perf_counter() - t) / calls * 1e3

    return timer


def _tvm_runner(tvm, path: str, dev, arrays):
    lib = tvm.runtime.load_module(path)
    vm = lib["vm_load_executable"]()
    cpu = tvm.cpu()
    # device type and id, allocator (2: pooled), then the same for the host
    vm["vm_initialization"](dev.dlpack_device_type(), dev.index, 2, cpu.dlpack_device_type(), cpu.index, 2)
    main = vm["main"]
    args = [tvm.runtime.tensor(a, dev) for a in arrays]

    def run():
        return main(*args)

    return run


def _torch_runner(name: str, arrays, device: str):
    import torch
    from suite_torch import BY_KERNEL

    ts = {k: torch.from_numpy(v.copy()).to(device) for k, v in arrays.items()}
    for v in ts.values():
        if v.is_floating_point():
            v.requires_grad_(True)
    out, leaves, cot = BY_KERNEL[name](**ts)
    cot = cot.detach().contiguous()
    return lambda: torch.autograd.grad(out, leaves, cot, retain_graph=True)


def _max_rel_diff(tvm_out, torch_out) -> float | None:
    import numpy as np

    pairs = []
    for a, b in zip([o.numpy() for o in tvm_out], [t.detach().cpu().numpy() for t in torch_out]):
        if a.shape != b.shape and b.ndim == 4 and a.shape == b.transpose(0, 2, 1, 3).shape:
            b = b.transpose(0, 2, 1, 3)  # attention: torch's [B, H, S, D] against rlx's [B, S, H, D]
        if a.shape != b.shape:
            return None
        pairs.append((a, b))
    if not pairs:
        return None
    return max(float(np.abs(a - b).max() / max(1e-30, np.abs(b).max())) for a, b in pairs)


def _round_arrays(tvm, args, dev):
    """The round's inputs as ``tune._random_tensors`` makes them: standard normal floats, zero
    integers (in range wherever they index)."""
    import numpy as np

    rng = np.random.default_rng(0)
    return [tvm.runtime.tensor(rng.standard_normal(shape).astype(dtype) if "float" in dtype
                               else np.zeros(shape, dtype), dev) for shape, dtype in args]


ROUND_LINE = "rlx-round "  # marks the child's result lines among whatever else it prints


def _load_compressed(tvm, path: str):
    """A round's task library (xz-compressed shared library), loaded from a temporary copy."""
    import lzma
    import tempfile

    with tempfile.TemporaryDirectory() as tmp, lzma.open(path) as src:
        so = os.path.join(tmp, "task.so")
        with open(so, "wb") as dst:
            dst.write(src.read())
        return tvm.runtime.load_module(so)


def _round_task(index: int, functions: list[str]) -> int:
    """Child process: time ``functions`` of the round's task ``index``, a JSON line each."""
    with open(os.path.join(HERE, "round", "round.json")) as f:
        rnd = json.load(f)
    task, ev = rnd["tasks"][index], rnd["evaluator"]
    tvm = _import_runtime()
    if rnd["device"] == "cuda":
        _load_cuda_runtime(tvm)
    dev = tvm.device(rnd["device"], 0)
    lib = _load_compressed(tvm, os.path.join(HERE, "round", task["library"]))
    args = _round_arrays(tvm, task["args"], dev)
    for name in functions:
        timer = lib.time_evaluator(name, dev, number=ev["number"], repeat=ev["repeat"],
                                   min_repeat_ms=ev["min_repeat_ms"])
        dev.sync()
        secs = [float(s) for s in timer(*args).results]
        print(ROUND_LINE + json.dumps({"function": name, "secs": secs}), flush=True)
    return 0


def _measure_round(rnd: dict, budget_s: float, timeout_s: float, save) -> dict:
    """Time every task's functions in child processes; a function that does not report within
    ``timeout_s`` (hangs) or whose child dies (faults) is recorded as failed (None)."""
    out = {"id": rnd["id"], "tasks": []}
    deadline = time.time() + budget_s
    for i, task in enumerate(rnd["tasks"]):
        if time.time() >= deadline:
            print(f"round: time budget spent, {len(rnd['tasks']) - i} task(s) not measured", flush=True)
            break
        t0 = time.time()
        # the default schedule first and last: its time is the bar the candidates must beat
        pending = [c["function"] for c in task["candidates"]]
        if task["default"]:
            pending = [task["default"], *pending, task["default"]]
        secs: dict[str, list | None] = {}
        silent = 0  # children in a row that failed before reporting anything
        while pending and time.time() < deadline:
            if silent == 2:  # the library itself does not load or run here: give up on the task
                print(f"  {task['name']}: {len(pending)} left unmeasured (two processes in a row failed at once)",
                      flush=True)
                secs.update({name: secs.get(name) for name in pending})
                break
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--round-task", str(i),
                                     "--functions", ",".join(pending)], stdout=subprocess.PIPE, text=True)
            silent += 1
            while pending and time.time() < deadline:
                ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
                line = proc.stdout.readline() if ready else ""
                if line and not line.startswith(ROUND_LINE):
                    print(line, end="", flush=True)
                    continue
                if not line:  # timed out, or the child died
                    name = pending.pop(0)
                    secs.setdefault(name, None)
                    print(f"  {task['name']} {name}: failed ({'timed out' if not ready else 'process died'})",
                          flush=True)
                    break
                got, silent = json.loads(line[len(ROUND_LINE):]), 0
                pending.pop(0)
                secs[got["function"]] = (secs.get(got["function"]) or []) + got["secs"]
            proc.kill()
            proc.wait()
        out["tasks"].append({"task": i, "secs": secs})
        save(out)
        good = [min(v) for n, v in secs.items() if v and n != task["default"]]
        default = secs.get(task["default"]) if task["default"] else None
        line = f"round [{i + 1}/{len(rnd['tasks'])}] {task['name']}: {len(good)} of {len(task['candidates'])} ran"
        line += f", best {min(good) * 1e6:.1f} us" if good else ""
        line += f", default {min(default) * 1e6:.1f} us" if default else ""
        print(f"{line} ({time.time() - t0:.0f} s)", flush=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Time a device pack's TVM kernels against PyTorch eager on this machine.")
    parser.add_argument("--out", default="device_results.json", help="JSON results file")
    parser.add_argument("--kernels", default="", help="comma-separated kernels (default: all in the pack)")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved rounds (median)")
    parser.add_argument("--min-ms", type=float, default=50.0, help="each timing lasts at least this long")
    parser.add_argument("--no-torch", action="store_true", help="leave out PyTorch")
    parser.add_argument("--no-round", action="store_true", help="leave out the pack's tuning round, if it has one")
    parser.add_argument("--round-budget", type=float, default=300.0,
                        help="seconds for the tuning round; tasks not started by then are left out (default 300)")
    parser.add_argument("--candidate-timeout", type=float, default=30.0,
                        help="a round candidate that has not reported after this many seconds failed (default 30)")
    parser.add_argument("--round-task", type=int, help=argparse.SUPPRESS)  # the child of the round
    parser.add_argument("--functions", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.round_task is not None:
        return _round_task(args.round_task, args.functions.split(","))

    with open(os.path.join(HERE, "spec.json")) as f:
        pack = json.load(f)
    tvm = _import_runtime()
    print(f"TVM runtime from {os.path.dirname(tvm.__file__)}", flush=True)
    device = pack["device"]  # "cuda" or "cpu" (a pack built for the CPU, to try the pack itself)
    if device == "cuda":
        _load_cuda_runtime(tvm)
    dev = tvm.device(device, 0)
    report = {"target": pack["target"], "device": device, "repeats": args.repeats, "min_ms": args.min_ms,
              "kernels": []}

    def save(part=None):
        if part is not None:
            report["round"] = part
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    round_file = os.path.join(HERE, "round", "round.json")
    if os.path.exists(round_file) and not args.no_round:
        with open(round_file) as f:
            rnd = json.load(f)
        print(f"tuning round {rnd['id']}: {len(rnd['tasks'])} tasks, "
              f"{sum(len(t['candidates']) for t in rnd['tasks'])} candidates", flush=True)
        _measure_round(rnd, args.round_budget, args.candidate_timeout, save)
    torch = None
    if not args.no_torch:
        try:
            import torch

            if device == "cuda" and not torch.cuda.is_available():
                torch = None
        except ImportError:
            torch = None

    def sync():
        dev.sync()
        if torch is not None and device == "cuda":
            torch.cuda.synchronize()

    copy_timer = None
    if torch is not None:
        a = torch.ones(24 << 20, device=device)
        b = torch.empty_like(a)
        copy_timer = _calibrated(lambda: b.copy_(a), sync, args.min_ms)
    packed = [k["name"] for k in pack["kernels"]]
    wanted = [k for k in args.kernels.split(",") if k] or packed
    if set(wanted) - set(packed):
        parser.error(f"not in this pack: {sorted(set(wanted) - set(packed))}; it has {packed}")
    results = report["kernels"]
    report["device_name"] = torch.cuda.get_device_name(0) if torch is not None and device == "cuda" else device
    for i, spec in enumerate([k for k in pack["kernels"] if k["name"] in wanted]):
        t0 = time.time()
        arrays = _inputs(spec)
        runners = {"tvm": _tvm_runner(tvm, os.path.join(HERE, spec["library"]), dev, list(arrays.values()))}
        if torch is not None:
            runners["torch"] = _torch_runner(spec["name"], arrays, device)
        check = None
        if "torch" in runners:
            check = _max_rel_diff(runners["tvm"](), runners["torch"]())
        timers = {n: _calibrated(r, sync, args.min_ms) for n, r in runners.items()}
        if copy_timer is not None:
            timers["copy"] = copy_timer
        samples = {n: [] for n in timers}
        order = random.Random(0)
        for _ in range(args.repeats):
            for n in order.sample(list(timers), len(timers)):
                samples[n].append(timers[n]())
        ms = {n: statistics.median(v) for n, v in samples.items()}
        copy_ms = ms.pop("copy", None)
        row = {"name": spec["name"], "ms": ms, "bytes": spec["bytes"], "flops": spec["flops"], "max_rel_diff": check,
               "copy_gbps": None if copy_ms is None else 2 * (24 << 20) * 4 / (copy_ms / 1e3) / 1e9}
        results.append(row)
        save()
        print(f"[{i + 1}/{len(wanted)}] {spec['name']}: " + ", ".join(f"{n} {v:.3f} ms" for n, v in ms.items())
              + f" ({time.time() - t0:.0f} s)", flush=True)
    print()
    head = ["kernel", "TVM ms", "PyTorch ms", "TVM / PyTorch", "rate", "check"]
    rows = []
    for r in results:
        tvm_ms, torch_ms = r["ms"]["tvm"], r["ms"].get("torch")
        rate = f"{r['flops'] / tvm_ms / 1e6:.1f} GFLOP/s" if r["flops"] else f"{r['bytes'] / tvm_ms / 1e6:.1f} GB/s"
        rows.append([r["name"], f"{tvm_ms:.3f}", "-" if torch_ms is None else f"{torch_ms:.3f}",
                     "-" if torch_ms is None else f"{tvm_ms / torch_ms:.2f}", rate,
                     "-" if r["max_rel_diff"] is None else f"{r['max_rel_diff']:.1e}"])
    widths = [max(len(str(x[c])) for x in [head, *rows]) for c in range(len(head))]
    for x in [head, ["-" * w for w in widths], *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(x, widths)).rstrip())
    save()
    print(f"\nresults written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
