"""Numerical checking helpers for rlx ops: build many cases into one module, compile once, run.

``import tvm`` and each ``tvm.compile`` cost seconds, so tests batch cases into one IRModule (one
Relax function per case) and compile it once per (dtype, shape mode, path); the sample inputs of
every op are declared in :mod:`rlx_tvm.testing.samples`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import tvm
from tvm import relax, tirx

from ..ops.registry import get_op
from ..passes import DecomposeBackwardOps, FuseSiblingBackwardOps

# Numerical checks compile without LLVM's optimizations: the TensorIR under test is the same, and
# building is ~3x faster. (The demo, the example model and the benchmarks build at full opt-level.)
CHECK_TARGET = {"kind": "llvm", "opt-level": 0}

TOLERANCES = {
    # (rtol, atol relative to the reference's max magnitude)
    "float32": (2e-4, 2e-5),
    "float64": (1e-9, 1e-11),
}


def cast_floats(inputs: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """Float arrays cast to ``dtype``; integer arrays (indices, labels) keep theirs."""
    return {k: (v.astype(dtype) if np.issubdtype(v.dtype, np.floating) else v) for k, v in inputs.items()}


def as_tensors(arrays) -> list:
    """Runtime tensors of C-contiguous copies of ``arrays`` (0-d arrays stay 0-d)."""
    return [tvm.runtime.tensor(np.ascontiguousarray(a).reshape(np.shape(a))) for a in arrays]


def gradient_mismatch(got, ref, rtol: float, atol: float) -> str | None:
    """None when ``got`` matches ``ref`` (``atol`` scaled by ``max(1, max|ref|)``), else the error."""
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    if got.shape != ref.shape:
        return f"shape {got.shape} vs {ref.shape}"
    if np.allclose(got, ref, rtol=rtol, atol=atol * max(1.0, float(np.abs(ref).max()))):
        return None
    return f"max abs err {np.abs(got - ref).max():.3g}"


@dataclass
class Case:
    """One call of one op with concrete inputs.

    ``inputs`` maps input names to arrays; float arrays are cast to the dtype under test, integer
    arrays keep theirs. ``batch`` says which dims become the shared symbolic var ``n`` in the
    symbolic-shape variant: ``{"x": 0}`` or ``{"cos": (0, 8)}`` for ``n * 8``; None keeps the case
    static-only.
    """

    op: str
    inputs: dict[str, np.ndarray]
    attrs: dict[str, Any] = field(default_factory=dict)
    batch: dict[str, Any] | None = None
    label: str = ""
    # For finite differences: forward(**primals) -> y, where primals are the op's inputs other
    # than the cotangent plus ``fd_extra`` (forward inputs the backward op does not take, e.g.
    # gamma for layer_norm_backward_gamma, or x for cumsum_backward); ``wrt`` names the primal
    # the op differentiates with respect to; ``cotangent`` names the op's cotangent input.
    forward: Callable[..., np.ndarray] | None = None
    wrt: str | None = None
    cotangent: str = "dy"
    fd_extra: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.label or self.op

    def reference(self, dtype: str = "float64") -> np.ndarray:
        ins = self.cast_inputs(dtype)
        opdef = get_op(self.op)
        # References receive every attribute, defaults filled in, exactly as the kernels do.
        attrs = {k: v for k, v in opdef.normalize_attrs(self.attrs).items() if v is not None or k in self.attrs}
        return np.asarray(opdef.reference_fn(**ins, **attrs), dtype=np.float64)

    def cast_inputs(self, dtype: str) -> dict[str, np.ndarray]:
        return cast_floats(self.inputs, dtype)


def _symbolic_shape(shape, spec, n):
    shape = [int(d) for d in shape]
    if spec is None:
        return shape
    axis, factor = (spec, 1) if isinstance(spec, int) else spec
    out = list(shape)
    out[axis] = n if factor == 1 else n * factor
    return out


def build_module(cases: Sequence[Case], dtype: str, symbolic: bool) -> tvm.IRModule:
    """One Relax function ``case_<i>`` per case, calling the op on its parameters."""
    bb = relax.BlockBuilder()
    for i, case in enumerate(cases):
        n = tirx.Var("n", "int64")
        params = []
        for name, arr in case.cast_inputs(dtype).items():
            spec = (case.batch or {}).get(name) if symbolic else None
            shape = _symbolic_shape(arr.shape, spec, n)
            params.append(relax.Var(name, relax.TensorType(shape, str(arr.dtype))))
        with bb.function(f"case_{i}", params):
            with bb.dataflow():
                out = bb.emit(get_op(case.op)(**dict(zip(case.inputs, params)), **case.attrs))
                gv = bb.emit_output(out)
            bb.emit_func_output(gv)
    return bb.get()


def build_loss_module(case: Case, dtype: str) -> tvm.IRModule:
    """``main(inputs...) -> sum(op(inputs...)**2)``: a scalar to differentiate through the op."""
    bb = relax.BlockBuilder()
    params = [relax.Var(k, relax.TensorType(list(v.shape), str(v.dtype))) for k, v in case.cast_inputs(dtype).items()]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit(get_op(case.op)(**dict(zip(case.inputs, params)), **case.attrs))
            loss = bb.emit_output(relax.op.sum(out * out))
        bb.emit_func_output(loss)
    return bb.get()


def compile_and_run(mod: tvm.IRModule, cases: Sequence[Case], dtype: str, target="llvm") -> list[np.ndarray]:
    ex = tvm.compile(mod, target=tvm.target.Target(target))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    outs = []
    for i, case in enumerate(cases):
        args = as_tensors(case.cast_inputs(dtype).values())
        outs.append(vm[f"case_{i}"](*args).numpy())
    return outs


def run_cases(cases: Sequence[Case], dtype: str, symbolic: bool, path: str, target=None,
              legalize_for=None) -> list[np.ndarray]:
    """Outputs of every case through ``path``: "fused" (FLegalize kernels) or "decomposed".
    ``legalize_for``: legalize in that target's scope (the fused kernels a GPU target gets), then
    run on the CPU."""
    cases = [c for c in cases if c.batch is not None] if symbolic else list(cases)
    mod = build_module(cases, dtype, symbolic)
    if path == "decomposed":
        mod = DecomposeBackwardOps(include_forward=True)(mod)
    elif path != "fused":
        raise ValueError(path)
    if legalize_for is not None:
        with tvm.target.Target(legalize_for):
            mod = relax.transform.LegalizeOps()(mod)
    return compile_and_run(mod, cases, dtype, target=CHECK_TARGET if target is None else target)


def compare(out: np.ndarray, ref: np.ndarray, dtype: str) -> str | None:
    """None if ``out`` matches ``ref`` within the dtype's tolerance, else a short report."""
    rtol, atol_rel = TOLERANCES[dtype]
    ref = np.asarray(ref, dtype=np.float64)
    out64 = np.asarray(out, dtype=np.float64)
    if out64.shape != ref.shape:
        return f"shape {out64.shape} != reference {ref.shape}"
    if not np.all(np.isfinite(out64)):
        return "non-finite values in output"
    atol = atol_rel * max(1.0, float(np.max(np.abs(ref))) if ref.size else 1.0)
    err = np.abs(out64 - ref)
    bad = err > atol + rtol * np.abs(ref)
    if bad.any():
        return f"max abs err {err.max():.3g} (atol {atol:.2g}, rtol {rtol:g}) at {int(bad.sum())} of {bad.size} elements"
    return None


def check_cases(cases: Sequence[Case], dtype: str, symbolic: bool, path: str, legalize_for=None) -> None:
    """Assert every case matches its NumPy reference; report all failures at once."""
    selected = [c for c in cases if c.batch is not None] if symbolic else list(cases)
    assert selected, "no cases selected"
    outs = run_cases(selected, dtype, symbolic=symbolic, path=path, legalize_for=legalize_for)
    failures = []
    for case, out in zip(selected, outs):
        problem = compare(out, case.reference(dtype), dtype)
        if problem:
            failures.append(f"{case.name}: {problem}")
    assert not failures, f"{len(failures)} of {len(selected)} cases differ ({dtype}, symbolic={symbolic}, {path}):\n" + "\n".join(failures)


def finite_difference_vjp(
    forward: Callable[..., np.ndarray], primals: dict[str, np.ndarray], wrt: str, cotangent: np.ndarray, eps: float = 1e-6
) -> np.ndarray:
    """d/d primals[wrt] of sum(forward(**primals) * cotangent) by fp64 central differences."""
    base = {k: (v.astype(np.float64) if np.issubdtype(v.dtype, np.floating) else v) for k, v in primals.items()}
    p = base[wrt].copy()
    grad = np.zeros_like(p)
    flat, gflat = p.reshape(-1), grad.reshape(-1)
    ct = np.asarray(cotangent, dtype=np.float64)
    for i in range(flat.size):
        orig = flat[i]
        flat[i] = orig + eps
        hi = np.sum(forward(**{**base, wrt: p}) * ct)
        flat[i] = orig - eps
        lo = np.sum(forward(**{**base, wrt: p}) * ct)
        flat[i] = orig
        gflat[i] = (hi - lo) / (2 * eps)
    return grad


def finite_difference_mismatch(case: Case, out: np.ndarray, rtol: float = 1e-5, atol: float = 1e-6) -> str | None:
    """None when ``out`` (the op's float64 output for ``case``) equals the finite-difference VJP of
    the case's independent ``forward``, else the error."""
    ins = case.cast_inputs("float64")
    primals = {k: v for k, v in ins.items() if k != case.cotangent}
    primals.update({k: np.asarray(v, dtype=np.float64) for k, v in case.fd_extra.items()})
    fd = finite_difference_vjp(case.forward, primals, case.wrt, ins[case.cotangent])
    scale = max(1.0, float(np.max(np.abs(fd))))
    if out.shape != fd.shape or not np.allclose(out, fd, rtol=rtol, atol=atol * scale):
        err = np.max(np.abs(out - fd)) if out.shape == fd.shape else f"shape {out.shape} vs {fd.shape}"
        return f"max abs err vs finite differences {err}"
    return None


def check_finite_differences(cases: Sequence[Case], rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Every case with a ``forward``: the op's fused fp64 output equals the finite-difference VJP
    of the forward."""
    selected = [c for c in cases if c.forward is not None]
    assert selected, "no cases with a forward"
    outs = run_cases(selected, "float64", symbolic=False, path="fused")
    failures = [f"{case.name}: {problem}" for case, out in zip(selected, outs)
                if (problem := finite_difference_mismatch(case, out, rtol, atol))]
    assert not failures, f"{len(failures)} of {len(selected)} cases differ from finite differences:\n" + "\n".join(failures)


# --------------------------------------------------------------------------------------------
# Gradient checks of whole Relax functions (autodiff through the rlx gradient rules)
# --------------------------------------------------------------------------------------------


@dataclass
class GradCase:
    """``build(*param_vars) -> scalar Relax expr`` over named inputs; ``wrt`` names the float
    inputs to differentiate (all float inputs when None)."""

    label: str
    inputs: dict[str, np.ndarray]
    build: Callable[..., Any]
    wrt: Sequence[str] | None = None

    def wrt_names(self) -> list[str]:
        if self.wrt is not None:
            return list(self.wrt)
        return [k for k, v in self.inputs.items() if np.issubdtype(v.dtype, np.floating)]

    def cast_inputs(self, dtype: str) -> dict[str, np.ndarray]:
        return cast_floats(self.inputs, dtype)


def scalar_functions(cases: Sequence[GradCase], dtype: str) -> tvm.IRModule:
    """``f<i>(inputs...) -> scalar`` for each case, float inputs in ``dtype``."""
    bb = relax.BlockBuilder()
    for i, case in enumerate(cases):
        params = [
            relax.Var(k, relax.TensorType(list(v.shape), dtype if np.issubdtype(v.dtype, np.floating) else str(v.dtype)))
            for k, v in case.inputs.items()
        ]
        with bb.function(f"f{i}", params):
            with bb.dataflow():
                out = bb.emit_output(case.build(*params))
            bb.emit_func_output(out)
    return bb.get()


def build_grad_module(cases: Sequence[GradCase], dtype: str) -> tvm.IRModule:
    """``scalar_functions``, each differentiated with rlx autodiff."""
    from .. import autodiff

    mod = scalar_functions(cases, dtype)
    for i, case in enumerate(cases):
        mod = autodiff.grad(mod, f"f{i}", wrt=case.wrt_names())
    return mod


_GRAD_VMS: dict = {}


def _grad_vm(cases: Sequence[GradCase], dtype: str, hvp: bool = False):
    """VM of :func:`build_grad_module` (with ``autodiff.hvp`` of every case when ``hvp``),
    compiled once per (cases, dtype, hvp) and shared by the checks below."""
    key = (tuple(id(c) for c in cases), dtype, hvp)
    if key not in _GRAD_VMS:
        from .. import autodiff

        mod = build_grad_module(cases, dtype)
        if hvp:
            for i, case in enumerate(cases):
                mod = autodiff.hvp(mod, f"f{i}", wrt=case.wrt_names())
        _GRAD_VMS[key] = (relax.VirtualMachine(tvm.compile(mod, tvm.target.Target(CHECK_TARGET)), tvm.cpu()), cases)
    return _GRAD_VMS[key][0]


def check_gradients(cases: Sequence[GradCase], dtype: str, eps: float = 1e-6, with_second_order: bool = False) -> None:
    """rlx autodiff gradients vs central finite differences of the compiled float64 forward.

    The forward evaluated for the finite differences is the same compiled function in float64,
    whose ops are each checked against NumPy elsewhere; the gradients come from the adjoint
    function compiled for ``dtype``. ``with_second_order``: the float64 module also holds the
    Hessian-vector products, so that :func:`check_second_order` of the same cases reuses it.
    """
    vm64 = _grad_vm(cases, "float64", hvp=with_second_order)
    vm = vm64 if dtype == "float64" else _grad_vm(cases, dtype)
    rtol, atol = (2e-3, 2e-4) if dtype == "float32" else (1e-5, 1e-7)
    failures = []
    for i, case in enumerate(cases):
        ins = case.cast_inputs(dtype)
        loss, grads = vm[f"f{i}_adjoint"](*as_tensors(ins.values()))
        ins64 = case.cast_inputs("float64")

        def f(**kw):
            return float(vm64[f"f{i}"](*as_tensors({**ins64, **kw}.values())).numpy())

        for name, g in zip(case.wrt_names(), grads):
            fd = finite_difference_vjp(lambda **kw: np.asarray(f(**kw)), {name: ins64[name]}, name, np.asarray(1.0), eps)
            problem = gradient_mismatch(g.numpy(), fd, rtol, atol)
            if problem:
                failures.append(f"{case.label} d/d{name}: {problem} (|fd| max {np.abs(fd).max():.3g})")
    assert not failures, f"{len(failures)} gradients differ from finite differences ({dtype}):\n" + "\n".join(failures)


def check_second_order(cases: Sequence[GradCase], eps: float = 1e-5, rtol: float = 1e-5, atol: float = 1e-7) -> None:
    """float64 Hessian-vector products (``autodiff.hvp``) vs central finite differences of the
    first-order gradient along the same direction."""
    vm = _grad_vm(cases, "float64", hvp=True)
    rng = np.random.default_rng(123)
    failures = []
    for i, case in enumerate(cases):
        ins = case.cast_inputs("float64")
        names = case.wrt_names()
        dirs = [rng.standard_normal(ins[n].shape) for n in names]

        def grads_at(t):
            moved = {**ins, **{n: ins[n] + t * d for n, d in zip(names, dirs)}}
            _, g = vm[f"f{i}_adjoint"](*as_tensors(moved.values()))
            return [x.numpy() for x in g]

        args = as_tensors(list(ins.values()) + dirs)
        _, _, hv = vm[f"f{i}_hvp"](*args)
        plus, minus = grads_at(eps), grads_at(-eps)
        for n, h, gp, gm in zip(names, hv, plus, minus):
            fd = (gp - gm) / (2 * eps)
            problem = gradient_mismatch(h.numpy(), fd, rtol, atol)
            if problem:
                failures.append(f"{case.label} (H v)[{n}]: {problem} (|fd| max {np.abs(fd).max():.3g})")
    assert not failures, f"{len(failures)} Hessian-vector products differ from finite differences:\n" + "\n".join(failures)


def check_nth_order(cases: Sequence[GradCase], order: int = 3, eps: float = 1e-5, rtol: float = 1e-5, atol: float = 1e-7) -> None:
    """float64 ``autodiff.nth_order_grad`` for the first ``wrt`` input of each case: every level
    ``g_{k+1} = d sum(g_k) / dp`` is checked as a directional derivative, ``<g_{k+1}, d>`` vs the
    central finite difference of ``sum(g_k)`` along a random direction ``d``."""
    from .. import autodiff

    mod = scalar_functions(cases, "float64")
    for i, case in enumerate(cases):
        mod = autodiff.nth_order_grad(mod, f"f{i}", [case.wrt_names()[0]], order)
    vm = relax.VirtualMachine(tvm.compile(mod, tvm.target.Target(CHECK_TARGET)), tvm.cpu())
    rng = np.random.default_rng(321)
    failures = []
    for i, case in enumerate(cases):
        ins = case.cast_inputs("float64")
        name = case.wrt_names()[0]
        d = rng.standard_normal(ins[name].shape)

        def levels(t):
            moved = {**ins, name: ins[name] + t * d}
            out = vm[f"f{i}_grad{order}"](*as_tensors(moved.values()))
            return [g.numpy() for g in out]

        here, plus, minus = levels(0.0), levels(eps), levels(-eps)
        for k in range(order - 1):
            fd = (plus[k].sum() - minus[k].sum()) / (2 * eps)
            got = float(np.sum(here[k + 1] * d))
            if not np.isclose(got, fd, rtol=rtol, atol=atol * max(1.0, abs(fd))):
                failures.append(f"{case.label} order {k + 2} d/d{name}: {got:.10g} vs finite differences {fd:.10g}")
    assert not failures, f"{len(failures)} higher-order derivatives differ from finite differences:\n" + "\n".join(failures)


def sibling_groups_module(groups: Sequence[Sequence[Case]], dtype: str, symbolic: bool) -> tvm.IRModule:
    """One Relax function ``group_<i>`` per group of cases that read the same inputs (by name, the
    first case's arrays): every case's op called on the shared parameters, the outputs returned as
    a tuple; what :class:`~rlx_tvm.passes.FuseSiblingBackwardOps` computes together."""
    bb = relax.BlockBuilder()
    for i, cases in enumerate(groups):
        inputs = {name: arr for case in cases for name, arr in case.cast_inputs(dtype).items()}
        batch = {k: v for case in cases for k, v in (case.batch or {}).items()} if symbolic else {}
        n = tirx.Var("n", "int64")
        params = {name: relax.Var(name, relax.TensorType(_symbolic_shape(arr.shape, batch.get(name), n), str(arr.dtype)))
                  for name, arr in inputs.items()}
        with bb.function(f"group_{i}", list(params.values())):
            with bb.dataflow():
                outs = [bb.emit(get_op(c.op)(**{k: params[k] for k in c.inputs}, **c.attrs)) for c in cases]
                gv = bb.emit_output(relax.Tuple(outs))
            bb.emit_func_output(gv)
    return bb.get()


def check_sibling_groups(groups: Sequence[Sequence[Case]], dtype: str, symbolic: bool, target=CHECK_TARGET):
    """Compile :func:`sibling_groups_module` with ``rlx_tvm.compile`` (sibling ops computed
    together on CPU targets) and assert every output matches its case's reference; returns the
    lowered module (for checks of which kernels it has)."""
    from ..build import lower

    mod = sibling_groups_module(groups, dtype, symbolic)
    relax.analysis.well_formed(FuseSiblingBackwardOps()(mod))  # raises when ill-formed
    target = tvm.target.Target(target)
    lowered = lower(mod, target, tuning_log=None, verbose=False)
    vm = relax.VirtualMachine(tvm.compile(lowered, target=target), tvm.cpu())
    failures = []
    for i, cases in enumerate(groups):
        inputs = {name: arr for case in cases for name, arr in case.cast_inputs(dtype).items()}
        outs = vm[f"group_{i}"](*as_tensors(inputs.values()))
        for case, out in zip(cases, outs):
            if (problem := compare(out.numpy(), case.reference(dtype), dtype)):
                failures.append(f"group {i}, {case.name}: {problem}")
    assert not failures, f"{len(failures)} outputs differ ({dtype}, symbolic={symbolic}):\n" + "\n".join(failures)
    return lowered
