"""Stochastic trace estimators for any :class:`LinearOperator`.

- :func:`hutchinson`: ``tr A = E[z^T A z]`` with Rademacher z; optionally
  adaptive (``rtol``): rounds of probes until the standard error is small
  enough relative to the value.
- :func:`hutchpp`: Hutch++ (Meyer et al. 2021): the trace of A on a
  sketched top subspace exactly, Hutchinson on the rest; far fewer probes
  when A's spectrum decays.

Probes are drawn on the device in the operator's dtype
(:mod:`keras_geosam.curvature.probes`): one seed gives the same probes on
every backend. ``z^T A z`` is reduced per tensor on the device; only k
scalars per tensor reach the host. A quadratic form ``z^T S A S z``
under a symmetric per-tensor S (a metric's inverse square root) takes one
product with S: ``(S z)^T A (S z)`` (``LinearOperator.quadratic_pair``).
"""

import math
import warnings

import numpy as np
from keras import ops

from keras_geosam.curvature.kernels import KernelCache
from keras_geosam._checks import check_int
from keras_geosam._checks import check_number
from keras_geosam.curvature import probes
from keras_geosam.curvature.operators.base import flatten
from keras_geosam.curvature.operators.base import per_tensor_inner
from keras_geosam.curvature.operators.base import unflatten
from keras_geosam.estimators.estimate import from_samples

# Probes per operator call are capped so that a block of them stays within
# this many elements (~128 MB in float32).
MAX_BLOCK_ELEMENTS = 1 << 25


_KERNELS = KernelCache()


def _inner(z, w):
    """Compiled per-tensor inner products (one kernel, not one op per tensor)."""
    shapes = tuple(tuple(int(d) for d in ops.shape(t)) for t in z)
    return _KERNELS.get(per_tensor_inner, key=shapes)(z, w)


def _block_size(op):
    return max(1, MAX_BLOCK_ELEMENTS // max(op.dim, 1))


def quadratic_forms(op, start, count, seed, stream="hutchinson"):
    """``z_i^T A z_i`` per tensor for probes ``start .. start+count-1``:
    a (count, number of tensors) float64 NumPy array."""
    out = []
    step = _block_size(op)
    for s in range(start, start + count, step):
        k = min(step, start + count - s)
        z = probes.rademacher(seed, s, k, op.shapes, op.dtype, stream)
        out.append(np.asarray(ops.convert_to_numpy(_inner(*op.quadratic_pair(z))), dtype="float64"))
    return np.concatenate(out, axis=0)


def hutchinson(op, num_probes=10, rtol=None, max_probes=200, seed=0, shift=0.0, paths=None, bar=None, min_probes=10):
    """Trace of `op` by Hutchinson's estimator.

    Args:
        op: any :class:`LinearOperator`.
        num_probes: probes in the first round; without `rtol`, all of them.
        rtol: draw further rounds of `num_probes` until
            ``stderr <= rtol * |shift + mean|`` or `max_probes` are used
            (a ``RuntimeWarning`` says when the target is not reached).
        max_probes: the cap on probes when `rtol` is set.
        min_probes: futility stop: once this many probes are drawn (at the
            end of a round), if reaching `rtol` would take more than
            `max_probes` probes (``n (stderr / (rtol |value|))^2``, the
            standard error falling as ``1/sqrt(n)``), it stops there, says
            so in a warning and records ``info["futility"]`` (the probes
            drawn and the projected count). ``min_probes >= max_probes``
            turns it off.
        seed: probe seed (identical probes on every backend).
        shift: an exact part of the quantity, added to the value (used only
            for the value and the `rtol` test).
        paths: names of the tensors for ``per_layer`` (default "0", "1", ...).
        bar: a ``keras.utils.Progbar`` advanced by one per probe.

    Returns:
        An :class:`Estimate` with the probe values in ``samples`` and each
        tensor's share in ``per_layer``.

    Raises:
        ValueError: if `num_probes`, `max_probes` or `min_probes` is not an
            integer >= 1, or `rtol` is not positive.

    Example:

    >>> D = kg.curvature.Diagonal([np.array([1.0, 2.0, 3.0], "float32")])
    >>> kg.estimators.hutchinson(D, num_probes=10)  # exact on a diagonal
    Estimate(value=6, stderr=0, num_samples=10)
    >>> A = kg.curvature.Dense(np.array([[2.0, 1.0], [1.0, 2.0]], "float32"), [(2,)])
    >>> kg.estimators.hutchinson(A, num_probes=10, seed=0)
    Estimate(value=5.2, stderr=0.533, num_samples=10)
    """
    num_probes = check_int("num_probes", num_probes)
    rtol = check_number("rtol", rtol, 0.0, strict=True, allow_none=True)
    min_probes = check_int("min_probes", min_probes)
    if rtol is not None:
        max_probes = max(check_int("max_probes", max_probes), num_probes)
    paths = [str(i) for i in range(len(op.shapes))] if paths is None else list(paths)
    rows = np.zeros((0, len(op.shapes)))
    futility = None
    while True:
        count = num_probes if rtol is None else min(num_probes, max_probes - rows.shape[0])
        rows = np.concatenate([rows, quadratic_forms(op, rows.shape[0], count, seed)], axis=0)
        if bar is not None:
            bar.add(count)
        if rtol is None:
            break
        total = rows.sum(axis=1)
        n = total.size
        stderr = total.std(ddof=1) / math.sqrt(n) if n > 1 else math.inf
        target = rtol * abs(shift + total.mean())
        if stderr <= target:
            break
        projected = math.inf if target == 0 else n * (stderr / target) ** 2
        if min_probes <= n < max_probes and projected > max_probes:
            futility = {"probes": int(n), "projected": float(projected)}
            warnings.warn(
                f"Hutchinson: relative standard error {stderr / max(abs(shift + total.mean()), 1e-300):.3g} "
                f"above rtol={rtol} after {n} probes; reaching it would take about {projected:.3g} probes, "
                f"more than max_probes={max_probes}, so it stopped there (futility; min_probes={min_probes} "
                "turns this off when >= max_probes). The estimate reports its stderr.",
                RuntimeWarning,
                stacklevel=2,
            )
            break
        if n >= max_probes:
            warnings.warn(
                f"Hutchinson: relative standard error {stderr / max(abs(shift + total.mean()), 1e-300):.3g} "
                f"above rtol={rtol} after max_probes={max_probes} probes; the estimate reports its stderr.",
                RuntimeWarning,
                stacklevel=2,
            )
            break
    info = {"estimator": "hutchinson (Rademacher)", "rtol": rtol, "seed": seed}
    if futility is not None:
        info["futility"] = futility
    return from_samples(rows.sum(axis=1), dict(zip(paths, rows.T)), info, shift=shift)


def hutchpp(op, num_matvecs=30, seed=0, shift=0.0, paths=None):
    """Trace of `op` by Hutch++ (Meyer et al. 2021).

    Uses `num_matvecs` products, a third each for the sketch, the exact
    part on its range, and Hutchinson on the rest: far fewer products than
    :func:`hutchinson` when the spectrum decays.

    Args:
        op: any symmetric :class:`LinearOperator`.
        num_matvecs: operator products, at least 6. Defaults to `30`.
        seed: probe seed (identical probes on every backend). Defaults to
            `0`.
        shift: an exact part added to the value. Defaults to `0.0`.
        paths: names of the tensors for ``per_layer``. Defaults to `None`
            ("0", "1", ...).

    Returns:
        An :class:`Estimate`; ``stderr`` is that of the Hutchinson part,
        ``info["exact_on_sketch"]`` the part computed exactly.

    Raises:
        ValueError: if `num_matvecs` is not an integer >= 6.

    Example:

    >>> A = kg.curvature.Dense(np.array([[2.0, 1.0], [1.0, 2.0]], "float32"), [(2,)])
    >>> kg.estimators.hutchpp(A, num_matvecs=6)  # the sketch spans this small space
    Estimate(value=4, stderr=0, num_samples=2)
    """
    num_matvecs = check_int("num_matvecs", num_matvecs)
    k = max(1, num_matvecs // 3)
    if k < 2:
        raise ValueError("hutchpp needs num_matvecs >= 6 (two probes per stage).")
    paths = [str(i) for i in range(len(op.shapes))] if paths is None else list(paths)
    sketch = op.matmat(probes.rademacher(seed, 0, k, op.shapes, op.dtype, "sketch"))
    q, _ = ops.qr(ops.transpose(flatten(sketch)))  # (dim, k), orthonormal columns
    Q = unflatten(ops.transpose(q), op.shapes)
    exact = np.asarray(ops.convert_to_numpy(per_tensor_inner(*op.quadratic_pair(Q))), dtype="float64").sum(axis=0)
    g = flatten(probes.rademacher(seed, 0, k, op.shapes, op.dtype, "hutchinson"))
    g = g - ops.einsum("kj,pj->kp", ops.einsum("kp,pj->kj", g, q), q)  # project out the sketched range
    G = unflatten(g, op.shapes)
    rows = np.asarray(ops.convert_to_numpy(per_tensor_inner(*op.quadratic_pair(G))), dtype="float64")
    info = {"estimator": "hutch++", "sketch_rank": k, "num_matvecs": 3 * k, "seed": seed, "exact_on_sketch": float(exact.sum())}
    est = from_samples(rows.sum(axis=1), dict(zip(paths, rows.T + exact[:, None])), info, shift=shift + float(exact.sum()))
    return est
