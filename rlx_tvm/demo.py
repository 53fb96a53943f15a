"""``rlx-tvm demo``: one module of rlx backward ops, built fused and decomposed, each output
checked against NumPy."""

from __future__ import annotations

import time

import numpy as np

from .ops import all_ops
from .passes import DecomposeBackwardOps
from .target import cpu_target
from .testing import TOLERANCES, Case, build_module, compile_and_run


def demo_cases(rng: np.random.Generator) -> list[Case]:
    """Representative calls with transformer-ish shapes (batch 4, sequence 16, hidden 64)."""
    n, s, h, heads, hd = 4, 16, 64, 4, 16
    x = rng.standard_normal((n * s, h))
    dy = rng.standard_normal((n * s, h))
    gamma = rng.uniform(0.5, 1.5, h)
    beta = rng.standard_normal(h)
    logits = rng.standard_normal((n * s, 100))
    labels = rng.integers(0, 100, n * s).astype("int64")
    labels[::7] = -100
    pos = np.arange(s)[:, None] * (10000.0 ** (-np.arange(hd // 2) / (hd // 2)))[None, :]
    act = rng.standard_normal((n, s, heads, hd))
    emb_idx = rng.integers(-50, 50, n * s).astype("int32")
    return [
        Case("relu_backward", {"x": x, "dy": dy}),
        Case("activation_backward", {"x": x, "dy": dy}, {"kind": "gelu"}, label="activation_backward[gelu]"),
        Case("activation_backward", {"x": x, "dy": dy}, {"kind": "silu"}, label="activation_backward[silu]"),
        Case("layer_norm_backward_input", {"x": x, "gamma": gamma, "dy": dy}),
        Case("layer_norm_backward_gamma", {"x": x, "dy": dy}),
        Case("rms_norm_backward_input", {"x": x, "gamma": gamma, "beta": beta, "dy": dy}),
        Case("group_norm_backward_input",
             {"x": x.reshape(n, s, 8, 8), "gamma": rng.uniform(0.5, 1.5, s), "beta": rng.standard_normal(s),
              "dy": dy.reshape(n, s, 8, 8)}, {"num_groups": 4}),
        Case("rope_backward", {"dy": act, "cos": np.cos(pos), "sin": np.sin(pos)}, {"head_dim": hd}),
        Case("softmax_cross_entropy_backward",
             {"logits": logits, "labels": labels, "d_loss": np.full(n * s, 1.0 / (n * s))},
             {"label_smoothing": 0.1}),
        Case("cumsum_backward", {"dy": rng.standard_normal((n, 4096))}, {"axis": 1}),
        Case("gather_backward", {"dy": dy, "indices": emb_idx}, {"axis": 0, "dim_size": 100}),
        Case("fake_quantize_backward", {"x": x, "dy": dy}, {"bits": 4, "axis": 1, "ste": "tanh"}),
    ]


def run_demo(target=None, dtype: str = "float32") -> int:
    """Build, run and check the demo cases for ``target`` (None: this CPU); 0 when all match."""
    target = target if target is not None else cpu_target()
    known = {o.name for o in all_ops()}
    cases = [c for c in demo_cases(np.random.default_rng(0)) if c.op in known]
    print(f"rlx_tvm demo: {len(cases)} backward ops, dtype {dtype}, target {target}")
    mod = build_module(cases, dtype, symbolic=False)
    results = {}
    for path in ("fused", "decomposed"):
        t0 = time.perf_counter()
        m = DecomposeBackwardOps()(mod) if path == "decomposed" else mod
        results[path] = compile_and_run(m, cases, dtype, target=target)
        print(f"  built and ran the {path} module in {time.perf_counter() - t0:.1f} s")

    rtol, atol_rel = TOLERANCES[dtype]
    width = max(len(c.name) for c in cases)
    shape_w = 18
    header = f"{'op':<{width}}  {'output shape':<{shape_w}}  {'fused err':>10}  {'decomp err':>10}  check"
    print()
    print(header)
    print("-" * len(header))
    failures = 0
    for i, case in enumerate(cases):
        ref = case.reference(dtype)
        scale = max(1.0, float(np.abs(ref).max()))
        errs = [float(np.abs(results[p][i].astype(np.float64) - ref).max()) / scale for p in ("fused", "decomposed")]
        ok = all(e <= atol_rel + rtol for e in errs)
        failures += not ok
        shape = "x".join(map(str, ref.shape))
        print(f"{case.name:<{width}}  {shape:<{shape_w}}  {errs[0]:>10.2e}  {errs[1]:>10.2e}  {'ok' if ok else 'MISMATCH'}")
    print()
    print("errors are max |out - numpy| / max(1, max |numpy|)")
    print("all ops match NumPy" if not failures else f"{failures} op(s) differ from NumPy")
    return 1 if failures else 0
