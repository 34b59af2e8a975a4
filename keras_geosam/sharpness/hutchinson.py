"""Hutchinson's estimator of the Hessian trace."""

import numpy as np

from keras_geosam.curvature.functional import progbar
from keras_geosam.sharpness import _common
from keras_geosam.sharpness.estimate import from_samples


def hessian_trace(model, x, y, num_probes=20, seed=0, batch_size=_common.DEFAULT_BATCH_SIZE, loss=None, verbose=0):
    """Trace of the Hessian of the mean loss, by Hutchinson's estimator.

    ``tr H = E[z^T H z]`` for Rademacher ``z``; each probe costs one
    Hessian-vector product over the data (streamed in `batch_size` pieces).

    Returns:
        An :class:`Estimate`: ``value`` the mean over probes, ``stderr`` their
        standard error, ``per_layer`` the trace of each variable's diagonal
        block, ``samples`` the probe values.
    """
    num_probes = _common.check_positive_int("num_probes", num_probes)
    variables = model.trainable_variables
    shapes = [tuple(v.shape) for v in variables]
    paths = [v.path for v in variables]
    rng = np.random.default_rng(seed)
    matvec = _common.hessian_matvec(model, x, y, loss, batch_size)
    bar = progbar(num_probes, verbose, "probe")
    samples, per_layer = _common.quadratic_probes(
        matvec, lambda i: _common.rademacher(rng, shapes), num_probes, paths, bar
    )
    info = _common.data_info(x, batch_size)
    info["estimator"] = "hutchinson (Rademacher)"
    return from_samples(samples, per_layer, info)
