"""Samples of cumsum_backward and gather_backward (finite differences of np.cumsum and np.take),
and the gradient rules of R.cumsum, R.take and their relatives."""

import numpy as np
from tvm import relax

from ...ops.indexing import SCAN_BLOCK
from .. import Case, GradCase

RNG = np.random.default_rng(11)
op = relax.op


def _cumsum_forward(axis, exclusive):
    def forward(x):
        y = np.cumsum(x, axis=axis)
        return y - x if exclusive else y

    return forward


def _take_forward(axis):
    return lambda x, indices: np.take(x, indices, axis=axis)


def _cumsum_case(shape, axis, exclusive=False, batch=None, fd=False, label=""):
    dy = RNG.standard_normal(shape)
    return Case(
        "cumsum_backward", {"dy": dy}, {"axis": axis, "exclusive": exclusive}, batch=batch,
        label=label or f"cumsum_backward[{shape}, axis={axis}, exclusive={exclusive}]",
        forward=_cumsum_forward(axis, exclusive) if fd else None, wrt="x",
        fd_extra={"x": RNG.standard_normal(shape)} if fd else {},
    )


def _gather_case(x_shape, indices, axis, batch=None, fd=False, label=""):
    """dy for take(x, indices, axis) with x of ``x_shape``."""
    ax = axis % len(x_shape)
    dy_shape = x_shape[:ax] + indices.shape + x_shape[ax + 1:]
    return Case(
        "gather_backward", {"dy": RNG.standard_normal(dy_shape), "indices": indices},
        {"axis": axis, "dim_size": x_shape[ax]}, batch=batch,
        label=label or f"gather_backward[x{x_shape}, idx{indices.shape} {indices.dtype}, axis={axis}]",
        forward=_take_forward(axis) if fd else None, wrt="x",
        fd_extra={"x": RNG.standard_normal(x_shape)} if fd else {},
    )


def _cases():
    i32, i64 = np.int32, np.int64
    return [
        # cumsum: short rows (one block), several blocks with a partial last one, symbolic length,
        # axis 0 and a middle axis of rank 3, length 1.
        _cumsum_case((2, 9), 1, fd=True, batch={"dy": 0}),
        _cumsum_case((2, 9), -1, exclusive=True, fd=True, batch={"dy": 0}),
        _cumsum_case((1, 2 * SCAN_BLOCK + 7), 1, exclusive=True, fd=True, batch={"dy": 1},
                     label="cumsum_backward[multi-block, symbolic length]"),
        _cumsum_case((3, 3 * SCAN_BLOCK + 1), 1, batch={"dy": 1}),
        _cumsum_case((5, 3, 2), 0, fd=True, batch={"dy": 1}),
        _cumsum_case((2, SCAN_BLOCK + 5, 3), 1, exclusive=True, batch={"dy": 0}),
        _cumsum_case((2, 3, 4), -2, fd=True, batch={"dy": 2}),
        _cumsum_case((3, 1), 1, exclusive=True, batch={"dy": 0}),
        # gather: embedding-style axis 0 with duplicates and negatives, a symbolic index count.
        _gather_case((5, 3), np.array([0, 3, 3, -1, 2, -5], i32), 0, fd=True, batch={"dy": 0, "indices": 0}),
        _gather_case((4, 6), np.array([1, -1, 1, 0], i64), 1, fd=True, batch={"dy": 0}),
        _gather_case((2, 3, 4), np.array([[0, 2, 2], [-1, 1, 0]], i64), 1, fd=True, batch={"dy": 0}),
        _gather_case((3, 2, 5), np.array([4, -2, 0, 4], i32), -1, fd=True, batch={"dy": 1}),
        _gather_case((4,), np.array([3, 3, -4, 1], i64), 0, fd=True, batch={"dy": 0, "indices": 0}),
        # rows of features wide enough for the CPU kernel's chunks of 64 (3 chunks) and of 16 (80 = 5 x 16)
        _gather_case((9, 192), np.array([0, 8, 8, -1, 3, -9, 2], i64), 0, batch={"dy": 0, "indices": 0},
                     label="gather_backward[192 features: chunks of 64]"),
        _gather_case((3, 5, 80), np.array([4, 0, -1, 4], i32), 1, batch={"dy": 0},
                     label="gather_backward[80 features: chunks of 16]"),
        # indices outside [-dim_size, dim_size) are dropped at run time (np.take would raise, no FD)
        _gather_case((6, 2), np.array([7, -7, 5, -6, 100], i32), 0, batch={"dy": 0, "indices": 0},
                     label="gather_backward[runtime out-of-range dropped]"),
    ]


CASES = _cases()


# -- gradient rules of R.cumsum and R.take ------------------------------------------------------


def _weighted(fn):
    return lambda x, w, *rest: op.sum(op.multiply(fn(x, *rest), w))


def _cube_sum(e):  # not quadratic, so the Hessian-vector products differentiate the decompositions
    return op.sum(op.multiply(op.multiply(e, e), e))


def _cubed(fn):
    return lambda x, *rest: _cube_sum(fn(x, *rest))


def _grad_cases():
    x = RNG.standard_normal((3, 40))
    idx = np.array([2, 0, 2, 1], np.int64)
    idx32 = np.array([[1, 1], [0, 3]], np.int32)
    scatter_idx = np.array([[0, 2, 2], [1, 1, 0]], np.int64)
    return [
        GradCase("relax.cumsum", {"x": x, "w": RNG.standard_normal((3, 40))},
                 _weighted(lambda t: op.cumsum(t, axis=1)), wrt=["x"]),
        GradCase("relax.cumsum(exclusive)", {"x": x[:, :6]},
                 _cubed(lambda t: op.cumsum(t, axis=0, exclusive=True)), wrt=["x"]),
        GradCase("relax.cumsum(axis=None)", {"x": x[:2, :3]}, _cubed(lambda t: op.cumsum(t)), wrt=["x"]),
        GradCase("relax.take(axis=0)", {"x": x[:, :4], "idx": idx}, _cubed(lambda t, i: op.take(t, i, axis=0)), wrt=["x"]),
        GradCase("relax.take(axis=1, 2-d int32 indices)", {"x": x[:, :5], "w": RNG.standard_normal((3, 2, 2)), "idx": idx32},
                 _weighted(lambda t, i: op.take(t, i, axis=1)), wrt=["x"]),
        GradCase("relax.flip", {"x": x[:, :4]}, _cubed(lambda t: op.flip(t, 1)), wrt=["x"]),
        GradCase("relax.gather_elements", {"x": x[:2, :3], "idx": scatter_idx[:, :2].copy()},
                 _cubed(lambda t, i: op.gather_elements(t, i, axis=1)), wrt=["x"]),
        GradCase("relax.scatter_elements(add)", {"x": x[:2, :3], "u": RNG.standard_normal((2, 3)), "idx": scatter_idx},
                 lambda t, u, i: _cube_sum(op.scatter_elements(t, i, u, axis=1, reduction="add")),
                 wrt=["x", "u"]),
        GradCase("relax.scatter_elements(update)",
                 {"x": x[:2, :3], "u": RNG.standard_normal((2, 2)), "idx": np.array([[2, 0], [1, 2]], np.int64)},
                 lambda t, u, i: _cube_sum(op.scatter_elements(t, i, u, axis=1)),
                 wrt=["x", "u"]),
    ]


GRAD_CASES = _grad_cases()
