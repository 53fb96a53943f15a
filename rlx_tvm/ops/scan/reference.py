"""NumPy references (float64) of the scan ops: operators.md §6 literally, segment by segment."""

from __future__ import annotations

import numpy as np

from .layout import _as_list, _ceildiv, row_steps

def _np_body(body, what: str):
    fn = getattr(body, "numpy_fn" if what == "fn" else "numpy_vjp", None)
    if fn is None:
        raise ValueError(f"rlx.scan reference: the body {body!r} has no NumPy {'function' if what == 'fn' else 'VJP'}")
    return fn


def _np_setup(init, xs, params, length, num_checkpoints):
    xs = [np.asarray(x, dtype=np.float64) for x in _as_list(xs)]
    params = [np.asarray(p, dtype=np.float64) for p in _as_list(params)]
    L = length if length is not None else xs[0].shape[0]
    R = num_checkpoints if num_checkpoints > 0 else L
    return np.asarray(init, dtype=np.float64), xs, params, L, R


def _scan_reference(init, xs=None, params=None, *, body, length=None, save_trajectory=False, num_checkpoints=0, num_xs=None):
    f = _np_body(body, "fn")
    c, xs, params, L, R = _np_setup(init, xs, params, length, num_checkpoints)
    carries = []
    for t in range(L):
        c = np.asarray(f(c, *[x[t] for x in xs], *params), dtype=np.float64)
        carries.append(c)
    if not save_trajectory:
        return c
    return np.stack([carries[t] for t in row_steps(L, R)])


def _backward_reference(init, trajectory, upstream, xs, params, body, length, save_trajectory, num_checkpoints):
    """operators.md §6 literally (recomputing each segment from its checkpoint): (dc, [dxs], [dps])."""
    f, vjp = _np_body(body, "fn"), _np_body(body, "vjp")
    init, xs, params, L, R = _np_setup(init, xs, params, length, num_checkpoints)
    traj = np.asarray(trajectory, dtype=np.float64)
    up = np.asarray(upstream, dtype=np.float64)
    dc = np.zeros_like(init) if save_trajectory else up.copy()
    dxs = [np.zeros_like(x) for x in xs]
    dps = [np.zeros_like(p) for p in params]
    for r in reversed(range(R)):
        if save_trajectory:
            dc = dc + up[r]
        a, b = _ceildiv(r * L, R), _ceildiv((r + 1) * L, R)
        seg = [init if r == 0 else traj[r - 1]]
        for t in range(a, b - 1):
            seg.append(np.asarray(f(seg[-1], *[x[t] for x in xs], *params), dtype=np.float64))
        for t in reversed(range(a, b)):
            g = [np.asarray(v, dtype=np.float64) for v in vjp(seg[t - a], *[x[t] for x in xs], *params, dc)]
            dc = g[0]
            for j in range(len(xs)):
                dxs[j][t] = g[1 + j]
            for j in range(len(params)):
                dps[j] = dps[j] + g[1 + len(xs) + j]
    return dc, dxs, dps


def _backward_reference_for(which):
    def ref(init, trajectory, upstream, xs=None, params=None, *, body, length=None, save_trajectory=False,
            num_checkpoints=0, num_xs=None, xs_idx=0, param_idx=0):
        dc, dxs, dps = _backward_reference(init, trajectory, upstream, xs, params, body, length, save_trajectory, num_checkpoints)
        return {"init": dc, "xs": dxs[xs_idx] if dxs else None, "params": dps[param_idx] if dps else None}[which]

    return ref
