"""Depthwise and separable convolutions get exact per-example gradients
from their input patches and output gradients (``DepthwiseConvRule``,
``SeparableConvRule``), on every backend: they equal a loop of one-example
gradients, the probe-free Fisher diagonal equals the dense GGN's diagonal,
and the K-FAC metric gives them diagonal blocks, without a fallback warning.
Tolerance 1e-5 relative (float32 models).
"""

import warnings

import keras
import numpy as np
import pytest

import keras_geosam as kg
from reference import curvature as ref

N, K = 6, 3
LAYERS = {
    "depthwise2d": lambda: keras.layers.DepthwiseConv2D(3, depth_multiplier=2, padding="same", activation="tanh"),
    "depthwise2d_strided": lambda: keras.layers.DepthwiseConv2D(3, strides=2, activation="relu"),
    "separable2d": lambda: keras.layers.SeparableConv2D(4, 3, depth_multiplier=2, activation="tanh"),
    "depthwise1d": lambda: keras.layers.DepthwiseConv1D(3, depth_multiplier=2, activation="tanh"),
    "separable1d": lambda: keras.layers.SeparableConv1D(4, 3, padding="same", dilation_rate=2, activation="tanh"),
}


def _case(name):
    keras.utils.set_random_seed(5)
    shape = (7, 7, 3) if name.endswith("2d") or "2d_" in name else (9, 3)
    pool = keras.layers.GlobalAveragePooling2D() if len(shape) == 3 else keras.layers.GlobalAveragePooling1D()
    model = keras.Sequential([keras.Input(shape), LAYERS[name](), pool, keras.layers.Dense(K)])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(2)
    return model, rng.normal(size=(N,) + shape).astype("float32"), rng.integers(0, K, size=N)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_per_example_gradients_and_fisher_diagonal(name):
    model, x, y = _case(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "diagonal block fallback" warning
        grads = kg.curvature.per_example_gradients(model, x, y)
        diag = kg.sharpness.fisher_diagonal(model, x)
        M = kg.sharpness.fisher_metric(model, x, structure="kfac")
    for n in range(N):
        _, one = kg.curvature.loss_and_gradient(model, x[n:n + 1], y[n:n + 1])
        assert ref.rel_err([g[n] for g in grads], one) < 1e-5, (name, n)
    dense = kg.curvature.GGN(model, x).to_dense()
    assert ref.rel_err(ref.flatten(diag), np.diag(dense)) < 1e-5
    conv = model.layers[0]
    assert all(type(b).__name__ == "Diagonal" for b, v in zip(M.blocks, model.trainable_variables) if v.path.startswith(conv.name))


def test_mobilenet_v3_small_kfac_sharpness_is_finite_with_its_stderr():
    """The issue's model: depthwise kernels no longer take a vectorised
    backward through the network (a 102 GB request on JAX before)."""
    keras.utils.set_random_seed(0)
    model = keras.applications.MobileNetV3Small(weights=None, input_shape=(32, 32, 3), classes=10,
                                                include_preprocessing=False)
    model.compile(loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(4, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = kg.sharpness.riemannian_sharpness(model, x, y, structure="kfac", num_probes=2, rtol=None)
    assert np.isfinite(est.value) and np.isfinite(est.stderr) and est.stderr > 0
