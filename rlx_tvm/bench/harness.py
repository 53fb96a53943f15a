"""``rlx-tvm bench``: the backward-kernel suite timed side by side.

For every suite kernel (:mod:`rlx_tvm.bench.suite`) and in one process:

* ``tuned``: :func:`rlx_tvm.compile` with the committed tuning log of the target (kernels without
  a record get default schedules; the count is reported);
* ``default``: :func:`rlx_tvm.compile` without a log (rlx default schedules);
* ``tvm``: TVM 0.27 on its own: its ``relax.op.grad`` ops where it has them, else the rlx
  decomposition into primitive Relax ops, compiled by plain ``tvm.compile`` (no schedules);
* ``torch``: PyTorch eager CPU, the backward only (``torch.autograd.grad`` on a saved forward),
  when torch is installed.

Repeats are interleaved (each round times every variant once, in a shuffled order, seeded), each
timing averages enough calls to last ``min_ms`` and follows a pause of at least ``settle_ms``
that lasts until the process's threads are idle (:func:`rlx_tvm.timing.settle`), and the
median over repeats is reported. TVM and torch use the same thread count. A parallel copy kernel,
timed in every kernel's rounds alongside its variants, gives the machine's copy bandwidth at that
time, the yardstick for that memory-bound kernel (on a shared machine it moved between 29.5 and 52
GB/s, up to 1.6x within one run); compute-bound ones (conv, attention) report GFLOP/s.
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import tvm
from tvm import te

from .. import build
from ..passes import DecomposeBackwardOps
from ..target import cpu_target
from ..testing import as_tensors
from ..threads import cpu_threads
from ..timing import SETTLE_MS, calibrated_timer, settle, vm_runner
from .suite import flops_of, suite_kernels, suite_module

__all__ = ["KernelResult", "VARIANTS", "format_markdown", "format_table", "run_bench", "write_json"]

VARIANTS = ("tuned", "default", "tvm", "torch")


@dataclass
class KernelResult:
    name: str
    ms: dict[str, float] = field(default_factory=dict)  # variant -> median milliseconds
    bytes: int = 0
    flops: float | None = None
    tuned_kernels: str = ""  # "k/n" kernels with a tuning record
    max_rel_diff: float = 0.0  # largest difference between the TVM variants' outputs
    copy_gbps: float = 0.0  # the copy kernel's bandwidth, timed in this kernel's rounds

    def rate(self, variant: str = "tuned") -> tuple[float, str] | None:
        if variant not in self.ms:
            return None
        secs = self.ms[variant] / 1e3
        return (self.flops / secs / 1e9, "GFLOP/s") if self.flops else (self.bytes / secs / 1e9, "GB/s")

    def copy_fraction(self, variant: str = "tuned") -> float | None:
        """The memory-bound rate as a fraction of the copy bandwidth of the same rounds."""
        rate = self.rate(variant)
        return None if self.flops or rate is None or not self.copy_gbps else rate[0] / self.copy_gbps


COPY_ELEMENTS = 24 << 20


def _copy_runner(target, n: int = COPY_ELEMENTS):
    """A parallel, vectorized float32 copy of ``n`` elements, whose GB/s (read + write) is the
    yardstick; 96 MiB a side by default, past the last-level cache, like the memory-bound suite
    kernels (3 x 32 MiB)."""
    a = te.placeholder((n // 1024, 1024), "float32", name="a")
    b = te.compute(a.shape, lambda i, j: a[i, j], name="b")
    sch = tvm.s_tir.Schedule(te.create_prim_func([a, b]))
    i, j = sch.get_loops(sch.get_sblock("b"))
    sch.parallel(i)
    _, lanes = sch.split(j, factors=[None, 16])  # one 512-bit vector (a 1024-wide one spills)
    sch.vectorize(lanes)
    f = tvm.compile(sch.mod, target=target)
    x = tvm.runtime.tensor(np.ones((n // 1024, 1024), "float32"))
    y = tvm.runtime.empty((n // 1024, 1024), "float32")
    return lambda: f(x, y)


def _copy_gbps(ms: float, n: int = COPY_ELEMENTS) -> float:
    return 2 * n * 4 / (ms / 1e3) / 1e9


def _torch_runner(kernel, inputs):
    import torch

    ts = {k: torch.from_numpy(v.copy()) for k, v in inputs.items()}
    for k, v in ts.items():
        if v.is_floating_point():
            v.requires_grad_(True)
    out, leaves, cot = kernel.torch(**ts)
    cot = cot.detach().contiguous()

    def run():
        return torch.autograd.grad(out, leaves, cot, retain_graph=True)

    return run


def run_bench(kernels=None, repeats: int = 5, min_ms: float = 50.0, threads: int | None = None,
              tuning_log: str | None = "auto", use_torch: bool = True, scale: str = "full",
              settle_ms: float = SETTLE_MS, progress=print) -> dict:
    """Time the suite; returns the JSON-able result (also what :func:`format_table` prints)."""
    threads = threads or cpu_threads()
    os.environ["TVM_NUM_THREADS"] = str(threads)  # before TVM's thread pool starts (at the first parallel kernel)
    torch = None
    if use_torch:
        try:
            import torch
        except ImportError:
            progress("torch is not installed: no PyTorch column (pip install -e '.[torch]')")
    if torch is not None:
        torch.set_num_threads(threads)
    target = cpu_target()
    log = build.tuning_log_for(target) if tuning_log == "auto" else tuning_log
    if log is None:
        progress(f"no tuning log for {build.target_key(target)}: the 'tuned' column is left out")

    copy_timer = calibrated_timer(_copy_runner(target), min_ms)
    results = []
    selected = suite_kernels(kernels)
    for i, kernel in enumerate(selected):
        t0 = time.time()
        inputs = kernel.inputs(scale)
        args = as_tensors(inputs.values())
        mod = suite_module(kernel, scale)
        exes = {}
        res = KernelResult(kernel.name, flops=flops_of(kernel, scale))
        same_as_default = False
        if log is not None:
            lowered, how = build.lower_with_report(mod, target, tuning_log=log, verbose=False)
            res.tuned_kernels = f"{len(how.tuned)}/{how.kernels}"
            # No record applies: the tuned build is the default build. Timed as a copy of its own,
            # it differed from the default by up to 1.6x on this shared machine (layer norm, same
            # code, 4.4 vs 2.8 ms): noise, not tuning. It gets the default's timings instead.
            same_as_default = not how.tuned
            if not same_as_default:
                exes["tuned"] = tvm.compile(lowered, target=target)
        exes["default"] = build.compile(mod, target, tuning_log=None)
        base = suite_module(kernel, scale, "tvm") if kernel.tvm else DecomposeBackwardOps()(mod)
        exes["tvm"] = tvm.compile(base, target=target)
        runners, outs = {}, {}
        for name, ex in exes.items():
            runners[name] = vm_runner(ex, args)
            outs[name] = [o.numpy() for o in runners[name]()]
        ref = outs["default"]
        res.bytes = kernel.bytes_moved(inputs, ref)
        res.max_rel_diff = max(
            float(np.abs(a - b).max() / max(1e-30, np.abs(b).max())) for o in outs.values() for a, b in zip(o, ref))
        if torch is not None:
            runners["torch"] = _torch_runner(kernel, inputs)
        timers = {name: calibrated_timer(run, min_ms) for name, run in runners.items()}
        timers["copy"] = copy_timer
        samples: dict[str, list[float]] = {name: [] for name in timers}
        names = list(timers)
        order = random.Random(0)
        for _ in range(repeats):  # interleaved: every variant once per round, in shuffled order
            # (a rotation kept each variant behind the same one in most rounds, and whatever ran
            # before a timing could slow it: tuned, right after torch and the copy, read 12-40%
            # slower than the identical default kernels on rope and RMS norm)
            for name in order.sample(names, len(names)):
                settle(settle_ms)
                samples[name].append(timers[name]())
        res.copy_gbps = _copy_gbps(statistics.median(samples.pop("copy")))
        res.ms = {name: statistics.median(v) for name, v in samples.items()}
        if same_as_default:
            res.ms = {"tuned": res.ms["default"], **res.ms}
        results.append(res)
        progress(f"[{i + 1}/{len(selected)}] {kernel.name}: "
                 + ", ".join(f"{n} {ms:.3f} ms" for n, ms in res.ms.items())
                 + f", copy {res.copy_gbps:.1f} GB/s  ({time.time() - t0:.0f} s)")
    return _report(results, threads, target, log, repeats, settle_ms)


def _geomean(xs):
    xs = [x for x in xs if x and x > 0]
    return float(np.exp(np.mean(np.log(xs)))) if xs else None


def _report(results, threads, target, log, repeats, settle_ms=SETTLE_MS) -> dict:
    best = "tuned" if all("tuned" in r.ms for r in results) else "default"
    vs_torch = [r.ms[best] / r.ms["torch"] for r in results if "torch" in r.ms]
    vs_tvm = [r.ms["tvm"] / r.ms[best] for r in results]
    memory_bound = [r for r in results if not r.flops]
    return {
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "target": str(target), "threads": threads, "repeats": repeats, "settle_ms": settle_ms, "tuning_log": log,
        "copy_gbps": statistics.median(r.copy_gbps for r in results),
        "copy_gbps_range": [min(r.copy_gbps for r in results), max(r.copy_gbps for r in results)],
        "compared": best,
        "kernels": [dict(asdict(r), rate=r.rate(best)) for r in results],
        "summary": {
            "geomean_vs_torch": _geomean(vs_torch),
            "worst_vs_torch": max(vs_torch) if vs_torch else None,
            "geomean_speedup_vs_tvm": _geomean(vs_tvm),
            "min_speedup_vs_tvm": min(vs_tvm) if vs_tvm else None,
            "memory_bound_at_60pct_copy": sum(r.copy_fraction(best) >= 0.6 for r in memory_bound),
            "memory_bound": len(memory_bound),
        },
    }


def format_table(report: dict) -> str:
    best = report["compared"]
    head = ["kernel", "tuned ms", "default ms", "TVM ms", "torch ms", f"{best}/torch", f"TVM/{best}",
            "rate", "% copy BW", "tuned", "check"]
    rows = []
    for k in report["kernels"]:
        ms = k["ms"]
        rate, unit = k["rate"]
        rows.append([
            k["name"], *(f"{ms[v]:.3f}" if v in ms else "-" for v in VARIANTS),
            f"{ms[best] / ms['torch']:.2f}x" if "torch" in ms else "-",
            f"{ms['tvm'] / ms[best]:.1f}x",
            f"{rate:.1f} {unit}", "-" if unit != "GB/s" else f"{100 * rate / k['copy_gbps']:.0f}%",
            k["tuned_kernels"] or "-", "ok" if k["max_rel_diff"] < 1e-3 else f"DIFF {k['max_rel_diff']:.1e}",
        ])
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    line = lambda r: "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    s = report["summary"]
    out = [line(head), line(["-" * w for w in widths]), *map(line, rows), ""]
    low, high = report["copy_gbps_range"]
    out.append(f"copy bandwidth {report['copy_gbps']:.1f} GB/s (median; {low:.1f}-{high:.1f} in the kernels' rounds, "
               "each kernel's % against its own), "
               f"{report['threads']} threads, "
               f"median of {report['repeats']} interleaved repeats; target {report['target']}")
    if s["geomean_vs_torch"] is not None:
        out.append(f"{best} vs PyTorch eager: geomean {s['geomean_vs_torch']:.2f}x of torch's time, "
                   f"worst {s['worst_vs_torch']:.2f}x")
    out.append(f"{best} vs TVM untuned: geomean {s['geomean_speedup_vs_tvm']:.1f}x faster, "
               f"least {s['min_speedup_vs_tvm']:.1f}x")
    out.append(f"memory-bound kernels at >= 60% of copy bandwidth: {s['memory_bound_at_60pct_copy']} of {s['memory_bound']}")
    return "\n".join(out)


def format_markdown(report: dict) -> str:
    """The table as Markdown (what the README quotes)."""
    best = report["compared"]
    lines = [f"| kernel | tuned ms | default ms | TVM untuned ms | PyTorch ms | {best} / PyTorch | TVM / {best} | rate |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for k in report["kernels"]:
        ms = k["ms"]
        rate, unit = k["rate"]
        times = " | ".join(f"{ms[v]:.2f}" if v in ms else "-" for v in VARIANTS)
        vs_torch = f"{ms[best] / ms['torch']:.2f}" if "torch" in ms else "-"
        pct = f" ({100 * rate / k['copy_gbps']:.0f}% of copy)" if unit == "GB/s" else ""
        lines.append(f"| {k['name']} | {times} | {vs_torch} | {ms['tvm'] / ms[best]:.1f}x | {rate:.1f} {unit}{pct} |")
    return "\n".join(lines)


def write_json(report: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
