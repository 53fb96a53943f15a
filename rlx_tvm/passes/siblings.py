"""``FuseSiblingBackwardOps``: compute backward ops that share their operands in one kernel."""

from __future__ import annotations

import tvm
from tvm import relax

from ..registry import get_op, is_rlx_call


class _Group:
    def __init__(self, fusion, bindings):
        self.fusion = fusion
        self.bindings = bindings
        self.results = None  # one expression per binding, once emitted


@relax.expr_functor.mutator
class _SiblingFuser(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.plan: dict = {}  # binding var -> (group, index in group)

    def visit_dataflow_block_(self, block):
        found: dict = {}
        position = {b.var: k for k, b in enumerate(block.bindings)}
        for binding in block.bindings:
            if not (isinstance(binding, relax.VarBinding) and is_rlx_call(binding.value)):
                continue
            opdef = get_op(binding.value.op.name)
            if opdef.siblings is None:
                continue
            key = opdef.siblings.key(opdef, binding.value)
            if key is not None:
                found.setdefault((opdef.siblings.name, key), (opdef.siblings, []))[1].append(binding)
        for fusion, bindings in found.values():
            if fusion.absorb is not None:
                lead = bindings[0].value
                bindings.extend(b for b in block.bindings if isinstance(b, relax.VarBinding)
                                and isinstance(b.value, relax.Call) and not is_rlx_call(b.value)
                                and fusion.absorb(get_op(lead.op.name), lead, b.value))
                bindings.sort(key=lambda b: position[b.var])
            # Computed where the first member stands: every member's operands must be bound by then
            # (a norm's dx may read a gamma bound between its dgamma and itself).
            first = position[bindings[0].var]
            operands = [a for b in bindings for a in b.value.args if isinstance(a, relax.Var)]
            if len(bindings) > 1 and all(position.get(a, -1) < first for a in operands):
                group = _Group(fusion, bindings)
                self.plan.update({b.var: (group, i) for i, b in enumerate(bindings)})
        return super().visit_dataflow_block_(block)

    def visit_var_binding_(self, binding):
        entry = self.plan.get(binding.var)
        if entry is None:
            return super().visit_var_binding_(binding)
        group, index = entry
        if group.results is None:
            # At the first member: every member reads the same operands, all bound by now.
            members = [(get_op(b.value.op.name) if is_rlx_call(b.value) else None, self.visit_expr(b.value))
                       for b in group.bindings]
            group.results = group.fusion.fuse(self.builder_, members) or ()  # (): the fusion declined
        if not group.results:
            return super().visit_var_binding_(binding)
        value = self.builder_.normalize(group.results[index])
        self.builder_.emit_normalized(relax.VarBinding(binding.var, value))

    def run(self) -> tvm.IRModule:
        for gv, func in self.builder_.get().functions.items():
            if isinstance(func, relax.Function):
                self.builder_.update_func(gv, self.visit_expr(func))
        return self.builder_.get()


@tvm.transform.module_pass(opt_level=0, name="rlx.FuseSiblingBackwardOps")
class FuseSiblingBackwardOps:
    """Replace backward calls of one dataflow block that read the same operands and have a
    registered :class:`~rlx_tvm.registry.SiblingFusion` (attention's dq, dk and dv; a norm's
    dx, dgamma and dbeta, also layer norm's dbeta as a plain ``sum(dy)``) with one kernel computing
    them together: the stages they share (scores, probabilities, dS; row statistics) run once.
    Calls without siblings are left as they are. ``rlx_tvm.compile`` runs it for CPU targets;
    ``DecomposeBackwardOps`` should run first where both are wanted (a fused group is a
    ``call_tir``, no longer an rlx op)."""

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        return _SiblingFuser(mod).run()
