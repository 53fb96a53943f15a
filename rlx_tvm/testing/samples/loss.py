"""Samples of softmax_cross_entropy and its backward (finite differences of an independent NumPy
per-row loss), and the gradient rule of the forward op."""

import numpy as np
from tvm import relax

from ... import ops
from .. import Case, GradCase

RNG = np.random.default_rng(5)
op = relax.op


def per_row_loss(ignore_index=-100, label_smoothing=0.0):
    """PyTorch's cross_entropy(reduction="none", label_smoothing=ls), written independently: the
    smoothed target puts 1 - ls + ls/C on the label and ls/C on every other class."""

    def forward(logits, labels):
        n, c = logits.shape
        m = logits.max(axis=1, keepdims=True)
        log_p = logits - m - np.log(np.sum(np.exp(logits - m), axis=1, keepdims=True))
        target = np.full((n, c), label_smoothing / c)
        keep = labels != ignore_index
        target[np.arange(n)[keep], labels[keep]] += 1.0 - label_smoothing
        return np.where(keep, -np.sum(target * log_p, axis=1), 0.0)

    return forward


def labels_for(n, c, ignored=(), dtype=np.int64, ignore_index=-100, rng=RNG):
    """``n`` random labels in [0, c), ``ignore_index`` at the rows ``ignored``."""
    labels = rng.integers(0, c, n).astype(dtype)
    labels[list(ignored)] = ignore_index
    return labels


def forward_case(n, c, scale=1.0, batch=None, label="", **attrs):
    ignore = attrs.get("ignore_index", -100)
    labels = labels_for(n, c, ignored=(1,), ignore_index=ignore)
    return Case("softmax_cross_entropy", {"logits": scale * RNG.standard_normal((n, c)), "labels": labels}, attrs,
                batch=batch, label=label or f"softmax_cross_entropy[{n}x{c}, {attrs}]")


def backward_case(n, c, scale=1.0, batch=None, label="", labels_dtype=np.int64, **attrs):
    ignore = attrs.get("ignore_index", -100)
    labels = labels_for(n, c, ignored=(0, n - 1), dtype=labels_dtype, ignore_index=ignore)
    return Case(
        "softmax_cross_entropy_backward",
        {"logits": scale * RNG.standard_normal((n, c)), "labels": labels, "d_loss": RNG.standard_normal(n)},
        attrs, batch=batch, label=label or f"softmax_cross_entropy_backward[{n}x{c}, {attrs}]",
        forward=per_row_loss(**attrs), wrt="logits", cotangent="d_loss",
    )


SYMBOLIC_N = {"logits": 0, "labels": 0}
SYMBOLIC_N_BW = {"logits": 0, "labels": 0, "d_loss": 0}


def _cases():
    return [
        forward_case(5, 6, batch=SYMBOLIC_N),
        forward_case(5, 6, label_smoothing=0.2, batch=SYMBOLIC_N),
        forward_case(4, 7, label_smoothing=1.0, ignore_index=3, batch={"logits": 1}, label="softmax_cross_entropy[ls=1, symbolic C]"),
        forward_case(3, 9, scale=60.0, label_smoothing=0.1, batch=SYMBOLIC_N, label="softmax_cross_entropy[large logits]"),
        backward_case(5, 6, batch=SYMBOLIC_N_BW),
        backward_case(5, 6, label_smoothing=0.1, labels_dtype=np.int32, batch=SYMBOLIC_N_BW),
        backward_case(4, 5, label_smoothing=0.3, ignore_index=2, batch={"logits": 1},
                       label="softmax_cross_entropy_backward[ignore_index=2, symbolic C]"),
        backward_case(3, 8, scale=60.0, label_smoothing=0.05, batch=SYMBOLIC_N_BW,
                       label="softmax_cross_entropy_backward[large logits]"),
    ]


CASES = _cases()


# -- gradient rule of rlx.softmax_cross_entropy -------------------------------------------------


def _grad_cases():
    labels = np.array([1, -100, 3, 0, 3])
    w = RNG.standard_normal(5)
    return [
        GradCase("rlx.softmax_cross_entropy", {"logits": RNG.standard_normal((5, 4)), "labels": labels, "w": w},
                 lambda z, t, w: op.sum(op.multiply(ops.softmax_cross_entropy(z, t), w)), wrt=["logits"]),
        GradCase("rlx.softmax_cross_entropy(ls=0.2, mean)", {"logits": RNG.standard_normal((5, 4)), "labels": labels},
                 lambda z, t: op.mean(ops.softmax_cross_entropy(z, t, label_smoothing=0.2)), wrt=["logits"]),
    ]


GRAD_CASES = _grad_cases()
