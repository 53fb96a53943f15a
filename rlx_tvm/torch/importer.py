"""From a torch module to a Relax function: ``torch.export`` and TVM's ``from_exported_program``.

TVM 0.27's importer binds every buffer as a constant and returns zeros for BatchNorm's new running
statistics. For training, the running statistics must be state of the step, so the batch-norm
calls get them as parameters (``b_<name>``) and the training function also returns their updates,
computed as torch computes them (biased variance to normalize, unbiased variance into
``running_var``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
import tvm
from tvm import relax
from tvm.relax.frontend.torch import from_exported_program

_BN_TRAIN = "_native_batch_norm_legit_functional"
_BN_EVAL = ("_native_batch_norm_legit_no_training", "batch_norm")


class _WithLoss(torch.nn.Module):
    """``loss(model(*inputs), target)`` as one module, so one export holds model and loss."""

    def __init__(self, model, loss):
        super().__init__()
        self.model = model
        self.loss_fn = loss

    def forward(self, *args):
        return self.loss_fn(self.model(*args[:-1]), args[-1])


@dataclass
class BatchNormStats:
    """The running statistics of one BatchNorm layer (state_dict names) and its momentum."""

    mean: str
    var: str
    momentum: float


@dataclass
class Imported:
    """A Relax module whose ``main`` is ``main(*inputs, *params, *buffers)``."""

    mod: tvm.IRModule
    num_inputs: int
    params: list[str]  # state_dict names, in main's order
    buffers: list[str]
    batch_norms: list[BatchNormStats] = field(default_factory=list)
    dynamic_batch: bool = False
    program: object = None  # the torch.export program (for error messages)


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"Tensor(shape={tuple(x.shape)}, dtype={x.dtype})"
    return type(x).__name__


def export(module: torch.nn.Module, inputs: tuple, dynamic_batch: bool | None, what: str):
    """``torch.export.export`` with the first dim of every input symbolic (``dynamic_batch``: True
    requires it, None tries it and falls back to static shapes); returns (program, dynamic)."""
    for i, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"rlx_tvm.torch: example input {i} of {what} expected a torch.Tensor, got {_describe(x)}")
    sizes = {int(x.shape[0]) for x in inputs if x.dim() > 0}
    can_be_dynamic = len(sizes) == 1 and min(sizes) > 1 and all(x.dim() > 0 for x in inputs)
    if dynamic_batch and not can_be_dynamic:
        raise ValueError(f"rlx_tvm.torch: dynamic_batch=True expected every example input of {what} to share a "
                         f"first (batch) dim > 1, got shapes {[tuple(x.shape) for x in inputs]}")
    attempts = ([True] if dynamic_batch else [True, False] if dynamic_batch is None and can_be_dynamic else [False])
    error = None
    for dynamic in attempts:
        shapes = _batch_dynamic_shapes(module, inputs) if dynamic else None
        try:
            return torch.export.export(module, inputs, dynamic_shapes=shapes), dynamic
        except Exception as err:  # torch raises many types (UserError, Unsupported, RuntimeError, ...)
            error = err
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    raise ValueError(f"rlx_tvm.torch: torch.export could not export {what} ({type(error).__name__}: {first})") from error


def _batch_dynamic_shapes(module, inputs) -> dict:
    """torch.export's ``dynamic_shapes`` with dim 0 of every input one shared ``Dim``, keyed by the
    forward's parameter names (a ``*args`` parameter gets a tuple)."""
    batch = torch.export.Dim("batch")
    bound = inspect.signature(module.forward).bind(*inputs)
    shapes = {}
    for name, value in bound.arguments.items():
        kind = inspect.signature(module.forward).parameters[name].kind
        shapes[name] = tuple({0: batch} for _ in value) if kind is inspect.Parameter.VAR_POSITIONAL else {0: batch}
    return shapes


def _batch_norm_nodes(ep, names) -> list[tuple[str | None, str | None, float | None]]:
    """(running_mean name, running_var name, momentum) of every batch-norm node, in graph order."""
    to_buffer = ep.graph_signature.inputs_to_buffers
    found = []
    for node in ep.graph.nodes:
        target = getattr(node.target, "__name__", "")
        if node.op != "call_function" or not target.startswith(names):
            continue
        mean, var = (to_buffer.get(a.name) if isinstance(a, torch.fx.Node) else None for a in node.args[3:5])
        momentum = None
        if target.startswith(_BN_TRAIN):
            momentum = node.args[6] if len(node.args) > 6 else node.kwargs.get("momentum", 0.1)
        found.append((mean, var, momentum))
    return found


def _stats_update(bb, x, mean_in, var_in, momentum: float):
    """torch's running-statistics update from the batch ``x`` (channels on axis 1)."""
    axes = [a for a in range(x.ty.ndim) if a != 1]
    dtype = str(x.ty.dtype.dtype)
    c = lambda v: relax.const(v, dtype)  # noqa: E731
    mean = bb.emit(relax.op.mean(x, axes))
    shape = [1] * x.ty.ndim
    shape[1] = -1
    centered = relax.op.subtract(x, relax.op.reshape(mean, shape))
    var_sum = relax.op.sum(relax.op.multiply(centered, centered), axes)
    count = relax.op.sum(relax.op.ones_like(x), axes)
    unbiased = bb.emit(relax.op.divide(var_sum, relax.op.subtract(count, c(1.0))))
    new_mean = bb.emit_output(relax.op.add(relax.op.multiply(mean, c(momentum)),
                                           relax.op.multiply(mean_in, c(1.0 - momentum))))
    new_var = bb.emit_output(relax.op.add(relax.op.multiply(unbiased, c(momentum)),
                                          relax.op.multiply(var_in, c(1.0 - momentum))))
    return new_mean, new_var


@relax.expr_functor.mutator
class _BatchNormStatsAsParams(relax.PyExprMutator):
    """Batch-norm calls read their running statistics from parameters; in training mode each one
    also emits (as dataflow outputs) its updated statistics."""

    def __init__(self, stats_vars, training, momenta):
        super().__init__()
        self.stats_vars = stats_vars  # one (mean var, var var) per batch-norm call, in order
        self.training = training
        self.momenta = momenta
        self.index = 0
        self.updates = []

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.nn.batch_norm"):
            return call
        pair, momentum = self.stats_vars[self.index], self.momenta[self.index]
        self.index += 1
        if pair is None:  # no running statistics (track_running_stats=False)
            return call
        mean_in, var_in = pair
        args = list(call.args)
        args[3], args[4] = mean_in, var_in
        if self.training:
            self.updates.extend(_stats_update(self.builder_, args[0], mean_in, var_in, momentum))
        return relax.Call(call.op, args, call.attrs, call.ty_args)


@relax.expr_functor.mutator
class _FoldTupleGetItem(relax.PyExprMutator):
    """``t = (a, b); c = t[0]`` becomes ``c = a``. The importer builds such tuples (max-pool's
    (values, indices), batch norm's five outputs) and Gradient fails on the unused fields
    ("key is not in Map")."""

    def visit_tuple_getitem_(self, op):
        op = super().visit_tuple_getitem_(op)
        value = op.tuple_value
        bound = self.lookup_binding(value) if isinstance(value, relax.Var) else None
        return bound.fields[op.index] if isinstance(bound, relax.Tuple) else op


def _simplify(f: relax.Function) -> relax.Function:
    mod = tvm.IRModule({"main": f})
    mod["main"] = _FoldTupleGetItem().visit_expr(f)
    return relax.transform.DeadCodeElimination(["main"])(mod)["main"]


def import_program(ep, num_inputs: int, training: bool, dynamic: bool, what: str) -> Imported:
    """Import ``ep`` with parameters (and batch-norm statistics) as inputs. ``main`` returns the
    loss/output (the importer's one-element tuple unwrapped); in training mode with batch-norm
    running statistics, a tuple of the loss and the new statistics."""
    ep = ep.run_decompositions()
    nodes = _batch_norm_nodes(ep, (_BN_TRAIN,) if training else _BN_EVAL)
    for mean, var, momentum in nodes:
        if training and momentum is None and mean is not None:
            raise ValueError(f"rlx_tvm.torch: {what}: BatchNorm with momentum=None (cumulative average) expected a "
                             "float momentum, got None")
    try:
        mod = from_exported_program(ep, keep_params_as_input=True, run_ep_decomposition=False)
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"rlx_tvm.torch: TVM's from_exported_program could not import {what} "
                         f"({type(err).__name__}: {first})") from err
    f = _simplify(mod["main"])
    to_param = ep.graph_signature.inputs_to_parameters
    params = [to_param[v.name] for v in f.params[num_inputs:]]
    buffers, stats_vars = [], []
    named_buffers = dict(ep.named_buffers())
    for mean, var, _ in nodes:
        if mean is None or var is None:
            stats_vars.append(None)
            continue
        pair = []
        for name in (mean, var):
            b = named_buffers[name]
            var_ = relax.Var("b_" + name.replace(".", "_"), relax.TensorType(list(b.shape), _dtype(b.dtype)))
            buffers.append(name)
            pair.append(var_)
        stats_vars.append(tuple(pair))
    if nodes:
        count = sum(isinstance(c, relax.Call) and isinstance(c.op, tvm.ir.Op) and c.op.name == "relax.nn.batch_norm"
                    for c in _calls(f))
        if count != len(nodes):
            raise ValueError(f"rlx_tvm.torch: {what}: expected one relax.nn.batch_norm per torch batch-norm node "
                             f"({len(nodes)}), the importer emitted {count}")
        mutator = _BatchNormStatsAsParams(stats_vars, training, [m for _, _, m in nodes])
        body = mutator.visit_expr(f.body)
        updates = mutator.updates
        new_params = [v for pair in stats_vars if pair is not None for v in pair]
        f = relax.Function(list(f.params) + new_params, body, None, f.is_pure, f.attrs)
    else:
        updates = []
    ret = f.body.body
    first = relax.TupleGetItem(ret, 0)
    ret_ty = f.body.body.ty
    if not isinstance(ret_ty, relax.TupleType) or len(ret_ty.fields) != 1:
        raise ValueError(f"rlx_tvm.torch: {what} expected to return one tensor, got {ret_ty}")
    if updates:
        out = relax.Tuple([first] + list(updates))
        out_ty = relax.TupleType([ret_ty.fields[0]] + [u.ty for u in updates])
    else:
        out, out_ty = first, ret_ty.fields[0]
    f = relax.Function(f.params, relax.SeqExpr(f.body.blocks, out), out_ty, f.is_pure, f.attrs)
    mod = relax.transform.Normalize()(tvm.IRModule({"main": f.with_attr("global_symbol", "main")}))
    stats = [BatchNormStats(*n) for n in nodes if n[0] is not None and n[1] is not None]
    return Imported(mod, num_inputs, params, buffers, stats, dynamic, ep)


# torch (core ATen) ops the importer maps onto a Relax op whose name does not say so.
_ATEN_FOR = {
    "strided_slice": ("slice", "split", "chunk", "narrow", "select", "unbind"),
    "batch_norm": ("_native_batch_norm",),
    "take": ("embedding", "index_select", "index"),
    "gather_elements": ("gather",),
    "scatter_elements": ("scatter",),
    "conv1d": ("convolution",), "conv2d": ("convolution",), "conv3d": ("convolution",),
    "conv2d_transpose": ("convolution",), "conv1d_transpose": ("convolution",),
    "attention": ("scaled_dot_product",),
    "concat": ("cat",), "permute_dims": ("permute", "transpose"),
}


def torch_sources(ep, relax_op: str, limit: int = 3) -> list[str]:
    """Where the model calls the torch ops that import as ``relax_op``: module path and type, and
    the model's source line, from the exported program's node metadata."""
    short = relax_op.rsplit(".", 1)[-1]
    names = _ATEN_FOR.get(short, (short,))
    torch_dir = torch.__file__.rsplit("/", 1)[0]
    found = []
    for node in ep.graph.nodes:
        target = getattr(node.target, "__name__", "")
        if node.op != "call_function" or not any(target.startswith(n) for n in names):
            continue
        where = ""
        stack = node.meta.get("nn_module_stack") or {}
        if stack:
            path, kind = list(stack.values())[-1]
            kind = kind.__name__ if isinstance(kind, type) else str(kind).rsplit(".", 1)[-1]
            where = f"{path.removeprefix('L__self__').strip('.') or 'model'} ({kind})"
        lines = (node.meta.get("stack_trace") or "").strip().splitlines()
        frames = [(lines[i].strip(), lines[i + 1].strip()) for i in range(len(lines) - 1)
                  if lines[i].strip().startswith("File ") and torch_dir not in lines[i]]
        if frames:
            head, code = frames[-1]
            where += f" at {head.removeprefix('File ')}: {code}"
        text = f"torch op {target}" + (f" in {where}" if where else "")
        if text not in found:
            found.append(text)
        if len(found) == limit:
            break
    return found


def _calls(f):
    found = []
    relax.analysis.post_order_visit(f, lambda e: found.append(e) if isinstance(e, relax.Call) else None)
    return found


def _dtype(torch_dtype) -> str:
    return str(torch_dtype).replace("torch.", "")
