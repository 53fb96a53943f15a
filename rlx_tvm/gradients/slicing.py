"""Gradients of slicing and padding, which TVM 0.27 leaves without one: ``relax.strided_slice``
(``x[..., a:b:s]``, ``narrow``, the q/k/v split of a fused projection, ``chunk``/``unbind`` as the
torch importer writes them) and ``relax.nn.pad`` (``F.pad``).

The two are each other's adjoints in the constant-padding case, so both rules are written with
ops that have gradients themselves and higher orders keep working.
"""

from __future__ import annotations

from tvm import relax, tirx
from tvm.relax.op.grad import no_grad

from ._rule import rule


def _static(value, what: str, op: str) -> int:
    value = getattr(value, "value", value)  # PrimValue -> PrimExpr
    if isinstance(value, tirx.IntImm):
        return int(value.value)
    if isinstance(value, int):
        return value
    raise ValueError(f"gradient of {op}: {what} must be a static integer, got {value}")


def _dims(expr) -> list:
    shape = expr.ty.shape
    if shape is None:
        raise ValueError(f"gradient: the shape of {expr} must be known, got {expr.ty}")
    return [int(d) if isinstance(d, tirx.IntImm) else d for d in shape.values]


def _insert_every(dy, axis: int, step: int, dims: list):
    """Along ``axis`` of ``dy`` (length m), put ``step - 1`` zeros after every element: length
    ``(m - 1) * step + 1``. Built from expand_dims, pad, reshape and strided_slice."""
    m = dims[axis]
    spread = relax.op.expand_dims(dy, axis + 1)
    widths = [0] * (2 * (len(dims) + 1))
    widths[2 * (axis + 1) + 1] = step - 1
    spread = relax.op.nn.pad(spread, widths)
    merged = dims[:axis] + [m * step] + dims[axis + 1:]
    spread = relax.op.reshape(spread, merged)
    return relax.op.strided_slice(spread, [axis], [0], [(m - 1) * step + 1], assume_inbound=True)


@rule("relax.strided_slice")
def _strided_slice_grad(orig_var, orig_call, output_grad, ctx):
    """``y = x[begin:end:stride]`` along ``axes`` (clipped like Python slices): ``d x`` is zero
    except at the positions read, which receive ``dy``. Per sliced axis, a negative stride is a
    flip of a positive one, a stride ``s > 1`` spreads ``dy`` with ``s - 1`` zeros between
    elements, and a pad puts the result at its offset in ``x``. Sliced axes must be static."""
    op = "relax.strided_slice"
    x, axes, begins, ends = orig_call.args[:4]
    strides = orig_call.args[4] if len(orig_call.args) > 4 and orig_call.args[4] is not None else None
    in_dims = _dims(x)
    ndim = len(in_dims)
    dy = output_grad
    out_dims = _dims(orig_var)
    widths = [0] * (2 * ndim)
    for i, a in enumerate(axes.fields):
        axis = _static(a, "axes", op) % ndim
        n = _static(in_dims[axis], f"the size of sliced axis {axis}", op)
        begin = _static(begins.fields[i], "begin", op)
        end = _static(ends.fields[i], "end", op)
        step = _static(strides.fields[i], "strides", op) if strides is not None else 1
        picked = range(n)[slice(begin, end, step)]
        m = len(picked)
        if m == 0:
            return [relax.op.zeros_like(x)] + [no_grad(a) for a in orig_call.args[1:]]
        lo = min(picked[0], picked[-1])
        if step < 0:
            dy = relax.op.flip(dy, axis)
        if abs(step) > 1 and m > 1:
            dy = _insert_every(dy, axis, abs(step), out_dims)
        out_dims[axis] = (m - 1) * abs(step) + 1
        widths[2 * axis], widths[2 * axis + 1] = lo, n - lo - out_dims[axis]
    if any(widths):
        dy = relax.op.nn.pad(dy, widths)
    return [dy] + [no_grad(a) for a in orig_call.args[1:]]


@rule("relax.nn.pad")
def _pad_grad(orig_var, orig_call, output_grad, ctx):
    """Constant padding: ``d x`` is ``dy`` with the padding sliced off (negative widths crop,
    so their slice is a pad back)."""
    mode = str(orig_call.attrs.pad_mode)
    if mode != "constant":
        raise ValueError(f"gradient of relax.nn.pad: pad_mode 'constant' expected, got {mode!r}")
    (x,) = orig_call.args[:1]
    widths = [int(w) for w in orig_call.attrs.pad_width]
    out_dims = _dims(orig_var)
    ndim = len(out_dims)
    axes, begin, end, crop = [], [], [], [0] * (2 * ndim)
    for axis in range(ndim):
        before, after = widths[2 * axis], widths[2 * axis + 1]
        if before > 0 or after > 0:
            axes.append(axis)
            begin.append(max(before, 0))
            end.append(out_dims[axis] - max(after, 0))
        crop[2 * axis], crop[2 * axis + 1] = max(-before, 0), max(-after, 0)
    dx = output_grad
    if axes:
        dx = relax.op.strided_slice(dx, axes, begin, end, assume_inbound=True)
    if any(crop):
        dx = relax.op.nn.pad(dx, crop)
    return [dx] + [no_grad(a) for a in orig_call.args[1:]]
