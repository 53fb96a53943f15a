"""A device pack: the benchmark suite built here for a GPU target, with what it needs to be timed
on a machine that has the GPU, PyTorch and NumPy but neither TVM's compiler nor a network.

Such a machine may allow nothing to be fetched there and take little with a run (64 MiB, say),
while TVM's compiler library alone is 60 MB compressed (259 MB as installed). TVM's
runtime is small, though, and ``TVM_USE_RUNTIME_LIB=1`` makes ``import tvm`` load only it. So
:func:`build_pack` compiles every suite kernel here (CUDA through nvcc, so the libraries hold
device code for the target's architecture) and writes, into one directory:

* ``<kernel>.so``: the Relax VM executable of each suite kernel (``export_library``);
* ``spec.json``: per kernel its library, inputs (shape, dtype, generator), bytes and flops;
* ``tvm_runtime/``: TVM's Python package without the compiler library, its bundled headers and
  sources, and ``tvm_ffi`` for the device's Python version (fetched here with ``pip download``
  when that version is not this one's);
* ``suite_torch.py`` (the PyTorch counterparts) and ``device_time.py`` (the timer).

Run there: ``python3 PACK/device_time.py --out results.json``.

With ``tuning_round=N`` the pack also holds ``round/``: a MetaSchedule tuning round of up to N
candidates per task, built here (:mod:`rlx_tvm.tuning.device_round`), which ``device_time.py``
measures there before timing the suite; ``rlx-tvm tune --device-results results.json`` stores the
measurements in the work database here and exports the tuning log. Tuning needs the compiler, which
does not fit on the device, and an RPC tracker cannot reach it, so the search runs here and only
the measuring travels.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from types import SimpleNamespace

import tvm
import tvm_ffi

from ..build import compile as rlx_compile
from ..build import target_key, tuning_log_for
from ..tuning.device_round import make_round
from .suite import flops_of, suite_ir_module, suite_kernels, suite_module

__all__ = ["build_pack", "pack_size"]

# Parts of TVM's Python package the runtime does not use: the compiler (loaded only without
# TVM_USE_RUNTIME_LIB), and the headers and sources bundled for building against TVM.
_NOT_RUNTIME = ("lib/libtvm_compiler.so", "3rdparty", "src", "include")
FFI_VERSION = "0.1.14.post1"  # the pin of pyproject.toml


def _copy_runtime(dest: str, python_version: str, progress) -> None:
    tvm_dir = os.path.dirname(tvm.__file__)
    shutil.copytree(tvm_dir, os.path.join(dest, "tvm"), ignore=shutil.ignore_patterns("__pycache__"))
    for part in _NOT_RUNTIME:
        path = os.path.join(dest, "tvm", part)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if python_version == here:
        shutil.copytree(os.path.dirname(tvm_ffi.__file__), os.path.join(dest, "tvm_ffi"),
                        ignore=shutil.ignore_patterns("__pycache__", "include", "cmake"))
        return
    progress(f"fetching apache-tvm-ffi=={FFI_VERSION} for Python {python_version} (pip download)")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", f"apache-tvm-ffi=={FFI_VERSION}", "--no-deps",
                        "--only-binary=:all:", "--python-version", python_version, "-d", tmp, "-q"], check=True)
        (wheel,) = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        with zipfile.ZipFile(os.path.join(tmp, wheel)) as z:
            z.extractall(dest, [n for n in z.namelist() if n.startswith("tvm_ffi/") and "/include/" not in n])


def build_pack(out_dir: str, target, kernels=None, python_version: str | None = None, scale: str = "full",
               tuning_log: str | None = "auto", progress=print, tuning_round: int = 0,
               work_dir: str | None = None) -> dict:
    """Build the pack for ``target`` into ``out_dir`` (replaced); returns the spec. With
    ``tuning_round``, also a tuning round of that many candidates per task of the selected kernels
    into ``out_dir/round``, searched with the records of ``work_dir`` (the tuning database of
    ``rlx-tvm tune``, default ``tuning_work/<target key>``), which starts from ``tuning_log``'s
    records when it is empty."""
    target = tvm.target.Target(target) if not isinstance(target, tvm.target.Target) else target
    device = "cuda" if target.kind.name == "cuda" else "cpu" if target.kind.name == "llvm" else None
    if device is None:
        raise ValueError(f"rlx-tvm device-pack: targets 'cuda' and 'llvm' only (the timer runs them), not {target.kind.name}")
    python_version = python_version or f"{sys.version_info.major}.{sys.version_info.minor}"
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        if not os.path.exists(os.path.join(out_dir, "spec.json")):  # replace earlier packs only
            raise ValueError(f"rlx-tvm device-pack: {out_dir} is not empty and holds no device pack (spec.json); "
                             "give a new or empty directory")
        shutil.rmtree(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    spec = {"target": str(target), "device": device, "scale": scale, "python": python_version, "kernels": []}
    selected = suite_kernels(kernels)
    for i, kernel in enumerate(selected):
        mod = suite_module(kernel, scale)
        library = f"{kernel.name}.so"
        rlx_compile(mod, target, tuning_log=tuning_log, verbose=False).export_library(os.path.join(out_dir, library))
        inputs = kernel.inputs(scale)
        outputs = [SimpleNamespace(shape=[int(d) for d in o.shape.values]) for o in mod["main"].ret_ty.fields]
        spec["kernels"].append({
            "name": kernel.name, "library": library,
            "inputs": [{"name": n, "shape": list(a.shape), "dtype": str(a.dtype), "kind": kernel.shapes(scale)[n][1]}
                       for n, a in inputs.items()],
            "bytes": kernel.bytes_moved(inputs, outputs),
            "flops": flops_of(kernel, scale),
        })
        progress(f"[{i + 1}/{len(selected)}] {kernel.name}: {library} "
                 f"({os.path.getsize(os.path.join(out_dir, library)) // 1024} KiB)")
    if tuning_round > 0:
        work_dir = work_dir or os.path.join("tuning_work", target_key(target))
        progress(f"tuning round: up to {tuning_round} candidates per task, searched with the records of {work_dir}")
        rnd = make_round(suite_ir_module(selected, scale), target, work_dir, os.path.join(out_dir, "round"),
                         trials=tuning_round, progress=progress,
                         seed_log=tuning_log_for(target) if tuning_log == "auto" else tuning_log)
        spec["round"] = {"id": rnd["id"], "work_dir": work_dir}
    _copy_runtime(os.path.join(out_dir, "tvm_runtime"), python_version, progress)
    here = os.path.dirname(os.path.abspath(__file__))
    shutil.copy(os.path.join(here, "suite_torch.py"), out_dir)
    shutil.copy(os.path.join(here, "device_time.py"), out_dir)
    with open(os.path.join(out_dir, "spec.json"), "w") as f:
        json.dump(spec, f, indent=1)
    return spec


def pack_size(out_dir: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(out_dir) for f in files)
