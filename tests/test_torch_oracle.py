"""rlx_tvm.autodiff gradients vs torch.autograd (an independent oracle), float32 and float64.

Each case is a scalar loss written twice, once with Relax forward ops (differentiated by rlx autodiff
through the project's gradient rules) and once with PyTorch ops. Skipped as a whole when torch is not
installed (the optional ``torch`` extra); the finite-difference checks in test_gradients.py do not
need it.
"""

import numpy as np
import pytest
import tvm
from tvm import relax

from rlx_tvm import ops
from rlx_tvm.testing import CHECK_TARGET, GradCase, as_tensors, build_grad_module, gradient_mismatch

torch = pytest.importorskip("torch")
F = torch.nn.functional

RNG = np.random.default_rng(2026)
op = relax.op


def _randn(*shape):
    return RNG.standard_normal(shape)


def _weighted(relax_fn, torch_fn):
    """``sum(fn(inputs...) * w)`` for a Relax and a torch ``fn``; ``w`` is the last input."""
    return (lambda *a: op.sum(op.multiply(relax_fn(*a[:-1]), a[-1])),
            lambda *a: (torch_fn(*a[:-1]) * a[-1]).sum())


def _rope_torch(x, cos, sin, n_rot, style):
    """SPEC §4 rotation of the first n_rot dims of the last axis; x [B, S, H, D], tables [S, n_rot/2]."""
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    rot, rest = x[..., :n_rot], x[..., n_rot:]
    if style == "neox":
        a, b = rot[..., : n_rot // 2], rot[..., n_rot // 2:]
        out = torch.cat([a * c - b * s, b * c + a * s], dim=-1)
    else:  # gptj: pairs (2i, 2i+1)
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)
    return torch.cat([out, rest], dim=-1)


def _attention_torch(q, k, v, bias, *, scale, softcap, causal, window):
    """SPEC §5 in plain torch ops: [B, S, H, D] layout, GQA by repeating kv heads."""
    group = q.shape[2] // k.shape[2]
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)))
    s = scale * qh @ kh.transpose(-1, -2)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s + bias
    sq, sk = s.shape[-2:]
    qpos = torch.arange(sq)[:, None] + (sk - sq if causal == "BottomRight" else 0)
    kpos = torch.arange(sk)[None, :]
    visible = kpos <= qpos
    if window is not None:
        visible &= kpos >= qpos - window
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    return (p @ vh).transpose(1, 2)


def _cases():
    cases = []

    def add(label, inputs, pair, wrt):
        relax_fn, torch_fn = pair
        case = GradCase(label, inputs, relax_fn, wrt=wrt)
        case.torch_fn = torch_fn
        cases.append(case)

    x = _randn(3, 7)
    for label, rfn, tfn in [
        ("relu", op.nn.relu, F.relu),
        ("gelu", op.nn.gelu, F.gelu),
        ("gelu_tanh", op.nn.gelu_tanh, lambda t: F.gelu(t, approximate="tanh")),
        ("silu", op.nn.silu, F.silu),
        ("sigmoid", op.sigmoid, torch.sigmoid),
        ("tanh", op.tanh, torch.tanh),
        ("softplus(beta=2)", lambda t: op.nn.softplus(t, beta=2.0, threshold=20.0), lambda t: F.softplus(t, beta=2.0)),
    ]:
        add(label, {"x": x, "w": _randn(3, 7)}, _weighted(rfn, tfn), ["x"])

    add("layer_norm", {"x": _randn(2, 3, 8), "g": _randn(8), "b": _randn(8), "w": _randn(2, 3, 8)},
        _weighted(lambda x, g, b: op.nn.layer_norm(x, g, b, axes=[-1], epsilon=1e-5),
                  lambda x, g, b: F.layer_norm(x, (8,), g, b, eps=1e-5)), ["x", "g", "b"])
    add("rms_norm", {"x": _randn(4, 8), "g": _randn(8), "w": _randn(4, 8)},
        _weighted(lambda x, g: op.nn.rms_norm(x, g, axes=[-1], epsilon=1e-6),
                  lambda x, g: F.rms_norm(x, (8,), g, eps=1e-6)), ["x", "g"])
    add("group_norm G=2", {"x": _randn(2, 6, 3, 4), "g": _randn(6), "b": _randn(6), "w": _randn(2, 6, 3, 4)},
        _weighted(lambda x, g, b: op.nn.group_norm(x, g, b, num_groups=2, channel_axis=1, axes=[2, 3], epsilon=1e-5),
                  lambda x, g, b: F.group_norm(x, 2, g, b, eps=1e-5)), ["x", "g", "b"])

    add("conv2d stride 2 pad 1 dilation 2 groups 2", {"x": _randn(2, 4, 9, 8), "k": _randn(6, 2, 3, 3),
                                                      "w": _randn(2, 6, 4, 3)},
        _weighted(lambda x, k: op.nn.conv2d(x, k, strides=2, padding=1, dilation=2, groups=2),
                  lambda x, k: F.conv2d(x, k, stride=2, padding=1, dilation=2, groups=2)), ["x", "k"])
    # ties (integer-valued inputs): both must send each window's gradient to its first maximum
    for ceil in (False, True):
        add(f"max_pool2d k3 s2 p1 ties ceil_mode={ceil}", {"x": np.round(2 * _randn(2, 3, 7, 6)),
                                                           "w": _randn(2, 3, 4, 4 if ceil else 3)},
            _weighted(lambda x, c=ceil: op.nn.max_pool2d(x, pool_size=3, strides=2, padding=1, ceil_mode=c),
                      lambda x, c=ceil: F.max_pool2d(x, 3, stride=2, padding=1, ceil_mode=c)), ["x"])

    q, k, v = _randn(2, 5, 2, 4), _randn(2, 5, 2, 4), _randn(2, 5, 2, 3)
    add("R.nn.attention TopLeft scale=0.5", {"q": q, "k": k, "v": v, "w": _randn(2, 5, 2, 3)},
        _weighted(lambda q, k, v: op.nn.attention(q, k, v, scale=0.5, causal_mask="TopLeft"),
                  lambda q, k, v: F.scaled_dot_product_attention(
                      q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=0.5
                  ).transpose(1, 2)), ["q", "k", "v"])
    q, k, v, bias = _randn(1, 3, 4, 4), _randn(1, 6, 2, 4), _randn(1, 6, 2, 2), _randn(1, 4, 3, 6)
    add("rlx.attention GQA BottomRight window 2 softcap bias", {"q": q, "k": k, "v": v, "bias": bias,
                                                               "w": _randn(1, 3, 4, 2)},
        _weighted(lambda q, k, v, b: ops.attention(q, k, v, b, causal_mask="BottomRight", window_size=2,
                                                   softcap=0.8, scale=1.1),
                  lambda q, k, v, b: _attention_torch(q, k, v, b, scale=1.1, softcap=0.8, causal="BottomRight",
                                                      window=2)), ["q", "k", "v"])

    for style in ("neox", "gptj"):
        ang = _randn(5, 3)
        add(f"rope {style} n_rot=6 of 8", {"x": _randn(2, 5, 3, 8), "cos": np.cos(ang), "sin": np.sin(ang),
                                          "w": _randn(2, 5, 3, 8)},
            _weighted(lambda x, c, s, st=style: ops.rope(x, c, s, head_dim=8, n_rot=6, style=st),
                      lambda x, c, s, st=style: _rope_torch(x, c, s, 6, st)), ["x"])

    # torch's fake-quant gradient is the clipped straight-through estimator; with the symmetric
    # max-abs scale of SPEC every element is in range, so both pass dy through. (Per-channel is not compared:
    # torch's per-channel fake-quant rejects float64.)
    add("fake_quantize bits=4 clipped per-tensor", {"x": _randn(3, 5), "w": _randn(3, 5)},
        _weighted(lambda x: ops.fake_quantize(x, bits=4, ste="clipped"),
                  lambda x: torch.fake_quantize_per_tensor_affine(x, float(x.detach().abs().max()) / 7, 0, -7, 7)),
        ["x"])
    add("cumsum exclusive axis 1", {"x": _randn(3, 9), "w": _randn(3, 9)},
        _weighted(lambda x: op.cumsum(x, axis=1, exclusive=True), lambda x: torch.cumsum(x, 1) - x), ["x"])
    idx = np.array([4, 0, 4, 2, 4, 6], dtype="int64")  # duplicates accumulate
    add("take axis 0 duplicates", {"x": _randn(7, 3), "idx": idx, "w": _randn(6, 3)},
        _weighted(lambda x, i: op.take(x, i, axis=0), lambda x, i: torch.index_select(x, 0, i)), ["x"])
    labels = np.array([2, -100, 0, 4, 1, 3], dtype="int64")
    add("softmax_cross_entropy ignore_index label_smoothing", {"z": 3 * _randn(6, 5), "t": labels, "w": _randn(6)},
        _weighted(lambda z, t: ops.softmax_cross_entropy(z, t, label_smoothing=0.1),
                  lambda z, t: F.cross_entropy(z, t, reduction="none", label_smoothing=0.1)), ["z"])
    return cases


CASES = _cases()


def _torch_grads(case, dtype):
    tdtype = getattr(torch, dtype)
    args = {}
    for name, a in case.inputs.items():
        floating = np.issubdtype(a.dtype, np.floating)
        args[name] = torch.tensor(a, dtype=tdtype if floating else torch.int64, requires_grad=name in case.wrt)
    loss = case.torch_fn(*args.values())
    return torch.autograd.grad(loss, [args[n] for n in case.wrt])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_autodiff_matches_torch_autograd(dtype):
    mod = build_grad_module(CASES, dtype)
    vm = relax.VirtualMachine(tvm.compile(mod, tvm.target.Target(CHECK_TARGET)), tvm.cpu())
    rtol, atol = (1e-4, 1e-5) if dtype == "float32" else (1e-10, 1e-12)
    failures = []
    for i, case in enumerate(CASES):
        _, grads = vm[f"f{i}_adjoint"](*as_tensors(case.cast_inputs(dtype).values()))
        for name, g, ref in zip(case.wrt, grads, _torch_grads(case, dtype)):
            problem = gradient_mismatch(g.numpy(), ref.numpy(), rtol, atol)
            if problem:
                failures.append(f"{case.label} d/d{name}: {problem}")
    assert not failures, f"{len(failures)} gradients differ from torch.autograd ({dtype}):\n" + "\n".join(failures)


def test_cases_cover_every_differentiable_forward_family():
    labels = " ".join(c.label for c in CASES)
    for family in ("gelu", "silu", "layer_norm", "rms_norm", "group_norm", "conv2d", "max_pool2d", "R.nn.attention",
                   "rlx.attention", "rope", "cumsum", "take", "softmax_cross_entropy", "relu", "fake_quantize"):
        assert family in labels, family
