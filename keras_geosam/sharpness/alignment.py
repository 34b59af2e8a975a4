"""Does minibatch gradient noise align with the Fisher? (spec section 3)

The paper assumes ``Cov[grad L_B] = (eta/B) G``. Sampling without
replacement gives ``Cov[g_B] = (1/B) (N-B)/(N-1) C`` with C the per-example
gradient covariance, which is close to the *empirical* Fisher near a minimum
and to the model Fisher only for a calibrated model. So the fitted factor
``alpha`` in ``diag Cov[g_B] ~ alpha diag F`` is expected near 1/B;
``eta/B`` is the scale of the *update* noise, shown beside it.
"""

import dataclasses

import keras
import numpy as np
import scipy.stats
from keras import ops

from keras_geosam._checks import check_int
from keras_geosam._checks import renamed_arguments
from keras_geosam.curvature import loss_and_gradient
from keras_geosam.curvature.data import num_examples
from keras_geosam.curvature.functional import progbar
from keras_geosam.sharpness import _common
from keras_geosam.sharpness.fisher import fisher_diagonal


@dataclasses.dataclass
class Alignment:
    """Result of :func:`gradient_noise_alignment`.

    Attributes:
        cosine: cosine between diag Cov[g_B] and diag F (inflated towards 1
            for any two non-negative vectors: read it with the next two).
        rank_correlation: Spearman correlation of the two diagonals.
        log_cosine: cosine between the centred log-diagonals (entries where
            both are > 0).
        alpha: least-squares factor in diag Cov[g_B] ~ alpha diag F.
        alpha_per_example: the same against the per-example gradient
            variance diag C; sampling theory predicts ``finite_population``.
        inv_batch_size, lr_over_batch, finite_population: 1/B, eta/B (None
            without a learning rate) and (1/B)(N-B)/(N-1).
        batch_size, num_batches, num_examples: B, the minibatches drawn and
            N.
        fisher: the Fisher kind compared with.
        noise_variance, fisher_diagonal: the two diagonals, flat float64
            NumPy arrays.

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, kernel_initializer="zeros")])
    >>> model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> a = kg.sharpness.gradient_noise_alignment(model, x, y, batch_size=4, num_batches=4)
    >>> a.batch_size, a.num_examples, a.inv_batch_size, round(a.finite_population, 4)
    (4, 8, 0.25, 0.1429)
    >>> a.noise_variance.shape == a.fisher_diagonal.shape == (15,)
    True
    """

    cosine: float
    rank_correlation: float
    log_cosine: float
    alpha: float
    alpha_per_example: float
    inv_batch_size: float
    lr_over_batch: float
    finite_population: float
    batch_size: int
    num_batches: int
    num_examples: int
    fisher: str
    noise_variance: list = dataclasses.field(repr=False, default=None)
    fisher_diagonal: list = dataclasses.field(repr=False, default=None)


def _take(x, idx):
    """Rows `idx` of every array in `x` (a structure: several inputs,
    labels or weights per output; None entries stay None)."""
    if x is None:
        return None
    if isinstance(x, dict):
        return {k: _take(v, idx) for k, v in x.items()}
    if isinstance(x, (list, tuple)) and not hasattr(x, "shape"):
        return type(x)(_take(v, idx) for v in x)
    return x[idx]


def _host(x):
    """`x` (a structure of arrays or tensors, or None) as NumPy arrays."""
    if x is None:
        return None
    if isinstance(x, dict):
        return {k: _host(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)) and any(v is None or hasattr(v, "shape") for v in x):
        return type(x)(_host(v) for v in x)
    return np.asarray(ops.convert_to_numpy(x))


def _cos(a, b):
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-300))


@renamed_arguments(fisher="kind")
def gradient_noise_alignment(
    model, x, y, batch_size, num_batches=64, kind="exact", learning_rate=None,
    num_samples=1, seed=0, eval_batch_size=_common.DEFAULT_BATCH_SIZE, loss=None, verbose=0, sample_weight=None,
):
    """Compares minibatch gradient noise with the Fisher diagonal.

    Draws `num_batches` minibatches of `batch_size` examples without
    replacement from ``(x, y)``, measures the variance of their gradients
    around the full-data gradient, and compares it with the Fisher diagonal
    of kind `kind` on the same data. Sampling theory predicts ``alpha``
    near ``(1/B)(N-B)/(N-1)`` for a calibrated model (module doc).

    Args:
        model: a built model compiled with a negative log-likelihood
            (categorical or binary cross-entropy, mean squared error).
        x, y: the data minibatches are drawn from.
        batch_size: B, smaller than the number of examples.
        num_batches: minibatches drawn. Defaults to `64`.
        kind: Fisher kind, ``"exact"``, ``"mc"`` or ``"empirical"``
            (``fisher=`` is a deprecated alias). Defaults to ``"exact"``.
        learning_rate: eta for the ``eta/B`` column. Defaults to `None`
            (the compiled optimizer's, if any).
        num_samples: labels per example for ``kind="mc"``. Defaults to
            `1`.
        seed: seeds the minibatch draw and sampled labels. Defaults to `0`.
        eval_batch_size: examples per streamed batch for the full-data
            quantities. Defaults to `256`.
        loss: loss to use instead of the compiled one. Defaults to `None`.
        verbose: 1 shows a progress bar over the minibatches. Defaults to
            `0`.
        sample_weight: ``(N,)`` or per-token weights of the loss terms:
            every gradient (minibatch and full) is then of the weighted mean
            loss, and the Fisher the weighted mean over tokens. Examples
            (sequences) are what minibatches draw. Defaults to `None`.

    Returns:
        An :class:`Alignment`.

    Raises:
        ValueError: if `batch_size` or `num_batches` is not an integer >= 1,
            `batch_size` is not smaller than the data, `kind` is unknown,
            the loss has no likelihood, the model is not
            built, or the data is invalid (lengths differ, non-finite
            inputs, labels that are not class ids of the model).

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, kernel_initializer="zeros")])
    >>> model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> a = kg.sharpness.gradient_noise_alignment(model, x, y, batch_size=4, num_batches=8)
    >>> 0 < a.cosine <= 1, round(a.finite_population, 4)
    (True, 0.1429)
    """
    _common.check_inputs(model, x, y, loss, sample_weight)
    n = num_examples(x)
    sw = _host(sample_weight)
    batch_size = check_int("batch_size", batch_size)
    num_batches = check_int("num_batches", num_batches)
    if batch_size >= n:
        raise ValueError(f"batch_size ({batch_size}) must be smaller than the data ({n} examples).")
    rng = np.random.default_rng(seed)
    flat = lambda gs: np.concatenate([np.asarray(ops.convert_to_numpy(g), "float64").ravel() for g in gs])
    _, g_full = loss_and_gradient(model, x, y, loss=loss, batch_size=eval_batch_size, sample_weight=sample_weight)
    g_full = flat(g_full)
    xn = keras.tree.map_structure(lambda a: np.asarray(ops.convert_to_numpy(a)), x)
    yn = _host(y)
    var = np.zeros_like(g_full)
    bar = progbar(num_batches, verbose, "batch")
    for _ in range(num_batches):
        idx = np.sort(rng.choice(n, batch_size, replace=False))
        _, gb = loss_and_gradient(model, _take(xn, idx), _take(yn, idx), loss=loss, sample_weight=_take(sw, idx))
        var += (flat(gb) - g_full) ** 2
        if bar is not None:
            bar.add(1)
    var /= num_batches
    F = np.concatenate([f.ravel() for f in fisher_diagonal(model, x, y, kind=kind, num_samples=num_samples, seed=seed,
                                                           batch_size=eval_batch_size, loss=loss, sample_weight=sample_weight)])
    emp = np.concatenate([f.ravel() for f in fisher_diagonal(model, x, y, kind="empirical", batch_size=eval_batch_size, loss=loss,
                                                             sample_weight=sample_weight)])
    # Per-example variance of the data loss: regularisers shift every
    # per-example gradient alike, so their mean is taken without them.
    _, g_data = loss_and_gradient(model, x, y, loss=loss, batch_size=eval_batch_size, include_regularization=False,
                                  sample_weight=sample_weight)
    C = np.clip(emp - flat(g_data) ** 2, 0, None)
    both = (var > 0) & (F > 0)
    lv, lf = np.log(var[both]), np.log(F[both])
    if learning_rate is None and getattr(model, "optimizer", None) is not None:
        try:
            learning_rate = float(ops.convert_to_numpy(model.optimizer.learning_rate))
        except Exception:  # schedules without a current value
            learning_rate = None
    return Alignment(
        cosine=_cos(var, F),
        rank_correlation=float(scipy.stats.spearmanr(var, F).statistic),
        log_cosine=_cos(lv - lv.mean(), lf - lf.mean()) if both.sum() > 1 else float("nan"),
        alpha=float(var @ F / (F @ F)),
        alpha_per_example=float(var @ C / (C @ C + 1e-300)),
        inv_batch_size=1.0 / batch_size,
        lr_over_batch=None if learning_rate is None else learning_rate / batch_size,
        finite_population=(n - batch_size) / (batch_size * (n - 1)),
        batch_size=batch_size,
        num_batches=num_batches,
        num_examples=n,
        fisher=kind,
        noise_variance=var,
        fisher_diagonal=F,
    )
