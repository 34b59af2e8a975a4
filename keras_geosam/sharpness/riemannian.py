"""Riemannian (Fisher-geometric) sharpness S_R = tr(M^{-1} H).

Metrics M (``structure=``, the block structure of M; ``metric=`` is a
deprecated alias):

- ``"diagonal"`` (the paper's estimator): M = diag(Fisher);
- ``"kfac"``: K-FAC blocks on Dense/Conv/EinsumDense kernels, diagonal
  blocks elsewhere;
- ``"exact"``: the dense Fisher, for small models.

For the first two (``sharpness/metric.py``), S_R is split as
``tr(M^-1 GGN) + tr(M^-1 (H - GGN))`` (``sharpness/trace.py``): the first
term exactly, with no probes; the second by Hutchinson on the symmetric
form ``z^T M^-1/2 (H - GGN) M^-1/2 z`` (each probe unchanged by positive
per-parameter rescalings of the undamped diagonal metric), and exactly zero
on layerwise-linear networks. ``split=False`` estimates the whole of
``M^-1/2 H M^-1/2`` by probes instead.

Caveat for piecewise-linear networks (ReLU/LeakyReLU, no normalisation,
a softmax, sigmoid or linear output): the network is linear in every single parameter, so
``diag H = diag F_exact`` and the undamped diagonal S_R equals the number of
parameters with nonzero Fisher, whatever the minimum. The result reports
that count (``info["num_nonzero_fisher"]``) and the value per counted
parameter (``info["normalized"]``), and a warning is issued.
"""


import numpy as np
from keras import ops

from keras_geosam import backend
from keras_geosam._checks import check_int
from keras_geosam._checks import check_number
from keras_geosam._checks import renamed_arguments
from keras_geosam._checks import warn_at_caller
from keras_geosam.curvature.functional import model_functions
from keras_geosam.curvature.losses import require_likelihood
from keras_geosam.curvature.operators.eigh import symmetric_eigh
from keras_geosam.curvature.operators import EKFAC
from keras_geosam.curvature.operators import GGN
from keras_geosam.curvature.operators import Hessian
from keras_geosam.curvature.operators.model import MAX_EXACT_CLASSES
from keras_geosam.estimators import Estimate
from keras_geosam.sharpness import _common
from keras_geosam.sharpness.linearity import is_piecewise_linear
from keras_geosam.sharpness.metric import fisher_metric
from keras_geosam.sharpness.metric import samples_labels
from keras_geosam.sharpness.trace import check_estimator
from keras_geosam.sharpness.trace import split_trace
from keras_geosam.sharpness.trace import stochastic_trace

METRICS = ("diagonal", "kfac", "exact")
# Relative damping by default: a thousandth of each block's mean Fisher
# eigenvalue bounds M^-1 where the Fisher is tiny but not zero.
DEFAULT_DAMPING = 1e-3


def stderr_given_metric(structure, kind, num_classes, max_exact_classes=MAX_EXACT_CLASSES, metric_draws=1):
    """Whether :func:`riemannian_sharpness`'s stderr is given one draw of a
    metric built from sampled labels (``info["stderr_given_metric"]``),
    decided from its arguments and the model's class count alone: the
    dense metric samples only for ``kind="mc"``; the others also above
    `max_exact_classes` (``samples_labels``); two or more draws cover it."""
    if metric_draws > 1:
        return False
    if structure == "exact":
        return kind == "mc"
    return samples_labels(kind, num_classes, max_exact_classes)


def _count(condition):
    return ops.sum(ops.cast(condition, "int32"))


def _nonzero_count(values):
    return _count(ops.not_equal(values, 0))


def _gram_kept_count(QA, s, null, rows, columns):
    # A Gram-built block: QA's nonzero columns, then the complement (one
    # scale, `null`, on (rows - rank) * columns directions).
    used = ops.greater(ops.sum(ops.square(QA), axis=0), 0)
    kept = _count(ops.logical_and(ops.not_equal(s, 0), used[:, None]))
    rest = (rows - _count(used)) * columns
    return kept + rest * ops.cast(ops.not_equal(null, 0), "int32")


def _kept_total(values, grams, gram_views):
    total = ops.zeros((), "int32")
    for v in values:
        total = total + _nonzero_count(v)
    for (QA, s, null), (rows, columns) in zip(grams, gram_views):
        total = total + _gram_kept_count(QA, s, null, rows, columns)
    return total


# One call for all blocks (one program on JAX): eagerly, each op compiles
# per block shape, and on TensorFlow a call per block cost 0.2 s of
# MobileNetV3Small's 1.5 s S_R.
_kept_kernel = backend.block_kernel(_kept_total, static_argnames=("gram_views",))


def _kept(blocks):
    """Directions the inverse blocks keep (nonzero scale): coordinates of a
    diagonal block, Kronecker eigen-directions of a K-FAC / EK-FAC one."""
    values, grams, views = [], [], []
    for block in blocks:
        if isinstance(block, EKFAC) and block.null is not None:
            grams.append((block.QA, block.s, block.null))
            views.append(tuple(block.view))
        else:
            values.append(block.s if isinstance(block, EKFAC) else block.values[0])
    return _kept_kernel(values, grams, gram_views=tuple(views))


def _metric_info(M, Minv, damping, rcond):
    """Direction counts of the metric, the same for every structure, in its
    own eigenbasis (coordinates for the diagonal, Kronecker eigen-directions
    for K-FAC): ``num_nonzero_fisher`` directions where the undamped Fisher is
    nonzero (above the pseudo-inverse's rounding cutoff), ``num_zero_fisher``
    the rest (the two add up to ``num_params``), ``num_excluded`` the
    directions the inverse used leaves out (the zero-Fisher ones for the
    pseudo-inverse, ``damping=0``; none when damped, unless a block is at
    rounding level). Counted on the device; three integers reach the host.
    The pseudo-inverse reuses the factors' cached eigendecompositions."""
    num_params = int(sum(int(np.prod(s)) for s in M.shapes))
    pinv = Minv if damping == 0 else M.inverse(0.0, relative=True, rcond=rcond)
    counts = ops.convert_to_numpy(ops.stack([_kept(pinv.blocks), _kept(Minv.blocks)]))
    nonzero, used = int(counts[0]), int(counts[1])
    return {"num_params": num_params, "num_nonzero_fisher": nonzero, "num_zero_fisher": num_params - nonzero,
            "num_excluded": num_params - used}


@renamed_arguments(metric="structure", fisher="kind")
def riemannian_sharpness(
    model, x, y, structure="diagonal", kind="exact", damping=None, num_probes=20, rtol=0.05, max_probes=100,
    num_samples=1, seed=0, batch_size=_common.DEFAULT_BATCH_SIZE, split=True, estimator="hutchinson",
    max_params=4000, rcond=None, loss=None, verbose=0, sample_weight=None, max_exact_classes=MAX_EXACT_CLASSES,
    exact_samples=8, metric_draws=1, min_probes=10,
):
    """Riemannian sharpness ``S_R = tr(M^-1 H)`` at the model's weights.

    Args:
        model: a built model compiled with a negative log-likelihood
            (categorical or binary cross-entropy on logits or probabilities,
            mean squared error; ``curvature/likelihoods.py``).
        x, y: data (streamed in `batch_size` pieces).
        structure: block structure of M, ``"diagonal"`` | ``"kfac"`` |
            ``"exact"`` (module doc; ``metric=`` is a deprecated alias).
        kind: Fisher kind behind M: ``"exact"`` | ``"mc"`` | ``"empirical"``
            (``fisher=`` is a deprecated alias).
        damping: relative damping of each block of M (see
            ``sharpness/metric.py``; default 1e-3, 0 for ``"exact"``);
            ``damping=0`` is a pseudo-inverse that excludes zero-Fisher
            directions (counted in ``info["num_excluded"]``).
        num_probes, rtol, max_probes: probes for the residual (first round;
            more until ``stderr <= rtol * |S_R|`` or `max_probes`). None of
            them are drawn when the residual is exactly zero.
        min_probes: the futility stop: after this many probes, stop when
            `rtol` is projected to need more than `max_probes`
            (``info["futility"]``); ``min_probes >= max_probes`` turns
            it off. Defaults to `10`.
        num_samples: labels per example for ``kind="mc"``.
        seed: seeds label draws and probes (the same on every backend).
        split: exact GGN part plus residual (default) or probes on all of H.
        estimator: ``"hutchinson"``, ``"hutch++"`` or ``"deflated"`` for the
            probed part (as for ``hessian_trace``).
        max_params: refuse ``structure="exact"`` above this many parameters.
        rcond: pseudo-inverse cutoff relative to each block's largest
            eigenvalue (default: 0 for diagonal blocks; dimension times the
            dtype's epsilon for Kronecker blocks; for ``"exact"`` ten machine
            epsilons of the model's dtype).
        loss: loss to use instead of the compiled one. Defaults to `None`.
        verbose: 1 shows a progress bar over the probes. Defaults to `0`.
        sample_weight: ``(N,)`` or per-token weights of the loss terms
            (with the model's own mask; ``keras_geosam.curvature.weights``),
            or, for several outputs, one per output (a list in output order
            or a dict by name; each output's loss is then its own weighted
            mean). Defaults to `None`.
        max_exact_classes: above this many output classes (a language
            model's vocabulary), ``kind="exact"`` quantities sample labels
            from the model instead of one backward column per class and
            position: the metric from `exact_samples` labels per token, the
            GGN part as the mean of `exact_samples` independent draws, with
            its standard error. Defaults to `64`.
        exact_samples: labels per token above `max_exact_classes` (>= 2).
            Defaults to `8`.
        metric_draws: independent estimates to average, each with its own
            metric, sampled columns and probes (seeds ``seed``,
            ``seed + 1``, ...). A metric built from sampled labels
            (``kind="mc"``, or more than `max_exact_classes` classes) varies
            with its draw, and one draw's stderr cannot see that: with
            `metric_draws` >= 2 the value is the draws' mean and the stderr
            their spread over sqrt(draws), covering every random source.
            With 1 (default) and a sampled metric, the stderr is given the
            metric drawn: ``info["stderr_given_metric"]`` is True and
            ``format()`` ends with "(given M)". Defaults to `1`.

    Returns:
        An :class:`Estimate`; ``info`` holds the metric, damping, excluded
        parameters and the two parts with their standard errors:
        ``exact_part`` / ``exact_part_stderr`` (``tr(M^-1 GGN)``) and
        ``residual`` / ``residual_stderr`` (``tr(M^-1 (H - GGN))``), whether
        the residual was exact and whether `rtol` was reached. A residual
        larger than the GGN part, or an unmet `rtol`, gives one
        ``RuntimeWarning`` that says which, what it means and what to do
        (also in ``info["residual_warning"]``).

    Raises:
        ValueError: if `structure`, `kind` or `estimator` is unknown, `num_probes`,
            `max_probes`, `min_probes` or `metric_draws` is not an integer >= 1, `rtol` is not positive,
            `damping` is negative, the loss has no likelihood, ``structure="exact"`` exceeds `max_params`, the
            model is not built, or the data is invalid (lengths differ,
            non-finite inputs, labels that are not class ids of the model).

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, kernel_initializer="zeros")])
    >>> model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> est = kg.sharpness.riemannian_sharpness(model, x, y, structure="diagonal")
    >>> est
    Estimate(value=14.9838, stderr=0, num_samples=0, nonzero_fisher=15/15)
    >>> round(est.info["normalized"], 3)  # ~1 per parameter: the piecewise-linear caveat
    0.999
    >>> round(float(kg.sharpness.riemannian_sharpness(model, x, y, structure="kfac")), 3)
    10.985
    """
    if structure not in METRICS:
        raise ValueError(f"structure of the metric must be one of {METRICS}, got {structure!r}.")
    num_probes = check_int("num_probes", num_probes)
    check_number("rtol", rtol, 0.0, strict=True, allow_none=True)
    check_int("max_probes", max_probes)
    min_probes = check_int("min_probes", min_probes)
    check_estimator(estimator)
    check_number("damping", damping, 0.0, allow_none=True)
    metric_draws = check_int("metric_draws", metric_draws)
    if metric_draws > 1:
        return _over_draws(
            lambda s: riemannian_sharpness(
                model, x, y, structure, kind, damping, num_probes, rtol, max_probes, num_samples, s, batch_size, split,
                estimator, max_params, rcond, loss, verbose, sample_weight, max_exact_classes, exact_samples,
                min_probes=min_probes),
            seed, metric_draws)
    fns = model_functions(model, loss, training=False)
    require_likelihood(fns.spec, "riemannian_sharpness")
    _common.check_inputs(model, x, y, loss, sample_weight)
    _common.warn_if_tiny(x)
    if structure == "exact":
        return _exact(model, fns, x, y, kind, damping or 0.0, num_samples, seed, batch_size, max_params, loss, rcond, sample_weight)
    damping = DEFAULT_DAMPING if damping is None else float(damping)
    M = fisher_metric(model, x, y, structure, kind, num_samples, seed, batch_size, loss, sample_weight=sample_weight,
                      max_exact_classes=max_exact_classes, exact_samples=exact_samples)
    info = {"metric": structure, "fisher": kind, "damping": damping, "damping_relative_to": "each block's mean eigenvalue"}
    info.update(M.info if hasattr(M, "info") else {})
    info["stderr_given_metric"] = bool(info.get("metric_sampled"))
    info.update(_metric_info(M, M.inverse(damping, relative=True, rcond=rcond), damping, rcond))
    # The probes' products need the most memory, so neither M's factors nor
    # M^-1 (each about a copy of the weights) is kept for them: M^-1 is
    # rebuilt for the exact part from the cached eigendecompositions
    # (element-wise work) and freed after it, and M itself once M^-1/2 is
    # built (which holds the eigenvectors it needs).
    metric = [M]
    del M

    def M_inverse():
        return metric[0].inverse(damping, relative=True, rcond=rcond)

    def M_inverse_sqrt():  # only the probed parts need it
        S = metric[0].inverse_sqrt(damping, relative=True, rcond=rcond)
        metric.clear()
        return S

    if split:
        what = f"riemannian_sharpness (structure={structure!r}, damping={damping:g})"
        est = split_trace(model, x, y, M_inverse, M_inverse_sqrt,
                          num_probes, rtol, max_probes, estimator, seed, batch_size, loss, verbose,
                          sample_weight, max_exact_classes, exact_samples, what, min_probes)
    else:
        S = M_inverse_sqrt()
        op = S @ Hessian(model, x, y, loss=loss, batch_size=batch_size, sample_weight=sample_weight) @ S
        est = stochastic_trace(op, estimator, num_probes, rtol, max_probes, seed, 0.0, fns.paths, verbose, min_probes)
        est.info.update(_common.data_info(x, batch_size), split=False)
    est.info.update(info)
    est.info["inverse"] = "pseudo-inverse (zero-Fisher directions excluded)" if damping == 0 else "damped inverse"
    # Per parameter with nonzero Fisher: 1 for the undamped diagonal S_R of
    # a piecewise-linear net (the degeneracy), whatever the damping asked.
    est.info["normalized"] = est.value / max(info["num_nonzero_fisher"], 1)
    pl = is_piecewise_linear(model, link=fns.spec.likelihood.link)
    est.info["piecewise_linear"] = pl
    if pl and structure == "diagonal" and damping == 0 and kind == "exact":
        warn_at_caller(
            f"{model.name} is piecewise linear in each parameter (ReLU-type "
            f"activations, no normalisation), so diag H equals the exact "
            f"Fisher diagonal and the undamped diagonal S_R equals the number "
            f"of parameters with nonzero Fisher ({info['num_nonzero_fisher']} of "
            f"{info['num_params']}), whatever the minimum. Compare "
            f"info['normalized'], use damping>0, structure='kfac' or "
            f"structure='exact' for an informative value.",
            UserWarning,
        )
    return est


def _over_draws(estimate, seed, draws):
    """The mean of `draws` independent estimates (seeds ``seed + i``), with
    their spread as the stderr: every random source (the metric's labels,
    sampled columns, probes) is in it. ``info`` is the first draw's, with
    each part averaged and its stderr from the parts' spread."""
    runs = [estimate(seed + i) for i in range(draws)]
    values = np.array([r.value for r in runs])
    sqrt_n = np.sqrt(draws)
    info = dict(runs[0].info)
    for part in ("exact_part", "residual"):
        if part in info:
            parts = np.array([r.info[part] for r in runs])
            info[part], info[f"{part}_stderr"] = float(parts.mean()), float(parts.std(ddof=1) / sqrt_n)
    if "rtol_reached" in info:
        info["rtol_reached"] = all(r.info["rtol_reached"] for r in runs)
    info.update(metric_draws=draws, draw_values=values.tolist(), draw_stderrs=[r.stderr for r in runs],
                stderr_given_metric=False, stderr_covers="the spread of independent draws (metric, columns, probes)")
    value = float(values.mean())
    info["normalized"] = value / max(info.get("num_nonzero_fisher", 0), 1)
    per_layer = {k: float(np.mean([r.per_layer[k] for r in runs])) for k in runs[0].per_layer}
    return Estimate(value=value, stderr=float(values.std(ddof=1) / sqrt_n), num_samples=sum(r.num_samples for r in runs),
                    per_layer=per_layer, samples=values, info=info)


def _exact(model, fns, x, y, kind, damping, num_samples, seed, batch_size, max_params, loss, rcond, sample_weight=None):
    shapes = [tuple(v.shape) for v in fns.variables]
    dim = sum(int(np.prod(s)) for s in shapes)
    if dim > max_params:
        raise ValueError(
            f'structure="exact" materialises {dim}x{dim} matrices; the model has '
            f"{dim} parameters > max_params={max_params}. Use structure='diagonal' "
            f"or 'kfac', or raise max_params."
        )
    G = GGN(model, x, y, kind=kind, num_samples=num_samples, seed=seed, loss=loss, batch_size=batch_size,
            sample_weight=sample_weight).to_dense(max_dim=max_params)
    G = (G + G.T) / 2
    H = Hessian(model, x, y, loss=loss, batch_size=batch_size, sample_weight=sample_weight).to_dense(max_dim=max_params)
    H = (H + H.T) / 2
    evals, evecs = symmetric_eigh(np.asarray(G, "float64"), "the dense Fisher metric")
    lam = damping * max(float(np.mean(np.clip(evals, 0, None))), 0.0)
    shifted = evals + lam
    # Relative cutoff at the precision the gradients were computed in: below
    # it an eigenvalue of G is rounding noise, and inverting it is meaningless.
    if rcond is None:
        rcond = max(dim * float(np.finfo("float64").eps), 10 * float(np.finfo(fns.variables[0].dtype).eps))
    tol = max(shifted.max(), 0.0) * rcond
    keep = shifted > tol
    inv = np.where(keep, 1.0 / np.where(keep, shifted, 1.0), 0.0)
    Ginv = (evecs * inv) @ evecs.T
    Mat = Ginv @ H
    value = float(np.trace(Mat))
    sizes = np.cumsum([0] + [int(np.prod(s)) for s in shapes])
    per_layer = {p: float(np.trace(Mat[a:b, a:b])) for p, a, b in zip(fns.paths, sizes[:-1], sizes[1:])}
    info = _common.data_info(x, batch_size)
    info.update(
        metric="exact",
        fisher=kind,
        num_params=dim,
        fisher_rank=int(keep.sum()),
        damping=damping,
        damping_abs=lam,
        rcond=rcond,
        inverse=("pseudo-inverse (eigenvalues below rcond * max dropped)" if lam == 0 else "damped inverse"),
        stderr_given_metric=kind == "mc",
    )
    return Estimate(value=value, stderr=0.0, num_samples=info["num_examples"], per_layer=per_layer, info=info)
