"""Inputs checked against the model before any work: named inputs present,
token ids inside every Embedding's vocabulary.

A token id outside ``[0, input_dim)`` is not an error on every backend: JAX
clamps or fills gathers (NaN curvature, or a number for the wrong token),
and a tokenizer's padding id of -1 reads as the last row on some. So every
input that feeds an ``Embedding`` (keras-hub's ``ReversibleEmbedding`` is
one) directly is checked here, in the model's graph: the input layers'
consumers, nested functional models (a keras-hub task's backbone) included.
Subclassed models have no graph to read and are not checked.
"""

import keras
import numpy as np

from keras_geosam import keras_internals


def input_names(model):
    """The names a dict of inputs needs, or None (one unnamed input)."""
    struct = keras_internals.inputs_struct(model)
    if isinstance(struct, dict):
        return list(struct)
    inputs = _model_inputs(model)
    return [t.name for t in inputs] if len(inputs) > 1 else None


def check_inputs_fit(model, x):
    """Raises ``ValueError`` if dict inputs miss one of the model's named
    inputs, or a token id lies outside an Embedding's ``[0, input_dim)``."""
    for name, tensor, array in _paired(model, x):
        for layer in _embeddings_fed_by(tensor):
            _check_ids(array, name, layer)


def _model_inputs(model):
    try:
        return list(model.inputs or [])
    except (AttributeError, ValueError):  # subclassed or unbuilt: no graph
        return []


def _paired(model, x):
    """``[(name, input tensor, array)]`` for each model input `x` holds."""
    inputs = _model_inputs(model)
    if not inputs:
        return []
    struct = keras_internals.inputs_struct(model)
    if isinstance(x, dict):
        named = dict(struct) if isinstance(struct, dict) else {t.name: t for t in inputs}
        missing = [k for k in named if k not in x]
        if missing:
            raise ValueError(
                f"x is a dict without the model's input(s) {missing}: the model takes {list(named)}, "
                f"x has {list(x)}."
            )
        return [(k, t, x[k]) for k, t in named.items()]
    if isinstance(x, (list, tuple)):
        return [(t.name, t, a) for t, a in zip(inputs, x)]
    return [(inputs[0].name, inputs[0], x)] if len(inputs) == 1 else []


def _embeddings_fed_by(tensor):
    """Embedding layers that read `tensor` (a model input) directly."""
    source = keras_internals.producer(tensor)
    if source is None:
        return []
    found = []
    for consumer in keras_internals.consumers(source):
        if isinstance(consumer, keras.layers.Embedding):
            found.append(consumer)
    return found


def _check_ids(array, name, layer):
    ids = np.asarray(keras.ops.convert_to_numpy(array))
    if ids.size == 0:
        return
    if not (np.issubdtype(ids.dtype, np.integer) or np.all(np.mod(ids[np.isfinite(ids)], 1) == 0)):
        return  # not token ids (a float input into a custom layer)
    low, high = ids.min(), ids.max()
    if low < 0 or high >= layer.input_dim:
        raise ValueError(
            f"Token ids of input {name!r} must lie in [0, {layer.input_dim}) for {type(layer).__name__} "
            f"{layer.name!r} (input_dim={layer.input_dim}); got values in [{low:g}, {high:g}]. "
            "Outside it some backends silently read another row or give NaN; a tokenizer's padding "
            "id (-1 and the like) should be mapped to a valid id and masked."
        )
