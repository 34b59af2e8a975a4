"""Shared argument checks and bookkeeping of the sharpness measures."""

import numpy as np

from keras_geosam.curvature.functional import num_examples
from keras_geosam.curvature.functional import progbar  # noqa: F401  (re-exported for the measures)
from keras_geosam.estimators.trace import check_positive_int  # noqa: F401

from keras_geosam.curvature.operators.model import DEFAULT_BATCH_SIZE  # noqa: F401,E402


def require_fisher(model, loss, what):
    """Raises unless the model's loss is a classifier's: the Fisher of the
    predictive distribution (which the GGN of a squared error is not said to
    be here) needs one."""
    from keras_geosam.curvature.functional import model_functions
    from keras_geosam.curvature.losses import require_classifier

    require_classifier(model_functions(model, loss).spec, what)


def check_inputs(model, x, y, loss=None, sample_weight=None, labels_needed=True):
    """Validates the data of a sharpness measure before anything is
    computed, whichever path (probed or exact) follows: arrays (no
    datasets), equal lengths, finite inputs, labels that fit the outputs
    (positions included) and are class ids of the model, and weights of the
    right shape. Returns the model's functions."""
    from keras_geosam.curvature import weights
    from keras_geosam.curvature.functional import check_data
    from keras_geosam.curvature.functional import check_labels
    from keras_geosam.curvature.functional import model_functions

    fns = model_functions(model, loss, training=False)
    check_data(x, y, labels_needed=labels_needed, sample_weight=sample_weight)
    check_labels(fns, x, y)
    if sample_weight is not None:
        weights.resolve(fns, x, y, sample_weight, DEFAULT_BATCH_SIZE)
    return fns


def check_rtol(rtol, max_probes):
    if rtol is not None and not (isinstance(rtol, (int, float, np.floating)) and rtol > 0):
        raise ValueError(f"rtol must be a number > 0 or None, got {rtol!r}.")
    check_positive_int("max_probes", max_probes)


def data_info(x, batch_size):
    n = num_examples(x)
    return {"num_examples": n, "batch_size": batch_size}


def warn_if_tiny(x):
    import warnings

    if num_examples(x) < 2:
        warnings.warn(
            "A curvature estimate from a single example describes that example only; "
            "pass more data for a sharpness of the model.",
            UserWarning,
            stacklevel=3,
        )
