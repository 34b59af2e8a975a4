"""Diagonal Fisher information, three honestly named kinds.

All three average over examples (F = 1/N sum_n ...), matching the Hessian
of the *mean* loss:

- ``"exact"``: the Fisher of the model's predictive distribution,
  ``sum_k p_k (grad log p_k)^2`` per example (= the GGN diagonal);
- ``"mc"``: the same with ``num_samples`` labels per example drawn from the
  model's softmax (the paper's estimator); unbiased but noisy, and zero
  wherever no drawn label moves a parameter;
- ``"empirical"``: data labels with the model's loss. Not the Fisher: it is
  the second moment of per-example gradients.

Computed on the device from layer inputs and output gradients
(``GGN.diagonal()``): one forward and a batched backward per batch, no
per-example gradient matrix.
"""

import numpy as np
from keras import ops

from keras_geosam.curvature.operators import GGN
from keras_geosam.curvature.operators.model import KINDS  # noqa: F401
from keras_geosam.curvature.operators.model import check_kind
from keras_geosam.sharpness import _common


def fisher_diagonal(model, x, y=None, kind="exact", num_samples=1, seed=0, batch_size=_common.DEFAULT_BATCH_SIZE, loss=None, verbose=0):
    """Diagonal of the Fisher information (averaged over examples).

    Args:
        model: a built classifier compiled with a categorical cross-entropy
            (logits or softmax outputs); anything else raises ValueError.
        x, y: data; `y` is needed only for ``kind="empirical"``.
        kind: ``"exact"`` | ``"mc"`` | ``"empirical"`` (see module doc).
        num_samples: labels drawn per example for ``"mc"``.
        seed: seeds the label draw (identical on every backend).
        batch_size: examples per pass; memory is about
            ``batch_size x (activations + largest layer)``.

    Returns:
        A list of float64 NumPy arrays matching ``model.trainable_variables``.
    """
    check_kind(kind)
    num_samples = _common.check_positive_int("num_samples", num_samples)
    op = GGN(model, x, y, kind=kind, num_samples=num_samples, seed=seed, loss=loss, batch_size=batch_size)
    return [np.asarray(ops.convert_to_numpy(d), dtype="float64") for d in op.diagonal()]


def dense_fisher(model, x, y=None, kind="exact", num_samples=1, seed=0, batch_size=_common.DEFAULT_BATCH_SIZE, loss=None, max_params=20000):
    """The full Fisher matrix (float64 NumPy, P x P) for small models."""
    check_kind(kind)
    op = GGN(model, x, y, kind=kind, num_samples=num_samples, seed=seed, loss=loss, batch_size=batch_size)
    G = op.to_dense(max_dim=max_params)
    return (G + G.T) / 2
