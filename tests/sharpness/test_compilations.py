"""What a sharpness call compiles on JAX: its kernels on the first call, and
nothing on the second (same model, same data shapes). The forwards that only
read shapes (the output shape, K-FAC's call shapes) are traced abstractly and
compile nothing; an eager forward would compile every op of the model.
TensorFlow's kernels are graphs one HVP block long (``test_operators.py``);
torch runs eagerly and compiles nothing.
"""

import keras
import numpy as np
import pytest

import keras_geosam as kg

BACKEND = keras.backend.backend()
pytestmark = pytest.mark.skipif(BACKEND != "jax", reason="only JAX compiles per call (per op when eager)")

_COMPILED = [0]


def _count(event, seconds, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILED[0] += 1


if BACKEND == "jax":
    import jax

    jax.monitoring.register_event_duration_secs_listener(_count)


def _compilations(fn):
    before = _COMPILED[0]
    fn()
    return _COMPILED[0] - before


def _transformer():
    keras.utils.set_random_seed(0)
    ids = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(11, 8)(ids)
    h = keras.layers.LayerNormalization()(h + keras.layers.MultiHeadAttention(2, 4)(h, h))
    h = keras.layers.Dense(12, activation="gelu")(h)
    out = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h))
    model = keras.Model(ids, out)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    return model, rng.integers(0, 11, size=(16, 6)).astype("int32"), rng.integers(0, 3, size=16)


@pytest.mark.parametrize("call", ["hessian_trace", "riemannian_kfac", "riemannian_diagonal", "logger"])
def test_a_second_call_compiles_nothing(call):
    model, x, y = _transformer()
    logger = kg.callbacks.SharpnessLogger(x, y, metrics=("riemannian_sharpness_kfac", "hessian_trace"))
    logger.set_model(model)
    fn = {
        "hessian_trace": lambda: kg.sharpness.hessian_trace(model, x, y, num_probes=4, max_probes=8, seed=1),
        "riemannian_kfac": lambda: kg.sharpness.riemannian_sharpness(model, x, y, structure="kfac", num_probes=4,
                                                                     max_probes=8, seed=1),
        "riemannian_diagonal": lambda: kg.sharpness.riemannian_sharpness(model, x, y, num_probes=4, max_probes=8,
                                                                         seed=1),
        "logger": logger.compute,
    }[call]
    assert _compilations(fn) > 0  # the counter sees the first call's kernels
    assert _compilations(fn) == 0


def test_shape_only_forwards_compile_nothing():
    from keras_geosam.curvature import weights
    from keras_geosam.curvature.capture import Capture
    from keras_geosam.curvature.functional import ModelFunctions

    model, x, _ = _transformer()
    fns = ModelFunctions(model)
    assert _compilations(lambda: weights.first_example(fns, x)) == 0
    assert weights.output_shape(fns, x) == (16, 3) and not weights.emits_mask(fns, x)
    capture = Capture(fns)
    shapes = []
    assert _compilations(lambda: shapes.append(capture.call_shapes(x))) == 0
    # the feed-forward Dense sees (16, 6, 12), the head (16, 3): shapes as an eager forward gives them
    assert (16, 6, 12) in [s for calls in shapes[0] for s in calls]
    assert (16, 3) in [s for calls in shapes[0] for s in calls]
