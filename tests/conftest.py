import numpy as np
import pytest

import rlx_tvm  # noqa: F401  (registers the ops once per worker)

DTYPES = ("float32", "float64")
SHAPE_MODES = ("static", "symbolic")
PATHS = ("fused", "decomposed")


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def numeric_matrix():
    """(dtype, shape mode, path) combinations every family is checked under."""
    return [(d, s, p) for d in DTYPES for s in SHAPE_MODES for p in PATHS]
