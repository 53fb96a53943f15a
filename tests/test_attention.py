"""attention and attention_backward: the references vs an independent definition, every option
covered, float16, the SPEC §8 traps through both paths (on the samples' outputs, checked against
the references by tests/test_ops.py), autodiff of the decomposition, TVMScript, bad input, and the
gradients computed together. The gradient rules are checked numerically by tests/test_gradients.py."""

import importlib

import numpy as np
import pytest
import tvm
from tvm import relax

from rlx_tvm.ops import OpError, get_op
from rlx_tvm.passes import DecomposeBackwardOps
from rlx_tvm.testing import CHECK_TARGET, Case, build_loss_module, build_module, finite_difference_vjp, run_cases
from rlx_tvm.testing.samples import output
from rlx_tvm.testing.samples.attention import (
    BY_NAME, CASES, OPTIONS, TRAP_VARIANTS, attention_inputs, attention_np, symbolic_batch,
)

from .helpers import assert_op_error, emit_call, tensor_var

# The builders (``rlx_tvm.ops.attention`` is the family's module, not the op).
attention_op = get_op("attention")
attention_backward_op = get_op("attention_backward")


def _output(name, dtype="float64", path="fused"):
    return output(name, dtype, path)


def test_reference_forward_matches_definition():
    for c in CASES:
        if c.op == "attention":
            np.testing.assert_allclose(c.reference(), attention_np(**c.inputs, **c.attrs), rtol=1e-12, atol=1e-12,
                                       err_msg=c.name)


def test_every_option_and_wrt_is_covered():
    """Each option with the forward and with finite-difference cases for wrt = q, k and v."""

    def has(pred):
        checked = [c for c in CASES if c.op == "attention" or c.forward is not None]
        return {c.attrs.get("wrt") for c in checked if pred(c.attrs, c.inputs)} >= {None, "q", "k", "v"}

    assert has(lambda a, i: not ({"causal_mask", "window_size"} & set(a)))
    assert has(lambda a, i: a.get("causal_mask") == "TopLeft")
    assert has(lambda a, i: a.get("causal_mask") == "BottomRight" and i["k"].shape[1] > i["q"].shape[1])
    assert has(lambda a, i: a.get("causal_mask") == "BottomRight" and i["k"].shape[1] < i["q"].shape[1])
    assert has(lambda a, i: "window_size" in a and "causal_mask" not in a)
    assert has(lambda a, i: "window_size" in a and "causal_mask" in a)
    assert has(lambda a, i: "scale" in a)
    assert has(lambda a, i: "softcap" in a)
    assert has(lambda a, i: "bias" in i)
    assert has(lambda a, i: i["q"].shape[2] > i["k"].shape[2])  # GQA
    assert has(lambda a, i: i["q"].shape[3] != i["v"].shape[3])  # Dv != D


def test_float16_accumulates_in_float32():
    cases = [CASES[BY_NAME[n]] for n in (
        "attention[bottom_right+window+mqa+scale+softcap]",
        "attention_backward[bottom_right+softcap+bias+Dv, wrt=q]",
        "attention_backward[window+gqa+bias[1,H,1,Sk], wrt=k]",
    )]
    for path in ("fused", "decomposed"):
        for c, out in zip(cases, run_cases(cases, "float16", symbolic=False, path=path)):
            assert out.dtype == np.float16
            ref = c.reference("float16")
            np.testing.assert_allclose(out.astype(np.float64), ref, rtol=2e-2, atol=2e-2 * max(1.0, np.abs(ref).max()),
                                       err_msg=f"{path} {c.name}")


# -- SPEC §8 traps (the cases are in CASES, so the matrix and finite-difference tests check their
# values; these tests check that each trap is really exercised, through both paths) -------------

PATHS = ("fused", "decomposed")


@pytest.mark.parametrize("wrt", ["q", "k"])
def test_non_default_scale_and_softcap_enter_the_gradient(wrt):
    for path in PATHS:
        plain = _output(f"attention_backward[plain, wrt={wrt}]", path=path)
        for label, _ in TRAP_VARIANTS:
            other = _output(f"attention_backward[{label}, wrt={wrt}]", path=path)
            assert np.abs(other - plain).max() > 1e-2, (path, label)


def test_sliding_window_and_bottom_right_masks():
    for path in PATHS:
        # TopLeft with Sk = 5 > Sq = 3: keys 3 and 4 are visible to no query, so no gradient and
        # no contribution; BottomRight (queries at the end): the last query sees every key.
        dk = _output("attention_backward[top_left+scale+bias[Sq,Sk], wrt=k]", path=path)
        assert np.all(dk[:, 3:] == 0) and np.abs(dk[:, :3]).min() > 0, path
        dk = _output("attention_backward[bottom_right+softcap+bias+Dv, wrt=k]", path=path)
        assert np.abs(dk[:, 4]).max() > 1e-3, path
        # BottomRight, window 1, Sk = 5: query i (absolute i + 2) sees keys i + 1 and i + 2 only.
        dv = _output("attention_backward[bottom_right+window+mqa+scale+softcap, wrt=v]", path=path)
        assert np.all(dv[:, 0] == 0) and np.all(np.abs(dv[:, 1:]).max(axis=(0, 2, 3)) > 1e-3), path
        # A window without a causal mask lets a query see the keys after it (j >= i - 1).
        dv = _output("attention_backward[window+gqa+bias[1,H,1,Sk], wrt=v]", path=path)
        assert np.abs(dv[:, 3]).max() > 1e-3, path
        # TopLeft window 1 with Sq = 4 > Sk = 3: query 3 sees key 2 only, query 0 key 0 only.
        dq = _output("attention_backward[top_left+window, wrt=q]", path=path)
        out = _output("attention[top_left+window]", path=path)
        c = CASES[BY_NAME["attention[top_left+window]"]]
        np.testing.assert_allclose(out[:, 3], c.inputs["v"][:, 2], rtol=1e-12, err_msg=path)
        np.testing.assert_allclose(out[:, 0], c.inputs["v"][:, 0], rtol=1e-12, err_msg=path)
        assert np.all(dq[:, 0] == 0) and np.all(dq[:, 3] == 0), path  # a single key: softmax is constant


def test_grouped_query_heads_sum_over_their_group():
    """GQA (H=4, Hkv=2) equals multi-head attention with each kv head repeated for its group,
    with dK and dV summed over the group."""
    label = "window+gqa+bias[1,H,1,Sk]"
    gqa = [CASES[BY_NAME[f"attention_backward[{label}, wrt={w}]"]] for w in "qkv"]
    mha = []
    for c in gqa:
        ins = dict(c.inputs)
        ins["k"], ins["v"] = np.repeat(ins["k"], 2, axis=2), np.repeat(ins["v"], 2, axis=2)
        mha.append(Case("attention_backward", ins, c.attrs, label=c.name + "[mha]"))
    for path in PATHS:
        dq, dk, dv = (_output(c.name, path=path) for c in gqa)
        mq, mk, mv = run_cases(mha, "float64", symbolic=False, path=path)
        np.testing.assert_allclose(dq, mq, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(dk, mk.reshape(2, 4, 2, 2, 3).sum(axis=3), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(dv, mv.reshape(2, 4, 2, 2, 3).sum(axis=3), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fully_masked_rows_are_exactly_zero(dtype):
    """Queries 0 and 1 see no key: their output and dQ rows are exactly 0, nothing is NaN, and
    (checked by the finite differences) their dy rows reach neither dK nor dV."""
    for path in PATHS:
        out, dq, dk, dv = (_output(n, dtype, path) for n in (
            "attention[fully_masked]", *(f"attention_backward[fully_masked, wrt={w}]" for w in "qkv")))
        for name, r in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
            assert np.all(np.isfinite(r)), (path, name)
        assert np.all(out[:, :2] == 0) and np.abs(out[:, 2:]).max() > 1e-3, path
        assert np.all(dq[:, :2] == 0) and np.abs(dq[:, 2:]).max() > 1e-3, path


def test_fully_masked_rows_stay_finite_under_autodiff_of_the_decomposition():
    """Gradient of the decomposed forward and (second order) of the decomposed backward: finite,
    zero for the masked queries, and equal to finite differences."""
    fwd, bwd_q = (CASES[BY_NAME[n]] for n in ("attention[fully_masked]", "attention_backward[fully_masked, wrt=q]"))
    for case, loss_np in (
        (fwd, lambda **kw: np.sum(attention_np(**kw, **fwd.attrs) ** 2)),
        # The backward reference is itself checked against finite differences of the definition.
        (bwd_q, lambda **kw: np.sum(attention_backward_op.reference_fn(**kw, **bwd_q.attrs) ** 2)),
    ):
        mod = DecomposeBackwardOps(include_forward=True)(build_loss_module(case, "float64"))
        mod = relax.transform.Gradient("main", require_grads=list(mod["main"].params[:3]))(mod)
        vm = relax.VirtualMachine(tvm.compile(mod, tvm.target.Target(CHECK_TARGET)), tvm.cpu())
        _, grads = vm["main_adjoint"](*[tvm.runtime.tensor(a) for a in case.inputs.values()])
        for name, g in zip("qkv", grads):
            g = g.numpy()
            assert np.all(np.isfinite(g)), (case.name, name)
            fd = finite_difference_vjp(loss_np, dict(case.inputs), name, np.asarray(1.0))
            np.testing.assert_allclose(g, fd, rtol=1e-5, atol=1e-6, err_msg=f"{case.name} d/d{name}")
        assert np.all(grads[0].numpy()[:, :2] == 0), case.name


# -- gradient rules (checked numerically by tests/test_gradients.py) -----------------------------


def test_nn_attention_gradient_refuses_tvms_bottom_right_when_sq_exceeds_sk():
    q, k = tensor_var("q", (1, 4, 2, 3), "float64"), tensor_var("k", (1, 2, 2, 3), "float64")
    bb = relax.BlockBuilder()
    with bb.function("main", [q, k]):
        with bb.dataflow():
            out = bb.emit(relax.op.nn.attention(q, k, k, causal_mask="BottomRight"))
            loss = bb.emit_output(relax.op.sum(out))
        bb.emit_func_output(loss)
    with pytest.raises(OpError, match="Sk >= query length Sq"):
        relax.transform.Gradient("main")(bb.get())


def test_tvmscript_round_trip_with_every_attribute():
    cases = [CASES[BY_NAME[n]] for n in (
        "attention[bottom_right+window+mqa+scale+softcap]", "attention_backward[bottom_right+softcap+bias+Dv, wrt=k]")]
    for symbolic in (False, True):
        mod = build_module(cases, "float32", symbolic)
        text = mod.script()
        assert "R.rlx.attention(" in text and 'causal_mask="BottomRight"' in text and 'wrt="k"' in text, text
        tvm.ir.assert_structural_equal(mod, tvm.script.from_source(text))


# -- bad input ------------------------------------------------------------------------------------


def _qkv(q=(2, 3, 4, 8), k=(2, 5, 2, 8), v=(2, 5, 2, 6), dtype="float32"):
    return tensor_var("q", q, dtype), tensor_var("k", k, dtype), tensor_var("v", v, dtype)


def test_bad_input_heads_not_divisible():
    assert_op_error(lambda: attention_op(*_qkv(q=(2, 3, 4, 8), k=(2, 5, 3, 8), v=(2, 5, 3, 6))),
                    "attention", "k", "Hkv = 3")


def test_bad_input_rank():
    assert_op_error(lambda: attention_op(*_qkv(q=(2, 3, 32))), "attention", "q", "rank 4", "rank 3")
    assert_op_error(lambda: attention_backward_op(*_qkv(v=(2, 5, 12)), tensor_var("dy", (2, 3, 4, 6)), wrt="q"),
                    "attention_backward", "v", "rank 4")


def test_bad_input_mismatched_shapes():
    assert_op_error(lambda: attention_op(*_qkv(k=(2, 5, 2, 7))), "attention", "k", "head dim", "7")
    assert_op_error(lambda: attention_op(*_qkv(v=(3, 5, 2, 6))), "attention", "v", "batch", "3")
    assert_op_error(lambda: attention_op(*_qkv(v=(2, 4, 2, 6))), "attention", "v", "key length", "4")
    assert_op_error(lambda: attention_backward_op(*_qkv(), tensor_var("dy", (2, 3, 4, 8)), wrt="k"),
                    "attention_backward", "dy", "[2, 3, 4, 6]", "[2, 3, 4, 8]")


def test_bad_input_dtype():
    q, k, v = _qkv()
    assert_op_error(lambda: attention_op(q, k, tensor_var("v", (2, 5, 2, 6), "float64")), "attention", "v", "float64")
    assert_op_error(lambda: attention_op(*_qkv(dtype="int32")), "attention", "q", "int32")


def test_bad_input_attributes():
    dy = tensor_var("dy", (2, 3, 4, 6))
    assert_op_error(lambda: attention_backward_op(*_qkv(), dy, wrt="bias"), "attention_backward", "wrt", "bias")
    assert_op_error(lambda: attention_backward_op(*_qkv(), dy), "attention_backward", "wrt", "required")
    assert_op_error(lambda: attention_op(*_qkv(), causal_mask="Causal"), "attention", "causal_mask", "Causal")
    assert_op_error(lambda: attention_op(*_qkv(), window_size=-1), "attention", "window_size", "-1")
    assert_op_error(lambda: attention_op(*_qkv(), softcap=0.0), "attention", "softcap", "> 0")
    assert_op_error(lambda: attention_op(*_qkv(), softcap=-2.0), "attention", "softcap", "> 0")


def test_bad_input_bias_not_broadcastable():
    q, k, v = _qkv()
    for shape in [(2, 4, 3, 4), (2, 3, 3, 5), (1, 2, 1, 1, 5), (4, 5)]:
        assert_op_error(lambda: attention_op(q, k, v, tensor_var("bias", shape)), "attention", "bias",
                        "broadcastable to [B, H, Sq, Sk] = [2, 4, 3, 5]")
    for shape in [(2, 4, 3, 5), (1, 4, 1, 5), (3, 5), (5,)]:  # these broadcast
        emit_call(attention_op(q, k, v, tensor_var("bias", shape)))


# -- dq, dk and dv computed together (FuseSiblingBackwardOps, applied by rlx_tvm.compile on CPU) ------


@pytest.mark.parametrize("dtype,symbolic,chunk_bytes,row_block", [
    ("float32", False, None, None), ("float64", False, None, None), ("float64", True, None, None),
    ("float64", False, 1, None),  # one (batch, kv head) pair per call: slices of every input and bias shape
    ("float64", False, None, 1),  # causal masks: one query row per call, with the keys it sees
    ("float64", False, 1, 2),  # both
])
def test_gradients_asked_together_share_one_kernel(dtype, symbolic, chunk_bytes, row_block, monkeypatch):
    from rlx_tvm.testing import check_sibling_groups

    attention_module = importlib.import_module("rlx_tvm.ops.attention")
    if chunk_bytes is not None:
        monkeypatch.setattr(attention_module, "CHUNK_TILE_BYTES", chunk_bytes)
    if row_block is not None:
        monkeypatch.setattr(attention_module, "ROW_BLOCK", row_block)
    # Every option with all three gradients; pairs (and a repeated one) on the first two.
    chosen = [(o, "qkv") for o in OPTIONS] + [(OPTIONS[1], "kv"), (OPTIONS[2], "qk"), (OPTIONS[0], "vqv")]
    groups = []
    for seed, ((label, dims, attrs, bias_shape, symbolic_dim), wrts) in enumerate(chosen):
        if symbolic and symbolic_dim is None:
            continue
        ins = attention_inputs(dims, bias_shape, np.random.default_rng(seed))
        groups.append([Case("attention_backward", ins, {"wrt": w, **attrs}, batch=symbolic_batch(ins, symbolic_dim),
                            label=f"{label} d{w}") for w in wrts])
    lowered = check_sibling_groups(groups, dtype, symbolic)
    for i, cases in enumerate(groups):
        calls = []
        relax.analysis.post_order_visit(lowered[f"group_{i}"], lambda e: calls.append(e) if isinstance(e, relax.Call) else None)
        kernels = [c for c in calls if c.op.name == "relax.call_tir" and c.args[0].name_hint.startswith("rlx_attention_backward")]
        # one kernel for all the gradients asked (one per shape of a block of rows and its keys)
        assert all(len(c.ty.fields) == len({case.attrs["wrt"] for case in cases}) for c in kernels), i
        b, h = cases[0].inputs["k"].shape[0], cases[0].inputs["k"].shape[2]
        sq, sk = cases[0].inputs["q"].shape[1], cases[0].inputs["k"].shape[1]
        blocked = row_block is not None and "causal_mask" in cases[0].attrs and sq <= sk and sq > row_block
        rows = -(-sq // row_block) if blocked else 1
        if row_block is None:
            assert len({c.args[0].name_hint for c in kernels}) == 1, i
        if chunk_bytes == 1:
            assert len(kernels) == b * h * rows, (i, len(kernels))  # every (batch, kv head) pair its own call
        elif blocked:
            assert len(kernels) in (rows, b * rows), (i, len(kernels))


def test_attention_is_sliced_into_cache_sized_chunks():
    """At training shapes the gradients run on a few (batch, head) pairs per call: their [Sq, Sk]
    tiles stay in cache between the kernel's stages."""
    attention_module = importlib.import_module("rlx_tvm.ops.attention")
    q, k = tensor_var("q", (4, 512, 8, 64)), tensor_var("k", (4, 512, 8, 64))
    chunks = attention_module._head_chunks(q, k)
    assert chunks[:2] == [(0, 0, 2), (0, 2, 4)] and len(chunks) == 16  # 2 heads of 1 MiB tiles
    gqa = attention_module._head_chunks(q, tensor_var("k", (4, 512, 2, 64)))
    assert gqa == [(b, c, c + 1) for b in range(4) for c in range(2)]  # 4 query heads per kv head
    n = tvm.tirx.Var("n", "int64")
    assert attention_module._head_chunks(tensor_var("q", (n, 512, 8, 64)), tensor_var("k", (n, 512, 8, 64))) is None


def test_causal_attention_runs_blocks_of_rows_on_the_keys_they_see():
    """A causal mask leaves the keys after a block's last row (and, with a window, before its first
    row's window) out of the block's call; no blocks without a causal mask, with Sk < Sq (rows that
    see no key) or a symbolic length."""
    attention_module = importlib.import_module("rlx_tvm.ops.attention")
    blocks = attention_module._visible_key_blocks
    q512, k512 = tensor_var("q", (4, 512, 8, 64)), tensor_var("k", (4, 512, 8, 64))
    assert blocks(q512, k512, None, {"causal_mask": "TopLeft"}) == [(0, 256, 0, 256), (256, 512, 0, 512)]
    q300 = tensor_var("q", (1, 300, 8, 64))
    assert blocks(q300, k512, None, {"causal_mask": "BottomRight"}) == [(0, 256, 0, 468), (256, 300, 0, 512)]
    assert blocks(q300, k512, None, {"causal_mask": "TopLeft", "window_size": 100}) == [(0, 256, 0, 256), (256, 300, 156, 300)]
    assert blocks(q512, k512, None, {"causal_mask": None, "window_size": 3}) is None
    assert blocks(q512, q300, None, {"causal_mask": "BottomRight"}) is None  # Sk < Sq
    n = tvm.tirx.Var("n", "int64")
    assert blocks(tensor_var("q", (1, n, 8, 64)), tensor_var("k", (1, n, 8, 64)), None, {"causal_mask": "TopLeft"}) is None


def test_gradients_of_different_attentions_stay_apart():
    from rlx_tvm.passes import FuseSiblingBackwardOps

    q, k, v, dy = (tensor_var(n, (1, 4, 2, 8)) for n in ("q", "k", "v", "dy"))
    bb = relax.BlockBuilder()
    with bb.function("main", [q, k, v, dy]):
        with bb.dataflow():
            a = bb.emit(attention_backward_op(q, k, v, dy, wrt="q", causal_mask="TopLeft"))
            b = bb.emit(attention_backward_op(q, k, v, dy, wrt="k"))  # another mask: another attention
            c = bb.emit(attention_backward_op(q, v, k, dy, wrt="v", causal_mask="TopLeft"))  # k, v swapped
            gv = bb.emit_output(relax.Tuple([a, b, c]))
        bb.emit_func_output(gv)
    fused = FuseSiblingBackwardOps()(bb.get())
    tvm.ir.assert_structural_equal(fused, bb.get())
