"""One argument-validation style: every public function and constructor
refuses a bad value with a ValueError naming the argument and the value,
and never truncates a float to an integer."""

import math

import keras
import numpy as np
import pytest

import keras_geosam as kg
from keras_geosam._checks import check_choice, check_int, check_number


@pytest.mark.parametrize("bad", [1.5, 2.0, True, "3", None, 0, -1])
def test_check_int_refuses_non_integers_and_small_values(bad):
    with pytest.raises(ValueError, match=r"k must be an integer >= 1, got "):
        check_int("k", bad)


def test_check_int_takes_python_and_numpy_integers_and_none_when_allowed():
    assert check_int("k", np.int64(3)) == 3 and type(check_int("k", np.int32(3))) is int
    assert check_int("k", 0, 0) == 0
    assert check_int("k", None, allow_none=True) is None


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, True, "abc", [1.0], -0.5])
def test_check_number_refuses_non_finite_non_numbers_and_out_of_range(bad):
    with pytest.raises(ValueError, match=r"^rho must be"):
        check_number("rho", bad)


def test_check_number_bounds_and_none():
    assert check_number("rho", np.float32(0.5)) == 0.5 and check_number("rho", "0.1") == 0.1
    with pytest.raises(ValueError, match="> 0"):
        check_number("eta", 0.0, strict=True)
    with pytest.raises(ValueError, match="< 1"):
        check_number("momentum", 1.0, below=1)
    assert check_number("rtol", None, allow_none=True) is None
    with pytest.raises(ValueError, match="rtol must be a number, got None"):
        check_number("rtol", None)
    assert check_choice("kind", "mc", ("exact", "mc")) == "mc"
    with pytest.raises(ValueError, match=r"kind must be one of \('exact', 'mc'\), got 'x'"):
        check_choice("kind", "x", ("exact", "mc"))


def _model_and_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 4)).astype("float32")
    y = rng.integers(0, 3, size=8)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, x, y


def test_public_entry_points_refuse_fractional_counts_and_bad_tolerances():
    model, x, y = _model_and_data()
    v = [np.ones(w.shape, "float32") for w in model.trainable_weights]
    with pytest.raises(ValueError, match="num_samples must be an integer >= 1, got 1.5"):
        kg.curvature.sample_labels(np.full((2, 3), 1 / 3), num_samples=1.5, seed=0)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got 2.5"):
        kg.curvature.hvp(model, x, y, v, batch_size=2.5)
    with pytest.raises(ValueError, match="rtol must be"):
        kg.sharpness.hessian_trace(model, x, y, rtol=math.inf)
    with pytest.raises(ValueError, match="rtol must be"):
        kg.sharpness.riemannian_sharpness(model, x, y, rtol="tight")
    with pytest.raises(ValueError, match="tol must be"):
        kg.sharpness.hessian_max_eigenvalue(model, x, y, tol=math.nan)
    with pytest.raises(ValueError, match="damping must be"):
        kg.sharpness.riemannian_max_eigenvalue(model, x, y, damping=-1.0)
    with pytest.raises(ValueError, match="max_probes must be an integer >= 1, got 10.0"):
        kg.callbacks.SharpnessLogger(x, y, max_probes=10.0)
    with pytest.raises(ValueError, match="n_resamples must be an integer >= 1, got 2.5"):
        kg.study.stats.bootstrap_interval(lambda a: 0.0, [1.0, 2.0, 3.0], n_resamples=2.5)


def test_optimizer_constructors_refuse_bad_hyperparameters():
    for make, arg in [
        (lambda: kg.optimizers.SAM(keras.optimizers.SGD(), rho=math.nan), "rho"),
        (lambda: kg.optimizers.SAM(keras.optimizers.SGD(), rho=True), "rho"),
        (lambda: kg.optimizers.LLQRSAM(keras.optimizers.SGD(), sam_start_step=1.0), "sam_start_step"),
        (lambda: kg.callbacks.PreconditionerRefresh(np.zeros((4, 2)), np.zeros(4), batch_size=2.0), "batch_size"),
    ]:
        with pytest.raises(ValueError, match=arg):
            make()


def test_renamed_keywords_one_name_each_old_names_still_work():
    """One keyword per idea: ``structure=`` for the block family (as LLQR's
    U), ``kind=`` for the Fisher kind (as ``fisher_diagonal``); the old
    ``metric=`` / ``fisher=`` give the same number with a
    DeprecationWarning, and passing both names is a TypeError."""
    model, x, y = _model_and_data()
    S = kg.sharpness
    new = S.riemannian_sharpness(model, x, y, structure="kfac", kind="mc", num_probes=2, rtol=None)
    with pytest.warns(DeprecationWarning, match=r"metric=\.\.\.\) is deprecated; use structure="):
        old = S.riemannian_sharpness(model, x, y, metric="kfac", fisher="mc", num_probes=2, rtol=None)
    assert (old.value, old.stderr) == (new.value, new.stderr) and old.info["metric"] == "kfac"
    with pytest.warns(DeprecationWarning, match="fisher="):
        old = S.riemannian_max_eigenvalue(model, x, y, metric="kfac", fisher="empirical", max_iter=3)
    assert old.value == S.riemannian_max_eigenvalue(model, x, y, structure="kfac", kind="empirical", max_iter=3).value
    with pytest.warns(DeprecationWarning, match="fisher="):
        old = S.fisher_metric(model, x, y, structure="kfac", fisher="empirical")
    assert old.info == S.fisher_metric(model, x, y, structure="kfac", kind="empirical").info == {"metric_fisher": "empirical", "metric_sampled": False}
    with pytest.warns(DeprecationWarning, match="fisher="):
        old = S.gradient_noise_alignment(model, x, y, 4, num_batches=3, fisher="empirical")
    assert old.fisher == "empirical" and old.alpha == S.gradient_noise_alignment(model, x, y, 4, num_batches=3, kind="empirical").alpha
    with pytest.raises(TypeError, match="got both 'structure' and its deprecated alias 'metric'"):
        S.riemannian_sharpness(model, x, y, structure="kfac", metric="kfac")
    with pytest.raises(ValueError, match=r"structure of the metric must be one of .*got 'full'"):
        S.riemannian_sharpness(model, x, y, structure="full")
    # the signature readers see is the new one
    import inspect
    params = inspect.signature(S.riemannian_sharpness).parameters
    assert "structure" in params and "kind" in params and "metric" not in params
