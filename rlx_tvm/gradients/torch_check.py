"""Differentiate torch modules through TVM's importer and compare with ``torch.autograd``.

Each case is a small ``nn.Module`` and its example inputs. Its output is reduced to a scalar
``sum(out * w)`` with a fixed random ``w`` (an extra input, so its gradient checks the forward
values too), exported with ``torch.export``, imported with ``from_exported_program(
keep_params_as_input=True)``, differentiated with :func:`rlx_tvm.autodiff.grad` with respect to
every float input and every parameter. Cases are exported in groups (one export, one import and
one adjoint per group: the group's loss is the sum of its cases' losses) and each group is
compiled once. Torch is imported only here (the optional ``torch`` extra).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import tvm
from tvm import relax


@dataclass
class TorchCase:
    """``build() -> (module, inputs)``; ``dtype`` is the float dtype of the inputs and parameters
    (float32 where the importer computes in float32 anyway: its matmul, linear and conv force
    float32); ``decompose`` is the importer's ``run_ep_decomposition`` (off to reach converters
    that core-ATen decomposition bypasses, e.g. SDPA onto ``R.nn.attention``)."""

    name: str
    build: Callable
    dtype: str = "float64"
    decompose: bool = True
    train: bool = False


@dataclass
class Prepared:
    """One group of cases exported as one module (one export, one import, one adjoint): the
    loss is the sum of the cases' losses, so each case's gradients are its own."""

    cases: list
    aten_ops: dict = field(default_factory=dict)  # case name -> ATen ops the importer saw
    relax_ops: set = field(default_factory=set)
    grad_ops: set = field(default_factory=set)
    adjoint: relax.Function | None = None
    name: str = ""
    args: list = field(default_factory=list)  # numpy arrays, in main's parameter order
    expected_loss: float = 0.0
    expected_grads: dict = field(default_factory=dict)  # case name -> [(label, array)]
    error: str | None = None


def _torch():
    import torch

    return torch


def _weights(model, inputs, gen):
    torch = _torch()
    with torch.no_grad():
        out = model(*inputs)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    keep = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.is_floating_point()]
    return keep, [torch.randn(outs[i].shape, generator=gen, dtype=outs[i].dtype) for i in keep]


def _group_module(built, seed: int):
    """``(args of case 0..., args of case 1..., ...) -> sum over cases of sum(out_i * w_i)``
    where each case's args are its inputs then its output weights."""
    torch = _torch()
    gen = torch.Generator().manual_seed(seed)
    layout, all_args = [], []
    for model, inputs in built:
        keep, weights = _weights(model, inputs, gen)
        layout.append((len(inputs), keep, len(all_args)))
        all_args += list(inputs) + weights

    class Cases(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cases = torch.nn.ModuleList([m for m, _ in built])

        def forward(self, *args):
            total = None
            for model, (n_in, keep, start) in zip(self.cases, layout):
                res = model(*args[start:start + n_in])
                res = list(res) if isinstance(res, (tuple, list)) else [res]
                for i, w in zip(keep, args[start + n_in:start + n_in + len(keep)]):
                    term = (res[i] * w).sum()
                    total = term if total is None else total + term
            return total

    return Cases(), tuple(all_args), layout


def _ops_in(func) -> set:
    found = set()

    def visit(e):
        if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op):
            found.add(str(e.op.name))

    relax.analysis.post_order_visit(func, visit)
    return found


def _case_of(node, n_cases: int):
    """The index of the case a graph node belongs to, from its module stack."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in stack.values():
        parts = str(path).replace("L['self'].", "").replace("[", ".").replace("]", "").split(".")
        if len(parts) >= 2 and parts[0] == "cases" and parts[1].isdigit():
            return int(parts[1])
    return None


def prepare(cases: list, seed: int = 0, name: str = "group") -> Prepared:
    """Export, import and differentiate a group of cases (same ``decompose``); torch's reference
    gradients alongside."""
    torch = _torch()
    from tvm.relax.frontend.torch import from_exported_program

    from ..autodiff import grad

    out = Prepared(list(cases), name=name)
    try:
        torch.manual_seed(seed)
        built = []
        for c in cases:
            model, inputs = c.build()
            model.train(c.train)
            built.append((model, inputs))
        loss_mod, args, layout = _group_module(built, seed)
        ep = torch.export.export(loss_mod, args)
        if cases[0].decompose:
            ep = ep.run_decompositions()
        for c in cases:
            out.aten_ops[c.name] = set()
        for n in ep.graph.nodes:
            if n.op == "call_function" and hasattr(n.target, "__name__"):
                i = _case_of(n, len(cases))
                if i is not None:
                    out.aten_ops[cases[i].name].add(n.target.__name__)
        mod = from_exported_program(
            ep, keep_params_as_input=True, unwrap_unit_return_tuple=True, run_ep_decomposition=False
        )
        mod, params = relax.frontend.detach_params(mod)
        main = mod["main"]
        out.relax_ops = _ops_in(main)
        n_in = int(main.attrs["num_input"])
        specs = {s.arg.name: s for s in ep.graph_signature.input_specs}
        named = dict(loss_mod.named_parameters())
        # Differentiate with respect to float user inputs and parameters (not buffers).
        call_args = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
        param_values = list(params.get("main", []))
        wrt, refs, owners = [], [], []
        starts = [start for _, _, start in layout]
        for i, p in enumerate(main.params):
            value = args[i].detach().numpy() if i < n_in else param_values[i - n_in].numpy()
            out.args.append(value)
            spec = specs.get(p.name)
            if i < n_in and args[i].is_floating_point():
                wrt.append(p.name)
                refs.append(call_args[i])
                owners.append(max(k for k, s in enumerate(starts) if s <= i))
            elif i >= n_in and spec is not None and str(spec.kind).endswith("PARAMETER"):
                wrt.append(p.name)
                refs.append(named[spec.target])
                owners.append(int(spec.target.split(".")[1]))
        if len(refs) != sum(1 for a in args if a.is_floating_point()) + len(named):
            raise RuntimeError(f"matched {len(refs)} of the float inputs and parameters only")
        out.adjoint = grad(mod, "main", wrt=wrt)["main_adjoint"]
        out.grad_ops = _ops_in(out.adjoint)
        loss = loss_mod(*call_args)
        grads = torch.autograd.grad(loss, refs, allow_unused=True)
        out.expected_loss = float(loss.detach())
        for c in cases:
            out.expected_grads[c.name] = []
        for k, (label, r, g_) in enumerate(zip(wrt, refs, grads)):
            ref = np.zeros(tuple(r.shape)) if g_ is None else g_.detach().numpy()
            out.expected_grads[cases[owners[k]].name].append((k, label, ref))
    except Exception as err:  # reported per case by the tests
        out.error = f"{type(err).__name__}: {err}"
    return out


def combined_module(prepared: list[Prepared]) -> tvm.IRModule:
    """One IRModule with each group's adjoint as a function named after the group."""
    funcs = {}
    for p in prepared:
        if p.adjoint is not None:
            funcs[p.name] = p.adjoint.with_attr("global_symbol", p.name)
    return tvm.IRModule(funcs)


def run(executable, prepared: list[Prepared]) -> dict[str, tuple]:
    """Run every prepared group; ``group name -> (loss, [grads])`` as numpy."""
    vm = relax.VirtualMachine(executable, tvm.cpu())
    results = {}
    for p in prepared:
        if p.adjoint is None:
            continue
        try:
            res = vm[p.name](*[tvm.runtime.tensor(np.array(a, order="C")) for a in p.args])
        except Exception as err:  # reported per case
            results[p.name] = f"{type(err).__name__}: {err}"
            continue
        results[p.name] = (float(res[0].numpy()), [g.numpy() for g in res[1]])
    return results


def mismatch(p: Prepared, case_name: str, grads: list, rtol: float, atol: float) -> str | None:
    """None when every gradient of ``case_name`` matches torch's (``atol`` relative to max |ref|)."""
    for k, label, ref in p.expected_grads[case_name]:
        got, ref = np.asarray(grads[k], np.float64), np.asarray(ref, np.float64)
        if got.shape != ref.shape:
            return f"d/{label}: shape {got.shape} vs torch {ref.shape}"
        tol = atol * max(1.0, float(np.abs(ref).max(initial=0.0)))
        if not np.allclose(got, ref, rtol=rtol, atol=tol):
            return f"d/{label}: max abs error {np.abs(got - ref).max():.3g} (torch max {np.abs(ref).max():.3g})"
    return None


TOLERANCES = {"float64": (1e-9, 1e-10), "float32": (1e-4, 1e-5)}


def prepare_all(cases: list, group_size: int = 32) -> list[Prepared]:
    """Groups of cases prepared together; a group that fails is split into single cases, so one
    failing case does not hide the others."""
    groups: list[Prepared] = []
    by_mode: dict = {}
    for c in cases:
        by_mode.setdefault(c.decompose, []).append(c)
    for mode_cases in by_mode.values():
        for start in range(0, len(mode_cases), group_size):
            chunk = mode_cases[start:start + group_size]
            p = prepare(chunk, name=f"group{len(groups)}")
            if p.error is None or len(chunk) == 1:
                groups.append(p)
                continue
            for c in chunk:
                groups.append(prepare([c], name=f"group{len(groups)}"))
    return groups


def check_target():
    """This CPU (:func:`rlx_tvm.target.cpu_target`) without LLVM's optimizations: the kernels and
    their schedules are the same, building is faster."""
    from ..target import cpu_target

    attrs = dict(cpu_target().export())
    return tvm.target.Target({"kind": "llvm", "mcpu": attrs["mcpu"], "num-cores": attrs["num-cores"], "opt-level": 0})


def check_all(cases: list, target=None, group_size: int = 32, log=None):
    """Prepare, compile (each group once) and compare every case: ``(groups, {case name: error or None})``."""
    from ..build import compile as rlx_compile

    target = target or check_target()
    groups = prepare_all(cases, group_size)
    if log is not None:
        log(f"prepared {len(groups)} groups")
        for p in groups:
            if p.error:
                log(f"  {[c.name for c in p.cases]}: {p.error[:300]}")
    errors: dict = {}
    for p in groups:
        for c in p.cases:
            errors[c.name] = p.error
    # One build per group: a module holding every group builds several times slower than the
    # groups one by one.
    results = {}
    for p in groups:
        if p.adjoint is None:
            continue
        try:
            results.update(run(rlx_compile(combined_module([p]), target=target, verbose=False), [p]))
        except Exception as err:
            results[p.name] = f"{type(err).__name__}: {str(err)[-2000:]}"
    if log is not None:
        log("compiled and ran")
    for p in groups:
        if p.error is not None or p.name not in results:
            continue
        if isinstance(results[p.name], str):
            for c in p.cases:
                errors[c.name] = results[p.name]
            continue
        _, grads = results[p.name]
        for c in p.cases:
            rtol, atol = TOLERANCES[c.dtype]
            errors[c.name] = mismatch(p, c.name, grads, rtol, atol)
    return groups, errors
