"""What a user gets from the default settings, in float32 on real data.

Models are initialised from NumPy (the same weights on every backend) and
trained deterministically on scikit-learn's digits; sharpness is measured
on 256 training examples, the data the model was fitted to.

- ReLU networks without normalisation (an MLP and a CNN) are layerwise
  linear: the default Riemannian sharpness (diagonal and K-FAC metrics) is
  exact, so any two seeds give the same value (float32, relative 1e-4; in
  fact bit-identical, as no probe is drawn).
- Smooth networks trained to near a minimum (a sigmoid MLP; a swish CNN
  with BatchNormalization): the default value is positive, its relative
  standard error is at most 10%, and values over eight seeds scatter as
  their standard errors say (the ratio of the across-seed variance to the
  mean squared standard error lies in [0.1, 5], a 99%+ band for eight
  draws with estimated errors).

Values against explicit matrices are in test_sharpness.py (float64).
"""

import functools
import warnings

import keras
import numpy as np
import pytest

from reference.dtypes import keras_dtype

from keras_geosam import sharpness as ks

L = keras.layers


@pytest.fixture(autouse=True)
def _float32():
    with keras_dtype("float32"):
        yield


@functools.lru_cache(maxsize=None)
def _digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.data / 16.0).astype("float32"), d.target.astype("int32")


def _init(model, seed):
    rng = np.random.default_rng(seed)
    for v in model.trainable_variables:
        if len(v.shape) >= 2:
            v.assign((rng.normal(size=v.shape) / np.sqrt(np.prod(v.shape[:-1]))).astype("float32"))


def _trained(layers, image, epochs, seed):
    x, y = _digits()
    if image:
        x = x.reshape(-1, 8, 8, 1)
    model = keras.Sequential([keras.Input(x.shape[1:])] + layers)
    _init(model, seed)
    model.compile(optimizer=keras.optimizers.SGD(0.2, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x[:512], y[:512], epochs=epochs, batch_size=32, verbose=0, shuffle=False)
    return model, x[:256], y[:256]


_MODELS = {
    "relu_mlp": lambda: _trained([L.Dense(32, activation="relu"), L.Dense(32, activation="relu"), L.Dense(10)], False, 5, 0),
    "relu_cnn": lambda: _trained([L.Conv2D(6, 3, activation="relu", padding="same"), L.MaxPooling2D(2),
                                  L.Conv2D(8, 3, activation="relu"), L.Flatten(), L.Dense(10)], True, 5, 1),
    "sigmoid_mlp": lambda: _trained([L.Dense(32, activation="sigmoid"), L.Dense(10)], False, 20, 0),
    "bn_cnn": lambda: _trained([L.Conv2D(6, 3, padding="same"), L.BatchNormalization(momentum=0.9), L.Activation("swish"),
                                L.Conv2D(8, 3, strides=2, padding="same"), L.BatchNormalization(momentum=0.9),
                                L.Activation("swish"), L.GlobalAveragePooling2D(), L.Dense(10)], True, 30, 1),
}
_CACHE = {}


def model(name):
    if name not in _CACHE:
        _CACHE[name] = _MODELS[name]()
    return _CACHE[name]


@pytest.mark.parametrize("name", ["relu_mlp", "relu_cnn"])
@pytest.mark.parametrize("metric", ["diagonal", "kfac"])
def test_default_sharpness_of_relu_nets_does_not_depend_on_the_seed(name, metric):
    m, x, y = model(name)
    values = [ks.riemannian_sharpness(m, x, y, structure=metric, seed=s) for s in (0, 1, 2)]
    for e in values:
        assert e.info["residual_exact"] and e.stderr == 0.0 and e.num_samples == 0
        assert e.value == pytest.approx(values[0].value, rel=1e-4)
    assert values[0].value > 0
    trace = ks.hessian_trace(m, x, y, seed=0)
    assert trace.stderr == 0.0 and trace.value == ks.hessian_trace(m, x, y, seed=5).value


@pytest.mark.parametrize("name", ["sigmoid_mlp", "bn_cnn"])
@pytest.mark.parametrize("metric", ["diagonal", "kfac"])
def test_default_sharpness_of_smooth_nets_is_positive_and_resolved(name, metric):
    m, x, y = model(name)
    assert not ks.is_layerwise_linear(m)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # rtol reached within max_probes
        est = [ks.riemannian_sharpness(m, x, y, structure=metric, seed=s) for s in range(8)]
    values = np.array([e.value for e in est])
    stderr = np.array([e.stderr for e in est])
    assert np.all(values > 0), values
    assert np.all(stderr > 0) and np.all(stderr <= 0.10 * values), stderr / values
    ratio = values.var(ddof=1) / np.mean(stderr**2)
    assert 0.1 <= ratio <= 5.0, (ratio, values, stderr)
    assert all(not e.info["residual_exact"] and e.info["exact_part"] > 0 for e in est)


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="TensorFlow's pfor warning")
def test_no_while_loop_warnings_from_conv_curvature():
    """Per-example conv gradients come from unfolded patches, not from a
    vectorised map over the filter gradient (which TF converts to a
    while_loop, with a warning each time)."""
    import logging

    messages = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler = Collect()
    logging.getLogger("tensorflow").addHandler(handler)
    try:
        m, x, y = model("relu_cnn")
        ks.fisher_diagonal(m, x, y)
        ks.riemannian_sharpness(m, x, y, structure="kfac")
        ks.hessian_trace(m, x, y, split=False, num_probes=2, rtol=None)
        from keras_geosam import curvature

        curvature.per_example_gradients(m, x[:8], y[:8])
    finally:
        logging.getLogger("tensorflow").removeHandler(handler)
    assert not [msg for msg in messages if "while_loop" in msg], messages
