"""Largest Hessian eigenvalue by Lanczos iteration on Hessian-vector products."""

import math

import numpy as np
import scipy.linalg

from keras_geosam.curvature.functional import progbar
from keras_geosam.sharpness import _common
from keras_geosam.sharpness.estimate import Estimate


def _flatten(vs):
    return np.concatenate([v.ravel() for v in vs])


def _unflatten(flat, shapes):
    out, i = [], 0
    for s in shapes:
        n = int(np.prod(s))
        out.append(flat[i : i + n].reshape(s))
        i += n
    return out


def lanczos_top(matvec, dim, max_iter=100, tol=1e-3, seed=0, bar=None):
    """Largest algebraic eigenvalue of a symmetric operator.

    Lanczos with full reorthogonalisation (float64). Stops when the Ritz
    residual ``|beta_k s_k|`` (a bound on the distance from the Ritz value to
    an eigenvalue of the operator) falls below ``tol * |theta|``.

    Returns ``(theta, residual, iterations, ritz_vector)``.
    """
    rng = np.random.default_rng(seed)
    q = rng.normal(size=dim)
    q /= np.linalg.norm(q)
    basis, alphas, betas = [q], [], []
    theta, resid, vec = 0.0, math.inf, None
    for k in range(min(max_iter, dim)):
        w = matvec(basis[-1])
        alpha = float(w @ basis[-1])
        w = w - alpha * basis[-1] - (betas[-1] * basis[-2] if betas else 0.0)
        Q = np.array(basis)
        for _ in range(2):  # full reorthogonalisation, twice is enough
            w = w - Q.T @ (Q @ w)
        beta = float(np.linalg.norm(w))
        alphas.append(alpha)
        evals, evecs = scipy.linalg.eigh_tridiagonal(np.array(alphas), np.array(betas)) if k else (np.array([alpha]), np.ones((1, 1)))
        theta = float(evals[-1])
        resid = abs(beta * evecs[-1, -1])
        vec = Q.T @ evecs[:, -1]
        if bar is not None:
            bar.add(1)
        if resid <= tol * abs(theta) or beta <= 1e-12 * max(abs(theta), 1.0):
            return theta, resid, k + 1, vec
        betas.append(beta)
        basis.append(w / beta)
    return theta, resid, len(alphas), vec


def hessian_max_eigenvalue(model, x, y, max_iter=100, tol=1e-3, seed=0, batch_size=_common.DEFAULT_BATCH_SIZE, loss=None, verbose=0):
    """Largest eigenvalue lambda_max of the Hessian of the mean loss.

    Lanczos on Hessian-vector products over the data (streamed). The result's
    ``stderr`` holds the final Ritz residual, which bounds the distance from
    ``value`` to an eigenvalue of H; ``num_samples`` is the iteration count;
    ``info["eigenvector"]`` the Ritz vector as a list like the variables.
    """
    max_iter = _common.check_positive_int("max_iter", max_iter)
    if not tol > 0:
        raise ValueError(f"tol must be > 0, got {tol!r}.")
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    matvec_list = _common.hessian_matvec(model, x, y, loss, batch_size)
    dim = sum(int(np.prod(s)) for s in shapes)
    bar = progbar(max_iter, verbose, "iteration")
    theta, resid, iters, vec = lanczos_top(
        lambda v: _flatten(matvec_list(_unflatten(v, shapes))), dim, max_iter, tol, seed, bar
    )
    info = _common.data_info(x, batch_size)
    info.update(
        estimator="lanczos",
        converged=bool(resid <= tol * abs(theta)),
        tol=tol,
        eigenvector=_unflatten(vec, shapes),
    )
    return Estimate(value=theta, stderr=float(resid), num_samples=iters, info=info)
