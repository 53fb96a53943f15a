"""What TVM's torch importer (``from_exported_program``) can emit, read from its source.

For every entry of ``ExportedProgramImporter.create_convert_map`` (a torch ATen op name), the
converter's source and the sources of the importer methods it reaches are scanned for
``relax.op.*`` builders; each builder is resolved to the Relax op(s) it creates (a wrapper such as
``relax.op.linear`` resolves to the ops it is written with). ``call_te`` / ``call_tir`` converters
are reported as ``call_tir``: a TensorIR kernel that no gradient rule can see into.

Static reading over-approximates (a converter's branches are all counted) but misses nothing a
converter writes as ``relax.op.<name>``. No torch is needed.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import textwrap

import tvm

CALL_TIR = "call_tir"


def _chain(node: ast.AST) -> list[str] | None:
    """``relax.op.nn.conv2d`` -> ["relax", "op", "nn", "conv2d"]; None for other expressions."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return parts[::-1]
    return None


@functools.lru_cache(maxsize=None)
def _op_names() -> frozenset:
    return frozenset(str(n) for n in tvm.ir.Op.list_op_names())


def _builder_ops(fn) -> frozenset:
    """The Relax ops one ``relax.op`` builder function creates."""
    module = getattr(fn, "__module__", "") or ""
    name = getattr(fn, "__name__", "")
    prefix = "relax."
    for sub in ("nn", "image", "ccl", "memory", "grad"):
        if f".op.{sub}" in module:
            prefix = f"relax.{sub}."
    if prefix + name in _op_names():
        return frozenset([prefix + name])
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError):
        return frozenset()
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            c = _chain(node.func)
            if c and c[0] == "_ffi_api" and len(c) == 2 and prefix + c[1] in _op_names():
                found.add(prefix + c[1])
            elif c and c[0] in ("relax", "_op", "op") and len(c) >= 2:
                found |= _resolve(c)
            elif c and len(c) == 1 and c[0] != name:
                target = fn.__globals__.get(c[0]) if hasattr(fn, "__globals__") else None
                if callable(target) and getattr(target, "__module__", "").startswith("tvm.relax.op"):
                    found |= _builder_ops(target)
    return frozenset(found)


def _resolve(chain: list[str]) -> frozenset:
    if chain[:2] != ["relax", "op"] or len(chain) < 3:
        return frozenset()
    obj = importlib.import_module("tvm.relax.op")
    for part in chain[2:]:
        obj = getattr(obj, part, None)
        if obj is None:
            return frozenset()
    if inspect.ismodule(obj) or not callable(obj):
        return frozenset()
    return _builder_ops(obj)


class _Scanner:
    """Relax ops reachable from an importer method (through the ``self._x`` methods it uses)."""

    def __init__(self, importer_cls):
        self.cls = importer_cls
        self.cache: dict[str, frozenset] = {}

    def _scan(self, tree: ast.AST, seen: set) -> set:
        found: set = set()
        for node in ast.walk(tree):
            c = _chain(node) if isinstance(node, ast.Attribute) else None
            if not c:
                continue
            if c[:2] == ["relax", "op"]:
                found |= _resolve(c)
            elif c[0] == "self" and len(c) == 2:
                found |= self.method(c[1], seen)
            elif c[-1] in ("call_te", "call_tir", "call_dps_packed"):
                found.add(CALL_TIR)
        return found

    def method(self, name: str, seen: set | None = None) -> frozenset:
        if name in self.cache:
            return self.cache[name]
        seen = set() if seen is None else seen
        if name in seen:
            return frozenset()
        seen.add(name)
        fn = getattr(self.cls, name, None)
        if not inspect.isfunction(fn):
            return frozenset()
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        result = frozenset(self._scan(tree, seen))
        self.cache[name] = result
        return result

    def expression(self, node: ast.AST) -> frozenset:
        return frozenset(self._scan(node, set()))


@functools.lru_cache(maxsize=1)
def converter_table() -> dict[str, tuple[str, ...]]:
    """ATen op name (as the importer's table spells it) -> sorted Relax ops its converter can emit."""
    from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

    src = textwrap.dedent(inspect.getsource(ExportedProgramImporter.create_convert_map))
    tree = ast.parse(src)
    table_dict = next(n for n in ast.walk(tree) if isinstance(n, ast.Dict))
    scanner = _Scanner(ExportedProgramImporter)
    table: dict[str, tuple[str, ...]] = {}
    for key, value in zip(table_dict.keys, table_dict.values):
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            table[key.value] = tuple(sorted(scanner.expression(value)))
    return table


if __name__ == "__main__":  # pragma: no cover - a listing for people
    for aten, ops in converter_table().items():
        print(f"{aten:45s} {', '.join(ops) or '(no op: passes its input through)'}")
