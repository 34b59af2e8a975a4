"""Bad sequence inputs get a clear error before any work, never a number.

A small sequence classifier (``Embedding(mask_zero=True)``, a
``LayerNormalization(epsilon=0)``, pooling, a softmax head) and a
functional one with named inputs. Token ids outside ``[0, input_dim)``
(a tokenizer's -1 included), dict inputs without one of the model's names,
and a forward pass that is NaN on the probe data (a token whose embedding
row is constant: LayerNormalization divides 0 by 0) each raise a
``ValueError`` naming the cause, in every curvature function and in the
callbacks at the start of ``fit``, with weights and U unchanged.
"""

import warnings

import keras
import numpy as np
import pytest

import keras_geosam as kg

V, T, N, K = 20, 6, 16, 3


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((T,), dtype="int32"), keras.layers.Embedding(V, 8, mask_zero=True),
        keras.layers.LayerNormalization(epsilon=0.0), keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(K)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _data():
    rng = np.random.default_rng(0)
    x = rng.integers(2, V, size=(N, T)).astype("int32")
    return x, rng.integers(0, K, size=N)


FUNCTIONS = {
    "hessian_trace": lambda m, x, y: kg.sharpness.hessian_trace(m, x, y, num_probes=2, rtol=None),
    "riemannian_sharpness": lambda m, x, y: kg.sharpness.riemannian_sharpness(m, x, y, num_probes=2, rtol=None),
    "riemannian_sharpness_kfac": lambda m, x, y: kg.sharpness.riemannian_sharpness(
        m, x, y, structure="kfac", num_probes=2, rtol=None),
    "fisher_diagonal": lambda m, x, y: kg.sharpness.fisher_diagonal(m, x),
    "hessian_max_eigenvalue": lambda m, x, y: kg.sharpness.hessian_max_eigenvalue(m, x, y, max_iter=5),
    "loss_and_gradient": lambda m, x, y: kg.curvature.loss_and_gradient(m, x, y),
}


def _weights(model):
    return [np.array(keras.ops.convert_to_numpy(v)) for v in model.weights]


@pytest.mark.parametrize("bad", [-1, V, V + 7])
@pytest.mark.parametrize("fn", sorted(FUNCTIONS))
def test_token_ids_outside_the_vocabulary_are_refused(fn, bad):
    model = _model()
    x, y = _data()
    x[3, 2] = bad
    before = _weights(model)
    with pytest.raises(ValueError, match=rf"Token ids of input .* \[0, {V}\) for Embedding .*got values in \[{min(bad, 2)}"):
        FUNCTIONS[fn](model, x, y)
    assert all(np.array_equal(a, b) for a, b in zip(before, _weights(model)))


@pytest.mark.parametrize("fn", ["hessian_trace", "riemannian_sharpness", "riemannian_sharpness_kfac", "fisher_diagonal",
                                "hessian_max_eigenvalue"])
def test_a_non_finite_forward_names_the_first_non_finite_layer(fn):
    model = _model()
    emb = model.layers[0]
    table = np.array(keras.ops.convert_to_numpy(emb.embeddings))
    table[1] = 0.5  # a constant row: LayerNormalization(epsilon=0) gives 0/0
    emb.embeddings.assign(table)
    x, y = _data()
    x[0, 0] = 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"not finite: the output of layer layer_normalization.* \(LayerNormalization\)"):
            FUNCTIONS[fn](model, x, y)
    # teeth: without the constant token every function returns a number
    x[0, 0] = 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        FUNCTIONS[fn](model, x, y)


def _named():
    keras.utils.set_random_seed(1)
    ids = keras.Input((T,), dtype="int32", name="token_ids")
    scale = keras.Input((1,), name="scale")
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(V, 8)(ids))
    out = keras.layers.Dense(K)(h * scale)
    model = kg.attach(keras.Model({"token_ids": ids, "scale": scale}, out))
    return model


def test_dict_inputs_without_a_model_input_are_named():
    model = _named()
    model.compile(optimizer=kg.optimizers.LLQRSAM(keras.optimizers.SGD(0.1), refresh_source="callback"),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data()
    full = {"token_ids": x, "scale": np.ones((N, 1), "float32")}
    partial = {"token_ids": x}
    with pytest.raises(ValueError, match=r"without the model's input\(s\) \['scale'\]"):
        kg.sharpness.hessian_trace(model, partial, y, num_probes=2, rtol=None)
    model.optimizer.build(model.trainable_variables)
    state = model.optimizer.variables  # U and its statistics among them
    assert any("/U0" in v.path for v in state)
    before = _weights(model) + _weights_of(state)
    bad = dict(full, token_ids=np.where(x == 5, -1, x))
    for data, message in ((partial, r"\['scale'\]"), (bad, r"Token ids of input 'token_ids'")):
        logger = kg.callbacks.SharpnessLogger(data, y, every_n_epochs=1)
        for callback in (logger, kg.callbacks.PreconditionerRefresh(data, y, batch_size=4)):
            with pytest.raises(ValueError, match=message):
                model.fit(full, y, batch_size=8, epochs=1, verbose=0, callbacks=[callback])
            # weights, U (every optimizer variable) and logs unchanged: the check ran before any step
            assert all(np.array_equal(a, b) for a, b in zip(before, _weights(model) + _weights_of(state)))
        assert logger.history == []
    # teeth: with the full inputs the same fit takes steps and logs
    logger = kg.callbacks.SharpnessLogger(full, y, every_n_epochs=1, num_probes=2, rtol=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(full, y, batch_size=8, epochs=1, verbose=0, callbacks=[logger])
    assert len(logger.history) == 1
    assert not all(np.array_equal(a, b) for a, b in zip(before, _weights(model)))


def _weights_of(variables):
    return [np.array(keras.ops.convert_to_numpy(v)) for v in variables]


@pytest.mark.parametrize("bad", [-1, V])
def test_fit_of_an_attached_model_names_an_out_of_range_token_before_any_step(bad):
    """Array data: `fit` checks the token ids first (on JAX the step would
    be NaN and only skipped, the id never named)."""
    model = kg.attach(_model())
    model.compile(optimizer=kg.optimizers.LLQRSAM(keras.optimizers.SGD(0.1), structure="diagonal"),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data()
    before = _weights(model)
    bad_x = x.copy()
    bad_x[5, 1] = bad
    with pytest.raises(ValueError, match=rf"Token ids of input .* \[0, {V}\).*got values in \[{min(bad, 2)}"):
        model.fit(bad_x, y, batch_size=8, epochs=1, verbose=0)
    assert all(np.array_equal(a, b) for a, b in zip(before, _weights(model)))
    # teeth: the good ids train
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert not all(np.array_equal(a, b) for a, b in zip(before, _weights(model)))
