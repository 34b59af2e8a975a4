"""A curvature product that cannot fit fails before any work, naming the
batch_size that fits (``curvature/memory.py``).

The bound counts the layer outputs of one example from the model's graph
(hand-counted here), plus ``1 + 2k`` copies of the weights for k probes;
per-example gradients of layers without a rule count a batch's gradients
of their variables. The free memory is patched so that exactly the
suggested batch size fits.
"""

import keras
import numpy as np
import pytest

import keras_geosam as kg
from keras_geosam import backend
from keras_geosam.curvature import memory

N = 10


def _mlp():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    return model, rng.normal(size=(N, 4)).astype("float32"), rng.integers(0, 3, size=N)


def test_activations_are_counted_from_the_graph():
    model, _, _ = _mlp()
    assert memory.activation_elements(model) == 8 + 3  # Dense(8) and Dense(3) outputs per example
    a = keras.Input((4,))
    inner = keras.Model(a, keras.layers.Dense(6)(a))
    b = keras.Input((4,))
    nested = keras.Model(b, keras.layers.Dense(3)(inner(b)))
    assert memory.activation_elements(nested) == 6 + 3

    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(3)

        def call(self, x):
            return self.dense(x)

    sub = Subclassed()
    sub(np.zeros((1, 4), "float32"))
    assert memory.activation_elements(sub) is None  # no graph: not checked
    total, per_example, weights = memory.product_bytes(model, 5, 2)
    P = 4 * 8 + 8 + 8 * 3 + 3
    assert (per_example, weights) == (11 * 4, 5 * P * 4) and total == 5 * per_example + weights


def test_a_product_beyond_free_memory_names_the_batch_size_that_fits(monkeypatch):
    model, x, y = _mlp()
    fits = memory.product_bytes(model, 4, 2)[0]
    monkeypatch.setattr(backend, "available_memory", lambda: fits)
    vectors = [np.ones((2,) + tuple(v.shape), "float32") for v in model.trainable_variables]
    with pytest.raises(ValueError, match=r"batches of 10 examples with 2 probes .* lower batch_size to 4 or fewer"):
        kg.curvature.Hessian(model, x, y, batch_size=10).matmat(vectors)
    with pytest.raises(ValueError, match=r"lower batch_size to 4"):
        kg.sharpness.hessian_trace(model, x, y, batch_size=10, num_probes=2, rtol=None)
    # teeth: the suggested size fits and gives the product
    out = kg.curvature.Hessian(model, x, y, batch_size=4).matmat(vectors)
    assert np.all(np.isfinite(keras.ops.convert_to_numpy(out[0])))
    monkeypatch.setattr(backend, "available_memory", lambda: memory.product_bytes(model, 1, 2)[2] // 2)
    with pytest.raises(ValueError, match=r"even one example does not fit: lower the number of probes"):
        kg.curvature.Hessian(model, x, y, batch_size=1).matmat(vectors)
    monkeypatch.setattr(backend, "available_memory", lambda: None)  # unknown: not checked
    kg.curvature.Hessian(model, x, y, batch_size=10).matmat(vectors)


def test_free_memory_is_read():
    free = backend.available_memory()
    assert free is None or 0 < free < 2**50


def test_per_example_gradients_of_layers_without_a_rule_are_bounded(monkeypatch):
    """A layer without a curvature rule takes per-example gradients, a
    batch of them at once: the Fisher diagonal names the batch size that
    fits them."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4, 3)), keras.layers.SimpleRNN(5), keras.layers.Dense(3)])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rnn = model.layers[0].trainable_variables
    per_example = sum(int(np.prod(v.shape)) for v in rnn) * 4
    monkeypatch.setattr(backend, "available_memory", lambda: 3 * per_example)
    x = np.random.default_rng(0).normal(size=(N, 4, 3)).astype("float32")
    with pytest.raises(ValueError, match=r"layers without a rule on batches of 10 examples .* lower batch_size to 3"):
        kg.sharpness.fisher_diagonal(model, x, batch_size=10)
    d = kg.sharpness.fisher_diagonal(model, x, batch_size=3)  # teeth: the suggested size runs
    assert all(np.all(np.isfinite(keras.ops.convert_to_numpy(t))) for t in d)
