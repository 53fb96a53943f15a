"""Input helpers shared by the sample declarations."""

import numpy as np


def away_from(rng, shape, lo, hi, kinks, margin=0.05):
    """Uniform samples in [lo, hi] at least ``margin`` from every kink."""
    x = rng.uniform(lo, hi, size=shape)
    for k in kinks:
        close = np.abs(x - k) < margin
        x[close] = k + np.sign(x[close] - k + 1e-12) * margin * 2
    return x


def pair(v):
    """An int or (h, w) pair as an (h, w) pair."""
    return (v, v) if isinstance(v, int) else tuple(v)


def pads(p):
    """(top, left, bottom, right) from an int, an (h, w) pair or the 4-tuple itself."""
    if isinstance(p, int):
        return (p, p, p, p)
    return (p[0], p[1], p[0], p[1]) if len(p) == 2 else tuple(p)
