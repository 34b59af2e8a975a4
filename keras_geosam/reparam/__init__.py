"""Function-preserving reparametrisations, for invariance checks.

``rescale(model, layer, alpha)`` multiplies a layer's output units by
``alpha`` and the next weighted layer's matching inputs by ``1/alpha``. The
function is unchanged when everything in between is positively homogeneous
(ReLU, LeakyReLU, linear, max/average pooling, dropout, flatten), the layer's
own activation too, and ``alpha > 0`` (any nonzero alpha for linear paths).
Anything else raises ``ValueError`` instead of silently changing the model.
"""

import keras
import numpy as np

_WEIGHTED = (keras.layers.Dense, keras.layers.Conv1D, keras.layers.Conv2D)
_HOMOGENEOUS = {"relu", "leaky_relu", "linear"}
_PASS_THROUGH = (
    keras.layers.Dropout,
    keras.layers.MaxPooling1D,
    keras.layers.MaxPooling2D,
    keras.layers.AveragePooling1D,
    keras.layers.AveragePooling2D,
    keras.layers.GlobalAveragePooling1D,
    keras.layers.GlobalAveragePooling2D,
    keras.layers.GlobalMaxPooling1D,
    keras.layers.GlobalMaxPooling2D,
    keras.layers.ReLU,
    keras.layers.LeakyReLU,
)


def _activation_name(fn):
    return "linear" if fn is None else getattr(fn, "__name__", repr(fn))


def _consumers(model, layer):
    """Layers fed by `layer` inside `model`'s graph."""
    inside = {id(l) for l in model._flatten_layers(include_self=False)}
    out = []
    for node in layer._outbound_nodes:
        op = node.operation
        if id(op) in inside and op not in out:
            out.append(op)
    if not out and isinstance(model, keras.Sequential):
        layers = model.layers
        i = layers.index(layer)
        out = layers[i + 1 : i + 2]
    return out


def rescale(model, layer, alpha, next_layer=None):
    """Scales `layer`'s output units by `alpha`, the next layer's inputs by 1/alpha.

    Args:
        model: the (built) model holding both layers; modified in place.
        layer: a Dense/Conv1D/Conv2D layer or its name.
        alpha: a scalar or one value per output unit (filters/units).
        next_layer: the weighted layer consuming `layer` (found from the
            model's graph when omitted; required for subclassed models).

    Returns:
        The model.

    Raises:
        ValueError: if the layer type, an activation or a layer in between
            is not positively homogeneous, alpha is not positive (non-zero
            for linear paths), or the consumer cannot be determined uniquely.
    """
    if isinstance(layer, str):
        layer = model.get_layer(layer)
    if not isinstance(layer, _WEIGHTED):
        raise ValueError(
            f"rescale supports Dense/Conv1D/Conv2D layers; {layer.name!r} is a "
            f"{type(layer).__name__}."
        )
    units = int(layer.kernel.shape[-1])
    alpha = np.broadcast_to(np.asarray(alpha, dtype="float64"), (units,)).copy()
    acts = {_activation_name(layer.activation)}
    path_kinds = []

    # Walk to the next weighted layer, through positively homogeneous ops.
    current, repeat = layer, 1
    while True:
        if next_layer is not None and current is layer:
            nxt = next_layer if not isinstance(next_layer, str) else model.get_layer(next_layer)
        else:
            consumers = _consumers(model, current)
            if len(consumers) != 1:
                raise ValueError(
                    f"Cannot rescale {layer.name!r}: {current.name!r} feeds "
                    f"{len(consumers)} layers ({[c.name for c in consumers]}); "
                    f"exactly one consumer is needed (pass `next_layer` for "
                    f"subclassed models)."
                )
            nxt = consumers[0]
        if isinstance(nxt, _WEIGHTED):
            break
        if isinstance(nxt, keras.layers.Activation):
            acts.add(_activation_name(nxt.activation))
        elif isinstance(nxt, keras.layers.Flatten):
            shape = current.output.shape if hasattr(current, "output") else None
            spatial = int(np.prod(shape[1:-1])) if shape is not None else None
            if spatial is None:
                raise ValueError(f"Cannot infer the spatial size flattened by {nxt.name!r}.")
            repeat *= spatial
        elif isinstance(nxt, _PASS_THROUGH):
            if isinstance(nxt, (keras.layers.ReLU, keras.layers.LeakyReLU)):
                acts.add("relu")
        else:
            raise ValueError(
                f"Cannot rescale {layer.name!r}: {nxt.name!r} "
                f"({type(nxt).__name__}) between it and the next weighted "
                f"layer is not known to be positively homogeneous, so the "
                f"function would change."
            )
        path_kinds.append(type(nxt).__name__)
        current = nxt

    bad = acts - _HOMOGENEOUS
    if bad:
        raise ValueError(
            f"Cannot rescale {layer.name!r}: activation(s) {sorted(bad)} are not "
            f"positively homogeneous; only ReLU, LeakyReLU and linear are."
        )
    nonlinear = acts - {"linear"} or any(k.startswith(("Max", "GlobalMax")) for k in path_kinds)
    if nonlinear and not np.all(alpha > 0):
        raise ValueError(f"alpha must be > 0 across ReLU-type activations or max pooling; got {alpha}.")
    if np.any(alpha == 0) or not np.all(np.isfinite(alpha)):
        raise ValueError(f"alpha must be finite and non-zero; got {alpha}.")

    layer.kernel.assign(keras.ops.convert_to_numpy(layer.kernel) * alpha)
    if layer.bias is not None:
        layer.bias.assign(keras.ops.convert_to_numpy(layer.bias) * alpha)
    k = keras.ops.convert_to_numpy(nxt.kernel)
    inv = np.tile(1.0 / alpha, repeat)
    if k.shape[-2] != inv.shape[0]:
        raise ValueError(
            f"{nxt.name!r} has {k.shape[-2]} inputs but {layer.name!r} provides "
            f"{inv.shape[0]} after the layers in between."
        )
    shape = (1,) * (k.ndim - 2) + (inv.shape[0], 1)
    nxt.kernel.assign(k * inv.reshape(shape))
    return model


__all__ = ["rescale"]
