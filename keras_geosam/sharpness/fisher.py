"""Diagonal Fisher information, three honestly named kinds.

All three average over examples (F = 1/N sum_n ...), matching the Hessian
of the *mean* loss:

- ``"exact"``: the Fisher of the compiled loss's likelihood (categorical,
  Gaussian or Bernoulli: ``curvature/likelihoods.py``), ``sum_k p_k (grad
  log p_k)^2`` per example for a softmax (= the GGN diagonal);
- ``"mc"``: the same with ``num_samples`` targets per example drawn from the
  model (labels from its softmax: the paper's estimator); unbiased but
  noisy, and zero wherever no drawn label moves a parameter;
- ``"empirical"``: data labels with the model's loss. Not the Fisher: it is
  the second moment of per-example gradients.

Computed on the device from layer inputs and output gradients
(``GGN.diagonal()``): one forward and a batched backward per batch, no
per-example gradient matrix.
"""

import numpy as np
from keras import ops

from keras_geosam._checks import check_int
from keras_geosam.curvature.operators import GGN
from keras_geosam.curvature.operators.model import check_kind
from keras_geosam.curvature.finite import require_finite
from keras_geosam.sharpness import _common


def fisher_diagonal(model, x, y=None, kind="exact", num_samples=1, seed=0, batch_size=_common.DEFAULT_BATCH_SIZE, loss=None, verbose=0,
                    sample_weight=None):
    """Diagonal of the Fisher information (averaged over examples).

    Args:
        model: a built model compiled with a negative log-likelihood: a
            categorical or binary cross-entropy (logits or probabilities)
            or the mean squared error; anything else raises ValueError.
        x, y: data; `y` is needed only for ``kind="empirical"``.
        kind: ``"exact"`` | ``"mc"`` | ``"empirical"`` (see module doc).
        num_samples: labels drawn per example for ``"mc"``.
        seed: seeds the label draw (identical on every backend).
        batch_size: examples per pass; memory is about
            ``batch_size x (activations + largest layer)``.
        loss: loss to use instead of the compiled one. Defaults to `None`.
        verbose: unused; kept for a uniform signature. Defaults to `0`.
        sample_weight: ``(N,)`` or per-token weights of the loss terms
            (with the model's own mask): the Fisher is then the weighted
            mean over tokens; or, for several outputs, one per output (a
            list in output order or a dict by name; each output's loss is
            then its own weighted mean). Defaults to `None`.

    Returns:
        A list of float64 NumPy arrays matching ``model.trainable_variables``.

    Raises:
        ValueError: if `kind` is unknown, `num_samples` is not an integer >=
            1, the loss has no likelihood, `y` is missing
            for ``"empirical"``, the model is not built, or the data is
            invalid (lengths differ, non-finite inputs, labels that are not
            class ids of the model).

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, kernel_initializer="zeros")])
    >>> model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> F = kg.sharpness.fisher_diagonal(model, x)
    >>> [f.shape for f in F]
    [(4, 3), (3,)]
    >>> F[1].round(4).tolist()  # p (1 - p) for uniform predictions over 3 classes
    [0.2222, 0.2222, 0.2222]
    >>> F_mc = kg.sharpness.fisher_diagonal(model, x, kind="mc", num_samples=4, seed=0)
    >>> F_mc[1].round(4).tolist()  # the same labels on every backend
    [0.1736, 0.2049, 0.2882]
    """
    check_kind(kind)
    num_samples = check_int("num_samples", num_samples)
    _common.require_fisher(model, loss, "fisher_diagonal")
    op = GGN(model, x, y, kind=kind, num_samples=num_samples, seed=seed, loss=loss, batch_size=batch_size, sample_weight=sample_weight)
    out = [np.asarray(ops.convert_to_numpy(d), dtype="float64") for d in op.diagonal()]
    require_finite(sum(float(d.sum()) for d in out), model, x, "fisher_diagonal", batch_size)
    return out


def dense_fisher(model, x, y=None, kind="exact", num_samples=1, seed=0, batch_size=_common.DEFAULT_BATCH_SIZE, loss=None, max_params=20000,
                 sample_weight=None):
    """The full Fisher matrix (float64 NumPy, P x P) for small models.

    Built from per-example factor gradients, so it is symmetric positive
    semi-definite with the exact rank.

    Args:
        model, x, y, kind, num_samples, seed, batch_size, loss: as for
            :func:`fisher_diagonal`.
        max_params: refuse models with more parameters. Defaults to
            `20000`.
        sample_weight: as for :func:`fisher_diagonal`. Defaults to `None`.

    Returns:
        A ``(P, P)`` float64 NumPy array, P the number of trainable
        parameters, coordinates in the order of the flattened variables.

    Raises:
        ValueError: if the model has more than `max_params` parameters, or
            for the reasons :func:`fisher_diagonal` gives.

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, kernel_initializer="zeros")])
    >>> model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> F = kg.sharpness.dense_fisher(model, x)
    >>> F.shape, np.allclose(np.diag(F)[-3:], kg.sharpness.fisher_diagonal(model, x)[1])
    ((15, 15), True)
    """
    check_kind(kind)
    _common.require_fisher(model, loss, "dense_fisher")
    op = GGN(model, x, y, kind=kind, num_samples=num_samples, seed=seed, loss=loss, batch_size=batch_size, sample_weight=sample_weight)
    G = op.to_dense(max_dim=max_params)
    return (G + G.T) / 2
