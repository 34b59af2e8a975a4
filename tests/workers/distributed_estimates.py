"""The estimates the distribution workers compare with one device: every
measure streamed in batches of 12 (so a data set of 30 ends on a batch of 6),
fixed seeds, as JSON-ready lists."""

import numpy as np


def flat(values):
    import keras

    return np.concatenate([np.ravel(keras.ops.convert_to_numpy(v)).astype("float64") for v in values]).tolist()


def estimates(model, x, y, batch_size=12):
    import keras_geosam as kg

    common = {"num_probes": 6, "rtol": None, "seed": 2, "batch_size": batch_size}
    out = {}
    for name, est in (
        ("hessian_trace", lambda: kg.sharpness.hessian_trace(model, x, y, **common)),
        ("rs_kfac", lambda: kg.sharpness.riemannian_sharpness(model, x, y, structure="kfac", **common)),
        ("rs_diagonal", lambda: kg.sharpness.riemannian_sharpness(model, x, y, structure="diagonal", **common)),
    ):
        e = est()
        out[name] = [float(e.value), float(e.stderr)]
    out["fisher_diagonal"] = flat(kg.sharpness.fisher_diagonal(model, x, y, batch_size=batch_size))
    out["fisher_diagonal_mc"] = flat(kg.sharpness.fisher_diagonal(model, x, y, kind="mc", seed=4, batch_size=batch_size))
    return out
