"""The package's layers import only downwards: no import cycle between rlx_tvm's modules, no
module importing a layer above its own, and ``import rlx_tvm`` loads no tuning, benchmark or
command-line module (nor any part of MetaSchedule that ``import tvm`` does not load itself)."""

import ast
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "rlx_tvm"

# Layers, bottom first. A module belongs to the layer of the longest prefix naming it, so new
# modules inside these packages need no entry here; a new top-level module does.
LAYERS = [
    ("target", "threads", "timing", "tuning_logs"),  # what the CPU is; no rlx_tvm import at all
    ("overrides", "registry"),  # every change to TVM's op registries; the rlx op declaration API
    ("passes",),  # generic over the registry: they work on any declared op
    ("autodiff",),
    ("kernels", "ops"),  # the operators and their hand-written kernels (scan differentiates its body)
    ("gradients",),
    ("schedules",),  # default schedules
    ("build", ""),  # rlx_tvm.compile; "" is the package itself (rlx_tvm/__init__.py)
    ("testing",),  # NumPy-checked cases, used by tests, the demo and the benchmark
    ("tuning",),  # MetaSchedule search, export, device rounds
    ("bench",),  # the suite and its timing harness, device packs
    ("torch", "step_bench"),  # the PyTorch front door and the training-step benchmark
    ("cli", "examples", "demo"),  # what users run
]
LAYER_OF = {("rlx_tvm." + name).rstrip("."): i for i, names in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _layer(module: str) -> int:
    name = module
    while name not in LAYER_OF:
        if "." not in name:
            raise AssertionError(f"{module} is in no layer: add its top-level name to LAYERS in {__file__}")
        name = name.rsplit(".", 1)[0]
    return LAYER_OF[name]


def _top_level_imports(tree: ast.Module):
    """Import statements that run when the module is imported: not those inside functions or
    classes, nor under ``if TYPE_CHECKING``."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            stack += node.body + node.orelse
        elif isinstance(node, (ast.Try, ast.With)):
            stack += node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
            stack += [s for h in getattr(node, "handlers", []) for s in h.body]


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph() -> dict[str, set[str]]:
    """rlx_tvm module -> the rlx_tvm modules its top-level imports load (a submodule's packages
    included, as importing it runs their ``__init__``; the importer's own packages excluded, as
    they are being imported already)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        targets = set()
        for node in _top_level_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[:len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                found = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in found:
                if target.split(".")[0] != "rlx_tvm":
                    continue
                while target not in modules:  # `import rlx_tvm.x.attr`-like forms: the module holding it
                    target = target.rsplit(".", 1)[0]
                targets |= {t for t in [*_ancestors(target), target] if t != name and t not in _ancestors(name)}
        graph[name] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_is_read():
    """The graph the checks below walk: every module, with edges that are known to exist."""
    graph = import_graph()
    assert {"rlx_tvm", "rlx_tvm.build", "rlx_tvm.target", "rlx_tvm.cli", "rlx_tvm.tuning.export"} <= set(graph)
    assert {"rlx_tvm.build", "rlx_tvm.threads"} <= graph["rlx_tvm"]
    assert {"rlx_tvm.tuning.search", "rlx_tvm.tuning.device_round", "rlx_tvm.build", "rlx_tvm.timing"} <= \
        graph["rlx_tvm.tuning.export"]
    assert "rlx_tvm.tuning" in graph["rlx_tvm.bench.device_pack"]  # the package of tuning.device_round
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    cycles = _cycles(import_graph())
    assert not cycles, "import cycles (modules importing each other, directly or not): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def _top_name(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


@pytest.mark.parametrize("top", sorted({_top_name(m) for m in _modules()}))
def test_each_layer_imports_only_layers_below_it(top):
    """Per top-level module or package of rlx_tvm (``""``: the package's ``__init__``)."""
    upward = [f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
              for a, targets in sorted(import_graph().items()) if _top_name(a) == top
              for b in sorted(targets) if _layer(b) > _layer(a)]
    assert not upward, "imports of a higher layer:\n" + "\n".join(upward)


def test_device_time_runs_without_rlx_tvm():
    """The device pack's timer is copied out of the package and run alone: it imports nothing of
    rlx_tvm, and TVM only inside the functions that load the pack's runtime."""
    tree = ast.parse((PACKAGE / "bench" / "device_time.py").read_text())
    names = {a.name.split(".")[0] for n in _top_level_imports(tree) for a in n.names if isinstance(n, ast.Import)}
    names |= {(n.module or "").split(".")[0] for n in _top_level_imports(tree) if isinstance(n, ast.ImportFrom)}
    assert not names & {"rlx_tvm", "tvm", "tvm_ffi", "numpy", "torch", ""}, names


def test_import_rlx_tvm_loads_no_tuning():
    """``import rlx_tvm`` (in a fresh interpreter) loads no rlx_tvm.tuning, bench or cli module, and
    no MetaSchedule module beyond those ``import tvm`` loads itself."""
    code = ("import json, sys; import tvm; before = set(sys.modules); import rlx_tvm; "
            "print(json.dumps(sorted(set(sys.modules) - before)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "rlx_tvm.build" in loaded  # the probe did import the package
    heavy = [m for m in loaded if m.split(".")[:2] in (["rlx_tvm", "tuning"], ["rlx_tvm", "bench"], ["rlx_tvm", "cli"])
             or m.startswith(("tvm.s_tir.meta_schedule", "xgboost"))]
    assert not heavy, heavy
