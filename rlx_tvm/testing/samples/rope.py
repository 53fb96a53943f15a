"""Samples of rope and rope_backward: both styles, per-position and per-token tables, rank 3 and
rank 4 layouts, partial rotary (finite differences of an independent NumPy rope built from
explicit rotation matrices)."""

import functools

import numpy as np

from ...ops.rope import STYLES
from .. import Case

RNG = np.random.default_rng(11)
B, S, H = 2, 3, 2


# -- an independent NumPy rope: one explicit rotation matrix per table row ------------------------


def _pairs(n_rot, style):
    h = n_rot // 2
    return [(i, i + h) for i in range(h)] if style == "neox" else [(2 * i, 2 * i + 1) for i in range(h)]


def rotation_matrices(cos, sin, head_dim, n_rot, style):
    """[rows, head_dim, head_dim]: identity except the 2x2 rotation [[c, -s], [s, c]] on each pair."""
    rows = cos.shape[0]
    r = np.tile(np.eye(head_dim), (rows, 1, 1))
    for k, (i, j) in enumerate(_pairs(n_rot, style)):
        c, s = cos[:, k], sin[:, k]
        r[:, i, i], r[:, i, j], r[:, j, i], r[:, j, j] = c, -s, s, c
    return r


def np_rope(x, cos, sin, *, head_dim, n_rot=None, style="neox", transpose=False):
    n_rot = head_dim if n_rot is None else n_rot
    b, s = x.shape[:2]
    x4 = x.reshape(b, s, -1, head_dim)
    r = rotation_matrices(cos, sin, head_dim, n_rot, style)
    if transpose:
        r = r.transpose(0, 2, 1)
    rows = np.arange(s)[None, :].repeat(b, 0) if cos.shape[0] == s else np.arange(b * s).reshape(b, s)
    return np.einsum("bsij,bshj->bshi", r[rows], x4).reshape(x.shape)


# -- cases ------------------------------------------------------------------------------------------
#
# Cases come in groups sharing one table pair and one set of attributes. A "partial" group (3 heads,
# head_dim 6, n_rot 4) holds rope and rope_backward, each on a [B, S, H, hd] array and on the same
# array viewed as [B, S, H*hd]: the trap tests compare those outputs with each other. The full-rotary
# cases (n_rot == head_dim) have each op with each style, table kinds and layouts alternating; two more
# make the sequence length S the symbolic dim.


def rope_tables(rows, n_rot):
    ang = RNG.uniform(-np.pi, np.pi, (rows, n_rot // 2))
    return np.cos(ang), np.sin(ang)


def _case(op, act_value, cos, sin, attrs, label, batch):
    act = "x" if op == "rope" else "dy"
    case = Case(op, {act: act_value, "cos": cos, "sin": sin}, attrs, batch=batch, label=label)
    if op == "rope_backward":
        # dx is the VJP of the forward rope (linear in x, so any x): finite differences of np_rope.
        case.forward = functools.partial(np_rope, **attrs)
        case.wrt = "x"
        case.fd_extra = {"x": RNG.standard_normal(act_value.shape)}
    return case


def _group(style, per_token, heads, head_dim, n_rot, layouts, symbolic_seq=False):
    """{(op, rank): Case} for the given (op, rank) layouts."""
    cos, sin = rope_tables(B * S if per_token else S, n_rot)
    attrs = {"head_dim": head_dim, "style": style}
    if n_rot != head_dim:
        attrs["n_rot"] = n_rot
    if symbolic_seq:  # S is the symbolic dim n: per-token tables have B*n rows, per-position ones n
        act_dim, table_spec = 1, ((0, B) if per_token else 0)
    else:  # B is the symbolic dim n: per-token tables have n*S rows, per-position ones stay static
        act_dim, table_spec = 0, ((0, S) if per_token else None)
    tables = {} if table_spec is None else {"cos": table_spec, "sin": table_spec}
    out = {}
    for op, rank in layouts:
        act = "x" if op == "rope" else "dy"
        x4 = RNG.standard_normal((B, S, heads, head_dim))
        value = x4 if rank == 4 else x4.reshape(B, S, heads * head_dim)
        label = f"{op}[{style},rank{rank},{'token' if per_token else 'position'},H={heads},n_rot={n_rot}/{head_dim}]"
        out[(op, rank)] = _case(op, value, cos, sin, attrs, label + (" symbolic S" if symbolic_seq else ""),
                                {act: act_dim, **tables})
    return out


def _partial_group(style, per_token):
    g = _group(style, per_token, 3, 6, 4, [("rope", 4), ("rope_backward", 4)])
    for op, act in (("rope", "x"), ("rope_backward", "dy")):  # the same numbers in rank 3
        c = g[(op, 4)]
        flat = Case(op, {**c.inputs, act: c.inputs[act].reshape(B, S, -1)}, c.attrs, batch=c.batch,
                    label=c.label.replace("rank4", "rank3"), forward=c.forward, wrt=c.wrt)
        if c.fd_extra:
            flat.fd_extra = {"x": c.fd_extra["x"].reshape(B, S, -1)}
        g[(op, 3)] = flat
    return g


FULL = [("rope", "neox", True, 4), ("rope_backward", "neox", False, 3), ("rope", "gptj", False, 3), ("rope_backward", "gptj", True, 4)]
PARTIAL = {(style, per_token): _partial_group(style, per_token) for style in STYLES for per_token in (False, True)}


def _cases():
    cases = [c for g in PARTIAL.values() for c in g.values()]
    for op, style, per_token, rank in FULL:
        cases += _group(style, per_token, 2, 4, 4, [(op, rank)]).values()
    cases += _group("neox", True, 2, 6, 4, [("rope", 3)], symbolic_seq=True).values()
    cases += _group("gptj", False, 2, 4, 4, [("rope_backward", 4)], symbolic_seq=True).values()
    return cases


CASES = _cases()
