"""Largest eigenvalues: Euclidean ``lambda_max(H)`` and Riemannian
``lambda_max(M^-1/2 H M^-1/2)``, by Lanczos on operator products."""

from keras_geosam._checks import check_int
from keras_geosam._checks import check_number
from keras_geosam._checks import renamed_arguments
from keras_geosam.curvature.functional import model_functions
from keras_geosam.curvature.functional import progbar
from keras_geosam.curvature.losses import require_likelihood
from keras_geosam.curvature.operators import Hessian
from keras_geosam.curvature.operators.model import MAX_EXACT_CLASSES
from keras_geosam.estimators import lanczos
from keras_geosam.estimators.eigen import DEFAULT_MAX_MEMORY
from keras_geosam.curvature.finite import require_finite
from keras_geosam.sharpness import _common
from keras_geosam.sharpness.metric import fisher_metric
from keras_geosam.sharpness.riemannian import DEFAULT_DAMPING


def _lanczos(op, model, x, max_iter, tol, seed, batch_size, max_memory, verbose):
    _common.warn_if_tiny(x)
    bar = progbar(max_iter, verbose, "iteration")
    est = lanczos(op, max_iter=max_iter, tol=tol, seed=seed, max_memory=max_memory, bar=bar)
    require_finite(est.value, model, x, "The largest eigenvalue", batch_size)
    est.info.update(_common.data_info(x, batch_size))
    return est


def hessian_max_eigenvalue(model, x, y, max_iter=100, tol=1e-3, seed=0, batch_size=_common.DEFAULT_BATCH_SIZE,
                           loss=None, max_memory=DEFAULT_MAX_MEMORY, verbose=0, sample_weight=None):
    """Largest eigenvalue lambda_max of the Hessian of the mean loss.

    Lanczos on Hessian-vector products over the data (streamed). The
    result's ``stderr`` holds the final Ritz residual, which bounds the
    distance from ``value`` to an eigenvalue of H; ``num_samples`` is the
    iteration count; ``info["eigenvector"]`` the Ritz vector as a list like
    the variables (None when the basis exceeded `max_memory` bytes, see
    ``keras_geosam.estimators.eigen``).

    Args:
        model: a built single-output ``keras.Model`` with a loss.
        x, y: data (streamed in `batch_size` pieces).
        max_iter: the most Lanczos iterations. Defaults to `100`.
        tol: relative tolerance on the Ritz residual. Defaults to `1e-3`.
        seed: seeds the start vector. Defaults to `0`.
        batch_size: examples per streamed batch. Defaults to `256`.
        loss: loss to use instead of the compiled one. Defaults to `None`.
        max_memory: bytes the Lanczos basis may hold. Defaults to 1 GiB.
        verbose: 1 shows a progress bar. Defaults to `0`.
        sample_weight: ``(N,)`` or per-token weights of the loss terms.
            Defaults to `None`.

    Returns:
        An :class:`Estimate` (``info["converged"]`` says whether `tol` was
        reached).

    Raises:
        ValueError: if `max_iter` is not an integer >= 1, `tol` is not
            positive, the model has no loss, the model is not built, or the
            data is invalid (lengths differ, non-finite inputs, labels that
            are not class ids of the model).

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, kernel_initializer="zeros")])
    >>> model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> est = kg.sharpness.hessian_max_eigenvalue(model, x, y)
    >>> round(est.value, 4), est.info["converged"]
    (0.5414, True)
    """
    max_iter = check_int("max_iter", max_iter)
    _common.check_inputs(model, x, y, loss, sample_weight)
    op = Hessian(model, x, y, loss=loss, batch_size=batch_size, sample_weight=sample_weight)
    return _lanczos(op, model, x, max_iter, tol, seed, batch_size, max_memory, verbose)


@renamed_arguments(metric="structure", fisher="kind")
def riemannian_max_eigenvalue(model, x, y, structure="diagonal", kind="exact", damping=None, max_iter=100, tol=1e-3,
                              num_samples=1, seed=0, batch_size=_common.DEFAULT_BATCH_SIZE, loss=None,
                              max_memory=DEFAULT_MAX_MEMORY, verbose=0, sample_weight=None,
                              max_exact_classes=MAX_EXACT_CLASSES, exact_samples=8):
    """Largest eigenvalue of ``M^-1/2 H M^-1/2``: the Riemannian lambda_max.

    M is the Fisher metric of :func:`riemannian_sharpness` (``"diagonal"``
    or ``"kfac"``, relative `damping`, default 1e-3). Like S_R, it is
    unchanged when one layer's parameters are rescaled, while the Euclidean
    lambda_max is not. Result as :func:`hessian_max_eigenvalue`.

    Args:
        model: a built model compiled with a negative log-likelihood
            (categorical or binary cross-entropy, mean squared error).
        x, y: data (streamed in `batch_size` pieces).
        structure: block structure of M, ``"diagonal"`` or ``"kfac"``
            (``metric=`` is a deprecated alias). Defaults to ``"diagonal"``.
        kind: Fisher kind behind M, ``"exact"``, ``"mc"`` or
            ``"empirical"`` (``fisher=`` is a deprecated alias). Defaults
            to ``"exact"``.
        damping: relative damping of each block of M (>= 0). Defaults to
            `None` (1e-3).
        max_iter, tol, seed, batch_size, loss, max_memory, verbose: as for
            :func:`hessian_max_eigenvalue`.
        num_samples: labels per example for ``kind="mc"``. Defaults to
            `1`.
        sample_weight, max_exact_classes, exact_samples: as for
            :func:`riemannian_sharpness`.

    Returns:
        An :class:`Estimate`; ``info`` also holds the metric, the Fisher
        kind and the damping.

    Raises:
        ValueError: if `max_iter` is not an integer >= 1, `tol` is not
            positive, `damping` is negative, `structure` or `kind` is
            unknown, the loss has no likelihood, the model
            is not built, or the data is invalid (lengths differ, non-finite
            inputs, labels that are not class ids of the model).

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, kernel_initializer="zeros")])
    >>> model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> est = kg.sharpness.riemannian_max_eigenvalue(model, x, y, structure="diagonal")
    >>> round(est.value, 3), est.info["metric"]
    (2.859, 'diagonal')
    """
    max_iter = check_int("max_iter", max_iter)
    fns = model_functions(model, loss, training=False)
    require_likelihood(fns.spec, "riemannian_max_eigenvalue")
    damping = DEFAULT_DAMPING if damping is None else check_number("damping", damping, 0.0)
    _common.check_inputs(model, x, y, loss, sample_weight)
    M = fisher_metric(model, x, y, structure, kind, num_samples, seed, batch_size, loss, sample_weight=sample_weight,
                      max_exact_classes=max_exact_classes, exact_samples=exact_samples)
    S = M.inverse_sqrt(damping, relative=True)
    op = S @ Hessian(model, x, y, loss=loss, batch_size=batch_size, sample_weight=sample_weight) @ S
    est = _lanczos(op, model, x, max_iter, tol, seed, batch_size, max_memory, verbose)
    est.info.update(metric=structure, fisher=kind, damping=damping, **M.info)
    return est
