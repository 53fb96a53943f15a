"""Train a PyTorch character-level causal transformer through rlx_tvm, next to PyTorch eager.

The model is an ordinary ``torch.nn.Module`` (embedding, learned positions, causal
``scaled_dot_product_attention``, LayerNorm, GELU MLP, LM head); the text is a public-domain
passage bundled below. ``rlx_tvm.torch.compile_train_step`` exports it with ``torch.export``,
imports it with TVM's ``from_exported_program``, differentiates it with ``rlx_tvm.autodiff.grad``
and compiles forward, backward and the AdamW update as one step. The same model, data and
optimizer run in PyTorch eager on the same threads, step for step (interleaved), so the loss curves
and step times sit side by side; the first steps' losses must agree.

Run ``python -m rlx_tvm.examples.torch_train --help``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

# Edgar Allan Poe, "The Raven" (1845), first stanzas: public domain.
TEXT = """Once upon a midnight dreary, while I pondered, weak and weary,
Over many a quaint and curious volume of forgotten lore-
While I nodded, nearly napping, suddenly there came a tapping,
As of some one gently rapping, rapping at my chamber door.
"'Tis some visitor," I muttered, "tapping at my chamber door-
Only this and nothing more."
Ah, distinctly I remember it was in the bleak December;
And each separate dying ember wrought its ghost upon the floor.
Eagerly I wished the morrow;-vainly I had sought to borrow
From my books surcease of sorrow-sorrow for the lost Lenore-
For the rare and radiant maiden whom the angels name Lenore-
Nameless here for evermore.
And the silken, sad, uncertain rustling of each purple curtain
Thrilled me-filled me with fantastic terrors never felt before;
So that now, to still the beating of my heart, I stood repeating
"'Tis some visitor entreating entrance at my chamber door-
Some late visitor entreating entrance at my chamber door;-
This it is and nothing more."
"""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m rlx_tvm.examples.torch_train",
        description="Train a small character-level causal transformer (a torch.nn.Module) on a bundled "
                    "public-domain text through rlx_tvm.torch.compile_train_step, and the same model in "
                    "PyTorch eager side by side: loss curve, step times, and a check that the losses agree.")
    p.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    p.add_argument("--batch", type=int, default=16, help="sequences per batch (default 16)")
    p.add_argument("--seq", type=int, default=32, help="characters per sequence (default 32)")
    p.add_argument("--d-model", type=int, default=64, help="model width (default 64)")
    p.add_argument("--heads", type=int, default=4, help="attention heads; must divide --d-model (default 4)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                   help="AdamW (default) or SGD with Nesterov momentum 0.9, the same in both frameworks")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate (default 3e-3)")
    p.add_argument("--check-steps", type=int, default=5,
                   help="steps over which the rlx_tvm and PyTorch losses must agree (default 5)")
    p.add_argument("--rtol", type=float, default=1e-4,
                   help="relative tolerance of that check (default 1e-4; float32 rounding grows with the steps)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for both TVM and PyTorch (default: the CPUs this process may use)")
    p.add_argument("--target", default=None,
                   help='TVM target of the rlx_tvm step, a name or JSON, e.g. \'{"kind": "llvm", "opt-level": 0}\' '
                        "(default: this CPU)")
    p.add_argument("--every", type=int, default=5, help="print every N-th step (default 5; first and last always)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches (default 0)")
    args = p.parse_args(argv)
    if args.d_model % args.heads:
        p.error(f"--heads {args.heads} must divide --d-model {args.d_model}")
    if min(args.steps, args.batch, args.seq, args.layers) < 1:
        p.error("--steps, --batch, --seq and --layers must be >= 1")
    if args.seq >= len(TEXT):
        p.error(f"--seq must be shorter than the text ({len(TEXT)} characters)")
    return args


def build_model(vocab: int, args):
    import torch
    from torch import nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
            self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b, s, d = x.shape
            h = self.ln1(x)
            split = lambda t: t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
            a = F.scaled_dot_product_attention(split(self.q(h)), split(self.k(h)), split(self.v(h)), is_causal=True)
            x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
            return x + self.down(F.gelu(self.up(self.ln2(x))))

    class CharTransformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(vocab, args.d_model)
            self.pos = nn.Parameter(torch.randn(args.seq, args.d_model) * 0.02)
            self.blocks = nn.Sequential(*(Block(args.d_model, args.heads) for _ in range(args.layers)))
            self.ln, self.head = nn.LayerNorm(args.d_model), nn.Linear(args.d_model, vocab)

        def forward(self, tokens):
            x = self.blocks(self.tok(tokens) + self.pos)
            return self.head(self.ln(x)).flatten(0, 1)  # (batch * seq, vocab) logits

    return CharTransformer()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads is not None:  # before TVM's thread pool starts (at the first kernel)
        os.environ["TVM_NUM_THREADS"] = str(args.threads)
    import numpy as np
    import torch
    import torch.nn.functional as F
    import rlx_tvm  # noqa: F401
    from rlx_tvm.threads import cpu_threads
    from rlx_tvm.torch import SGD, AdamW, compile_train_step

    threads = args.threads or int(os.environ.get("TVM_NUM_THREADS") or cpu_threads())
    torch.set_num_threads(threads)
    chars = sorted(set(TEXT))
    data = np.array([chars.index(c) for c in TEXT], dtype=np.int64)
    rng = np.random.default_rng(args.seed)

    def batch():
        starts = rng.integers(0, len(data) - args.seq - 1, args.batch)
        x = np.stack([data[s:s + args.seq] for s in starts])
        y = np.stack([data[s + 1:s + args.seq + 1] for s in starts]).reshape(-1)
        return torch.from_numpy(x), torch.from_numpy(y)

    torch.manual_seed(args.seed)
    model = build_model(len(chars), args)
    eager = copy.deepcopy(model)
    if args.optimizer == "adamw":
        ours, theirs = AdamW(lr=args.lr), torch.optim.AdamW(eager.parameters(), lr=args.lr)
    else:
        ours = SGD(lr=args.lr, momentum=0.9, nesterov=True)
        theirs = torch.optim.SGD(eager.parameters(), lr=args.lr, momentum=0.9, nesterov=True)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"char transformer: {args.layers} blocks, d_model {args.d_model}, {args.heads} heads, vocab {len(chars)}, "
          f"{n_params} parameters; batch {args.batch} x {args.seq} characters; {args.optimizer}, lr {args.lr}; "
          f"{threads} threads")
    t0 = time.perf_counter()
    x, y = batch()
    target = json.loads(args.target) if args.target and args.target.lstrip().startswith("{") else args.target
    step = compile_train_step(model, (x, y), loss=F.cross_entropy, optimizer=ours, target=target)
    print(f"compiled the training step in {time.perf_counter() - t0:.1f} s "
          f"({'symbolic' if step.dynamic_batch else 'fixed'} batch size)")
    print(f"{'step':>5} {'loss rlx_tvm':>13} {'loss torch':>11} {'ms rlx_tvm':>11} {'ms torch':>9}")
    times, worst = ([], []), 0.0
    for i in range(1, args.steps + 1):
        if i > 1:
            x, y = batch()
        t = time.perf_counter()
        loss = step(x, y)
        t_ours = time.perf_counter() - t
        t = time.perf_counter()
        theirs.zero_grad()
        ref = F.cross_entropy(eager(x), y)
        ref.backward()
        theirs.step()
        t_theirs = time.perf_counter() - t
        ref = ref.item()
        if i > 1:  # the first call of each warms caches and thread pools
            times[0].append(t_ours)
            times[1].append(t_theirs)
        if i <= args.check_steps:
            worst = max(worst, abs(loss - ref) / max(abs(ref), 1e-12))
        if i in (1, args.steps) or i % args.every == 0:
            print(f"{i:>5} {loss:>13.5f} {ref:>11.5f} {t_ours * 1e3:>11.2f} {t_theirs * 1e3:>9.2f}")
    if times[0]:
        mo, mt = (float(np.median(t)) * 1e3 for t in times)
        print(f"median step time: rlx_tvm {mo:.2f} ms, PyTorch eager {mt:.2f} ms (steps 2..{args.steps})")
    checked = min(args.check_steps, args.steps)
    if worst > args.rtol:
        print(f"MISMATCH: over the first {checked} steps the losses differ by up to {worst:.2e} relative "
              f"(allowed {args.rtol:.0e})", file=sys.stderr)
        return 1
    print(f"losses agree over the first {checked} steps (max relative difference {worst:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
