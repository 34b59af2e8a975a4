"""Shared argument checks and bookkeeping of the sharpness measures."""

from keras_geosam._checks import warn_at_caller
from keras_geosam.curvature.data import num_examples
from keras_geosam.curvature.data import DEFAULT_BATCH_SIZE


def require_fisher(model, loss, what):
    """Raises unless the model's loss is a negative log-likelihood whose
    Fisher is defined (``curvature/likelihoods.py``)."""
    from keras_geosam.curvature.functional import model_functions
    from keras_geosam.curvature.losses import require_likelihood

    require_likelihood(model_functions(model, loss).spec, what)


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


def data_info(x, batch_size):
    n = num_examples(x)
    return {"num_examples": n, "batch_size": batch_size}


def warn_if_tiny(x):
    if num_examples(x) < 2:
        warn_at_caller(
            "A curvature estimate from a single example describes that example only; "
            "pass more data for a sharpness of the model.",
            UserWarning,
        )
