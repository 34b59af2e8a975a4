"""Traces of the Hessian, plain or under a metric, split into an exact part
and a residual.

For softmax cross-entropy, ``H = GGN + (H - GGN)``. The first part is exact
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

from keras_geosam.curvature.functional import model_functions
from keras_geosam.curvature.functional import progbar
from keras_geosam.curvature.operators import GGN
from keras_geosam.curvature.operators import GGNResidual
from keras_geosam.curvature.operators import Hessian
from keras_geosam.estimators import Estimate
from keras_geosam.estimators import hutchinson
from keras_geosam.estimators import hutchpp
from keras_geosam.sharpness import _common
from keras_geosam.sharpness.linearity import is_layerwise_linear

ESTIMATORS = ("hutchinson", "hutch++")


def _has_regularization(fns, x):
    """Whether the loss carries regularisation terms (their Hessian belongs
    to H - GGN and is not zero on layer blocks): one forward on one example."""
    if not fns.include_regularization:
        return False
    first = x[:1] if not isinstance(x, (list, tuple)) else type(x)(e[:1] for e in x)
    return bool(fns.outputs(fns.params(), fns.non_trainable(), first)[1])


def check_estimator(estimator):
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}.")


def stochastic_trace(op, estimator, num_probes, rtol, max_probes, seed, shift, paths, verbose):
    """Trace of `op` by the chosen estimator (Hutch++ uses ``3 * num_probes``
    products and no rtol)."""
    if estimator == "hutch++":
        return hutchpp(op, num_matvecs=3 * max(num_probes, 2), seed=seed, shift=shift, paths=paths)
    bar = progbar(max_probes if rtol is not None else num_probes, verbose, "probe")
    return hutchinson(op, num_probes, rtol, max_probes, seed, shift=shift, paths=paths, bar=bar)


def split_trace(model, x, y, inverse=None, inverse_sqrt=None, num_probes=20, rtol=0.05, max_probes=100,
                estimator="hutchinson", seed=0, batch_size=_common.DEFAULT_BATCH_SIZE, loss=None, verbose=0):
    """``tr(M^-1 H) = tr(M^-1 GGN)`` (exact) ``+ tr(M^-1 (H - GGN))`` (probes).

    `inverse` is ``M^-1`` (None: the identity, giving ``tr H``) and
    `inverse_sqrt` ``M^-1/2`` or a function returning it (called only when
    the residual needs probes), used for the symmetric probe form
    ``z^T M^-1/2 (H - GGN) M^-1/2 z``. Returns an :class:`Estimate` whose
    ``info`` says which parts were exact.
    """
    fns = model_functions(model, loss, training=False)
    exact, parts = GGN(model, x, kind="exact", loss=loss, batch_size=batch_size).trace_with(inverse)
    per_layer = dict(zip(fns.paths, parts))
    info = _common.data_info(x, batch_size)
    info.update(split=True, exact_part=exact)
    if is_layerwise_linear(model) and not _has_regularization(fns, x):
        info.update(
            residual=0.0, residual_stderr=0.0, residual_exact=True,
            parts="tr(M^-1 GGN) exact; residual tr(M^-1 (H - GGN)) = 0 exactly (layerwise-linear network)",
        )
        return Estimate(value=exact, stderr=0.0, num_samples=0, per_layer=per_layer, info=info)
    op = GGNResidual(model, x, y, loss=loss, batch_size=batch_size)
    if callable(inverse_sqrt):
        inverse_sqrt = inverse_sqrt()
    if inverse_sqrt is not None:
        op = inverse_sqrt @ op @ inverse_sqrt
    est = stochastic_trace(op, estimator, num_probes, rtol, max_probes, seed, exact, fns.paths, verbose)
    info.update(est.info)
    info.update(
        residual=est.value - exact, residual_stderr=est.stderr, residual_exact=False,
        parts=f"tr(M^-1 GGN) exact; residual tr(M^-1 (H - GGN)) by {info['estimator']}",
    )
    est.info = info
    est.per_layer = {p: per_layer[p] + est.per_layer.get(p, 0.0) for p in fns.paths}
    return est


def hessian_trace(model, x, y, num_probes=20, rtol=0.05, max_probes=100, split=None, estimator="hutchinson",
                  seed=0, batch_size=_common.DEFAULT_BATCH_SIZE, loss=None, verbose=0):
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
        split: see above; True needs a cross-entropy classifier. Defaults
            to `None` (True for classifiers).
        estimator: ``"hutchinson"`` or ``"hutch++"``.
        seed: probe seed (identical probes on every backend).
        batch_size: examples per streamed batch. Defaults to `256`.
        loss: loss to use instead of the compiled one. Defaults to `None`.
        verbose: 1 shows a progress bar over the probes. Defaults to `0`.

    Returns:
        An :class:`Estimate`: ``per_layer`` the trace of each variable's
        diagonal block; ``samples`` the probe values; ``info["exact_part"]``
        and ``info["residual"]`` when split.

    Raises:
        ValueError: if `num_probes` or `max_probes` is not an integer >= 1,
            `rtol` is not positive, `estimator` is unknown, ``split=True``
            meets a loss that is not a cross-entropy, the model is not
            built, or the data is invalid (lengths differ, non-finite
            inputs, labels that are not class ids of the model).

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
    num_probes = _common.check_positive_int("num_probes", num_probes)
    _common.check_rtol(rtol, max_probes)
    check_estimator(estimator)
    fns = model_functions(model, loss, training=False)
    if split is None:
        split = fns.spec.classifier
    _common.warn_if_tiny(x)
    if split:
        return split_trace(model, x, y, None, None, num_probes, rtol, max_probes, estimator, seed, batch_size, loss, verbose)
    op = Hessian(model, x, y, loss=loss, batch_size=batch_size)
    est = stochastic_trace(op, estimator, num_probes, rtol, max_probes, seed, 0.0, fns.paths, verbose)
    est.info.update(_common.data_info(x, batch_size), split=False)
    return est
