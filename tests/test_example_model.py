"""The example transformer block: its training graph uses the rlx ops, its gradients match finite
differences, and SGD lowers the loss."""

import numpy as np

from rlx_tvm.examples.tiny_transformer import PARAMS, Config, Trainer, synthetic_batch


def test_training_graph_uses_rlx_backward_ops():
    t = Trainer(Config(batch=2, seq=8))
    for name in ("attention_backward", "rms_norm_backward_input", "rope_backward", "gather_backward",
                 "softmax_cross_entropy_backward", "activation_backward"):
        assert t.rlx_ops.get(name), (name, t.rlx_ops)


def test_first_step_gradients_match_finite_differences():
    c = Config(batch=2, seq=8, dtype="float64")
    t = Trainer(c)
    tokens, targets = synthetic_batch(c, np.random.default_rng(3))
    _, grads = t.loss_and_grads(tokens, targets)
    rng = np.random.default_rng(4)
    eps = 1e-5
    for name in ("emb", "wq", "wk", "wv", "g_attn", "w1", "w2", "w_out"):
        for flat in rng.choice(t.params[name].size, size=3, replace=False):
            plus = {k: v.copy() for k, v in t.params.items()}
            minus = {k: v.copy() for k, v in t.params.items()}
            plus[name].reshape(-1)[flat] += eps
            minus[name].reshape(-1)[flat] -= eps
            fd = (t.loss_and_grads(tokens, targets, plus)[0] - t.loss_and_grads(tokens, targets, minus)[0]) / (2 * eps)
            got = grads[name].reshape(-1)[flat]
            assert abs(got - fd) <= 1e-6 + 1e-4 * abs(fd), (name, flat, got, fd)


def test_sgd_lowers_the_loss():
    t = Trainer(Config())
    losses = [t.step(lr=0.5) for _ in range(150)]
    start, end = losses[0], float(np.mean(losses[-10:]))
    assert end < 0.6 * start, (start, end)
    assert set(PARAMS) == set(t.params)
