"""Traces of the Hessian, plain or under a metric, split into an exact part
and a residual.

For a loss with a likelihood (cross-entropy, binary cross-entropy, mean
squared error), ``H = GGN + (H - GGN)``. The first part is exact
and probe-free (``GGN.trace_with``: per-example gradients from layer inputs
and output gradients); only the second needs Hutchinson probes, on products
with ``H - GGN`` (``GGNResidual``, one linearisation per batch for all
probes). For a layerwise-linear network (``linearity.py``) every per-layer
block of ``H - GGN`` vanishes, so for any metric that is block-diagonal per
layer the residual's trace is exactly zero and the result has no variance.
Elsewhere (smooth activations) the residual is small near minima, and
``rtol`` draws probes until its standard error is small relative to the
total.
"""

import warnings

import numpy as np

from keras_geosam._checks import check_int
from keras_geosam._checks import check_number
from keras_geosam._checks import warn_at_caller
from keras_geosam.curvature.functional import model_functions
from keras_geosam.curvature import weights
from keras_geosam.curvature.functional import progbar
from keras_geosam.curvature.operators import GGN
from keras_geosam.curvature.operators import GGNResidual
from keras_geosam.curvature.operators import Hessian
from keras_geosam.curvature.operators.model import MAX_EXACT_CLASSES
from keras_geosam.estimators import Estimate
from keras_geosam.estimators import deflated_hutchinson
from keras_geosam.estimators import hutchinson
from keras_geosam.estimators import hutchpp
from keras_geosam.sharpness import _common
from keras_geosam.sharpness.linearity import is_layerwise_linear
from keras_geosam.curvature.finite import require_finite

ESTIMATORS = ("hutchinson", "hutch++", "deflated")


def _has_regularization(fns, x):
    """Whether the loss carries regularisation terms (their Hessian belongs
    to H - GGN and is not zero on layer blocks): one forward on one example."""
    return fns.include_regularization and weights.first_example(fns, x)[2]


def check_estimator(estimator):
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}.")


def stochastic_trace(op, estimator, num_probes, rtol, max_probes, seed, shift, paths, verbose, min_probes=10):
    """Trace of `op` by the chosen estimator (Hutch++ uses ``3 * num_probes``
    products and no rtol; ``"deflated"`` is Hutchinson until its first round
    misses `rtol`, then a sketched subspace exactly and the rest by probes,
    within `max_probes` products; both stop early, after `min_probes`, when
    `rtol` is projected beyond `max_probes`)."""
    if estimator == "hutch++":
        return hutchpp(op, num_matvecs=3 * max(num_probes, 2), seed=seed, shift=shift, paths=paths)
    bar = progbar(max_probes if rtol is not None else num_probes, verbose, "probe")
    if estimator == "deflated":
        return deflated_hutchinson(op, num_probes, rtol, max_probes, seed, shift=shift, paths=paths, bar=bar,
                                   min_probes=min_probes)
    return hutchinson(op, num_probes, rtol, max_probes, seed, shift=shift, paths=paths, bar=bar, min_probes=min_probes)


def split_trace(model, x, y, inverse=None, inverse_sqrt=None, num_probes=20, rtol=0.05, max_probes=100,
                estimator="hutchinson", seed=0, batch_size=_common.DEFAULT_BATCH_SIZE, loss=None, verbose=0,
                sample_weight=None, max_exact_classes=MAX_EXACT_CLASSES, exact_samples=8, what="tr H", min_probes=10):
    """``tr(M^-1 H) = tr(M^-1 GGN)`` (exact) ``+ tr(M^-1 (H - GGN))`` (probes).

    `inverse` is ``M^-1`` or a function returning it (None: the identity,
    giving ``tr H``), released once the exact part is computed, and
    `inverse_sqrt` ``M^-1/2`` or a function returning it (called only when
    the residual needs probes), used for the symmetric probe form
    ``z^T M^-1/2 (H - GGN) M^-1/2 z``. Above `max_exact_classes` output
    classes the GGN part is sampled (``GGN.trace_estimate``) with
    `exact_samples` draws. Returns an :class:`Estimate` whose ``info``
    holds both parts with their standard errors (``exact_part``,
    ``exact_part_stderr``, ``residual``, ``residual_stderr``), whether the
    residual was exact, and ``rtol_reached``; its ``stderr`` combines both.
    A residual larger than the GGN part, or an unmet `rtol`, gives one
    warning that says which (``residual_warning``); `what` names the
    quantity in it.
    """
    fns = model_functions(model, loss, training=False)
    G = GGN(model, x, y, kind="exact", loss=loss, batch_size=batch_size, sample_weight=sample_weight)
    exact, exact_se, parts, ginfo = G.trace_estimate(inverse() if callable(inverse) else inverse, max_exact_classes,
                                                     exact_samples, seed)
    # Built from a function, M^-1 (a copy of the weights' size) is freed
    # here, before the probes' products need their memory.
    inverse = None
    require_finite(exact, model, x, f"{what} (its GGN part)", batch_size)
    per_layer = dict(zip(fns.paths, parts))
    info = _common.data_info(x, batch_size)
    info.update(split=True, exact_part=exact, exact_part_stderr=exact_se, **ginfo)
    if G.weighted:
        info["total_weight"] = G.total_weight
    if is_layerwise_linear(model, link=fns.spec.likelihood.link) and not _has_regularization(fns, x):
        info.update(
            residual=0.0, residual_stderr=0.0, residual_exact=True, rtol_reached=True,
            parts="tr(M^-1 GGN) exact; residual tr(M^-1 (H - GGN)) = 0 exactly (layerwise-linear network)",
        )
        return Estimate(value=exact, stderr=exact_se, num_samples=0, per_layer=per_layer, info=info)
    op = GGNResidual(model, x, y, loss=loss, batch_size=batch_size, sample_weight=sample_weight)
    if callable(inverse_sqrt):
        inverse_sqrt = inverse_sqrt()
    if inverse_sqrt is not None:
        op = inverse_sqrt @ op @ inverse_sqrt
    with warnings.catch_warnings():
        # An unmet rtol is reported below, with the parts that explain it.
        warnings.filterwarnings("ignore", message="Hutchinson: relative standard error", category=RuntimeWarning)
        est = stochastic_trace(op, estimator, num_probes, rtol, max_probes, seed, exact, fns.paths, verbose, min_probes)
    require_finite(est.value, model, x, f"{what} (its residual)", batch_size)
    info.update(est.info)
    residual, residual_se = est.value - exact, est.stderr
    stderr = float(np.hypot(residual_se, exact_se))
    reached = rtol is None or estimator == "hutch++" or stderr <= rtol * abs(est.value)
    info.update(
        residual=residual, residual_stderr=residual_se, residual_exact=False, rtol_reached=bool(reached),
        parts=f"tr(M^-1 GGN) {'sampled' if ginfo['exact_part_sampled'] else 'exact'}; "
              f"residual tr(M^-1 (H - GGN)) by {info['estimator']}",
    )
    est.info = info
    est.stderr = stderr
    est.per_layer = {p: per_layer[p] + est.per_layer.get(p, 0.0) for p in fns.paths}
    message = residual_diagnosis(est, what, rtol, max_probes)
    if message:
        info["residual_warning"] = message
        # An unmet rtol stays a RuntimeWarning, as Hutchinson's own; a
        # resolved residual that outweighs the GGN part is a UserWarning.
        warn_at_caller(message, RuntimeWarning if not info["rtol_reached"] else UserWarning)
    return est


def residual_diagnosis(est, what, rtol, max_probes):
    """The words of the one warning a split estimate gets when its residual
    outweighs its GGN part or its `rtol` was not reached; "" otherwise."""
    info = est.info
    exact, residual = info["exact_part"], info["residual"]
    big = abs(residual) > abs(exact)
    missed = not info["rtol_reached"]
    if not (big or missed):
        return ""
    riemannian = what != "tr H"
    said = []
    if big:
        said.append(
            f"the residual {residual:.4g} ± {info['residual_stderr']:.2g} outweighs the GGN part "
            f"{exact:.4g} ± {info['exact_part_stderr']:.2g}"
        )
    if missed:
        said.append(
            f"the relative standard error {abs(est.stderr) / max(abs(est.value), 1e-300):.3g} stays above "
            f"rtol={rtol} after {est.num_samples} probes (max_probes={max_probes})"
            + (f", where it stopped: reaching rtol would take about {info['futility']['projected']:.3g} probes"
               if "futility" in info else "")
        )
    if riemannian:
        meaning = (
            "H - GGN has curvature, often negative, in directions the Fisher metric barely sees, and M^-1 "
            "magnifies it there: the value is set by those few directions, not by the Fisher-weighted sharpness"
        )
        advice = (
            "measure nearer convergence (the residual vanishes at a minimum), use more damping (damping=...), "
            "or read the GGN part (info['exact_part'], SharpnessLogger's '_ggn' key)"
        )
    else:
        meaning = "the Hessian's second-order term (H - GGN) dominates: the model is far from a minimum"
        advice = "measure nearer convergence, draw more probes (max_probes=...), or read the GGN part (info['exact_part'])"
    return f"{what}: " + " and ".join(said) + f". This means {meaning}. What to do: {advice}."


def hessian_trace(model, x, y, num_probes=20, rtol=0.05, max_probes=100, split=None, estimator="hutchinson",
                  seed=0, batch_size=_common.DEFAULT_BATCH_SIZE, loss=None, verbose=0, sample_weight=None,
                  max_exact_classes=MAX_EXACT_CLASSES, exact_samples=8, min_probes=10):
    """Trace of the Hessian of the mean loss.

    With ``split`` (default for classifiers): ``tr GGN`` exactly plus the
    residual ``tr(H - GGN)`` by probes (exactly zero for layerwise-linear
    networks). Without it: Hutchinson on H itself.

    Args:
        model, x, y: a built model and data (streamed in `batch_size` pieces).
        num_probes: Rademacher probes in the first round (all of them when
            ``rtol=None``).
        rtol: keep drawing rounds of probes until ``stderr <= rtol * |value|``
            or `max_probes` (a RuntimeWarning if not reached).
        max_probes: the cap on probes when `rtol` is set. Defaults to `100`.
        min_probes: the futility stop (``kg.estimators.hutchinson``): after
            this many probes, stop when `rtol` is projected to need more
            than `max_probes` (``info["futility"]``); ``min_probes >=
            max_probes`` turns it off. Defaults to `10`.
        split: see above; True needs a loss with a likelihood
            (cross-entropy, binary cross-entropy, mean squared error).
            Defaults to `None` (True for those losses).
        estimator: ``"hutchinson"``, ``"hutch++"`` or ``"deflated"``
            (``kg.estimators.deflated_hutchinson``: Hutchinson until its first
            round misses `rtol`, then a sketched subspace exactly).
        seed: probe seed (identical probes on every backend).
        batch_size: examples per streamed batch. Defaults to `256`.
        loss: loss to use instead of the compiled one. Defaults to `None`.
        verbose: 1 shows a progress bar over the probes. Defaults to `0`.
        sample_weight: ``(N,)`` or per-token weights of the loss terms
            (with the model's own mask; ``keras_geosam.curvature.weights``),
            or, for several outputs, one per output (a list in output order
            or a dict by name; each output's loss is then its own weighted
            mean). Defaults to `None`.
        max_exact_classes: above this many output classes the GGN part is
            estimated from `exact_samples` sampled labels per token instead
            of one backward column per class (``GGN.trace_estimate``).
            Defaults to `64`.
        exact_samples: draws for a sampled GGN part (>= 2). Defaults to
            `8`.

    Returns:
        An :class:`Estimate`: ``per_layer`` the trace of each variable's
        diagonal block; ``samples`` the probe values; when split,
        ``info["exact_part"]`` / ``info["exact_part_stderr"]`` and
        ``info["residual"]`` / ``info["residual_stderr"]``.

    Raises:
        ValueError: if `num_probes`, `max_probes` or `min_probes` is not an
            integer >= 1, `rtol` is not positive, `estimator` is unknown, ``split=True``
            meets a loss that is not a cross-entropy, the model is not
            built, or the data is invalid (not arrays, lengths or sequence
            lengths differ, non-finite inputs, labels that are not class ids
            of the model, weights of the wrong shape).

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, kernel_initializer="zeros")])
    >>> model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> est = kg.sharpness.hessian_trace(model, x, y)
    >>> est  # a linear softmax model: tr H = tr GGN, computed exactly
    Estimate(value=2.4291, stderr=0, num_samples=0)
    >>> round(sum(est.per_layer.values()), 4), est.info["residual_exact"]
    (2.4291, True)
    """
    num_probes = check_int("num_probes", num_probes)
    check_number("rtol", rtol, 0.0, strict=True, allow_none=True)
    check_int("max_probes", max_probes)
    min_probes = check_int("min_probes", min_probes)
    check_estimator(estimator)
    fns = _common.check_inputs(model, x, y, loss, sample_weight)
    if split is None:
        split = fns.spec.likelihood is not None
    _common.warn_if_tiny(x)
    if split:
        return split_trace(model, x, y, None, None, num_probes, rtol, max_probes, estimator, seed, batch_size, loss, verbose,
                           sample_weight, max_exact_classes, exact_samples, "tr H", min_probes)
    op = Hessian(model, x, y, loss=loss, batch_size=batch_size, sample_weight=sample_weight)
    est = stochastic_trace(op, estimator, num_probes, rtol, max_probes, seed, 0.0, fns.paths, verbose, min_probes)
    require_finite(est.value, model, x, "tr H", batch_size)
    est.info.update(_common.data_info(x, batch_size), split=False)
    return est
