"""``DecomposeBackwardOps``: rewrite rlx ops into primitive, differentiable Relax ops."""

from __future__ import annotations

from typing import Iterable

import tvm
from tvm import relax

from ..registry import OP_PREFIX, get_op, is_rlx_call

MAX_ROUNDS = 8


def _short(name: str) -> str:
    return name[len(OP_PREFIX):] if name.startswith(OP_PREFIX) else name


@relax.expr_functor.mutator
class _Decomposer(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, should_decompose):
        super().__init__(mod)
        self.should_decompose = should_decompose
        self.rewrites = 0

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not is_rlx_call(call):
            return call
        opdef = get_op(call.op.name)
        if not self.should_decompose(opdef, call):
            return call
        self.rewrites += 1
        # Emitting normalizes the nested expression into one binding per primitive.
        return self.builder_.emit(opdef.decompose(self.builder_, call), name_hint=opdef.name)

    def run(self) -> tvm.IRModule:
        for gv, func in self.builder_.get().functions.items():
            if isinstance(func, relax.Function):
                self.builder_.update_func(gv, self.visit_expr(func))
        return self.builder_.get()


def count_rlx_calls(mod: tvm.IRModule, names: Iterable[str] | None = None) -> dict[str, int]:
    """How many calls of each rlx op the module holds (optionally only ``names``)."""
    wanted = None if names is None else {_short(n) for n in names}
    counts: dict[str, int] = {}

    def visit(expr):
        if is_rlx_call(expr):
            n = _short(expr.op.name)
            if wanted is None or n in wanted:
                counts[n] = counts.get(n, 0) + 1

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return counts


@tvm.transform.module_pass(opt_level=0, name="rlx.DecomposeBackwardOps")
class DecomposeBackwardOps:
    """Rewrite every rlx backward op not named in ``preserve`` into primitive Relax ops.

    Decompositions may themselves emit rlx ops, so the rewrite repeats until none that should be
    decomposed is left (at most ``MAX_ROUNDS`` rounds, else a RuntimeError). Every primitive a
    decomposition emits has a registered gradient, so ``relax.transform.Gradient`` can run on the
    result again (second and higher order).

    Parameters
    ----------
    preserve:
        Op names (``"layer_norm_backward_input"`` or ``"relax.rlx.layer_norm_backward_input"``)
        left as they are; they lower to their fused TensorIR kernels.
    include_forward:
        Also decompose the project's forward ops (``rope``, ``fake_quantize``,
        ``softmax_cross_entropy``). Off by default: those keep their own gradient rules (e.g. the
        straight-through estimator of ``fake_quantize``, which a decomposition into ``round``
        would lose).
    """

    def __init__(self, preserve: Iterable[str] = (), include_forward: bool = False):
        self.preserve = frozenset(_short(n) for n in preserve)
        for n in self.preserve:
            get_op(n)  # unknown names are a mistake worth reporting
        self.include_forward = include_forward

    def _should(self, opdef, call) -> bool:
        if opdef.name in self.preserve:
            return False
        if not opdef.backward and not self.include_forward:
            return False
        keep = opdef.extra.get("keep_fused")  # e.g. conv with a symbolic batch (docs/operators.md §7)
        return not (keep is not None and keep(call))

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        for _ in range(MAX_ROUNDS):
            mutator = _Decomposer(mod, self._should)
            mod = mutator.run()
            if mutator.rewrites == 0:
                return relax.transform.CanonicalizeBindings()(mod)
        left = {n: c for n, c in count_rlx_calls(mod).items() if n not in self.preserve}
        raise RuntimeError(
            f"rlx.DecomposeBackwardOps did not converge after {MAX_ROUNDS} rounds; "
            f"rlx calls still present: {left}"
        )
