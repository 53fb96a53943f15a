"""The gradient coverage table of TVM's torch importer: ``docs/gradient_coverage.md``.

    python -m rlx_tvm.gradients.coverage --write docs/gradient_coverage.md

For every ATen op in the importer's converter table (read from its source by
:mod:`.importer_ops`): the Relax ops its converter emits, where each one's gradient comes from
(TVM's own rule, an rlx rule in primitives, or an rlx rule that emits a fused ``relax.rlx.*``
backward op; or why it has none), and the tests (cases of :mod:`.coverage_cases`, checked against
``torch.autograd`` by ``tests/test_importer_gradients.py``) whose exported graph contains the op.
Building the test column exports every case with torch.
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect

from ..overrides import function_set_here, has_gradient
from .importer_ops import CALL_TIR, converter_table

TEST_FILE = "tests/test_importer_gradients.py"
TEST_FUNCTION = "test_gradient_matches_torch"

# Relax ops whose gradient is not a number to check, and why.
NOT_DIFFERENTIABLE = {
    "relax.argmax": "integer output (an index)",
    "relax.argmin": "integer output (an index)",
    "relax.argsort": "integer output (indices)",
    "relax.bucketize": "integer output (bucket indices)",
    "relax.nonzero": "integer output (indices)",
    "relax.one_hot": "integer input (indices)",
    "relax.bitwise_and": "integer/boolean op",
    "relax.bitwise_or": "integer/boolean op",
    "relax.bitwise_xor": "integer/boolean op",
    "relax.bitwise_not": "integer/boolean op",
    "relax.logical_xor": "boolean op",
    "relax.isfinite": "boolean output",
    "relax.isinf": "boolean output",
    "relax.isnan": "boolean output",
    "relax.eye": "constant (no tensor input)",
    "relax.hamming_window": "constant (no tensor input)",
    "relax.meshgrid": "index grids built from arange (integer inputs in the importer's use)",
    "relax.shape_to_tensor": "shape values, not data",
    "relax.tensor_to_shape": "shape values, not data",
    "relax.assert_op": "a run-time check, no data output",
    "relax.null_value": "control flow placeholder (torch.cond), no data",
    CALL_TIR: "an opaque TensorIR kernel",
}

# Differentiable Relax ops the importer emits that have no gradient yet, and why.
NO_GRADIENT_YET = {
    "relax.image.grid_sample": "no rule yet (data-dependent bilinear sampling: scatter-add to the input, "
    "and the interpolation weights' derivative for the grid)",
}

# ATen ops whose conversion by TVM 0.27's importer is wrong or fails before any gradient, so
# that no gradient test can pass through them (each found by a case of coverage_cases).
IMPORTER_ISSUES = {
    "celu.default": "importer computes exp(x) / alpha instead of exp(x / alpha)",
    "clamp_max.default": "importer drops the bound (clip(x, -inf, inf))",
    "batch_norm.default": "importer misreads the arguments (training as momentum, momentum as eps)",
    "std.correction": "importer ignores the correction (population std)",
    "lstm.input": "importer's converter fails on torch.export's LSTM",
    "gru.input": "importer output fails type inference",
    "rnn_tanh.input": "importer's converter fails on torch.export's RNN",
    "pixel_shuffle.default": "TVM cannot build relax.nn.pixel_shuffle (topi.nn.pixel_shuffle missing)",
    "upsample_bicubic2d.vec": "no gradient for resize2d's cubic method",
}

# Rules that lower onto fused rlx backward ops: the gradient of the Relax op (left) contains these
# ops (checked on the imported models by the tests).
FUSED = {
    "relax.nn.attention": ("relax.rlx.attention_backward",),
    "relax.nn.layer_norm": ("relax.rlx.layer_norm_backward_input", "relax.rlx.layer_norm_backward_gamma"),
    "relax.nn.group_norm": ("relax.rlx.group_norm_backward_input", "relax.rlx.group_norm_backward_gamma"),
    "relax.nn.conv2d": ("relax.rlx.conv2d_backward_input", "relax.rlx.conv2d_backward_weight"),
    "relax.nn.conv1d": ("relax.rlx.conv2d_backward_input", "relax.rlx.conv2d_backward_weight"),
    "relax.nn.conv2d_transpose": ("relax.rlx.conv2d_backward_weight",),
    "relax.nn.max_pool2d": ("relax.rlx.max_pool2d_backward",),
    "relax.nn.max_pool1d": ("relax.rlx.max_pool2d_backward",),
    "relax.cumsum": ("relax.rlx.cumsum_backward",),
    "relax.take": ("relax.rlx.gather_backward",),
}


def _activation_rules() -> dict:
    """The elementwise ops whose rule is ``rlx.activation_backward`` (``relu_backward`` for relu)."""
    from ..ops.activation import RELAX_ACTIVATIONS

    return {
        name: ("relax.rlx.relu_backward",) if kind == "relu" else ("relax.rlx.activation_backward",)
        for name, kind in RELAX_ACTIVATIONS.items()
    }


FUSED.update(_activation_rules())


@functools.lru_cache(maxsize=1)
def tvm_rules() -> frozenset:
    """The ops TVM 0.27 itself registers a gradient for (read from ``relax/op/_op_gradient.py``)."""
    from tvm.relax.op import _op_gradient

    tree = ast.parse(inspect.getsource(_op_gradient))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "register_gradient":
            if node.args and isinstance(node.args[0], ast.Constant):
                names.add(node.args[0].value)
    return frozenset(names)


def gradient_source(op_name: str) -> str:
    """Where ``op_name``'s gradient comes from, or why it has none."""
    import rlx_tvm  # noqa: F401  (registers every rule)

    if op_name in NOT_DIFFERENTIABLE:
        return f"not differentiable: {NOT_DIFFERENTIABLE[op_name]}"
    if op_name in NO_GRADIENT_YET and not has_gradient(op_name):
        return f"no gradient: {NO_GRADIENT_YET[op_name]}"
    if op_name in FUSED:
        return "rlx op " + ", ".join(o.replace("relax.rlx.", "rlx.") for o in FUSED[op_name])
    rule = function_set_here(op_name)
    if rule is not None:
        module = rule.__module__.replace("rlx_tvm.", "")
        return f"rlx rule ({module})"
    if op_name in tvm_rules() and has_gradient(op_name):
        return "TVM"
    if has_gradient(op_name):
        return "rlx rule"
    return "MISSING"


def _test_ref(case: str) -> str:
    return f"`{TEST_FUNCTION}[{case}]`"


def render(case_aten_ops: dict[str, set]) -> str:
    """The markdown table from each case's ATen ops (case name -> ATen op names)."""
    table = converter_table()
    by_aten: dict[str, list[str]] = {}
    for case, atens in case_aten_ops.items():
        for a in atens:
            by_aten.setdefault(a, []).append(case)
    relax_ops = sorted({o for ops in table.values() for o in ops})
    sources = {o: gradient_source(o) for o in relax_ops}
    rows, untested = [], []
    missing = sorted(o for o, s in sources.items() if s == "MISSING" or s.startswith("no gradient"))
    for aten, ops in table.items():
        cases = sorted(by_aten.get(aten, []))
        if ops:
            grad = "; ".join(f"{o.replace('relax.', '')}: {sources[o]}" for o in ops)
        else:
            grad = "(passes its input through)"
        # Rows without a "." convert Python operators on symbolic sizes, not tensor data; an op
        # with an integer/boolean result makes the row's output not differentiable.
        needs_test = "." in aten and bool(ops) and not any(
            sources[o].startswith(("not differentiable", "no gradient")) for o in ops
        )
        if cases:
            tests = ", ".join(_test_ref(c) for c in cases[:3]) + (f" (+{len(cases) - 3})" if len(cases) > 3 else "")
        elif aten in IMPORTER_ISSUES:
            tests = f"none: {IMPORTER_ISSUES[aten]}"
        elif needs_test:
            tests = "no test"
            untested.append(aten)
        elif any(sources[o].startswith("no gradient") for o in ops):
            tests = "none: no gradient yet"
        else:
            tests = "not differentiable" if ops and "." in aten else ("size arithmetic" if "." not in aten else "no op")
        emitted = ", ".join(o.replace("relax.", "") for o in ops) or "-"
        rows.append(f"| `{aten}` | {emitted} | {grad} | {tests} |")
    lines = [
        "# Gradient coverage of TVM's torch importer",
        "",
        "Generated by `python -m rlx_tvm.gradients.coverage --write docs/gradient_coverage.md`; do not edit.",
        "",
        "Every ATen op that TVM 0.27's `from_exported_program` converts, the Relax ops its converter can",
        "emit (read from the importer's source), where each Relax op's gradient comes from, and the tests",
        f"in `{TEST_FILE}` whose exported module contains the op. Each test exports a small",
        "torch module, imports it with `from_exported_program(keep_params_as_input=True)`, differentiates",
        "it with `rlx_tvm.autodiff.grad`, compiles it with `rlx_tvm.compile` and compares every input and",
        "parameter gradient with `torch.autograd`.",
        "",
        "Gradient sources: **TVM** (TVM's own rule), **rlx rule (module)** (a rule of this package written",
        "with Relax primitives), **rlx op** (a rule that emits the named fused `relax.rlx.*` backward ops).",
        "",
        f"{len(table)} ATen ops, {len(relax_ops)} Relax ops; "
        f"{len(relax_ops) - len(missing) - sum(1 for s in sources.values() if s.startswith('not differentiable'))} "
        f"with a gradient, {sum(1 for s in sources.values() if s.startswith('not differentiable'))} "
        f"not differentiable, {len(missing)} without a gradient; {len(untested)} ATen ops without a test.",
        "",
    ]
    if missing:
        lines += ["Relax ops without a gradient: " + ", ".join(f"`{o}`" for o in missing) + ".", ""]
    broken = [a for a in table if a in IMPORTER_ISSUES and not by_aten.get(a)]
    if broken:
        lines += ["ATen ops no gradient test can pass through (a wrong or failing conversion, or no rule): "
                  + "; ".join(f"`{a}` ({IMPORTER_ISSUES[a]})" for a in broken) + ".", ""]
    if untested:
        lines += ["Other ATen ops without a test: " + ", ".join(f"`{a}`" for a in untested) + ".", ""]
    lines += ["| ATen op | Relax ops | gradient | tests |", "|---|---|---|---|", *rows, ""]
    return "\n".join(lines)


def case_aten_ops(cases=None) -> dict[str, set]:
    """Export every case (grouped, as the tests do) and return its ATen ops."""
    from .coverage_cases import CASES
    from .torch_check import prepare_all

    result: dict[str, set] = {}
    for group in prepare_all(list(CASES if cases is None else cases)):
        result.update(group.aten_ops)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlx_tvm.gradients.coverage", description=__doc__.split("\n")[0])
    parser.add_argument("--write", metavar="PATH", help="write the table here (default: print it)")
    args = parser.parse_args(argv)
    text = render(case_aten_ops())
    if args.write:
        with open(args.write, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
