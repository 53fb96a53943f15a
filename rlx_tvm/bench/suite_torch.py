"""PyTorch eager counterparts of the benchmark suite's kernels (``SuiteKernel.torch``).

Each takes the suite kernel's inputs as torch tensors and returns ``(output, leaves, cotangent)``:
the forward output, the tensors to differentiate with respect to, and the cotangent, so that a
timer runs only ``torch.autograd.grad(output, leaves, cotangent)``. This module imports neither
TVM nor the rest of rlx_tvm: the GPU device pack (``rlx_tvm/bench/device_pack.py``) copies it to a
machine that has PyTorch but no TVM compiler.
"""

from __future__ import annotations

GROUP_NORM_GROUPS = 32


def _torch():
    import torch
    import torch.nn.functional as F

    return torch, F


def activation(torch_fn: str):
    def fn(x, dy):
        _, F = _torch()
        return getattr(F, torch_fn)(x), [x], dy

    return fn


def layer_norm(x, gamma, beta, dy):
    _, F = _torch()
    return F.layer_norm(x, x.shape[-1:], gamma, beta, eps=1e-5), [x, gamma, beta], dy


def rms_norm(x, gamma, beta, dy):
    _, F = _torch()
    return F.rms_norm(x, x.shape[-1:], gamma, eps=1e-6), [x, gamma], dy


def group_norm(x, gamma, beta, dy):
    _, F = _torch()
    return F.group_norm(x, GROUP_NORM_GROUPS, gamma, beta, eps=1e-5), [x, gamma, beta], dy


def cross_entropy(logits, labels, d_loss):
    _, F = _torch()
    return F.cross_entropy(logits, labels, reduction="none"), [logits], d_loss


def conv2d(wrt: str):
    def fn(x, w, dy):
        _, F = _torch()
        return F.conv2d(x, w, padding=1), [{"x": x, "w": w}[wrt]], dy

    return fn


def max_pool2d(x, dy):
    _, F = _torch()
    return F.max_pool2d(x, 3, 2, 1), [x], dy


def attention(q, k, v, dy):
    _, F = _torch()
    # torch's native layout is [B, H, S, D]: give it contiguous tensors in that layout
    q, k, v, dy = (a.transpose(1, 2).contiguous().detach() for a in (q, k, v, dy))
    for a in (q, k, v):
        a.requires_grad_(True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True), [q, k, v], dy


def embedding(table, indices, dy):
    _, F = _torch()
    return F.embedding(indices, table), [table], dy


def cumsum(x, dy):
    t, _ = _torch()
    return t.cumsum(x, dim=1), [x], dy


def fake_quantize(x, dy):
    t, _ = _torch()
    scale = float(x.detach().abs().max()) / 127  # torch takes the scale; rlx derives it from x in the kernel
    return t.fake_quantize_per_tensor_affine(x, scale, 0, -127, 127), [x], dy


def rope(x, cos, sin, dy):
    t, _ = _torch()
    half = x.shape[-1] // 2
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    a, b = x[..., :half], x[..., half:]
    return t.cat([a * c - b * s, b * c + a * s], dim=-1), [x], dy


# suite kernel name -> its PyTorch counterpart
BY_KERNEL = {
    "relu_backward": activation("relu"),
    "gelu_backward": activation("gelu"),
    "silu_backward": activation("silu"),
    "layer_norm_backward": layer_norm,
    "rms_norm_backward": rms_norm,
    "group_norm_backward": group_norm,
    "softmax_cross_entropy_backward": cross_entropy,
    "conv2d_backward_input": conv2d("x"),
    "conv2d_backward_weight": conv2d("w"),
    "max_pool2d_backward": max_pool2d,
    "attention_backward": attention,
    "gather_backward": embedding,
    "cumsum_backward": cumsum,
    "fake_quantize_backward": fake_quantize,
    "rope_backward": rope,
}
