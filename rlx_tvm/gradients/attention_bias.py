"""The bias gradient of ``R.nn.attention_bias`` (``F.scaled_dot_product_attention`` with a float
``attn_mask``, as TVM's torch importer writes it).

The fused ``rlx.attention_backward`` gives ``q``, ``k`` and ``v`` their gradients and none to the
bias; when the bias is computed from inputs (not a constant), its gradient is the softmax
backward of the scores, ``dS = P * (dP - rowsum(dP * P))`` with ``dP = dO V^T``, recomputed here in
primitives and summed to the bias's shape.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax

from ._rule import rule

op = relax.op


def _visible(attrs, sq: int, sk: int):
    """The key positions each query sees (None: all), as a boolean [Sq, Sk] expression."""
    causal = attrs.causal_mask
    if causal is None:
        if attrs.window_size is not None:
            raise ValueError("gradient of relax.nn.attention_bias: window_size without causal_mask is not supported")
        return None
    if attrs.window_size is not None:
        raise ValueError("gradient of relax.nn.attention_bias: bias with a sliding window is not supported")
    offset = sk - sq if str(causal) == "BottomRight" else 0
    qpos = op.reshape(op.arange(0, sq, 1, "int64"), [sq, 1])
    kpos = op.reshape(op.arange(0, sk, 1, "int64"), [1, sk])
    return op.less_equal(kpos, op.add(qpos, relax.const(offset, "int64")))


@rule("relax.nn.attention_bias")
def _attention_bias_grad(orig_var, orig_call, output_grad, ctx):
    from ..ops.attention import _nn_attention_gradient

    grads = list(_nn_attention_gradient(orig_var, orig_call, output_grad, ctx))
    q, k, v, bias = orig_call.args
    if isinstance(bias, tvm.ir.expr.GenericConst):
        return grads
    attrs = orig_call.attrs
    dtype = str(q.ty.dtype.dtype)
    _, sq, heads, depth = (int(d) for d in q.ty.shape.values)
    sk, kv_heads = int(k.ty.shape.values[1]), int(k.ty.shape.values[2])
    if kv_heads != heads:
        raise ValueError(f"gradient of relax.nn.attention_bias: bias gradient needs as many kv heads as query heads, got {kv_heads} and {heads}")
    scale = float(attrs.scale) if attrs.scale is not None else 1.0 / math.sqrt(depth)
    heads_first = [0, 2, 1, 3]
    qh, kh, vh = (op.permute_dims(t, heads_first) for t in (q, k, v))
    scores = op.matmul(qh, op.permute_dims(kh, [0, 1, 3, 2])) * relax.const(scale, dtype) + bias
    visible = _visible(attrs, sq, sk)
    if visible is not None:
        scores = op.where(visible, scores, op.full_like(scores, relax.const(-1e30 if dtype == "float64" else -3e38, dtype)))
    p = op.nn.softmax(scores, axis=-1)
    dp = op.matmul(op.permute_dims(output_grad, heads_first), op.permute_dims(vh, [0, 1, 3, 2]))
    ds = p * (dp - op.sum(dp * p, axis=[-1], keepdims=True))
    grads[3] = op.collapse_sum_to(ds, bias.ty.shape)
    return grads
