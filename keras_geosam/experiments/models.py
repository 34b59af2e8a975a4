"""The classifier both commands train."""


def build_mlp(input_dim, num_classes, seed, width=128, depth=2, activation="relu"):
    """An MLP (``keras_geosam.training.Sequential``) emitting logits.

    Args:
        input_dim: features per example.
        num_classes: output units.
        seed: reseeds Python, NumPy and the backend first
            (``keras.utils.set_random_seed``), fixing the weights and the
            order ``fit`` shuffles the data in.
        width: units per hidden layer.
        depth: hidden layers.
        activation: hidden activation (ReLU makes the diagonal and K-FAC
            S_R exact: no probe noise).

    Returns:
        An uncompiled model.

    Raises:
        ValueError: from Keras for an unknown activation.

    Example:

    >>> build_mlp(64, 10, seed=0, width=8).count_params()
    682
    """
    import keras

    from keras_geosam.training import Sequential

    keras.utils.set_random_seed(int(seed))
    layers = [keras.Input((int(input_dim),))]
    layers += [keras.layers.Dense(int(width), activation=activation) for _ in range(int(depth))]
    layers.append(keras.layers.Dense(int(num_classes)))
    return Sequential(layers)
