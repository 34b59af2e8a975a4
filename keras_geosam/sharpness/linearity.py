"""Which networks make parts of the curvature exact.

- :func:`is_piecewise_linear` (spec section 4): ReLU/LeakyReLU-type
  activations, no normalisation. Such a network is linear in every single
  parameter, so ``diag H = diag F_exact`` and the undamped diagonal S_R
  counts the parameters with nonzero Fisher (the degeneracy).
- :func:`is_layerwise_linear`: the output is piecewise linear in each
  layer's parameters jointly (the other layers fixed), so every per-layer
  diagonal block of H equals the GGN's (spec section 6) and
  ``tr(M^-1 (H - GGN)) = 0`` for any metric M block-diagonal per layer. This
  holds for the piecewise-linear networks above and, because curvature is
  taken in inference mode, also with BatchNormalization (an affine map of
  its input with fixed moving statistics).

Both checks are conservative: a layer type, activation or operation they
do not know, a layer called more than once, or a subclassed model's opaque
``call`` makes them return False (the residual is then estimated, never
assumed zero).
"""

import keras

from keras_geosam import keras_internals

_PL_ACTIVATIONS = ("relu", "leaky_relu", "linear", "relu6")


def _linear_types():
    L = keras.layers
    names = [
        "Dense", "EinsumDense", "Conv1D", "Conv2D", "Conv3D", "Conv1DTranspose", "Conv2DTranspose",
        "Conv3DTranspose", "DepthwiseConv1D", "DepthwiseConv2D", "Flatten", "Reshape", "Permute",
        "RepeatVector", "Dropout", "SpatialDropout1D", "SpatialDropout2D", "SpatialDropout3D",
        "GaussianNoise", "GaussianDropout", "AlphaDropout", "ActivityRegularization",
        "MaxPooling1D", "MaxPooling2D", "MaxPooling3D", "AveragePooling1D", "AveragePooling2D",
        "AveragePooling3D", "GlobalAveragePooling1D", "GlobalAveragePooling2D",
        "GlobalAveragePooling3D", "GlobalMaxPooling1D", "GlobalMaxPooling2D", "GlobalMaxPooling3D",
        "ZeroPadding1D", "ZeroPadding2D", "ZeroPadding3D", "Cropping1D", "Cropping2D", "Cropping3D",
        "LeakyReLU", "ReLU", "PReLU", "InputLayer", "Identity", "Add", "Subtract", "Concatenate",
        "Average", "Maximum", "Minimum", "Rescaling",
    ]
    return tuple(getattr(L, n) for n in names if hasattr(L, n))


def _activation_ok(act, last, link):
    if act is None:
        return True
    name = getattr(act, "__name__", "")
    return name in _PL_ACTIVATIONS or (name == link and last)


def _check(model, allow_batchnorm, is_last=True, link="softmax"):
    # A Sequential or functional graph: every operation is a known layer,
    # and no layer is applied twice (weight sharing is not linear in W).
    if not isinstance(model, (keras.Sequential, keras_internals.Functional)):
        return False
    linear = _linear_types()
    operations = list(getattr(model, "operations", None) or model.layers)
    for i, op in enumerate(operations):
        # Only the model's final layer may apply the loss's link (a softmax
        # or sigmoid the loss reads as probabilities belongs to the loss); a
        # nested model's last layer is last only if the model is.
        last = is_last and i == len(operations) - 1
        if not isinstance(op, keras.layers.Layer):
            return False  # a raw keras.ops node of a functional graph
        if keras_internals.calls_of(op) > 1 and not isinstance(op, keras.layers.InputLayer):
            return False
        if isinstance(op, (keras.Sequential, keras_internals.Functional)):
            if not _check(op, allow_batchnorm, last, link):
                return False
            continue
        if isinstance(op, keras.layers.Softmax) and last and link == "softmax":
            continue  # belongs to the loss
        if isinstance(op, keras.layers.Activation):
            if not _activation_ok(op.activation, last, link):
                return False
            continue
        if isinstance(op, keras.layers.BatchNormalization):
            if not allow_batchnorm or getattr(op, "renorm", False):
                return False
            continue
        if isinstance(op, (keras.layers.UpSampling1D, keras.layers.UpSampling2D)):
            if getattr(op, "interpolation", "nearest") != "nearest":
                return False
            continue
        if not isinstance(op, linear):
            return False
        if not _activation_ok(getattr(op, "activation", None), last, link):
            return False
    return True


def is_piecewise_linear(model, link="softmax"):
    """Whether every layer is piecewise linear in each single parameter.

    True for ReLU/LeakyReLU/linear activations with no normalisation or
    other nonlinearity (the last layer's `link` belongs to the loss).
    Conservative: anything unknown gives False.

    Args:
        model: a Sequential or functional ``keras.Model`` (subclassed
            models give False).
        link: the output activation the loss reads as probabilities
            (``Likelihood.link``: ``"softmax"`` for a cross-entropy on
            probabilities, ``"sigmoid"`` for a binary one, `None` for
            logits or a squared error). Defaults to ``"softmax"``.

    Returns:
        A bool.

    Example:

    >>> relu = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="relu"),
    ...                          keras.layers.Dense(3)])
    >>> tanh = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh"),
    ...                          keras.layers.Dense(3)])
    >>> kg.sharpness.is_piecewise_linear(relu), kg.sharpness.is_piecewise_linear(tanh)
    (True, False)
    """
    return _check(model, allow_batchnorm=False, link=link)


def is_layerwise_linear(model, training=False, link="softmax"):
    """Whether every per-layer diagonal block of the Hessian equals the GGN's.

    True for piecewise-linear networks, BatchNormalization allowed in
    inference mode (module doc); then the residual ``tr(M^-1 (H - GGN))``
    is exactly zero for per-layer block-diagonal metrics.

    Args:
        model: a Sequential or functional ``keras.Model``.
        training: whether curvature is taken in training mode (then
            BatchNormalization is not linear). Defaults to `False`.
        link: as for :func:`is_piecewise_linear`.

    Returns:
        A bool.

    Example:

    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="relu"),
    ...                           keras.layers.BatchNormalization(), keras.layers.Dense(3)])
    >>> kg.sharpness.is_piecewise_linear(model), kg.sharpness.is_layerwise_linear(model)
    (False, True)
    >>> kg.sharpness.is_layerwise_linear(model, training=True)
    False
    """
    return _check(model, allow_batchnorm=not training, link=link)
