"""The estimators under a mixed dtype policy: layers compute in float16 /
bfloat16, the weights stay float32, and every curvature statistic (K-FAC
factors, Fisher diagonals, traces) is accumulated in float32. Checked
against the same model and weights under float32."""

import keras
import numpy as np
import pytest

import keras_geosam as kg

# bfloat16 keeps 8 bits of mantissa: the activations' rounding alone moves
# these sums by up to a few percent.
TOL = {"mixed_float16": 2e-2, "mixed_bfloat16": 6e-2}


def _model(policy, weights=None):
    keras.mixed_precision.set_dtype_policy(policy)
    try:
        model = keras.Sequential([
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(3, dtype="float32"),  # float32 logits, as Keras advises
        ])
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    if weights is not None:
        model.set_weights(weights)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _values(model, x, y):
    out = {
        "hessian_trace": kg.sharpness.hessian_trace(model, x, y, num_probes=10, rtol=None, seed=1),
        "rs_kfac": kg.sharpness.riemannian_sharpness(model, x, y, structure="kfac", damping=0.1, num_probes=10, rtol=None, seed=1),
        "rs_diagonal": kg.sharpness.riemannian_sharpness(model, x, y, structure="diagonal", damping=0.1, num_probes=10, rtol=None, seed=1),
    }
    out = {k: float(v.value) for k, v in out.items()}
    out["fisher_diagonal"] = np.concatenate([np.ravel(d) for d in kg.sharpness.fisher_diagonal(model, x, y)])
    return out


@pytest.mark.parametrize("policy", sorted(TOL))
def test_estimators_under_mixed_policy_match_float32(policy):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8, 8, 1)).astype("float32")
    y = rng.integers(0, 3, size=32)
    reference = _model("float32")
    mixed = _model(policy, reference.get_weights())
    assert mixed.layers[0].compute_dtype != "float32" and mixed.layers[0].kernel.dtype == "float32"
    want, got = _values(reference, x, y), _values(mixed, x, y)
    for name in ("hessian_trace", "rs_kfac", "rs_diagonal"):
        assert np.isfinite(got[name]), name
        np.testing.assert_allclose(got[name], want[name], rtol=TOL[policy], err_msg=name)
    f_want, f_got = want["fisher_diagonal"], got["fisher_diagonal"]
    np.testing.assert_allclose(f_got, f_want, rtol=TOL[policy], atol=TOL[policy] * np.abs(f_want).max())
