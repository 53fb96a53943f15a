"""Small helpers shared by the op-family tests."""

from __future__ import annotations

import pytest
from tvm import relax

from rlx_tvm.ops import OpError
from rlx_tvm.testing import run_cases


def tensor_var(name, shape, dtype="float32"):
    return relax.Var(name, relax.TensorType(list(shape), dtype))


def emit_call(call):
    """Normalize ``call`` inside a throwaway function, as building a real module would."""
    bb = relax.BlockBuilder()
    params = [a for a in call.args if isinstance(a, relax.Var)]
    with bb.function("f", params):
        with bb.dataflow():
            out = bb.emit(call)
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    return bb.get()


def assert_op_error(build, op: str, arg: str, *fragments: str):
    """``build()`` (making and normalizing a call) raises OpError naming op and argument."""
    with pytest.raises(OpError) as info:
        call = build()
        emit_call(call)
    msg = str(info.value)
    assert f"rlx.{op}" in msg, msg
    assert f"'{arg}'" in msg, msg
    for f in fragments:
        assert f in msg, msg
    return msg


class CaseGroups:
    """Named groups of hand-made cases a test module checks through both paths, all compiled
    together: one module per (dtype, path) holding every group declared for that dtype.

    ``groups`` maps a name to ``(cases, dtypes)``; :meth:`outputs` returns ``{path: outputs}``
    of one group, in its cases' order."""

    PATHS = ("fused", "decomposed")

    def __init__(self, groups):
        self.groups = groups
        self._runs = {}

    def outputs(self, name, dtype="float64"):
        cases, dtypes = self.groups[name]
        assert dtype in dtypes, (name, dtype)
        return {path: self._run(dtype, path)[name] for path in self.PATHS}

    def _run(self, dtype, path):
        if (dtype, path) not in self._runs:
            chosen = {n: cases for n, (cases, dtypes) in self.groups.items() if dtype in dtypes}
            outs = iter(run_cases([c for cases in chosen.values() for c in cases], dtype, symbolic=False, path=path))
            self._runs[dtype, path] = {n: [next(outs) for _ in cases] for n, cases in chosen.items()}
        return self._runs[dtype, path]
