"""Recurrent classifiers (a masked Embedding into LSTM, GRU, SimpleRNN or
Bidirectional LSTM) on every backend: per-example gradients equal a loop of
one-example gradients, the probe-free GGN diagonal equals the dense GGN's
diagonal, and the sharpness estimators return numbers.

TensorFlow cannot vectorise a recurrent layer's while loop (its
``vectorized_map`` raised "dtype variant is not compatible"): the backend
loops over the examples there. Tolerance 1e-5 relative (float32 models).
"""

import keras
import numpy as np
import pytest

import keras_geosam as kg
from reference import curvature as ref

N, T, V, K = 6, 5, 12, 3
LAYERS = {
    "lstm": lambda: keras.layers.LSTM(3),
    "gru": lambda: keras.layers.GRU(3),
    "simple_rnn": lambda: keras.layers.SimpleRNN(3),
    "bidirectional": lambda: keras.layers.Bidirectional(keras.layers.LSTM(2)),
}


def _case(name):
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((T,), dtype="int32"), keras.layers.Embedding(V, 3, mask_zero=True),
                              LAYERS[name](), keras.layers.Dense(K)])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(1)
    x = rng.integers(1, V, size=(N, T)).astype("int32")
    x[:3, -2:] = 0  # padded sequences
    return model, x, rng.integers(0, K, size=N)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_per_example_gradients_equal_a_loop(name):
    model, x, y = _case(name)
    grads = kg.curvature.per_example_gradients(model, x, y, batch_size=4)
    for n in range(N):
        _, one = kg.curvature.loss_and_gradient(model, x[n:n + 1], y[n:n + 1])
        assert ref.rel_err([g[n] for g in grads], one) < 1e-5, (name, n)


@pytest.mark.parametrize("name", ["lstm"])
def test_ggn_diagonal_equals_the_dense_diagonal_and_estimators_run(name):
    model, x, y = _case(name)
    G = kg.curvature.GGN(model, x, batch_size=4)
    assert ref.rel_err(ref.flatten(G.diagonal()), np.diag(G.to_dense())) < 1e-5
    est = kg.sharpness.hessian_trace(model, x, y, num_probes=2, rtol=None)
    assert np.isfinite(est.value) and np.isfinite(est.stderr)
