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

from keras_geosam import keras_internals

_WEIGHTED = (keras.layers.Dense, keras.layers.Conv1D, keras.layers.Conv2D)
_HOMOGENEOUS = {"relu", "leaky_relu", "linear"}
_POOLING = (
    keras.layers.MaxPooling1D,
    keras.layers.MaxPooling2D,
    keras.layers.AveragePooling1D,
    keras.layers.AveragePooling2D,
    keras.layers.GlobalAveragePooling1D,
    keras.layers.GlobalAveragePooling2D,
    keras.layers.GlobalMaxPooling1D,
    keras.layers.GlobalMaxPooling2D,
)
_PASS_THROUGH = (keras.layers.Dropout, keras.layers.ReLU, keras.layers.LeakyReLU) + _POOLING


def _activation_name(fn):
    return "linear" if fn is None else getattr(fn, "__name__", repr(fn))


def _channels(layer):
    """"first" or "last": where a layer's data_format puts the channels (None
    for layers without one, e.g. Dense, which acts on the last axis)."""
    fmt = getattr(layer, "data_format", None)
    if fmt is None:
        return None
    return "first" if fmt == "channels_first" else "last"


def _output_shape(layer):
    try:
        return tuple(layer.output.shape)
    except Exception:  # layers without a (unique) symbolic output
        return None


def _consumers(model, layer):
    """Layers fed by `layer` inside `model`'s graph."""
    inside = {id(l) for l in keras_internals.flatten_layers(model)}
    out = []
    for op in keras_internals.consumers(layer):
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
            model's graph when omitted; required for subclassed models). When
            given, the layers in between are *not* inspected: the caller
            vouches that they are positively homogeneous.

    Returns:
        The model.

    Raises:
        ValueError: if the layer type, an activation or a layer in between
            is not positively homogeneous, alpha is not positive (non-zero
            for linear paths), or the consumer cannot be determined uniquely.
            Nothing is modified when it raises.

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> model = keras.Sequential([
    ...     keras.Input((4,)),
    ...     keras.layers.Dense(5, activation="relu", name="hidden"),
    ...     keras.layers.Dense(3),
    ... ])
    >>> before = model.predict(x, verbose=0)
    >>> model = kg.reparam.rescale(model, "hidden", 10.0)
    >>> np.allclose(model.predict(x, verbose=0), before, atol=1e-5)  # the same function
    True
    >>> kg.reparam.rescale(model, "hidden", -1.0)
    Traceback (most recent call last):
    ...
    ValueError: alpha must be > 0 across ReLU-type activations or max pooling; ...
    """
    if isinstance(layer, str):
        layer = model.get_layer(layer)
    if not isinstance(layer, _WEIGHTED):
        raise ValueError(
            f"rescale supports Dense/Conv1D/Conv2D layers; {layer.name!r} is a "
            f"{type(layer).__name__}."
        )
    units = int(layer.kernel.shape[-1])
    alpha = np.asarray(alpha, dtype="float64")
    if alpha.ndim > 1 or alpha.size not in (1, units):
        raise ValueError(
            f"alpha must be a scalar or hold one value per output unit of {layer.name!r} "
            f"({units}); got shape {alpha.shape}."
        )
    alpha = np.broadcast_to(alpha.reshape(-1) if alpha.ndim else alpha, (units,)).copy()
    acts = {_activation_name(layer.activation)}
    path_kinds = []
    # Which output unit of `layer` every feature along the channel axis of
    # the current tensor comes from (a Flatten turns positions into features).
    source = np.arange(units)
    channels = _channels(layer) or "last"

    # Walk to the next weighted layer, through positively homogeneous ops.
    current = layer
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
            shape = _output_shape(current)
            if shape is None or any(d is None for d in shape[1:]):
                raise ValueError(f"Cannot infer the shape flattened by {nxt.name!r}.")
            dims = list(shape[1:])
            axis = 0 if channels == "first" else len(dims) - 1  # among the non-batch axes
            if dims[axis] != source.size:
                raise ValueError(
                    f"Cannot rescale {layer.name!r}: the tensor reaching "
                    f"{nxt.name!r} has {dims[axis]} channels, not {source.size}."
                )
            ids = np.moveaxis(np.broadcast_to(source, dims[:axis] + dims[axis + 1 :] + [source.size]), -1, axis)
            if getattr(nxt, "data_format", None) == "channels_first" and len(dims) > 1:
                ids = np.moveaxis(ids, 0, -1)  # Flatten transposes to channels-last
            source = ids.reshape(-1)
            channels = "last"
        elif isinstance(nxt, _PASS_THROUGH):
            if isinstance(nxt, keras.layers.ReLU):
                if nxt.max_value is not None or nxt.threshold != 0:
                    raise ValueError(
                        f"Cannot rescale {layer.name!r}: {nxt.name!r} is a ReLU "
                        f"with max_value={nxt.max_value} and threshold="
                        f"{nxt.threshold}, which is not positively homogeneous."
                    )
                acts.add("relu")
            elif isinstance(nxt, keras.layers.LeakyReLU):
                acts.add("relu")
            elif isinstance(nxt, _POOLING):
                if _channels(nxt) not in (None, channels):
                    raise ValueError(
                        f"Cannot rescale {layer.name!r}: {nxt.name!r} pools with "
                        f"data_format={nxt.data_format!r}, which does not match "
                        f"the channel axis of its input, so it mixes channels."
                    )
                if type(nxt).__name__.startswith("Global") and not getattr(nxt, "keepdims", False):
                    channels = "last"
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

    k = keras.ops.convert_to_numpy(nxt.kernel)
    if (_channels(nxt) or "last") != channels:
        raise ValueError(
            f"Cannot rescale {layer.name!r}: {nxt.name!r} contracts the channels "
            f"{'last' if isinstance(nxt, keras.layers.Dense) else nxt.data_format}"
            f", but the units of {layer.name!r} reach it on the channels-{channels} axis."
        )
    inv = 1.0 / alpha[source]
    if k.shape[-2] != inv.shape[0]:
        raise ValueError(
            f"{nxt.name!r} has {k.shape[-2]} inputs but {layer.name!r} provides "
            f"{inv.shape[0]} after the layers in between."
        )
    shape = (1,) * (k.ndim - 2) + (inv.shape[0], 1)
    # Everything is checked: only now are weights written.
    layer.kernel.assign(keras.ops.convert_to_numpy(layer.kernel) * alpha)
    if layer.bias is not None:
        layer.bias.assign(keras.ops.convert_to_numpy(layer.bias) * alpha)
    nxt.kernel.assign(k * inv.reshape(shape))
    return model


__all__ = ["rescale"]
