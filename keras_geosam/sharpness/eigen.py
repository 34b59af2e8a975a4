"""Largest eigenvalues: Euclidean ``lambda_max(H)`` and Riemannian
``lambda_max(M^-1/2 H M^-1/2)``, by Lanczos on operator products."""

from keras_geosam.curvature.functional import model_functions
from keras_geosam.curvature.functional import progbar
from keras_geosam.curvature.losses import require_classifier
from keras_geosam.curvature.operators import Hessian
from keras_geosam.estimators import lanczos
from keras_geosam.estimators.eigen import DEFAULT_MAX_MEMORY
from keras_geosam.sharpness import _common
from keras_geosam.sharpness.metric import fisher_metric
from keras_geosam.sharpness.riemannian import DEFAULT_DAMPING


def _lanczos(op, model, x, max_iter, tol, seed, batch_size, max_memory, verbose):
    _common.warn_if_tiny(x)
    bar = progbar(max_iter, verbose, "iteration")
    est = lanczos(op, max_iter=max_iter, tol=tol, seed=seed, max_memory=max_memory, bar=bar)
    est.info.update(_common.data_info(x, batch_size))
    return est


def hessian_max_eigenvalue(model, x, y, max_iter=100, tol=1e-3, seed=0, batch_size=_common.DEFAULT_BATCH_SIZE,
                           loss=None, max_memory=DEFAULT_MAX_MEMORY, verbose=0):
    """Largest eigenvalue lambda_max of the Hessian of the mean loss.

    Lanczos on Hessian-vector products over the data (streamed). The
    result's ``stderr`` holds the final Ritz residual, which bounds the
    distance from ``value`` to an eigenvalue of H; ``num_samples`` is the
    iteration count; ``info["eigenvector"]`` the Ritz vector as a list like
    the variables (None when the basis exceeded `max_memory` bytes, see
    ``keras_geosam.estimators.eigen``).
    """
    max_iter = _common.check_positive_int("max_iter", max_iter)
    model_functions(model, loss, training=False)  # refuses an unbuilt model
    op = Hessian(model, x, y, loss=loss, batch_size=batch_size)
    return _lanczos(op, model, x, max_iter, tol, seed, batch_size, max_memory, verbose)


def riemannian_max_eigenvalue(model, x, y, metric="diagonal", fisher="exact", damping=None, max_iter=100, tol=1e-3,
                              num_samples=1, seed=0, batch_size=_common.DEFAULT_BATCH_SIZE, loss=None,
                              max_memory=DEFAULT_MAX_MEMORY, verbose=0):
    """Largest eigenvalue of ``M^-1/2 H M^-1/2``: the Riemannian lambda_max.

    M is the Fisher metric of :func:`riemannian_sharpness` (``"diagonal"``
    or ``"kfac"``, relative `damping`, default 1e-3). Like S_R, it is
    unchanged when one layer's parameters are rescaled, while the Euclidean
    lambda_max is not. Result as :func:`hessian_max_eigenvalue`.
    """
    max_iter = _common.check_positive_int("max_iter", max_iter)
    fns = model_functions(model, loss, training=False)
    require_classifier(fns.spec, "riemannian_max_eigenvalue")
    damping = DEFAULT_DAMPING if damping is None else float(damping)
    if not damping >= 0:
        raise ValueError(f"damping must be >= 0, got {damping!r}.")
    M = fisher_metric(model, x, y, metric, fisher, num_samples, seed, batch_size, loss)
    S = M.inverse_sqrt(damping, relative=True)
    op = S @ Hessian(model, x, y, loss=loss, batch_size=batch_size) @ S
    est = _lanczos(op, model, x, max_iter, tol, seed, batch_size, max_memory, verbose)
    est.info.update(metric=metric, fisher=fisher, damping=damping)
    return est
