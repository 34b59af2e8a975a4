"""Which layer first makes a model's outputs non-finite on some data.

A curvature estimate that comes out NaN or Inf is never returned: the
caller raises with the first layer (in the graph's order) whose output holds
NaN or Inf on the data, found by one forward pass over it that returns every
layer's output. Sequential and functional models only (a subclassed model
has no graph to read: the message then names the model's outputs).
"""

import keras
import numpy as np
from keras import ops

from keras_geosam.curvature.data import batches


def first_non_finite_layer(model, x, batch_size=None):
    """``"name (Class)"`` of the first layer whose output is not finite on
    `x`, or None when every layer's output is (or there is no graph)."""
    layers, outputs = [], []
    for layer in getattr(model, "layers", []):
        try:
            out = layer.output
        except (AttributeError, ValueError):  # called twice, or no graph
            continue
        if isinstance(out, keras.KerasTensor) and keras.backend.is_float_dtype(out.dtype):
            layers.append(layer)
            outputs.append(out)
    if not layers:
        return None
    try:
        probe = keras.Model(model.inputs, outputs)
    except (AttributeError, ValueError, TypeError):
        return None
    first = len(layers)
    for xb, _, _ in batches(x, None, batch_size):
        values = probe(xb, training=False)
        values = values if isinstance(values, (list, tuple)) else [values]
        for i, v in enumerate(values[:first]):
            if not bool(ops.convert_to_numpy(ops.all(ops.isfinite(v)))):
                first = i
                break
    if first == len(layers):
        return None
    return f"{layers[first].name} ({type(layers[first]).__name__})"


def require_finite(value, model, x, what, batch_size=None):
    """Raises ``ValueError`` unless `value` (a number or array) is finite,
    naming the first non-finite layer on `x` where it can."""
    if np.all(np.isfinite(np.asarray(value, dtype="float64"))):
        return
    layer = first_non_finite_layer(model, x, batch_size)
    where = (f"the output of layer {layer} is the first to hold NaN or Inf on these data" if layer
             else "the model's loss or its derivatives hold NaN or Inf on these data")
    raise ValueError(
        f"{what} is not finite: {where}. Nothing is returned rather than a NaN. Check the inputs (a "
        "constant sequence into LayerNormalization(epsilon=0), extreme values) and the weights."
    )
