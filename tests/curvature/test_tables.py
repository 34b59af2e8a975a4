"""Rules for tables other than Embedding (``curvature/tables.py``): Keras'
``ReversibleEmbedding``, tied (a lookup and the output projection) or not,
and keras-hub's ``PositionEmbedding``. On tiny models the GGN / Fisher
diagonal they give (from layer inputs and output gradients) equals the
diagonal of the dense matrix built from the backend's per-example map
(``GGN.to_dense``), and their per-example gradients equal the map's."""

import warnings

import keras
import numpy as np
import pytest

from keras_geosam import curvature as kc
from keras_geosam.curvature import model_functions
from keras_geosam.curvature.layers import kernel_views
from keras_geosam.curvature.tables import PositionEmbeddingRule
from keras_geosam.curvature.tables import ReversibleEmbeddingRule

V, D, T, N = 11, 6, 5, 4
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _reversible(tie_weights=True, logit_soft_cap=None, position=None):
    """ids -> table lookup (+ positions) -> tanh Dense -> reverse projection."""
    keras.utils.set_random_seed(0)
    ids = keras.Input((T,), dtype="int32")
    table = keras.layers.ReversibleEmbedding(V, D, tie_weights=tie_weights, logit_soft_cap=logit_soft_cap,
                                             embeddings_initializer="normal")
    h = table(ids)
    if position is not None:
        h = h + position(h)
    h = keras.layers.Dense(D, activation="tanh")(h)
    model = keras.Model(ids, table(h, reverse=True))
    model.compile(loss=LOSS)
    return model


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, V, size=(N, T)).astype("int32")
    x[0, :3] = 2  # a token repeated within an example: its rows add up before squaring
    return x, rng.integers(0, V, size=(N, T))


def _diagonal_against_dense(model, x, y, kind, sample_weight=None):
    G = kc.GGN(model, x, y, kind=kind, num_samples=3, sample_weight=sample_weight)
    assert G.capture.uncovered == []  # every variable has a rule: no per-example map
    diag = np.concatenate([np.ravel(keras.ops.convert_to_numpy(d)) for d in G.diagonal()])
    dense = np.diag(G.to_dense())
    np.testing.assert_allclose(diag, dense, rtol=1e-4, atol=1e-6 * np.max(dense))


@pytest.mark.parametrize("kind,tie_weights", [("mc", True), ("mc", False), ("empirical", True)])
def test_reversible_embedding_diagonal_equals_the_dense_fisher(kind, tie_weights):
    """(The rules see output factors of any kind alike; "mc" draws 3 per
    token, with padded tokens weighted out.)"""
    model = _reversible(tie_weights)
    assert isinstance(kc.GGN(model, *_data()).capture.rules[0], ReversibleEmbeddingRule)
    x, y = _data()
    sw = np.ones((N, T), "float32")
    sw[1, 3:] = 0.0  # padded tokens
    _diagonal_against_dense(model, x, y, kind, sample_weight=sw if tie_weights else None)


@pytest.mark.parametrize("pairs_per_product", [1, 4])
def test_a_large_table_is_squared_in_chunks_of_examples(monkeypatch, pairs_per_product):
    """A table larger than a chunk: its ``V x d`` products are formed for
    `pairs_per_product` (column, example) pairs at a time, in a loop (12
    pairs: 3 labels per token for 4 examples)."""
    from keras_geosam.curvature import tables

    monkeypatch.setattr(tables, "MAX_ELEMENTS", 1 if pairs_per_product == 1 else V * D * 5)
    x, y = _data()
    _diagonal_against_dense(_reversible(), x, y, "mc")


@pytest.mark.parametrize("kind", ["exact", "mc"])
def test_output_factors_pulled_back_one_column_at_a_time_give_the_same_statistics(monkeypatch, kind):
    """Output factors pulled back a few columns at a time (10 of the 55
    exact columns, the last chunk 5; or one of 3 sampled labels per token;
    on JAX in a compiled loop) give the diagonal, the K-FAC factors and
    ``tr(K-FAC^-1 GGN)`` of one chunk of every column (whose diagonal the
    tests above check against the dense matrix)."""
    from keras_geosam.curvature import capture

    x, y = _data()
    shapes = kc.GGN(_reversible(), x, y).capture.call_shapes(x)
    per_column = max(sum(int(np.prod(s)) for calls in shapes for s in calls), N * T * V)

    def statistics():
        G = kc.GGN(_reversible(), x, y, kind=kind, num_samples=3)
        K = G.kfac()
        total, _ = G.trace_with(K.inverse(damping=1e-3))
        diag = np.concatenate([np.ravel(keras.ops.convert_to_numpy(d)) for d in G.diagonal()])
        return diag, K.to_dense(), total

    whole_diag, whole_kfac, whole_trace = statistics()
    monkeypatch.setattr(capture, "MAX_ELEMENTS", 10 * per_column if kind == "exact" else 1)
    diag, kfac, trace = statistics()
    np.testing.assert_allclose(diag, whole_diag, rtol=1e-5, atol=1e-7 * np.max(whole_diag))
    np.testing.assert_allclose(kfac, whole_kfac, rtol=1e-5, atol=1e-7 * np.max(np.abs(whole_kfac)))
    np.testing.assert_allclose(trace, whole_trace, rtol=1e-5)


def test_position_embedding_diagonal_with_a_start_index_and_given_positions():
    keras_hub = pytest.importorskip("keras_hub")
    for call in ({"start_index": 2}, {"positions": np.array([4, 0, 4, 1, 6], "int32")}):
        layer = keras_hub.layers.PositionEmbedding(sequence_length=8)
        model = _reversible(position=lambda h, _layer=layer, _call=call: _layer(h, **_call))
        rules = kc.GGN(model, *_data()).capture.rules
        assert any(isinstance(r, PositionEmbeddingRule) for r in rules)
        _diagonal_against_dense(model, *_data(), "mc")


def test_per_example_gradients_from_the_rules_equal_the_backends_map():
    model = _reversible()
    x, y = _data()
    fns = model_functions(model)
    reference = fns.kernel(fns.per_example_grads_body)(
        fns.params(), fns.non_trainable(), keras.ops.convert_to_tensor(x), keras.ops.convert_to_tensor(y), None)
    for got, want in zip(kc.per_example_gradients(model, x, y), reference):
        np.testing.assert_allclose(keras.ops.convert_to_numpy(got), keras.ops.convert_to_numpy(want), rtol=1e-5,
                                   atol=1e-7)


def test_a_gpt2_is_covered_and_keeps_its_blocks():
    """A keras-hub GPT-2: no per-example map, the tied table and the
    position table get diagonal metric blocks (the exact diagonal, as
    before), and LLQR's U still gives the tied table a diagonal-input
    K-FAC block and the position table a diagonal one."""
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=12, num_layers=1, num_heads=2, hidden_dim=8,
                                             intermediate_dim=16, dropout=0.0, max_sequence_length=6)
    model = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    model.compile(loss=LOSS)
    tokens = np.random.default_rng(0).integers(0, 12, size=(3, 5))
    x, y = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((3, 4), "int32")}, tokens[:, 1:]
    _diagonal_against_dense(model, x, y, "mc")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no diagonal-fallback warning: both tables have rules
        M = kc.GGN(model, x, y, kind="mc").kfac()
    blocks = dict(zip(M.paths, M.blocks))
    table, position = backbone.token_embedding.embeddings, backbone.position_embedding.position_embeddings
    assert isinstance(blocks[table.path], kc.Diagonal) and isinstance(blocks[position.path], kc.Diagonal)
    views = kernel_views(model, for_preconditioner=True)
    assert views[id(table)] == (1, True) and views.get(id(position)) is None


def test_soft_capped_logits_are_left_to_the_per_example_map():
    model = _reversible(logit_soft_cap=3.0)
    x, y = _data()
    G = kc.GGN(model, x, y, kind="mc")
    assert not any(isinstance(r, ReversibleEmbeddingRule) for r in G.capture.rules) and G.capture.uncovered
    diag = np.concatenate([np.ravel(keras.ops.convert_to_numpy(d)) for d in G.diagonal()])
    np.testing.assert_allclose(diag, np.diag(G.to_dense()), rtol=1e-4, atol=1e-10)
