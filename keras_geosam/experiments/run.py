"""One run of either command: a freshly initialised MLP, compiled with a
fresh optimizer from the registry, trained within its budget."""

import time

from keras_geosam.experiments.budget import fit_within_budget
from keras_geosam.experiments.models import build_mlp
from keras_geosam.experiments.optimizers import OPTIMIZERS

# One model per architecture, reused by every run with fresh initial weights
# and a fresh optimizer: the sharpness functions cache their compiled kernels
# per model and loss object, so reuse saves a retrace per run (seconds each
# on JAX). The initial weights come from a model built anew with the run's
# seed, which draws the same random numbers as a fresh model would.
_POOL = {}
_POOL_SIZE = 4


def initialised_mlp(input_dim, num_classes, seed, width=128, depth=2, activation="relu"):
    """``(model, loss)``: an MLP (:func:`~keras_geosam.experiments.models.
    build_mlp`) holding the weights a fresh build with `seed` has, and its
    sparse categorical cross-entropy on logits; the same two objects for
    every run of one architecture (the last four kept).

    Example:

    >>> m1, loss = initialised_mlp(64, 10, seed=0, width=8)
    >>> m2, _ = initialised_mlp(64, 10, seed=1, width=8)
    >>> m1 is m2
    True
    """
    import keras

    arch = (int(input_dim), int(num_classes), int(width), int(depth), activation)
    fresh = build_mlp(input_dim, num_classes, seed, width, depth, activation)
    if arch not in _POOL:
        if len(_POOL) >= _POOL_SIZE:
            _POOL.pop(next(iter(_POOL)))
        _POOL[arch] = (fresh, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return _POOL[arch]
    model, loss = _POOL[arch]
    model.set_weights(fresh.get_weights())
    return model, loss


def train_run(model, loss, optimizer, learning_rate, x, y, batch_size, *, steps=0, epochs=None,
              target_train_loss=None, callbacks=(), **fit_kwargs):
    """Compiles `model` with a fresh `optimizer` (a name of
    :data:`~keras_geosam.experiments.optimizers.OPTIMIZERS`) at
    `learning_rate`, with accuracy, and trains it within the budget
    (:func:`~keras_geosam.experiments.budget.fit_within_budget`).

    Returns:
        ``(history, budget)``: ``budget`` has ``steps``, ``epochs``,
        ``converged`` and ``seconds`` (the wall time of ``fit``).

    Raises:
        KeyError: an unknown optimizer name.

    Example:

    >>> # history, budget = train_run(model, loss, "sam@adamw", 1e-3, x, y, 64, steps=500)
    """
    model.compile(optimizer=OPTIMIZERS[optimizer](learning_rate), loss=loss, metrics=["accuracy"])
    t0 = time.perf_counter()
    history, budget = fit_within_budget(model, x, y, batch_size, steps=steps, epochs=epochs,
                                        target_train_loss=target_train_loss, callbacks=callbacks, **fit_kwargs)
    budget["seconds"] = time.perf_counter() - t0
    return history, budget
