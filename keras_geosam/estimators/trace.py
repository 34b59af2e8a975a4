"""Stochastic trace estimators for any :class:`LinearOperator`.

- :func:`hutchinson`: ``tr A = E[z^T A z]`` with Rademacher z; optionally
  adaptive (``rtol``): rounds of probes until the standard error is small
  enough relative to the value.
- :func:`hutchpp`: Hutch++ (Meyer et al. 2021): the trace of A on a
  sketched top subspace exactly, Hutchinson on the rest; far fewer probes
  when A's spectrum decays.
- :func:`deflated_hutchinson`: Hutchinson's first round; only when it misses
  ``rtol``, the same deflation as Hutch++ (a sketched subspace exactly)
  with adaptive Hutchinson rounds on the rest, in the same probe budget.

Probes are drawn on the device in the operator's dtype
(:mod:`keras_geosam.curvature.probes`): one seed gives the same probes on
every backend. ``z^T A z`` is reduced per tensor on the device; only k
scalars per tensor reach the host. A quadratic form ``z^T S A S z``
under a symmetric per-tensor S (a metric's inverse square root) takes one
product with S: ``(S z)^T A (S z)`` (``LinearOperator.quadratic_pair``).
"""

import math

import numpy as np
from keras import ops

from keras_geosam._checks import warn_at_caller
from keras_geosam.curvature.kernels import KernelCache
from keras_geosam._checks import check_int
from keras_geosam._checks import check_number
from keras_geosam.curvature import probes
from keras_geosam.curvature.operators.base import LinearOperator
from keras_geosam.curvature.operators.base import flatten
from keras_geosam.curvature.operators.base import per_tensor_inner
from keras_geosam.curvature.operators.base import unflatten
from keras_geosam.estimators.estimate import from_samples

# Probes per operator call are capped so that a block of them stays within
# this many elements (~128 MB in float32).
MAX_BLOCK_ELEMENTS = 1 << 25
# A deflation's basis (rank x dim) and its sketch are held whole: above
# this many elements (~512 MB in float32) deflated_hutchinson does not deflate.
MAX_SKETCH_ELEMENTS = 1 << 27


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
        # The probes are handed over, not kept: a composed S A S lets them
        # go once S z exists.
        pair = op.quadratic_pair(probes.rademacher(seed, s, k, op.shapes, op.dtype, stream), consume=True)
        out.append(np.asarray(ops.convert_to_numpy(_inner(*pair)), dtype="float64"))
        del pair
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
        if rtol is None or not np.all(np.isfinite(rows)):
            break  # no number of probes makes a non-finite sample finite
        total = rows.sum(axis=1)
        n = total.size
        stderr = total.std(ddof=1) / math.sqrt(n) if n > 1 else math.inf
        target = rtol * abs(shift + total.mean())
        if stderr <= target:
            break
        projected = math.inf if target == 0 else n * (stderr / target) ** 2
        if min_probes <= n < max_probes and projected > max_probes:
            futility = {"probes": int(n), "projected": float(projected)}
            warn_at_caller(
                f"Hutchinson: relative standard error {stderr / max(abs(shift + total.mean()), 1e-300):.3g} "
                f"above rtol={rtol} after {n} probes; reaching it would take about {projected:.3g} probes, "
                f"more than max_probes={max_probes}, so it stopped there (futility; min_probes={min_probes} "
                "turns this off when >= max_probes). The estimate reports its stderr.",
                RuntimeWarning,
            )
            break
        if n >= max_probes:
            warn_at_caller(
                f"Hutchinson: relative standard error {stderr / max(abs(shift + total.mean()), 1e-300):.3g} "
                f"above rtol={rtol} after max_probes={max_probes} probes; the estimate reports its stderr.",
                RuntimeWarning,
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
    q = _sketch_basis(op, k, seed)
    exact = _trace_on(op, q)
    rest = Deflated(op, q)
    rows = np.asarray(ops.convert_to_numpy(per_tensor_inner(*rest.quadratic_pair(
        probes.rademacher(seed, 0, k, op.shapes, op.dtype, "hutchinson")))), dtype="float64")
    info = {"estimator": "hutch++", "sketch_rank": k, "num_matvecs": 3 * k, "seed": seed, "exact_on_sketch": float(exact.sum())}
    est = from_samples(rows.sum(axis=1), dict(zip(paths, rows.T + exact[:, None])), info, shift=shift + float(exact.sum()))
    return est


def _sketch_basis(op, k, seed):
    """``(dim, k)`` orthonormal basis of the range of ``A Omega`` (k
    Rademacher probes of the "sketch" stream): A's top subspace, roughly."""
    sketch = op.matmat(probes.rademacher(seed, 0, k, op.shapes, op.dtype, "sketch"))
    q, _ = ops.qr(ops.transpose(flatten(sketch)))
    return q


def _trace_on(op, q):
    """``tr(q^T A q)`` per tensor (a NumPy vector): k products."""
    Q = unflatten(ops.transpose(q), op.shapes)
    return np.asarray(ops.convert_to_numpy(per_tensor_inner(*op.quadratic_pair(Q))), dtype="float64").sum(axis=0)


class Deflated(LinearOperator):
    """``(I - q q^T) A (I - q q^T)``: `op` with the orthonormal columns of
    `q` (``(dim, k)``) projected out on both sides. Its trace is ``tr A -
    tr(q^T A q)``; a probe's quadratic form takes one product with A."""

    def __init__(self, op, q):
        super().__init__(op.shapes, op.dtype)
        self.op, self.q = op, q

    def project(self, vectors):
        g = flatten(vectors)
        g = g - ops.einsum("kj,pj->kp", ops.einsum("kp,pj->kj", g, self.q), self.q)
        return unflatten(g, self.shapes)

    def matmat(self, vectors):
        return self.project(self.op.matmat(self.project(self.check(vectors))))

    def quadratic_pair(self, vectors, consume=False):
        # The projection is a new list, held by no one else.
        return self.op.quadratic_pair(self.project(vectors), consume=True)


def deflated_hutchinson(op, num_probes=10, rtol=None, max_probes=200, seed=0, shift=0.0, paths=None, bar=None,
                        min_probes=10, rank=None):
    """Hutchinson, deflated when its first round misses `rtol`.

    The first round is :func:`hutchinson`'s (the same probes and value). If
    its standard error is above ``rtol * |shift + mean|``, the rest of the
    `max_probes` budget (counted in products with `op`) goes to
    ``tr A = tr(q^T A q) + tr((I - q q^T) A (I - q q^T))``: `q` an
    orthonormal basis of ``A Omega`` for `rank` sketch probes (`rank`
    products), the first term exactly (`rank` products), the second by
    Hutchinson rounds of `num_probes` on fresh projected probes until
    `rtol`, the budget or the futility stop. Where a few directions carry
    most of ``||A||_F`` (the variance of a probe), they leave the probes'
    variance. The value is the deflated estimate alone: the first round's
    values are not folded into it (``info`` keeps them).

    Args:
        op: any symmetric :class:`LinearOperator`.
        num_probes, rtol, max_probes, seed, shift, paths, bar, min_probes:
            as for :func:`hutchinson`; `max_probes` bounds every product,
            the sketch's and the exact part's included.
        rank: sketch probes. Defaults to `None` (`num_probes`).

    Returns:
        An :class:`Estimate`. Undeflated (`rtol` met in the first round,
        no `rtol`, a budget under ``2 rank + 2`` more products, or a basis
        over ``MAX_SKETCH_ELEMENTS``): :func:`hutchinson`'s own, with
        ``info["deflation"]`` saying why not. Deflated: the value
        ``shift + tr(q^T A q) + rest``, the stderr the rest's; ``info
        ["deflation"]`` holds ``rank``, ``exact_on_subspace``, ``rest``,
        ``rest_stderr``, the first round's ``first_round`` value and
        stderr and ``products`` (all products with `op`).

    Raises:
        ValueError: as for :func:`hutchinson`, or if `rank` is not an
            integer >= 1.

    Example:

    >>> rng = np.random.default_rng(0)
    >>> V = np.linalg.qr(rng.normal(size=(40, 40)))[0]
    >>> A = (V * np.r_[100.0, -80.0, rng.normal(size=38)]) @ V.T  # two directions dominate
    >>> op = kg.curvature.Dense(A.astype("float32"), [(40,)])
    >>> est = kg.estimators.deflated_hutchinson(op, num_probes=8, rtol=0.2, max_probes=60)
    >>> est.info["deflation"]["rank"], bool(abs(est.value - np.trace(A)) <= 4 * est.stderr)
    (8, True)
    """
    num_probes = check_int("num_probes", num_probes)
    rank = num_probes if rank is None else check_int("rank", rank)
    rtol = check_number("rtol", rtol, 0.0, strict=True, allow_none=True)
    max_probes = check_int("max_probes", max_probes)
    budget = max_probes - num_probes - 2 * rank
    why = None
    if rtol is None:
        why = "not asked: no rtol"
    elif budget < 2:
        why = f"no budget: max_probes={max_probes} leaves {budget} products after the first round and the sketch"
    elif rank * op.dim > MAX_SKETCH_ELEMENTS:
        why = f"too large: a basis of {rank} x {op.dim} elements is over {MAX_SKETCH_ELEMENTS}"
    if why is not None:
        est = hutchinson(op, num_probes, rtol, max_probes, seed, shift=shift, paths=paths, bar=bar, min_probes=min_probes)
        est.info["deflation"] = why
        return est
    first = hutchinson(op, num_probes, None, max_probes, seed, shift=shift, paths=paths, bar=bar, min_probes=min_probes)
    first.info["rtol"] = rtol
    if first.stderr <= rtol * abs(first.value):
        first.info["deflation"] = "not needed: the first round met rtol"
        return first
    q = _sketch_basis(op, rank, seed)
    exact = _trace_on(op, q)
    if bar is not None:
        bar.add(2 * rank)
    rest = hutchinson(Deflated(op, q), num_probes, rtol, budget, seed, shift=shift + float(exact.sum()), paths=paths,
                      bar=bar, min_probes=min_probes)
    value_of_rest = rest.value - shift - float(exact.sum())
    rest.info.update(estimator="deflated hutchinson (Rademacher)", deflation={
        "rank": rank, "exact_on_subspace": float(exact.sum()), "rest": value_of_rest, "rest_stderr": rest.stderr,
        "first_round": {"value": first.value, "stderr": first.stderr},
        "products": num_probes + 2 * rank + rest.num_samples})
    for i, path in enumerate(rest.per_layer):
        rest.per_layer[path] += float(exact[i])
    return rest

