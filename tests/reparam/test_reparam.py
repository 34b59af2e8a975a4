"""Tests of keras_geosam.reparam.rescale: function preserved, or a ValueError
with nothing modified.

Outputs are compared as ``max |f_after - f_before| / max |f_before|``:
1e-6 in float32; 1e-12 in float64 where Keras evaluates the model's ops in
float64 (on torch Keras 3.15 runs float64 `matmul`, hence Dense, in float32,
so float64 models with a Dense layer are held to the float32 tolerance there;
the lossy ops are found by probing Keras, not by backend name).
"""

import functools

import keras
import numpy as np
import pytest
from keras.src.backend.common import global_state

from keras_geosam.reparam import rescale

F32, F64 = 1e-6, 1e-12


@functools.lru_cache(maxsize=None)
def _keras_matmul_is_float64():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(4, 3)), rng.normal(size=(3, 2))
    out = np.asarray(keras.ops.convert_to_numpy(keras.ops.matmul(a, b)))
    return np.abs(out - a @ b).max() < 1e-14


def _tol(dtype):
    return F64 if dtype == "float64" and _keras_matmul_is_float64() else F32


@pytest.fixture(params=["float32", "float64"])
def dtype(request):
    # Keras caches its global dtype policy from floatx at the first layer it
    # builds (later set_floatx calls do not change it): set the policy too,
    # and restore both exactly, "not yet cached" included.
    old, old_policy = keras.config.floatx(), global_state.get_global_attribute("dtype_policy", None)
    keras.config.set_floatx(request.param)
    keras.config.set_dtype_policy(request.param)
    yield request.param
    keras.config.set_floatx(old)
    global_state.set_global_attribute("dtype_policy", old_policy)


def _set_weights(model, seed=0, scale=0.7):
    rng = np.random.default_rng(seed)
    for v in model.trainable_variables:
        v.assign(scale * rng.normal(size=v.shape))


def _weights(model):
    return [np.array(keras.ops.convert_to_numpy(v.value)) for v in model.weights]


def _out(model, x):
    return np.asarray(keras.ops.convert_to_numpy(model(x)), dtype="float64")


def _check_preserved(model, layer, alpha, x, tol):
    assert all(v.dtype == keras.config.floatx() for v in model.weights)
    before = _out(model, x)
    w0 = _weights(model)
    assert rescale(model, layer, alpha) is model
    after = _out(model, x)
    err = np.abs(after - before).max() / np.abs(before).max()
    assert err < tol, err
    changed = [not np.allclose(a, b) for a, b in zip(w0, _weights(model))]
    assert sum(changed) >= 2  # the layer's kernel and the consumer's kernel
    return model


def _check_refused(model, layer, alpha, match):
    w0 = _weights(model)
    with pytest.raises(ValueError, match=match):
        rescale(model, layer, alpha)
    for a, b in zip(w0, _weights(model)):
        np.testing.assert_array_equal(a, b)  # nothing modified


def _mlp(act="relu", middle=None):
    layers = [keras.Input((5,)), keras.layers.Dense(6, activation=act, name="d1")]
    layers += list(middle or [])
    layers += [keras.layers.Dense(3, name="d2")]
    model = keras.Sequential(layers)
    _set_weights(model)
    return model


def _x(shape, seed=1):
    return np.random.default_rng(seed).normal(size=(8,) + shape).astype(keras.config.floatx())


# ------------------------------------------------------- preserved ----
@pytest.mark.parametrize("alpha", [0.1, 10.0, "per_unit"])
def test_dense_relu_dense(dtype, alpha):
    model = _mlp("relu")
    if alpha == "per_unit":
        alpha = np.array([0.1, 2.0, 5.0, 0.3, 1.0, 30.0])
    x = _x((5,))
    _check_preserved(model, "d1", alpha, x, _tol(dtype))
    # the weights moved as documented: columns scaled by alpha, rows by 1/alpha
    model2 = _mlp("relu")
    k1, b1, k2 = (_weights(model2)[i] for i in (0, 1, 2))
    rescale(model2, model2.get_layer("d1"), alpha)
    a = np.broadcast_to(alpha, (6,))
    w = _weights(model2)
    np.testing.assert_allclose(w[0], k1 * a, rtol=1e-6)
    np.testing.assert_allclose(w[1], b1 * a, rtol=1e-6)
    np.testing.assert_allclose(w[2], k2 / a[:, None], rtol=1e-6)


def test_functional_dense_relu_dense(dtype):
    inp = keras.Input((5,))
    d1 = keras.layers.Dense(6, activation="relu")
    out = keras.layers.Dense(3)(keras.layers.Dropout(0.3)(d1(inp)))
    model = keras.Model(inp, out)
    _set_weights(model)
    _check_preserved(model, d1, 7.0, _x((5,)), _tol(dtype))


@pytest.mark.parametrize("alpha", [0.1, 10.0, "per_channel"])
def test_conv_maxpool_flatten_dense(dtype, alpha):
    model = keras.Sequential(
        [
            keras.Input((6, 6, 2)),
            keras.layers.Conv2D(3, 3, activation="relu", name="conv"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(4),
        ]
    )
    _set_weights(model)
    if alpha == "per_channel":
        alpha = np.array([0.05, 3.0, 20.0])
    _check_preserved(model, "conv", alpha, _x((6, 6, 2)), _tol(dtype))


@pytest.mark.parametrize("pool", [True, False])
@pytest.mark.parametrize("flatten_format", ["channels_last", "channels_first"])
def test_conv_channels_first_flatten_dense(dtype, flatten_format, pool):
    """Flatten's order depends on both data formats: per-channel alpha must
    follow the channels wherever they end up. (Without pooling the conv output
    is 3x3x3, where a channels-last assumption still fits the Dense's input
    size and would silently change the function.)"""
    if keras.backend.backend() == "tensorflow":
        # TF 2.21 on CPU runs NCHW Conv2D only through oneDNN (none in
        # float64), and its eager path keeps using the weights it saw first
        # after a Variable.assign: model(x) is stale, predict is not.
        pytest.skip("TensorFlow's CPU NCHW Conv2D is unreliable after assign (oneDNN)")
    layers = [
        keras.Input((2, 4, 4) if not pool else (2, 5, 5)),
        keras.layers.Conv2D(3, 2, activation="relu", data_format="channels_first", name="conv"),
    ]
    if pool:
        layers.append(keras.layers.MaxPooling2D(2, data_format="channels_first"))
    layers += [keras.layers.Flatten(data_format=flatten_format), keras.layers.Dense(4)]
    model = keras.Sequential(layers)
    _set_weights(model)
    x = _x(tuple(model.inputs[0].shape[1:]))
    _check_preserved(model, "conv", np.array([0.1, 4.0, 25.0]), x, _tol(dtype))


def test_conv_relu_avgpool_conv(dtype):
    model = keras.Sequential(
        [
            keras.Input((6, 6, 2)),
            keras.layers.Conv2D(3, 2, name="conv"),
            keras.layers.ReLU(),
            keras.layers.AveragePooling2D(2),
            keras.layers.Conv2D(2, 2),
            keras.layers.GlobalAveragePooling2D(),
        ]
    )
    _set_weights(model)
    _check_preserved(model, "conv", np.array([0.2, 5.0, 1.5]), _x((6, 6, 2)), _tol(dtype))


def test_conv_global_pool_dense(dtype):
    model = keras.Sequential(
        [
            keras.Input((5, 5, 2)),
            keras.layers.Conv2D(3, 2, activation="relu", name="conv"),
            keras.layers.GlobalMaxPooling2D(),
            keras.layers.Dense(2),
        ]
    )
    _set_weights(model)
    _check_preserved(model, "conv", np.array([0.3, 3.0, 9.0]), _x((5, 5, 2)), _tol(dtype))


@pytest.mark.parametrize("form", ["activation", "layer"])
def test_leaky_relu(dtype, form):
    if form == "activation":
        model = _mlp("leaky_relu")
    else:
        model = _mlp(None, [keras.layers.LeakyReLU(negative_slope=0.3)])
    _check_preserved(model, "d1", np.linspace(0.1, 10.0, 6), _x((5,)), _tol(dtype))


def test_linear_path_allows_negative_alpha(dtype):
    model = _mlp(None, [keras.layers.Activation("linear")])
    _check_preserved(model, "d1", -3.0, _x((5,)), _tol(dtype))


def test_dense_on_sequences_flatten(dtype):
    model = keras.Sequential(
        [keras.Input((4, 3)), keras.layers.Dense(5, activation="relu", name="d1"), keras.layers.Flatten(), keras.layers.Dense(2)]
    )
    _set_weights(model)
    _check_preserved(model, "d1", np.array([0.1, 1.0, 2.0, 7.0, 0.5]), _x((4, 3)), _tol(dtype))


def test_explicit_next_layer():
    model = _mlp("relu")
    _check_preserved(model, "d1", 0.25, _x((5,)), F32)
    d1, d2 = model.get_layer("d1"), model.get_layer("d2")
    before = _out(model, _x((5,)))
    rescale(model, d1, 4.0, next_layer=d2)
    assert np.abs(_out(model, _x((5,))) - before).max() < F32 * np.abs(before).max()


# --------------------------------------------------------- refused ----
def test_refuses_tanh_activation():
    _check_refused(_mlp("tanh"), "d1", 2.0, "positively homogeneous")
    _check_refused(_mlp("relu", [keras.layers.Activation("tanh")]), "d1", 2.0, "positively homogeneous")
    _check_refused(_mlp("sigmoid"), "d1", 2.0, "positively homogeneous")


def test_refuses_batchnorm_in_between():
    model = _mlp("relu", [keras.layers.BatchNormalization()])
    _check_refused(model, "d1", 2.0, "BatchNormalization")


def test_refuses_bounded_or_thresholded_relu():
    _check_refused(_mlp(None, [keras.layers.ReLU(max_value=6.0)]), "d1", 2.0, "max_value")
    _check_refused(_mlp(None, [keras.layers.ReLU(threshold=0.5)]), "d1", 2.0, "threshold")
    _check_refused(_mlp("relu6"), "d1", 2.0, "positively homogeneous")


@pytest.mark.parametrize("alpha", [0.0, -1.0, np.array([1.0, 2.0, -0.5, 1.0, 1.0, 1.0]), np.inf])
def test_refuses_non_positive_alpha_with_relu(alpha):
    _check_refused(_mlp("relu"), "d1", alpha, "alpha")


def test_refuses_zero_alpha_on_linear_path():
    _check_refused(_mlp(None), "d1", 0.0, "alpha")


def test_refuses_negative_alpha_across_max_pooling():
    model = keras.Sequential(
        [keras.Input((6, 6, 2)), keras.layers.Conv2D(3, 3, name="conv"), keras.layers.MaxPooling2D(2), keras.layers.Flatten(), keras.layers.Dense(4)]
    )
    _set_weights(model)
    _check_refused(model, "conv", -2.0, "alpha")


def test_refuses_non_weighted_layer():
    model = _mlp("relu", [keras.layers.BatchNormalization(name="bn")])
    _check_refused(model, "bn", 2.0, "Dense/Conv1D/Conv2D")
    model = keras.Sequential([keras.Input((4, 3)), keras.layers.Flatten(name="flat"), keras.layers.Dense(2)])
    _check_refused(model, "flat", 2.0, "Dense/Conv1D/Conv2D")


def test_refuses_last_layer_and_branches():
    _check_refused(_mlp("relu"), "d2", 2.0, "consumer")
    inp = keras.Input((5,))
    d1 = keras.layers.Dense(6, activation="relu", name="d1")
    h = d1(inp)
    out = keras.layers.Concatenate()([keras.layers.Dense(2)(h), keras.layers.Dense(2)(h)])
    model = keras.Model(inp, out)
    _set_weights(model)
    _check_refused(model, "d1", 2.0, "consumer")


def test_refuses_pooling_that_mixes_channels():
    model = keras.Sequential(
        [
            keras.Input((2, 6, 6)),
            keras.layers.Conv2D(3, 2, activation="relu", data_format="channels_first", name="conv"),
            keras.layers.MaxPooling2D(2, data_format="channels_last"),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ]
    )
    _set_weights(model)
    _check_refused(model, "conv", np.array([1.0, 2.0, 3.0]), "mixes channels")


@pytest.mark.parametrize("alpha", [np.ones(3), np.ones((2, 5))])
def test_alpha_of_the_wrong_length_is_refused(alpha):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="relu"), keras.layers.Dense(3)])
    before = [np.array(keras.ops.convert_to_numpy(v)) for v in model.weights]
    with pytest.raises(ValueError, match="one value per output unit"):
        rescale(model, model.layers[0], alpha)
    for v, b in zip(model.weights, before):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(v), b)
