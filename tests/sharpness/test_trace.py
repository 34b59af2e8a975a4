"""The probed sharpness measures pass `min_probes` (the futility stop) to
their estimator: on by default after 10 probes, off with ``min_probes >=
max_probes``, and then equal bit for bit to the measure run to `max_probes`.
The logger passes it on, and flags a stderr given a sampled metric."""

import math
import warnings

import keras
import numpy as np
import pytest

import keras_geosam as kg


def _tanh_net():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(3)])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    return model, rng.normal(size=(24, 5)).astype("float32"), rng.integers(0, 3, size=24)


# rtol 1e-6 on a tanh net's residual: projected far beyond 24 probes
_MEASURES = {
    "hessian_trace": lambda m, x, y, **k: kg.sharpness.hessian_trace(m, x, y, **k),
    "riemannian_kfac": lambda m, x, y, **k: kg.sharpness.riemannian_sharpness(m, x, y, structure="kfac", **k),
    "riemannian_diagonal": lambda m, x, y, **k: kg.sharpness.riemannian_sharpness(m, x, y, **k),
}


@pytest.mark.parametrize("measure", sorted(_MEASURES))
def test_min_probes_reaches_the_futility_stop(measure):
    model, x, y = _tanh_net()
    fn = _MEASURES[measure]
    common = dict(num_probes=4, rtol=1e-6, max_probes=24, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stopped = fn(model, x, y, min_probes=4, **common)
        default = fn(model, x, y, **common)
        off = fn(model, x, y, min_probes=24, **common)
    assert stopped.info["futility"]["probes"] == 4 and stopped.num_samples == 4
    assert stopped.info["futility"]["projected"] > 24
    assert default.info["futility"]["probes"] == 12  # the first round past 10 probes
    assert "futility" not in off.info and off.num_samples == 24
    # the stop only cuts the probe sequence: its first probes are the full run's
    np.testing.assert_array_equal(np.asarray(stopped.samples), np.asarray(off.samples)[:4])
    with pytest.raises(ValueError, match="min_probes"):
        fn(model, x, y, min_probes=0)


def test_the_logger_passes_min_probes_and_flags_a_stderr_given_a_sampled_metric():
    model, x, y = _tanh_net()
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match="min_probes"):
        kg.callbacks.SharpnessLogger(x, y, min_probes=0)
    logger = kg.callbacks.SharpnessLogger(
        x, y, metrics=("hessian_trace", "riemannian_sharpness", "riemannian_sharpness_kfac"), every_n_epochs=2,
        num_probes=4, rtol=1e-6, max_probes=24, min_probes=24, seed=3,
        options={"riemannian_sharpness_kfac": {"kind": "mc"}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h = model.fit(x, y, epochs=2, verbose=0, callbacks=[logger]).history
        direct = kg.sharpness.hessian_trace(model, x, y, num_probes=4, rtol=1e-6, max_probes=24, min_probes=24, seed=3)
    assert h["hessian_trace"][1] == float(direct.value)  # 24 probes, no futility stop
    # one draw of an mc metric: the column says its stderr is given the metric; NaN on the skipped epoch
    flag = h["riemannian_sharpness_kfac_stderr_given_metric"]
    assert math.isnan(flag[0]) and flag[1] == 1.0
    assert "riemannian_sharpness_stderr_given_metric" not in h  # the exact Fisher: nothing sampled


def test_the_flag_column_follows_the_measure_s_own_flag():
    """A vocabulary above max_exact_classes samples the exact Fisher too;
    the dense structure never does unless asked (kind="mc")."""
    model, x, y = _tanh_net()
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    logger = kg.callbacks.SharpnessLogger(
        x, y, metrics=("riemannian_sharpness", "riemannian_sharpness_exact", "riemannian_sharpness_kfac"),
        budget=None, num_probes=4, rtol=None, seed=3,
        options={"riemannian_sharpness": {"max_exact_classes": 2}, "riemannian_sharpness_kfac": {"metric_draws": 2},
                 "riemannian_sharpness_exact": {"fisher": "mc"}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h = model.fit(x, y, epochs=1, verbose=0, callbacks=[logger]).history
        direct = kg.sharpness.riemannian_sharpness(model, x, y, num_probes=4, rtol=None, seed=3, max_exact_classes=2)
    assert direct.info["stderr_given_metric"]
    assert h["riemannian_sharpness_stderr_given_metric"] == [1.0]
    assert h["riemannian_sharpness_exact_stderr_given_metric"] == [1.0]
    assert "riemannian_sharpness_kfac_stderr_given_metric" not in h  # two draws: the spread covers the metric
    # called by hand, outside fit: the same columns
    alone = kg.callbacks.SharpnessLogger(x, y, metrics="riemannian_sharpness", num_probes=4, rtol=None, seed=3,
                                         options={"riemannian_sharpness": {"kind": "mc"}})
    alone.set_model(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert alone.compute()["riemannian_sharpness_stderr_given_metric"] == 1.0


@pytest.mark.parametrize("structure,kind,max_exact_classes,draws", [
    ("diagonal", "exact", 64, 1), ("diagonal", "exact", 2, 1), ("kfac", "mc", 64, 1), ("kfac", "mc", 64, 2),
    ("exact", "mc", 64, 1), ("exact", "exact", 2, 1), ("diagonal", "empirical", 2, 1)])
def test_the_flag_is_predicted_from_the_arguments(structure, kind, max_exact_classes, draws):
    """The logger decides its column before the first log from the
    arguments alone; the estimate's own flag must agree."""
    from keras_geosam.sharpness.riemannian import stderr_given_metric

    model, x, y = _tanh_net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = kg.sharpness.riemannian_sharpness(model, x, y, structure=structure, kind=kind, num_probes=4, rtol=None,
                                                max_exact_classes=max_exact_classes, metric_draws=draws, seed=3)
    assert stderr_given_metric(structure, kind, 3, max_exact_classes, draws) == est.info["stderr_given_metric"]


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("structure", ["kfac", "diagonal"])
def test_the_metric_and_its_inverse_are_freed_before_the_probes(monkeypatch, split, structure):
    # The probes' products need the most memory: riemannian_sharpness must
    # not hold M (its factors) or M^-1 (a copy of the weights' size) while
    # they run. Checked by weak references, freed by reference counting.
    import weakref

    from keras_geosam.curvature.operators import BlockDiagonal
    from keras_geosam.sharpness import riemannian
    from keras_geosam.sharpness import trace

    refs, alive_at_probes = [], []
    build, invert = riemannian.fisher_metric, BlockDiagonal.inverse

    def fisher_metric(*args, **kwargs):
        M = build(*args, **kwargs)
        refs.append(weakref.ref(M))
        return M

    def inverse(self, *args, **kwargs):
        out = invert(self, *args, **kwargs)
        refs.append(weakref.ref(out))
        return out

    def probed(estimate):
        def run(*args, **kwargs):
            alive_at_probes.append(sum(r() is not None for r in refs))
            return estimate(*args, **kwargs)
        return run

    monkeypatch.setattr(riemannian, "fisher_metric", fisher_metric)
    monkeypatch.setattr(BlockDiagonal, "inverse", inverse)
    monkeypatch.setattr(riemannian, "stochastic_trace", probed(riemannian.stochastic_trace))
    monkeypatch.setattr(trace, "stochastic_trace", probed(trace.stochastic_trace))
    model, x, y = _tanh_net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = kg.sharpness.riemannian_sharpness(model, x, y, structure=structure, split=split, num_probes=2, rtol=None)
    assert np.isfinite(est.value)
    # M, the inverse for the counts, the pseudo-inverse (undamped counts),
    # and with split the inverse rebuilt for the exact part.
    assert len(refs) >= (3 if split else 2)
    assert alive_at_probes == [0]
