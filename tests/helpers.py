"""Small helpers shared by the op-family tests."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from rlx_tvm.ops import OpError, get_op

MATRIX = [
    pytest.param(d, s, p, id=f"{d}-{s}-{p}")
    for d in ("float32", "float64")
    for s in ("static", "symbolic")
    for p in ("fused", "decomposed")
]


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


def away_from(rng, shape, lo, hi, kinks, margin=0.05):
    """Uniform samples in [lo, hi] at least ``margin`` from every kink."""
    x = rng.uniform(lo, hi, size=shape)
    for k in kinks:
        close = np.abs(x - k) < margin
        x[close] = k + np.sign(x[close] - k + 1e-12) * margin * 2
    return x
