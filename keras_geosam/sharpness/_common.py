"""Shared plumbing of the sharpness estimators: validation, probes, matvecs.

Probes and sampled labels come from NumPy generators seeded by the caller, so
the same seed gives the same probes on every backend.
"""

import numpy as np
from keras import ops

from keras_geosam.curvature import hvp as _hvp
from keras_geosam.curvature.functional import num_examples

DEFAULT_BATCH_SIZE = 256


def check_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
    return int(value)


def rademacher(rng, shapes):
    return [rng.integers(0, 2, size=s).astype("float64") * 2.0 - 1.0 for s in shapes]


def hessian_matvec(model, x, y, loss, batch_size):
    """NumPy list -> NumPy list: the Hessian of the mean loss, streamed."""
    variables = model.trainable_variables

    def matvec(vectors):
        cast = [ops.convert_to_tensor(v.astype(var.dtype)) for v, var in zip(vectors, variables)]
        out = _hvp(model, x, y, cast, loss=loss, batch_size=batch_size)
        return [np.asarray(ops.convert_to_numpy(o), dtype="float64") for o in out]

    return matvec


def quadratic_probes(matvec, make_probe, num_probes, paths, bar=None):
    """Per-probe w^T M w and per-layer w_l^T (M w)_l for probes w = make_probe(i)."""
    samples, per_layer = [], {p: [] for p in paths}
    for i in range(num_probes):
        w = make_probe(i)
        mw = matvec(w)
        parts = [float(np.sum(a * b)) for a, b in zip(w, mw)]
        for p, v in zip(paths, parts):
            per_layer[p].append(v)
        samples.append(sum(parts))
        if bar is not None:
            bar.add(1)
    return np.array(samples), per_layer


def data_info(x, batch_size):
    return {"num_examples": num_examples(x), "batch_size": batch_size}
