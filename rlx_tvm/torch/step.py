"""``compile_train_step``: a PyTorch module, its loss and an optimizer as one compiled TVM step."""

from __future__ import annotations

import numpy as np
import torch
import tvm
from tvm import relax

from .. import autodiff
from ..build import compile as rlx_compile
from ..target import as_target, cpu_target
from .importer import Imported, _WithLoss, _describe, export, import_program, torch_sources
from .optim import SGD, Optimizer

__all__ = ["compile_train_step", "TrainStep"]


def _build_train_step(imp: Imported, trainable: list[bool], opt: Optimizer) -> tvm.IRModule:
    """``train_step(*inputs, *params, *buffers, *states, *scalars) -> (loss, grads, params, buffers,
    states)``: forward, loss, gradients and the optimizer update in one Relax function."""
    f = imp.mod["main"]
    n_in, n_p = imp.num_inputs, len(imp.params)
    wrt = [v for v, t in zip(f.params[n_in:n_in + n_p], trainable) if t]
    try:
        mod = autodiff.grad(imp.mod, "main", wrt=wrt, target_index=0)
    except autodiff.AutodiffError as err:
        raise ValueError(f"rlx_tvm.torch: cannot differentiate the model's loss: {_missing_gradient(err, imp)}") from err
    adjoint = mod["main_adjoint"]
    bb = relax.BlockBuilder(mod)
    copy = lambda v: relax.Var(v.name, v.ty)  # noqa: E731
    inputs = [copy(v) for v in f.params[:n_in]]
    params = [copy(v) for v in f.params[n_in:n_in + n_p]]
    buffers = [copy(v) for v in f.params[n_in + n_p:]]
    states = [[relax.Var(f"{name}_{p.name}", p.ty) for name in opt.state_names]
              for p, t in zip(params, trainable) if t]
    scalars = [relax.Var(name, relax.TensorType([], str(params[0].ty.dtype.dtype))) for name in opt.scalar_names]
    flat_states = [s for group in states for s in group]
    with bb.function("train_step", inputs + params + buffers + flat_states + scalars):
        with bb.dataflow():
            res = bb.emit(relax.Call(mod.get_global_var("main_adjoint"), inputs + params + buffers))
            primal = bb.emit(relax.TupleGetItem(res, 0))
            loss = bb.emit(relax.TupleGetItem(primal, 0)) if buffers else primal
            new_buffers = [bb.emit(relax.TupleGetItem(primal, 1 + i)) for i in range(len(buffers))]
            grads_t = bb.emit(relax.TupleGetItem(res, 1))
            grads = [bb.emit(relax.TupleGetItem(grads_t, i)) for i in range(len(wrt))]
            new_params, new_states, k = [], [], 0
            for p, t in zip(params, trainable):
                if not t:
                    new_params.append(p)
                    continue
                np_, ns = opt.emit_update(bb, p, grads[k], states[k], scalars)
                new_params.append(np_)
                new_states.extend(ns)
                k += 1
            out = bb.emit_output(relax.Tuple([loss, relax.Tuple(grads), relax.Tuple(new_params),
                                              relax.Tuple(new_buffers), relax.Tuple(new_states)]))
        bb.emit_func_output(out)
    mod = bb.get()
    # The adjoint stays a callee: TVM 0.27's InlinePrivateFunctions loses the symbolic batch dim in
    # the shapes Gradient writes (R.shape([n]) gets an unbound copy of n).
    mod = tvm.IRModule({gv: fn for gv, fn in mod.functions.items() if gv.name_hint != "main"})
    return relax.transform.DeadCodeElimination(["train_step"])(mod)


def _missing_gradient(err: Exception, imp: Imported) -> str:
    text = str(err)
    marker = "FPrimalGradient has not been registered for "
    if marker in text:
        op = text.split(marker, 1)[1].split()[0].strip("`'\".,")
        sources = torch_sources(imp.program, op) if imp.program is not None else []
        return (f"the op {op} has no gradient rule (rlx_tvm.gradients / relax.op.register_gradient)"
                + (f"; it comes from {'; '.join(sources)}" if sources else ""))
    return text.strip().splitlines()[-1] if text.strip() else type(err).__name__


def _to_numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


class _Signature:
    """Expected shapes and dtypes of a compiled function's inputs (None: any size)."""

    def __init__(self, examples, dynamic: bool, what: str):
        self.expected = [(tuple(None if (dynamic and i == 0) else int(d) for i, d in enumerate(x.shape)),
                          str(x.dtype).replace("torch.", "")) for x in examples]
        self.what = what

    def check(self, args) -> list[np.ndarray]:
        if len(args) != len(self.expected):
            raise TypeError(f"{self.what} expected {len(self.expected)} inputs, got {len(args)}")
        out = []
        for i, (a, (shape, dtype)) in enumerate(zip(args, self.expected)):
            if not isinstance(a, (torch.Tensor, np.ndarray)):
                raise TypeError(f"{self.what}: input {i} expected a torch.Tensor or numpy array, got {_describe(a)}")
            arr = _to_numpy(a)
            if str(arr.dtype) != dtype:
                raise TypeError(f"{self.what}: input {i} expected dtype {dtype}, got {arr.dtype}")
            if len(arr.shape) != len(shape) or any(e is not None and e != g for e, g in zip(shape, arr.shape)):
                want = "(" + ", ".join("batch" if e is None else str(e) for e in shape) + ")"
                raise ValueError(f"{self.what}: input {i} expected shape {want}, got {tuple(arr.shape)}")
            out.append(np.ascontiguousarray(arr))
        return out


class TrainStep:
    """A compiled training step. Call it with a batch (``step(*inputs, target)``) to run forward,
    loss, every gradient and the optimizer update on the device; it returns the loss as a float.

    ``grads``: the last step's gradients by parameter name; ``evaluate(*inputs)``: the model's
    output in eval mode (compiled on first use); ``state_dict()`` / ``write_back(model)``: the
    trained parameters and buffers for ``load_state_dict``.
    """

    def __init__(self, model, example_inputs, loss, optimizer, target, imp: Imported, trainable, ex, device,
                 module: tvm.IRModule):
        self.module = module  # the Relax module of the step (train_step: gradients and update), before lowering
        self.model_type = type(model).__name__
        self.optimizer = optimizer
        self.target = target
        self.device = device
        self.param_names = imp.params
        self.buffer_names = imp.buffers
        self.dynamic_batch = imp.dynamic_batch
        self.step_count = 0
        self._loss = loss
        self._model = model
        self._example_inputs = example_inputs
        self._trainable = trainable
        self._vm = relax.VirtualMachine(ex, device)
        self._sig = _Signature(example_inputs, imp.dynamic_batch, "TrainStep")
        sd = model.state_dict()
        self._params = [self._tensor(sd[n]) for n in imp.params]
        self._buffers = [self._tensor(sd[n]) for n in imp.buffers]
        self._states = [tvm.runtime.tensor(np.zeros(sd[n].shape, _to_numpy(sd[n]).dtype), device)
                        for n, t in zip(imp.params, trainable) if t for _ in optimizer.state_names]
        self._tracked = {bn.mean.rsplit(".", 1)[0] + ".num_batches_tracked" for bn in imp.batch_norms}
        self._num_batches = {k: int(sd[k]) for k in self._tracked if k in sd}
        self._grads = None
        self._eval = None

    def _tensor(self, t):
        return tvm.runtime.tensor(np.ascontiguousarray(_to_numpy(t)), self.device)

    def __call__(self, *inputs) -> float:
        arrays = self._sig.check(inputs)
        self.step_count += 1
        dtype = str(self._params[0].numpy().dtype) if self._params else "float32"
        scalars = [tvm.runtime.tensor(np.array(s, dtype), self.device)
                   for s in self.optimizer.host_scalars(self.step_count)]
        args = [self._tensor(a) for a in arrays] + self._params + self._buffers + self._states + scalars
        loss, grads, params, buffers, states = self._vm["train_step"](*args)
        self._params, self._buffers, self._states = list(params), list(buffers), list(states)
        self._grads = list(grads)
        for k in self._num_batches:
            self._num_batches[k] += 1
        return float(loss.numpy())

    @property
    def vm(self) -> relax.VirtualMachine:
        """The Relax VM that runs the step (e.g. to time its kernels with ``vm.set_instrument``)."""
        return self._vm

    @property
    def grads(self) -> dict[str, np.ndarray]:
        """Gradients of the last step by parameter name (trainable parameters only)."""
        if self._grads is None:
            return {}
        names = [n for n, t in zip(self.param_names, self._trainable) if t]
        return {n: g.numpy() for n, g in zip(names, self._grads)}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Trained parameters and the buffers the step updates, as torch tensors by state_dict name."""
        out = {n: torch.from_numpy(p.numpy()) for n, p in zip(self.param_names, self._params)}
        out.update({n: torch.from_numpy(b.numpy()) for n, b in zip(self.buffer_names, self._buffers)})
        out.update({k: torch.tensor(v, dtype=torch.int64) for k, v in self._num_batches.items()})
        return out

    def write_back(self, model: torch.nn.Module | None = None) -> torch.nn.Module:
        """Copy the trained weights into ``model`` (default: the module the step was built from)."""
        model = self._model if model is None else model
        model.load_state_dict(self.state_dict(), strict=False)
        return model

    def evaluate(self, *inputs):
        """The model's output (eval mode, no gradients) with the current weights, as numpy."""
        if self._eval is None:
            self._eval = _compile_evaluate(self)
        vm, sig = self._eval
        arrays = sig.check(inputs)
        out = vm["forward"](*[self._tensor(a) for a in arrays], *self._params, *self._eval_buffers())
        return out.numpy()

    def _eval_buffers(self):
        by_name = dict(zip(self.buffer_names, self._buffers))
        sd = None
        out = []
        for n in self._eval_buffer_names:
            if n not in by_name:
                sd = sd or self._model.state_dict()
                by_name[n] = self._tensor(sd[n])
            out.append(by_name[n])
        return out


def _compile_evaluate(step: TrainStep):
    model = step._model
    inputs = step._example_inputs[:-1] if step._loss is not None else step._example_inputs
    was_training = model.training
    model.eval()
    try:
        ep, dynamic = export(model, tuple(inputs), step.dynamic_batch or None, f"model {step.model_type} (eval mode)")
        imp = import_program(ep, len(inputs), training=False, dynamic=dynamic, what=f"model {step.model_type}")
    finally:
        model.train(was_training)
    if imp.params != step.param_names:
        raise ValueError(f"rlx_tvm.torch: the eval-mode export of {step.model_type} expected parameters "
                         f"{step.param_names}, got {imp.params}")
    mod = tvm.IRModule({"forward": imp.mod["main"].with_attr("global_symbol", "forward")})
    ex = rlx_compile(mod, step.target, verbose=False)
    step._eval_buffer_names = imp.buffers
    return relax.VirtualMachine(ex, step.device), _Signature(inputs, dynamic, "TrainStep.evaluate")


def _trace(model, module, example_inputs, dynamic_batch, what) -> Imported:
    """Export ``module`` in train mode, check that it returns a float scalar, import it."""
    was_training = model.training
    model.train()
    try:
        ep, dynamic = export(module, example_inputs, dynamic_batch, what)
    finally:
        model.train(was_training)
    out = [n for n in ep.graph.nodes if n.op == "output"][0].args[0]
    val = out[0].meta.get("val") if isinstance(out, (tuple, list)) and len(out) == 1 else None
    if not isinstance(val, torch.Tensor) or val.dim() != 0:
        got = f"a tensor of shape {tuple(val.shape)}" if isinstance(val, torch.Tensor) else \
            f"{len(out) if isinstance(out, (tuple, list)) else 1} outputs"
        raise ValueError(f"rlx_tvm.torch.compile_train_step: the loss of {what} expected a scalar (0-d tensor), got {got}")
    if not val.dtype.is_floating_point:
        raise ValueError(f"rlx_tvm.torch.compile_train_step: the loss of {what} expected a floating-point scalar, "
                         f"got dtype {val.dtype}")
    return import_program(ep, len(example_inputs), training=True, dynamic=dynamic, what=what)


def _rename(imp: Imported, loss) -> Imported:
    """State-dict names of the user's model (without the loss wrapper's ``model.`` prefix)."""
    prefix = "model." if loss is not None else ""
    strip = lambda n: n[len(prefix):] if n.startswith(prefix) else n  # noqa: E731
    imp.params = [strip(n) for n in imp.params]
    imp.buffers = [strip(n) for n in imp.buffers]
    for bn in imp.batch_norms:
        bn.mean, bn.var = strip(bn.mean), strip(bn.var)
    return imp


def _symbolic_shape_args(f: relax.Function) -> bool:
    """Whether an op of ``f`` takes a shape argument with a symbolic dim (``reshape(x, (n, 12))``):
    TVM 0.27's Gradient fails on those ("key is not in Map")."""
    found = []

    def visit(e):
        if isinstance(e, relax.Call):
            for a in e.args:
                if isinstance(a, relax.ShapeExpr) and any(not isinstance(v, tvm.tirx.IntImm) for v in a.values):
                    found.append(e)

    relax.analysis.post_order_visit(f, visit)
    return bool(found)


def compile_train_step(model: torch.nn.Module, example_inputs, loss=None, optimizer: Optimizer | None = None,
                       target=None, dynamic_batch: bool | None = None) -> TrainStep:
    """Compile one training step of ``model`` for ``target`` (default: this CPU).

    ``example_inputs``: a tuple of tensors ``(*model inputs, target)`` when ``loss`` is a callable
    ``loss(output, target) -> scalar`` (e.g. ``torch.nn.functional.cross_entropy``), or the
    model's inputs when ``loss`` is None and the model's forward returns the loss. ``optimizer``:
    :class:`SGD` (default, lr=1e-3) or :class:`AdamW`. ``dynamic_batch``: True makes the first dim
    of every input symbolic (one compile serves any batch size); None tries that and falls back to
    the example's shapes where torch.export or TVM 0.27's Gradient cannot (batch-dependent reshape
    and broadcast targets, some gradient rules); False keeps the example's shapes. ``step.dynamic_batch``
    says which one was built.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"rlx_tvm.torch.compile_train_step: argument 'model' expected a torch.nn.Module, "
                        f"got {_describe(model)}")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    if loss is not None and not callable(loss):
        raise TypeError(f"rlx_tvm.torch.compile_train_step: argument 'loss' expected a callable "
                        f"(output, target) -> scalar or None, got {_describe(loss)}")
    if loss is not None and len(example_inputs) < 2:
        raise ValueError("rlx_tvm.torch.compile_train_step: argument 'example_inputs' expected (*model inputs, "
                         f"target) with a loss, got {len(example_inputs)} tensor(s)")
    optimizer = SGD() if optimizer is None else optimizer
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"rlx_tvm.torch.compile_train_step: argument 'optimizer' expected rlx_tvm.torch.SGD or "
                        f"AdamW, got {_describe(optimizer)}")
    target = as_target(cpu_target() if target is None else target)
    what = f"model {type(model).__name__}" + (" with its loss" if loss is not None else "")
    module = _WithLoss(model, loss) if loss is not None else model
    imp = _trace(model, module, example_inputs, dynamic_batch, what)
    if imp.dynamic_batch and dynamic_batch is None and _symbolic_shape_args(imp.mod["main"]):
        imp = _trace(model, module, example_inputs, False, what)  # known to fail in Gradient: skip the try
    imp = _rename(imp, loss)
    named = dict(model.named_parameters())
    trainable = [named[n].requires_grad if n in named else True for n in imp.params]
    if not any(trainable):
        raise ValueError(f"rlx_tvm.torch.compile_train_step: {what} expected parameters that require grad, got none")
    try:
        mod = _build_train_step(imp, trainable, optimizer)
    except ValueError:
        if not (imp.dynamic_batch and dynamic_batch is None):
            raise
        # Some gradient rules need static shapes: the example's batch size then.
        imp = _rename(_trace(model, module, example_inputs, False, what), loss)
        mod = _build_train_step(imp, trainable, optimizer)
    ex = rlx_compile(mod, target, verbose=False)
    device = tvm.device(target.get_target_device_type() if hasattr(target, "get_target_device_type")
                        else target.kind.name, 0)
    return TrainStep(model, example_inputs, loss, optimizer, target, imp, trainable, ex, device, mod)
