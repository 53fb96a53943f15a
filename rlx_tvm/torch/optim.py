"""SGD and AdamW as Relax graphs, with PyTorch's update rules and hyper-parameter names.

Each optimizer emits its per-parameter update into the training step's dataflow block, so the
element-wise updates of a parameter (and its state) fuse into one kernel with FuseOps. Values
that change from step to step (the learning rate, Adam's bias corrections, SGD's first-step
momentum) are scalar inputs of the step computed on the host as torch computes them, so changing
``lr`` between steps needs no recompilation. No torch import here.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import relax

__all__ = ["SGD", "AdamW", "Optimizer"]


class Optimizer:
    """Base of the step optimizers: state names per parameter, host scalars per step, and the
    Relax update of one parameter."""

    state_names: tuple[str, ...] = ()
    scalar_names: tuple[str, ...] = ()

    def host_scalars(self, step: int) -> list[float]:
        """The scalar inputs of step number ``step`` (1-based), in ``scalar_names`` order."""
        raise NotImplementedError

    def emit_update(self, bb: relax.BlockBuilder, p, g, states, scalars):
        """Emit the update of parameter ``p`` with gradient ``g``; returns (new p, new states)."""
        raise NotImplementedError

    def _check(self, **checks) -> None:
        for name, (value, ok, expected) in checks.items():
            if not ok:
                raise ValueError(f"{type(self).__name__}: argument {name!r} expected {expected}, got {value!r}")


def _c(value: float, like) -> relax.Constant:
    return relax.const(value, str(like.ty.dtype.dtype))


@dataclass
class SGD(Optimizer):
    """``torch.optim.SGD``: ``lr``, ``momentum``, ``dampening``, ``weight_decay``, ``nesterov``,
    ``maximize``, with torch's rule (the momentum buffer starts as the first gradient)."""

    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    maximize: bool = False

    def __post_init__(self):
        self._check(lr=(self.lr, self.lr >= 0, "a learning rate >= 0"),
                    momentum=(self.momentum, self.momentum >= 0, "a value >= 0"),
                    weight_decay=(self.weight_decay, self.weight_decay >= 0, "a value >= 0"),
                    nesterov=(self.nesterov, not self.nesterov or (self.momentum > 0 and self.dampening == 0),
                              "momentum > 0 and dampening == 0 with nesterov=True"))

    @property
    def state_names(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("momentum_buffer",) if self.momentum != 0 else ()

    @property
    def scalar_names(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("lr", "buf_scale", "grad_scale") if self.momentum != 0 else ("lr",)

    def host_scalars(self, step: int) -> list[float]:
        if self.momentum == 0:
            return [self.lr]
        # torch: buf = grad on the first step, then buf = momentum * buf + (1 - dampening) * grad.
        return [self.lr, 0.0, 1.0] if step == 1 else [self.lr, self.momentum, 1.0 - self.dampening]

    def emit_update(self, bb, p, g, states, scalars):
        if self.maximize:
            g = bb.emit(relax.op.negative(g))
        if self.weight_decay != 0:
            g = bb.emit(relax.op.add(g, relax.op.multiply(p, _c(self.weight_decay, p))))
        new_states = []
        if self.momentum != 0:
            lr, buf_scale, grad_scale = scalars
            buf = bb.emit(relax.op.add(relax.op.multiply(states[0], buf_scale), relax.op.multiply(g, grad_scale)))
            new_states.append(buf)
            g = bb.emit(relax.op.add(g, relax.op.multiply(buf, _c(self.momentum, p)))) if self.nesterov else buf
        else:
            (lr,) = scalars
        new_p = bb.emit(relax.op.subtract(p, relax.op.multiply(g, lr)))
        return new_p, new_states


@dataclass
class AdamW(Optimizer):
    """``torch.optim.AdamW``: ``lr``, ``betas``, ``eps``, ``weight_decay`` (decoupled), ``amsgrad``,
    ``maximize``, with torch's single-tensor update rule."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    amsgrad: bool = False
    maximize: bool = False

    def __post_init__(self):
        b1, b2 = self.betas
        self._check(lr=(self.lr, self.lr >= 0, "a learning rate >= 0"),
                    betas=(self.betas, 0 <= b1 < 1 and 0 <= b2 < 1, "two values in [0, 1)"),
                    eps=(self.eps, self.eps >= 0, "a value >= 0"),
                    weight_decay=(self.weight_decay, self.weight_decay >= 0, "a value >= 0"))

    @property
    def state_names(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if self.amsgrad else ())

    scalar_names = ("decay", "step_size", "bias_correction2_sqrt")

    def host_scalars(self, step: int) -> list[float]:
        b1, b2 = self.betas
        return [1.0 - self.lr * self.weight_decay, self.lr / (1.0 - b1 ** step), (1.0 - b2 ** step) ** 0.5]

    def emit_update(self, bb, p, g, states, scalars):
        b1, b2 = self.betas
        decay, step_size, bc2_sqrt = scalars
        if self.maximize:
            g = bb.emit(relax.op.negative(g))
        p = bb.emit(relax.op.multiply(p, decay))
        m, v = states[0], states[1]
        w = 1.0 - b1  # torch's lerp picks its formula by the weight
        diff = relax.op.subtract(g, m)
        m = bb.emit(relax.op.add(m, relax.op.multiply(diff, _c(w, p))) if w < 0.5 else
                    relax.op.subtract(g, relax.op.multiply(diff, _c(1.0 - w, p))))
        v = bb.emit(relax.op.add(relax.op.multiply(v, _c(b2, p)),
                                 relax.op.multiply(relax.op.multiply(g, _c(1.0 - b2, p)), g)))
        new_states = [m, v]
        second = v
        if self.amsgrad:
            second = bb.emit(relax.op.maximum(states[2], v))
            new_states.append(second)
        denom = relax.op.add(relax.op.divide(relax.op.sqrt(second), bc2_sqrt), _c(self.eps, p))
        new_p = bb.emit(relax.op.subtract(p, relax.op.multiply(relax.op.divide(m, denom), step_size)))
        return new_p, new_states
