"""Input helpers shared by the sample declarations."""

import numpy as np


def away_from(rng, shape, lo, hi, kinks, margin=0.05):
    """Uniform samples in [lo, hi] at least ``margin`` from every kink."""
    x = rng.uniform(lo, hi, size=shape)
    for k in kinks:
        close = np.abs(x - k) < margin
        x[close] = k + np.sign(x[close] - k + 1e-12) * margin * 2
    return x
