"""Sample inputs of every rlx op, declared per op family (in the manner of PyTorch's OpInfo).

Each family module here declares ``CASES`` (or ``SAMPLES`` when it checks more inputs than its
finite-difference cases): :class:`~rlx_tvm.testing.Case` objects with the NumPy reference implied by
the op and, where the op is a derivative, the independent forward whose finite differences it must
equal. A family may also declare ``GRAD_CASES``: scalar Relax functions whose gradients its rules
provide. ``tests/test_ops.py`` checks every sample of every op in every (dtype, shape mode, path)
variant, all of them compiled into one module per variant; the family test files reuse those
outputs for their op-specific checks.
"""

from __future__ import annotations

import functools
import importlib

import numpy as np

from .. import Case, GradCase, run_cases

FAMILIES = ("activation", "norm", "rope", "loss", "indexing", "quantize", "conv", "pool", "attention", "scan")

# The (dtype, shape mode, path) variants every op is checked in.
VARIANTS = [(d, s, p) for d in ("float32", "float64") for s in ("static", "symbolic") for p in ("fused", "decomposed")]


def family(name: str):
    """The sample module of one op family (``rlx_tvm.testing.samples.<name>``)."""
    return importlib.import_module(f"{__name__}.{name}")


@functools.lru_cache(maxsize=None)
def all_samples() -> tuple[Case, ...]:
    """Every family's samples, in family order; names are unique."""
    cases = []
    for name in FAMILIES:
        mod = family(name)
        cases.extend(getattr(mod, "SAMPLES", mod.CASES))
    names = [c.name for c in cases]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"sample names must be unique; repeated: {duplicates}")
    return tuple(cases)


def samples(op: str) -> list[Case]:
    """The samples of one op (``rlx_tvm.ops`` name, e.g. ``"conv2d_backward_input"``)."""
    return [c for c in all_samples() if c.op == op]


def grad_samples() -> list[GradCase]:
    """Every family's gradient-rule cases, in family order."""
    return [c for name in FAMILIES for c in getattr(family(name), "GRAD_CASES", [])]


@functools.lru_cache(maxsize=None)
def outputs(dtype: str, symbolic: bool, path: str) -> dict[str, np.ndarray]:
    """Output of every sample (symbolic: those with a batch spec) by case name, through ``path``.

    One module holds every op's samples, compiled once per (dtype, shape mode, path) and shared
    by the per-op tests and the family tests that look at particular outputs."""
    cases = [c for c in all_samples() if c.batch is not None or not symbolic]
    return dict(zip((c.name for c in cases), run_cases(cases, dtype, symbolic=symbolic, path=path)))


def output(name: str, dtype: str = "float64", path: str = "fused", symbolic: bool = False) -> np.ndarray:
    """One sample's output (see :func:`outputs`)."""
    return outputs(dtype, symbolic, path)[name]


# Ops whose GPU legalization differs from the CPU's: their GPU forms are built for the CPU and
# checked on their samples, all in one module per (dtype, shape mode).
GPU_FORM_OPS = ("conv2d_backward_input", "conv2d_backward_weight", "max_pool2d_backward", "cumsum_backward",
                "gather_backward")


@functools.lru_cache(maxsize=None)
def gpu_form_outputs(dtype: str, symbolic: bool) -> dict[str, np.ndarray]:
    """Like :func:`outputs` for the samples of ``GPU_FORM_OPS``, legalized in a CUDA target's
    scope and built for the CPU."""
    cases = [c for c in all_samples() if c.op in GPU_FORM_OPS and (c.batch is not None or not symbolic)]
    outs = run_cases(cases, dtype, symbolic=symbolic, path="fused", legalize_for="cuda")
    return dict(zip((c.name for c in cases), outs))
