"""Samples of attention and attention_backward: every mask, window, scale, softcap, bias shape,
grouped-query and Dv != D option with the forward and each of wrt = q, k, v (finite differences of
an independent row-by-row definition), and the gradient rules of R.nn.attention / rlx.attention."""

import math

import numpy as np
from tvm import relax

from ...ops import get_op
from .. import Case, GradCase

attention_op = get_op("attention")


# -- the definition, written independently of rlx_tvm (docs/operators.md §5) --------------------------------


def attention_np(q, k, v, bias=None, *, causal_mask=None, window_size=None, scale=None, softcap=None):
    """Row by row from the definition: which keys a query sees, then a softmax over those."""
    B, Sq, H, D = q.shape
    Sk, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    bias = np.zeros((B, H, Sq, Sk)) if bias is None else np.broadcast_to(bias, (B, H, Sq, Sk))
    out = np.zeros((B, Sq, H, Dv))
    for b in range(B):
        for h in range(H):
            kv = h // (H // Hkv)
            for i in range(Sq):
                pos = i + (Sk - Sq if causal_mask == "BottomRight" else 0)
                keys = [
                    j for j in range(Sk)
                    if (causal_mask is None or j <= pos) and (window_size is None or j >= pos - window_size)
                ]
                if not keys:
                    continue  # a fully masked row outputs 0
                s = scale * (k[b, keys, kv] @ q[b, i, h])
                if softcap is not None:
                    s = softcap * np.tanh(s / softcap)
                s = s + bias[b, h, i, keys]
                p = np.exp(s - s.max())
                out[b, i, h] = (p / p.sum()) @ v[b, keys, kv]
    return out


# -- cases ----------------------------------------------------------------------------------------


def attention_dims(**over):
    d = dict(B=2, Sq=3, Sk=4, H=2, Hkv=2, D=3, Dv=3)
    d.update(over)
    return d


# Every option appears with the forward and each of wrt = q, k, v; several share a case so that
# every function compiled counts (each costs a few hundred ms of LLVM time).
# (label, dims, attrs, bias shape ("full" = [B, H, Sq, Sk]) or None, which dim is symbolic in the
# symbolic-shape variant: "B", "Sq" or None for static only)
OPTIONS = [
    ("plain", attention_dims(), {}, None, "B"),
    ("top_left+scale+bias[Sq,Sk]", attention_dims(Sq=3, Sk=5), {"causal_mask": "TopLeft", "scale": 0.37}, (3, 5), "B"),
    ("bottom_right+softcap+bias+Dv", attention_dims(Sq=3, Sk=5, Dv=2), {"causal_mask": "BottomRight", "softcap": 0.7},
     "full", "B"),
    ("window+gqa+bias[1,H,1,Sk]", attention_dims(H=4, Hkv=2), {"window_size": 1}, (1, 4, 1, 4), None),
    # A symbolic query length: the BottomRight offset Sk - Sq is symbolic too.
    ("bottom_right+window+mqa+scale+softcap", attention_dims(Sq=3, Sk=5, H=3, Hkv=1),
     {"causal_mask": "BottomRight", "window_size": 1, "scale": 1.3, "softcap": 1.1}, None, "Sq"),
    ("top_left+window", attention_dims(Sq=4, Sk=3), {"causal_mask": "TopLeft", "window_size": 1}, None, None),
    # BottomRight with Sq > Sk: queries 0 and 1 (absolute positions -2, -1) see no key.
    ("fully_masked", attention_dims(Sq=4, Sk=2), {"causal_mask": "BottomRight"}, None, "B"),
]
# Same inputs as "plain" (same seed), other attributes: a gradient that ignored them would equal
# plain's.
TRAP_VARIANTS = [("scale", {"scale": 0.37}), ("softcap", {"softcap": 0.7})]


def attention_inputs(dims, bias_shape, rng):
    d = dims
    ins = {
        "q": rng.standard_normal((d["B"], d["Sq"], d["H"], d["D"])),
        "k": rng.standard_normal((d["B"], d["Sk"], d["Hkv"], d["D"])),
        "v": rng.standard_normal((d["B"], d["Sk"], d["Hkv"], d["Dv"])),
        "dy": rng.standard_normal((d["B"], d["Sq"], d["H"], d["Dv"])),
    }
    if bias_shape == "full":
        bias_shape = (d["B"], d["H"], d["Sq"], d["Sk"])
    if bias_shape is not None:
        ins["bias"] = rng.standard_normal(bias_shape)
    return ins


def symbolic_batch(ins, dim):
    """Case.batch for a symbolic B (in every input that carries it; a broadcast bias keeps its 1)
    or a symbolic Sq (q and dy; no bias)."""
    if dim is None:
        return None
    if dim == "Sq":
        assert "bias" not in ins
        return {name: 1 for name in ("q", "dy") if name in ins}
    spec = {name: 0 for name in ("q", "k", "v", "dy") if name in ins}
    if "bias" in ins and ins["bias"].ndim == 4 and ins["bias"].shape[0] == ins["q"].shape[0]:
        spec["bias"] = 0
    return spec


def _forward_fn(attrs):
    return lambda q, k, v, bias=None: attention_np(q, k, v, bias, **attrs)


def _op_cases(label, ins, attrs, symbolic_dim, wrts="qkv", forward=True, fd=True):
    fwd_ins = {n: a for n, a in ins.items() if n != "dy"}
    cases = []
    if forward:
        cases.append(Case("attention", fwd_ins, attrs, batch=symbolic_batch(fwd_ins, symbolic_dim), label=f"attention[{label}]"))
    cases += [
        Case("attention_backward", ins, {"wrt": w, **attrs}, batch=symbolic_batch(ins, symbolic_dim),
             label=f"attention_backward[{label}, wrt={w}]", forward=_forward_fn(attrs) if fd else None, wrt=w)
        for w in wrts
    ]
    return cases


def _cases():
    cases = []
    for seed, (label, dims, attrs, bias_shape, symbolic_dim) in enumerate(OPTIONS):
        cases += _op_cases(label, attention_inputs(dims, bias_shape, np.random.default_rng(seed)), attrs, symbolic_dim)
    plain = attention_inputs(attention_dims(), None, np.random.default_rng(0))
    for label, attrs in TRAP_VARIANTS:
        # Their options have finite-difference cases above already.
        cases += _op_cases(label, plain, attrs, None, wrts="qk", forward=False, fd=False)
    return cases


CASES = _cases()
BY_NAME = {c.name: i for i, c in enumerate(CASES)}


# -- gradient rules: relax.transform.Gradient emits attention_backward --------------------------


def weighted(fn):
    return lambda q, k, v, w, *rest: relax.op.sum(relax.op.multiply(fn(q, k, v, *rest), w))


def rule_grad_cases():
    rng = np.random.default_rng(15)
    ins = attention_inputs(attention_dims(), "full", rng)
    mha = {n: ins[n] for n in "qkv"}
    w = rng.standard_normal(ins["dy"].shape)
    g = attention_inputs(attention_dims(H=4, Hkv=2, Dv=2), "full", rng)
    return [
        GradCase("R.nn.attention(TopLeft, scale, bias)", {**mha, "w": w, "bias": ins["bias"]},
                 weighted(lambda q, k, v, bias: relax.op.nn.attention(q, k, v, bias, scale=0.5, causal_mask="TopLeft")),
                 wrt=["q", "k", "v"]),
        GradCase("rlx.attention(GQA, softcap, window, bias)",
                 {"q": g["q"], "k": g["k"], "v": g["v"], "w": g["dy"], "bias": g["bias"]},
                 weighted(lambda q, k, v, bias: attention_op(q, k, v, bias, causal_mask="BottomRight", window_size=1,
                                                              softcap=0.9, scale=1.2)),
                 wrt=["q", "k", "v"]),
    ]


GRAD_CASES = rule_grad_cases()
