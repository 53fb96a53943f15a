"""Whole training steps of PyTorch models: rlx_tvm against PyTorch eager, with a per-kernel profile.

Each model is a ``torch.nn.Module`` that returns its scalar loss. It is compiled through the front
door, :func:`rlx_tvm.torch.compile_train_step` (``torch.export``, TVM's ``from_exported_program``,
:func:`rlx_tvm.autodiff.grad`, an SGD-momentum update, :func:`rlx_tvm.compile` for this CPU). A
step (forward, loss, every gradient, the update) is timed against PyTorch eager's (forward,
backward, ``torch.optim.SGD``) in the same process on the same number of threads, the two
interleaved, median of the repeats; the profile times every kernel of the rlx_tvm step through the
Relax VM's instrument hook. Run by ``rlx-tvm bench --steps``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import numpy as np
import tvm
from tvm import relax

from ..build import lower
from ..target import cpu_target, target_key
from ..threads import cpu_threads

__all__ = ["STEP_MODELS", "CompiledStep", "StepModel", "compile_step", "format_table", "profile_step", "run",
           "time_step"]


@dataclass(frozen=True)
class StepModel:
    """A benchmark model: ``build(scale)`` gives ``(module returning its loss, example inputs)``."""

    name: str
    build: Callable[[str], tuple]
    note: str = ""


def _torch():
    import torch  # noqa: PLC0415 (torch is optional for the rest of rlx_tvm)

    return torch


def _mlp(scale: str):
    torch = _torch()
    nn = torch.nn
    batch, d, hidden, classes = (1024, 1024, 4096, 16) if scale == "full" else (64, 64, 256, 8)

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(d, hidden)
            self.down = nn.Linear(hidden, d)
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, classes)

        def forward(self, x, y):
            h = self.down(nn.functional.gelu(self.up(x)))
            h = nn.functional.silu(self.norm(h + x))
            return nn.functional.cross_entropy(self.head(h), y)

    x = torch.randn(batch, d)
    y = torch.randint(0, classes, (batch,))
    return MLP(), (x, y)


def _cnn(scale: str):
    torch = _torch()
    nn = torch.nn
    batch, size, widths, classes = (32, 32, (32, 64, 128), 10) if scale == "full" else (4, 16, (16, 32, 32), 4)

    def stage(cin, cout, groups):
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(groups, cout), nn.SiLU()]

    class CNN(nn.Module):
        def __init__(self):
            super().__init__()
            a, b, c = widths
            self.body = nn.Sequential(
                *stage(3, a, 4), nn.MaxPool2d(2),
                *stage(a, b, 8), nn.MaxPool2d(2),
                *stage(b, c, 8), nn.AdaptiveAvgPool2d(1), nn.Flatten())
            self.head = nn.Linear(c, classes)

        def forward(self, x, y):
            return nn.functional.cross_entropy(self.head(self.body(x)), y)

    x = torch.randn(batch, 3, size, size)
    y = torch.randint(0, classes, (batch,))
    return CNN(), (x, y)


def _encoder(scale: str):
    torch = _torch()
    nn = torch.nn
    batch, seq, d, heads, ffn, classes = (8, 256, 256, 4, 1024, 16) if scale == "full" else (4, 32, 64, 4, 128, 4)

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.TransformerEncoderLayer(d, heads, ffn, dropout=0.0, batch_first=True)
            self.head = nn.Linear(d, classes)

        def forward(self, x, y):
            logits = self.head(self.layer(x))
            return nn.functional.cross_entropy(logits.reshape(-1, classes), y)

    x = torch.randn(batch, seq, d)
    y = torch.randint(0, classes, (batch * seq,))
    return Encoder(), (x, y)


def _decoder(scale: str):
    torch = _torch()
    nn, F = torch.nn, torch.nn.functional
    batch, seq, d, heads, ffn = (8, 256, 256, 4, 768) if scale == "full" else (4, 32, 64, 4, 128)
    hd = d // heads

    class Decoder(nn.Module):
        """Pre-norm causal block: RMSNorm, RoPE, SDPA(is_causal), SwiGLU; regression loss."""

        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
            self.qkv = nn.Linear(d, 3 * d, bias=False)
            self.out = nn.Linear(d, d, bias=False)
            self.gate = nn.Linear(d, ffn, bias=False)
            self.up = nn.Linear(d, ffn, bias=False)
            self.down = nn.Linear(ffn, d, bias=False)
            freq = 10000.0 ** (-torch.arange(hd // 2) / (hd // 2))
            angle = torch.arange(seq)[:, None] * freq[None, :]
            self.register_buffer("cos", torch.cat([angle.cos()] * 2, -1), persistent=False)
            self.register_buffer("sin", torch.cat([angle.sin()] * 2, -1), persistent=False)

        def rope(self, t):
            a, b = t.chunk(2, dim=-1)
            return t * self.cos + torch.cat([-b, a], -1) * self.sin

        def forward(self, x, y):
            q, k, v = self.qkv(self.norm1(x)).reshape(batch, seq, 3, heads, hd).permute(2, 0, 3, 1, 4).unbind(0)
            att = F.scaled_dot_product_attention(self.rope(q), self.rope(k), v, is_causal=True)
            h = x + self.out(att.transpose(1, 2).reshape(batch, seq, d))
            g = self.norm2(h)
            h = h + self.down(F.silu(self.gate(g)) * self.up(g))
            return F.mse_loss(h, y)

    x = torch.randn(batch, seq, d)
    y = torch.randn(batch, seq, d)
    return Decoder(), (x, y)


def _lm_head(scale: str):
    torch = _torch()
    nn = torch.nn
    batch, seq, d, vocab = (8, 256, 256, 8192) if scale == "full" else (4, 32, 32, 256)

    class LMHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)

        def forward(self, tokens, targets):
            logits = self.head(self.norm(self.embed(tokens)))
            return nn.functional.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))

    tokens = torch.randint(0, vocab, (batch, seq))
    targets = torch.randint(0, vocab, (batch, seq))
    return LMHead(), (tokens, targets)


STEP_MODELS = {m.name: m for m in (
    StepModel("mlp", _mlp, "1024 x (1024-4096-1024), GELU, LayerNorm, SiLU, cross-entropy"),
    StepModel("cnn", _cnn, "32 x 3 x 32 x 32, 3 conv/GroupNorm/SiLU stages, max/adaptive-avg pool"),
    StepModel("encoder", _encoder, "TransformerEncoderLayer 8 x 256 x 256, 4 heads, FFN 1024 + head"),
    StepModel("decoder", _decoder, "causal block 8 x 256 x 256: RMSNorm, RoPE, SDPA, SwiGLU 768"),
    StepModel("lm_head", _lm_head, "embedding 8192 x 256, LayerNorm, LM head, 2048 tokens"),
)}


@dataclass
class CompiledStep:
    """A training step of one model: ``run()`` is rlx_tvm's (forward, loss, gradients, update),
    ``run_torch()`` PyTorch eager's on an independent copy of the model."""

    name: str
    step: object  # rlx_tvm.torch.TrainStep
    torch_model: object
    torch_inputs: tuple
    torch_optimizer: object

    def run(self):
        return self.step(*self.torch_inputs)

    def run_torch(self):
        self.torch_optimizer.zero_grad(set_to_none=True)
        loss = self.torch_model(*self.torch_inputs)
        loss.backward()
        self.torch_optimizer.step()
        return loss

    @property
    def vm(self):
        return self.step.vm

    def lowered(self):
        """The step's Relax module lowered as it was compiled (scheduled PrimFuncs)."""
        return lower(self.step.module, self.step.target, verbose=False)


def compile_step(name: str, scale: str = "full", target=None, seed: int = 0, lr: float = 1e-3,
                 momentum: float = 0.9) -> CompiledStep:
    """One of :data:`STEP_MODELS` (``scale``: ``full`` or ``small``) as a training step through
    :func:`rlx_tvm.torch.compile_train_step`: forward, loss, every gradient and an SGD-momentum
    update, compiled for ``target`` (default: this CPU). The PyTorch side is an independent copy of
    the same model with ``torch.optim.SGD`` of the same settings."""
    import copy  # noqa: PLC0415

    from ..torch import SGD, compile_train_step  # noqa: PLC0415  (PyTorch is an optional dependency)

    if name not in STEP_MODELS:
        raise ValueError(f"rlx-tvm bench --steps: model expected one of {sorted(STEP_MODELS)}, got {name!r}")
    if scale not in ("full", "small"):
        raise ValueError(f"rlx-tvm bench --steps: argument 'scale' expected 'full' or 'small', got {scale!r}")
    torch = _torch()
    torch.manual_seed(seed)
    model, inputs = STEP_MODELS[name].build(scale)
    reference = copy.deepcopy(model)
    step = compile_train_step(model, inputs, optimizer=SGD(lr=lr, momentum=momentum), target=target,
                              dynamic_batch=False)
    return CompiledStep(name, step, reference, inputs, torch.optim.SGD(reference.parameters(), lr=lr, momentum=momentum))


def step_flops(step: CompiledStep) -> float:
    """Floating-point work of the step's kernels (TVM's estimate: a multiply-add counts 2; kernels
    it cannot analyse, hand-written TIR with opaque blocks, count 0)."""
    import tvm  # noqa: PLC0415
    from tvm.s_tir.analysis import estimate_tir_flops  # noqa: PLC0415

    total = 0.0
    for f in step.lowered().functions.values():
        if isinstance(f, tvm.tirx.PrimFunc):
            try:
                total += float(estimate_tir_flops(tvm.IRModule({"main": f})))
            except RuntimeError:  # TVM reports its errors as RuntimeError
                pass
    return total


def time_step(step: CompiledStep, repeats: int = 5, min_ms: float = 200.0) -> dict:
    """Median ms per step of rlx_tvm and of PyTorch eager, interleaved, on the same thread count
    (both steps train their own copy of the model: the work per step is the same)."""
    torch = _torch()

    threads = int(os.environ.get("TVM_NUM_THREADS", cpu_threads()))
    torch.set_num_threads(threads)
    runners = {"rlx_tvm": step.run, "torch": step.run_torch}
    for run in runners.values():  # warm-up (thread pools, allocations)
        run()
    times = defaultdict(list)
    for _ in range(repeats):
        for label, run in runners.items():
            n, elapsed = 0, 0.0
            start = time.perf_counter()
            while elapsed < min_ms / 1e3 or n == 0:
                run()
                n += 1
                elapsed = time.perf_counter() - start
            times[label].append(elapsed / n * 1e3)
    return {"threads": threads, **{label: statistics.median(ts) for label, ts in times.items()}}


def profile_step(step: CompiledStep, repeats: int = 3) -> list[tuple[str, float, int]]:
    """(kernel, ms per step, calls per step) of every kernel of the rlx_tvm step, slowest first,
    timed through the VM's instrument hook (before and after each call)."""
    totals, calls, started = defaultdict(float), defaultdict(int), {}

    def instrument(func, symbol, before_run, ret_value, *args):
        now = time.perf_counter()
        if before_run:
            started[symbol] = now
        else:
            totals[symbol] += now - started.pop(symbol, now)
            calls[symbol] += 1
        return 0

    step.run()
    step.vm.set_instrument(instrument)
    try:
        for _ in range(repeats):
            step.run()
    finally:
        step.vm.set_instrument(None)
    # Calls of the step's own Relax functions (train_step calls main_adjoint) enclose kernels
    # already counted: only kernels and VM builtins are listed.
    functions = {gv.name_hint for gv, f in step.step.module.functions.items() if isinstance(f, relax.Function)}
    rows = [(s, totals[s] / repeats * 1e3, calls[s] // repeats) for s in totals if s not in functions]
    return sorted(rows, key=lambda r: -r[1])


def format_profile(name: str, rows: list, step_ms: float | None = None, top: int = 10) -> str:
    total = sum(ms for _, ms, _ in rows)
    lines = [f"{name}: {len(rows)} kernels, {total:.1f} ms in kernels"
             + (f" of a {step_ms:.1f} ms step" if step_ms else ""),
             f"  {'kernel':<52} {'ms':>9} {'calls':>5} {'share':>6}"]
    for symbol, ms, n in rows[:top]:
        lines.append(f"  {symbol[:52]:<52} {ms:9.2f} {n:5d} {ms / total:6.1%}")
    return "\n".join(lines)


def format_table(results: list[dict]) -> str:
    lines = [f"{'model':<9} {'rlx_tvm ms':>10} {'torch ms':>9} {'ratio':>6} {'GFLOP':>7} {'rlx GFLOP/s':>11}"
             f" {'torch GFLOP/s':>13}"]
    for r in results:
        if "error" in r:
            lines.append(f"{r['model']:<9} failed: {r['error']}")
            continue
        gf = r["gflop"]
        lines.append(f"{r['model']:<9} {r['rlx_tvm']:10.1f} {r['torch']:9.1f} {r['rlx_tvm'] / r['torch']:6.2f}"
                     f" {gf:7.2f} {gf / r['rlx_tvm'] * 1e3:11.1f} {gf / r['torch'] * 1e3:13.1f}")
    ratios = [r["rlx_tvm"] / r["torch"] for r in results if "error" not in r]
    if ratios:
        lines.append(f"geomean ratio (rlx_tvm / torch): {float(np.exp(np.mean(np.log(ratios)))):.2f}")
    return "\n".join(lines)


def run(models: list[str], scale: str = "full", repeats: int = 5, min_ms: float = 200.0, top: int = 10,
        out=sys.stdout) -> list[dict]:
    """Compile, time and profile each model; print progress, profiles and the table."""
    results = []
    for name in models:
        print(f"[{name}] importing, differentiating, compiling ...", file=out, flush=True)
        start = time.perf_counter()
        try:
            step = compile_step(name, scale)
        except Exception as err:  # noqa: BLE001 (one model's failure leaves the others)
            message = str(err).strip().splitlines()
            results.append({"model": name, "error": message[-1] if message else type(err).__name__})
            print(f"[{name}] failed: {results[-1]['error']}", file=out, flush=True)
            continue
        print(f"[{name}] compiled in {time.perf_counter() - start:.0f} s; timing ...", file=out, flush=True)
        timing = time_step(step, repeats, min_ms)
        profile = profile_step(step)
        results.append({"model": name, "note": STEP_MODELS[name].note, **timing, "gflop": step_flops(step) / 1e9,
                        "kernels": [{"kernel": k, "ms": ms, "calls": n} for k, ms, n in profile]})
        print(format_profile(name, profile, timing["rlx_tvm"], top), file=out, flush=True)
    print(format_table(results), file=out, flush=True)
    return results


def write_json(results: list[dict], path: str) -> None:
    """The results with what they were measured on: the target key (CPU, cores), threads, versions."""
    torch = _torch()
    report = {"kind": "training_steps", "target": target_key(cpu_target()), "machine": platform.processor()
              or platform.machine(), "date": time.strftime("%Y-%m-%d"), "tvm": tvm.__version__,
              "torch": torch.__version__, "models": results}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
