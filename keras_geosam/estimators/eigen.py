"""The largest eigenvalue of any symmetric :class:`LinearOperator` by Lanczos.

Vectors stay on the device in the operator's dtype, flattened; only the
tridiagonal coefficients (two scalars per iteration) reach the host, where
the small tridiagonal eigenproblem is solved.

Memory: with full reorthogonalisation the Lanczos basis holds up to
``max_iter`` vectors (``max_iter * dim * itemsize`` bytes, e.g. 4 GB for
100 iterations on 10M float32 parameters). Above `max_memory` the basis is
not kept: plain three-term Lanczos uses three vectors; its largest Ritz
value still converges (lost orthogonality only adds spurious copies of
converged values), but no eigenvector is returned. ``info`` states which
was used and the bytes held.
"""

import math

import keras
import numpy as np
import scipy.linalg
from keras import ops

from keras_geosam._checks import check_int
from keras_geosam._checks import check_number
from keras_geosam.curvature import probes
from keras_geosam.curvature.operators.base import flatten
from keras_geosam.curvature.operators.base import unflatten
from keras_geosam.estimators.estimate import Estimate

DEFAULT_MAX_MEMORY = 1 << 30


def _apply(op, v):
    return flatten(op.matmat(unflatten(v[None], op.shapes)))[0]


def _scalar(t):
    return float(ops.convert_to_numpy(t))


def lanczos(op, max_iter=100, tol=1e-3, seed=0, max_memory=DEFAULT_MAX_MEMORY, bar=None):
    """Largest algebraic eigenvalue of the symmetric operator `op`.

    Stops when the Ritz residual ``|beta_k s_k|`` (a bound on the distance
    from the Ritz value to an eigenvalue of `op`) is at most
    ``tol * |theta|``, when an invariant subspace is found, or after
    `max_iter` iterations.

    Args:
        op: a symmetric :class:`LinearOperator`.
        max_iter: the most iterations (operator products). Defaults to
            `100`.
        tol: relative tolerance on the Ritz residual. Defaults to `1e-3`.
        seed: seeds the start vector (the same on every backend). Defaults
            to `0`.
        max_memory: bytes the Lanczos basis may hold; above it, plain
            three-term Lanczos without an eigenvector (module doc).
            Defaults to 1 GiB.
        bar: a ``keras.utils.Progbar`` advanced by one per iteration.
            Defaults to `None`.

    Returns:
        An :class:`Estimate`: ``value`` the Ritz value, ``stderr`` the final
        Ritz residual, ``num_samples`` the iterations, ``info`` with
        ``converged``, ``reorthogonalized``, ``basis_bytes`` and
        ``eigenvector`` (a list like the operator's tensors, or None).

    Raises:
        ValueError: if `max_iter` is not an integer >= 1 or `tol` is not
            positive.

    Example:

    >>> D = kg.curvature.Diagonal([np.array([1.0, 2.0, 3.0], "float32")])
    >>> est = kg.estimators.lanczos(D)
    >>> round(est.value, 4), est.info["converged"]
    (3.0, True)
    >>> np.abs(keras.ops.convert_to_numpy(est.info["eigenvector"][0])).round(3).tolist()
    [0.0, 0.0, 1.0]
    """
    max_iter = check_int("max_iter", max_iter)
    tol = check_number("tol", tol, 0.0, strict=True)
    dim = op.dim
    steps = min(max_iter, dim)
    np_dtype = np.dtype(keras.backend.standardize_dtype(op.dtype))
    itemsize, eps = np_dtype.itemsize, float(np.finfo(np_dtype).eps)
    keep = steps * dim * itemsize <= max_memory
    q = flatten(probes.rademacher(seed, 0, 1, op.shapes, op.dtype, "lanczos"))[0]
    q = q / ops.sqrt(ops.sum(q * q))
    basis = [q] if keep else None
    q_prev, alphas, betas = None, [], []
    theta, resid, vec = 0.0, math.inf, None
    for k in range(steps):
        w = _apply(op, q)
        alpha = _scalar(ops.sum(w * q))
        if not math.isfinite(alpha):
            theta, resid = alpha, math.inf  # no iteration recovers from it
            break
        w = w - alpha * q
        if q_prev is not None:
            w = w - betas[-1] * q_prev
        if keep:
            Q = ops.stack(basis)
            for _ in range(2):  # full reorthogonalisation, twice is enough
                w = w - ops.einsum("j,jp->p", ops.einsum("jp,p->j", Q, w), Q)
        beta = math.sqrt(max(_scalar(ops.sum(w * w)), 0.0))
        alphas.append(alpha)
        if k:
            evals, evecs = scipy.linalg.eigh_tridiagonal(np.array(alphas), np.array(betas))
        else:
            evals, evecs = np.array([alpha]), np.ones((1, 1))
        theta = float(evals[-1])
        resid = abs(beta * evecs[-1, -1])
        if bar is not None:
            bar.add(1)
        # beta at rounding level: the Krylov space is invariant, theta exact.
        done = resid <= tol * abs(theta) or beta <= 100 * eps * max(abs(theta), abs(alpha), 1e-30)
        if done or k == steps - 1:
            if keep:
                s = ops.convert_to_tensor(evecs[:, -1], dtype=op.dtype)
                vec = unflatten(ops.einsum("j,jp->p", s, ops.stack(basis))[None], op.shapes)
                vec = [v[0] for v in vec]
            break
        betas.append(beta)
        q_prev, q = q, w / beta
        if keep:
            basis.append(q)
    info = {
        "estimator": "lanczos",
        "converged": bool(resid <= tol * abs(theta)),
        "tol": tol,
        "reorthogonalized": keep,
        "basis_bytes": (len(basis) if keep else 3) * dim * itemsize,
        "eigenvector": vec,
    }
    return Estimate(value=theta, stderr=float(resid), num_samples=len(alphas), info=info)
