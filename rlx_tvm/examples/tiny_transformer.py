"""A one-block causal transformer language model, trained with SGD through rlx_tvm.

The forward graph is ordinary Relax (``take`` embedding, ``rms_norm``, ``rlx.rope``, causal
``nn.attention``, a ``gelu`` MLP, ``rlx.softmax_cross_entropy``). ``rlx_tvm.autodiff.grad`` turns it
into a training graph whose backward pass is made of rlx backward ops; ``rlx_tvm.compile`` lowers those
to their fused kernels with the default CPU schedules (and tuned ones where the committed log
matches). The task is synthetic and learnable: predict the next token of sequences that repeat a
short random pattern.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from .. import autodiff
from ..build import compile as rlx_compile
from ..ops import rope, softmax_cross_entropy
from ..passes import count_rlx_calls
from ..target import cpu_target


@dataclass(frozen=True)
class Config:
    vocab: int = 32
    d_model: int = 32
    heads: int = 4
    ffn: int = 64
    seq: int = 16
    batch: int = 8
    period: int = 4  # the data repeats a pattern of this many tokens
    dtype: str = "float32"

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads


PARAMS = ("emb", "g_attn", "wq", "wk", "wv", "wo", "g_mlp", "w1", "w2", "g_out", "w_out")


def param_shapes(c: Config) -> dict[str, tuple[int, ...]]:
    d = c.d_model
    return {
        "emb": (c.vocab, d), "g_attn": (d,), "wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d),
        "g_mlp": (d,), "w1": (d, c.ffn), "w2": (c.ffn, d), "g_out": (d,), "w_out": (d, c.vocab),
    }


def init_params(c: Config, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in param_shapes(c).items():
        if name.startswith("g_"):
            out[name] = np.ones(shape, c.dtype)
        else:
            fan_in = shape[0] if name != "emb" else 1
            out[name] = (rng.standard_normal(shape) / np.sqrt(fan_in) * (0.5 if name == "emb" else 1.0)).astype(c.dtype)
    return out


def rope_tables(c: Config) -> tuple[np.ndarray, np.ndarray]:
    half = c.head_dim // 2
    freq = 10000.0 ** (-np.arange(half) / half)
    ang = np.arange(c.seq)[:, None] * freq[None, :]
    return np.cos(ang).astype(c.dtype), np.sin(ang).astype(c.dtype)


def build_forward(c: Config) -> tvm.IRModule:
    """``main(tokens[B,S], targets[B*S], cos, sin, params...) -> mean cross-entropy``."""
    B, S, H, hd, d = c.batch, c.seq, c.heads, c.head_dim, c.d_model
    T = lambda shape, dtype=c.dtype: relax.TensorType(list(shape), dtype)  # noqa: E731
    tokens = relax.Var("tokens", T((B, S), "int64"))
    targets = relax.Var("targets", T((B * S,), "int64"))
    cos = relax.Var("cos", T((S, hd // 2)))
    sin = relax.Var("sin", T((S, hd // 2)))
    p = {n: relax.Var(n, T(s)) for n, s in param_shapes(c).items()}
    op = relax.op
    bb = relax.BlockBuilder()
    with bb.function("main", [tokens, targets, cos, sin] + [p[n] for n in PARAMS]):
        with bb.dataflow():
            e = bb.emit
            x = e(op.take(p["emb"], e(op.reshape(tokens, (B * S,))), axis=0))  # [B*S, d]

            h = e(op.nn.rms_norm(x, p["g_attn"], axes=-1, epsilon=1e-6))

            def heads(w):
                return e(rope(e(op.reshape(e(op.matmul(h, w)), (B, S, H, hd))), cos, sin, head_dim=hd))

            q, k = heads(p["wq"]), heads(p["wk"])
            v = e(op.reshape(e(op.matmul(h, p["wv"])), (B, S, H, hd)))
            a = e(op.nn.attention(q, k, v, causal_mask="TopLeft"))  # [B, S, H, hd]
            x = e(op.add(x, e(op.matmul(e(op.reshape(a, (B * S, d))), p["wo"]))))

            h = e(op.nn.rms_norm(x, p["g_mlp"], axes=-1, epsilon=1e-6))
            x = e(op.add(x, e(op.matmul(e(op.nn.gelu(e(op.matmul(h, p["w1"])))), p["w2"]))))

            h = e(op.nn.rms_norm(x, p["g_out"], axes=-1, epsilon=1e-6))
            logits = e(op.matmul(h, p["w_out"]))  # [B*S, vocab]
            loss = bb.emit_output(op.mean(e(softmax_cross_entropy(logits, targets))))
        bb.emit_func_output(loss)
    return bb.get()


def synthetic_batch(c: Config, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Sequences repeating a random pattern of ``period`` tokens; targets are the next tokens."""
    pattern = rng.integers(0, c.vocab, size=(c.batch, c.period))
    reps = -(-(c.seq + 1) // c.period)
    seq = np.tile(pattern, (1, reps))[:, : c.seq + 1]
    return seq[:, :-1].astype("int64"), seq[:, 1:].reshape(-1).astype("int64")


class Trainer:
    """Compiles the training step once; ``step`` runs forward + backward and applies SGD."""

    def __init__(self, c: Config, target="local", seed: int = 0):
        self.c = c
        self.train_mod = autodiff.grad(build_forward(c), "main", wrt=list(PARAMS))
        self.rlx_ops = count_rlx_calls(self.train_mod)
        # rlx_tvm.compile: default CPU schedules, plus the committed tuning log of this CPU where it
        # has records for these shapes (it says how many kernels it matched)
        target = cpu_target() if target in (None, "local") else target
        self.vm = relax.VirtualMachine(rlx_compile(self.train_mod, target), tvm.cpu())
        self.params = init_params(c, seed)
        self.cos, self.sin = rope_tables(c)
        self.rng = np.random.default_rng(seed + 1)

    def loss_and_grads(self, tokens, targets, params=None):
        params = self.params if params is None else params
        args = [tokens, targets, self.cos, self.sin] + [params[n] for n in PARAMS]
        loss, grads = self.vm["main_adjoint"](*[tvm.runtime.tensor(np.ascontiguousarray(a)) for a in args])
        return float(loss.numpy()), {n: g.numpy() for n, g in zip(PARAMS, grads)}

    def step(self, lr: float) -> float:
        tokens, targets = synthetic_batch(self.c, self.rng)
        loss, grads = self.loss_and_grads(tokens, targets)
        for n in PARAMS:
            self.params[n] = (self.params[n] - lr * grads[n]).astype(self.c.dtype)
        return loss


def train(steps: int = 300, lr: float = 0.5, report_every: int = 25, target="local", c: Config | None = None) -> list[float]:
    """Train and print the loss curve as a table; returns the per-step losses."""
    c = c or Config()
    t0 = time.perf_counter()
    trainer = Trainer(c, target=target)
    print(f"tiny transformer: vocab {c.vocab}, d_model {c.d_model}, heads {c.heads}, seq {c.seq}, batch {c.batch}")
    print(f"compiled the training step in {time.perf_counter() - t0:.1f} s; rlx ops in its graph: "
          + ", ".join(f"{n} x{k}" for n, k in sorted(trainer.rlx_ops.items())))
    print()
    print(f"{'step':>6}  {'loss':>8}  {'ms/step':>8}")
    print(f"{'-' * 6}  {'-' * 8}  {'-' * 8}")
    losses = []
    window_start, last_reported = time.perf_counter(), -1
    for i in range(steps):
        losses.append(trainer.step(lr))
        if i % report_every == 0 or i == steps - 1:
            ms = (time.perf_counter() - window_start) / (i - last_reported) * 1e3
            print(f"{i:>6}  {losses[-1]:>8.4f}  {ms:>8.2f}")
            window_start, last_reported = time.perf_counter(), i
    print()
    print(f"loss {losses[0]:.4f} -> {np.mean(losses[-10:]):.4f} (mean of the last 10 steps); "
          f"chance level ln({c.vocab}) = {np.log(c.vocab):.4f}")
    return losses
