"""Eigendecompositions of symmetric curvature blocks that end in a number or
a clear error, never in an obscure LAPACK or XLA one.

Solvers fail on blocks that are ill-conditioned or have many repeated
eigenvalues (torch raises "linalg.eigh: The algorithm failed to converge";
JAX returns NaN). :func:`symmetric_eigh` symmetrises, tries the device's
solver, then the same with a jitter relative to the block's mean eigenvalue
(the trace over the size; shifted back afterwards), then float64 on the host
(NumPy's LAPACK, with and without the jitter). If all fail it raises
:class:`EigenDecompositionError` with the block's size and condition number;
``BlockDiagonal`` adds the variable's path. Inside a compiled function there
is no host to fall back to: the device's solver alone runs there.
"""

import numpy as np
from keras import ops

from keras_geosam import backend

# The jitter, relative to the mean |eigenvalue|: far above float32 rounding
# of a well-scaled block, far below any eigenvalue a damping keeps.
RELATIVE_JITTER = 1e-6


class EigenDecompositionError(ValueError):
    """A symmetric block whose eigendecomposition failed every fallback."""


def symmetric_eigh(matrix, what="a curvature block"):
    """Eigenvalues (ascending) and eigenvectors of ``(matrix + matrix^T) / 2``.

    Args:
        matrix: a square tensor, or a NumPy array (then solved on the host
            in float64 alone, and NumPy arrays returned).
        what: names the block in an error.

    Returns:
        ``(w, v)`` in `matrix`'s dtype.

    Raises:
        EigenDecompositionError: if the block holds NaN or Inf, or every
            fallback failed (the message gives its condition number).
    """
    if isinstance(matrix, np.ndarray):
        return _host_eigh((matrix + matrix.T) / 2, what)
    return symmetric_eighs([matrix], [what])[0]


def symmetric_eighs(matrices, whats):
    """:func:`symmetric_eigh` of each of `matrices` (tensors), the device's
    first try of all of them in one call: a convolutional network's metric
    has a hundred factors, and a call each cost more than the solves
    (TensorFlow: 2 ms a call). Each factor is solved on its own inside that
    call: a batched solve among others wedged XLA's CPU thread pool (jax
    0.10, 2 cores). A factor that fails takes the whole ladder alone.

    Raises:
        EigenDecompositionError: as :func:`symmetric_eigh`, for the first
            factor that failed every fallback.
    """
    matrices = list(matrices)
    if not matrices:
        return []
    if not all(backend.is_concrete(m) for m in matrices):
        return [backend.eigh(_symmetrised(m)) for m in matrices]
    try:
        ws, vs, finite = _device_solve_kernel(matrices, solver=backend.eigh)
        finite = np.asarray(ops.convert_to_numpy(finite)).astype(bool)
        tried = True  # each result judged on its own
    except Exception as error:  # noqa: BLE001 - named in _numerical
        if not _numerical(error):
            raise
        # One failed solve stops the call (torch raises): the others have
        # not had their try, unless it was alone.
        ws, vs, finite = None, None, np.zeros(len(matrices), bool)
        tried = len(matrices) == 1
    return [(ws[i], vs[i]) if finite[i] else _ladder(m, what, tried)
            for i, (m, what) in enumerate(zip(matrices, whats))]


def _ladder(matrix, what, tried=False):
    """One matrix alone: the device's solver (unless `tried`), then with
    the jitter, then float64 on the host (module doc)."""
    found = None if tried else _first_try(matrix)
    if found is not None:
        return found
    a = _symmetrised(matrix)
    host = np.asarray(ops.convert_to_numpy(a), dtype="float64")
    _check_finite(host, what)
    jitter = _jitter(host)
    shifted = _attempt(backend.eigh, a + ops.cast(jitter, a.dtype) * ops.eye(int(host.shape[0]), dtype=a.dtype))
    if shifted is not None:
        return shifted[0] - ops.cast(jitter, a.dtype), shifted[1]
    w, v = _host_eigh(host, what, device_tried=True)
    return ops.convert_to_tensor(w, dtype=a.dtype), ops.convert_to_tensor(v, dtype=a.dtype)


def _symmetrised(matrix):
    return (matrix + ops.transpose(matrix)) / 2


def _device_solve(matrices, solver):
    """Each matrix's ``solver`` on its symmetrised self, and a vector of
    whether each result is finite."""
    ws, vs = zip(*[solver(_symmetrised(m)) for m in matrices])
    finite = ops.stack([ops.logical_and(ops.all(ops.isfinite(w)), ops.all(ops.isfinite(v))) for w, v in zip(ws, vs)])
    return list(ws), list(vs), finite


# The first try, with its finiteness check, as one program on JAX (one
# call on TensorFlow): eagerly, each of its ops compiles for each shape.
# The solver is looked up per call (a static argument), so a replaced
# ``backend.eigh`` is the one that runs.
_device_solve_kernel = backend.block_kernel(_device_solve, static_argnames=("solver",))


def _first_try(matrix):
    """The device's solver on the symmetrised block, or None where it
    raised a numerical error or gave NaN or Inf (as ``_attempt``)."""
    try:
        (w,), (v,), finite = _device_solve_kernel([matrix], solver=backend.eigh)
    except Exception as error:  # noqa: BLE001 - named in _numerical
        if not _numerical(error):
            raise
        return None
    return (w, v) if bool(ops.convert_to_numpy(finite)[0]) else None


def _host_eigh(host, what, device_tried=False):
    """NumPy's float64 solver, then with the jitter; else the clear error."""
    host = np.asarray(host, dtype="float64")
    _check_finite(host, what)
    jitter = _jitter(host)
    for shift in (0.0, jitter):
        found = _attempt(np.linalg.eigh, host + shift * np.eye(host.shape[0]))
        if found is not None:
            return found[0] - shift, found[1]
    n = host.shape[0]
    where = "on the device, with a jitter, and in float64 on the host" if device_tried else "in float64, also with a jitter"
    raise EigenDecompositionError(
        f"The eigendecomposition of {what} ({n} x {n}) failed {where} (jitter {jitter:.3g}: "
        f"{RELATIVE_JITTER:g} of its mean eigenvalue); its condition number is about {_condition(host):.3g}. "
        "Raise the damping or pass more data to the curvature estimate."
    )


def _check_finite(host, what):
    bad = int(np.size(host) - np.count_nonzero(np.isfinite(host)))
    if bad:
        n = host.shape[0]
        raise EigenDecompositionError(
            f"{what} ({n} x {n}) holds {bad} NaN or Inf entries: its eigendecomposition is undefined. "
            "The model's outputs or gradients are not finite on these data (check the inputs and the loss)."
        )


def _jitter(host):
    n = max(host.shape[0], 1)
    return RELATIVE_JITTER * max(abs(float(np.trace(host))) / n, float(np.finfo("float64").tiny))


def _attempt(solver, a):
    """``solver(a)`` if it returns finite values, else None (also when it
    raises a numerical error: LAPACK's, torch's, TensorFlow's or XLA's)."""
    try:
        w, v = solver(a)
    except Exception as error:  # noqa: BLE001 - named below
        if not _numerical(error):
            raise
        return None
    if isinstance(w, np.ndarray):
        return (w, v) if np.all(np.isfinite(w)) and np.all(np.isfinite(v)) else None
    finite = ops.logical_and(ops.all(ops.isfinite(w)), ops.all(ops.isfinite(v)))
    return (w, v) if bool(ops.convert_to_numpy(finite)) else None


def _numerical(error):
    # torch's LinAlgError is a RuntimeError; TensorFlow's and XLA's errors
    # derive from Exception directly, so they are told by their module.
    if isinstance(error, (np.linalg.LinAlgError, RuntimeError, ArithmeticError)):
        return True
    return type(error).__module__.startswith(("tensorflow", "jax", "jaxlib"))


def _condition(host):
    try:
        s = np.linalg.svd(host, compute_uv=False)
        return float(s.max() / s.min()) if s.min() > 0 else float("inf")
    except np.linalg.LinAlgError:
        d = np.abs(np.diag(host))
        return float(d.max() / d.min()) if d.min() > 0 else float("inf")
