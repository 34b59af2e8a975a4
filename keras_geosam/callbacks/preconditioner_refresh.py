"""PreconditionerRefresh: refresh LLQR's U from a dataset you pass."""

import keras
import numpy as np
from keras import ops

from keras_geosam._checks import check_int
from keras_geosam.curvature.tokens import check_inputs_fit
from keras_geosam.optimizers.base import unwrap


class PreconditionerRefresh(keras.callbacks.Callback):
    """Refreshes an LLQR/LLQRSAM preconditioner on its own batches.

    Use with ``refresh_source="callback"`` on the optimizer. Before every
    step ``t`` with ``t % refresh_every == 0`` it draws the next
    preconditioner batch of `batch_size` examples from ``(x, y)``
    (reshuffled each pass with `seed`), runs the refresh eagerly at the
    current weights and writes U, which step t then uses (as with the
    in-step refresh). Needs ``steps_per_execution=1``: Keras calls batch
    callbacks once per execution, so due steps inside one would be missed.

    Args:
        x, y: the data preconditioner batches are drawn from: arrays of
            equal length, or structures of them as ``fit`` takes (a dict of
            named inputs, a list or tuple for several inputs or outputs).
        batch_size: examples per refresh batch (at most the data size).
            Defaults to `128`.
        seed: seeds the reshuffling. Defaults to `0`.

    Raises:
        ValueError: if the arrays of `x` and `y` differ in length or `batch_size` is not
            an integer >= 1; at the start of training, if the optimizer is
            not an LLQR/LLQRSAM with ``refresh_source="callback"`` or
            ``steps_per_execution`` is above 1.

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> model = kg.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    >>> model.compile(
    ...     optimizer=kg.optimizers.LLQR(keras.optimizers.SGD(0.1), refresh_every=2,
    ...                                  refresh_steps=5, refresh_source="callback"),
    ...     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    ... )
    >>> refresher = kg.callbacks.PreconditionerRefresh(x, y, batch_size=4)
    >>> history = model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[refresher])
    >>> refresher.num_refreshes, int(model.optimizer.refreshes)  # at steps 0 and 2
    (2, 2)
    """

    def __init__(self, x, y, batch_size=128, seed=0):
        super().__init__()
        self.x, self.y = (keras.tree.map_structure(lambda a: np.asarray(ops.convert_to_numpy(a)), a) for a in (x, y))
        lengths = {len(a) for a in keras.tree.flatten((self.x, self.y))}
        if len(lengths) != 1:
            raise ValueError(f"The arrays of x and y differ in length ({sorted(lengths)}).")
        (self._n,) = lengths
        self.batch_size = min(check_int("batch_size", batch_size), self._n)
        self._rng = np.random.default_rng(seed)
        self._order, self._pos = self._rng.permutation(self._n), 0
        self.num_refreshes = 0

    def _optimizer(self):
        opt, _ = unwrap(self.model.optimizer)
        if opt is None or not hasattr(opt, "refresh_now"):
            raise ValueError("PreconditionerRefresh needs a model compiled with kg.optimizers.LLQR or LLQRSAM.")
        if opt.refresh_source != "callback":
            raise ValueError(
                'PreconditionerRefresh needs the optimizer built with refresh_source="callback"; '
                "otherwise U is already refreshed inside the train step."
            )
        return opt

    def set_model(self, model):
        # Keras sets the model before fit builds its step; checking here keeps
        # JAX's variables intact on error (later, fit has moved them out).
        super().set_model(model)
        opt, _ = unwrap(getattr(model, "optimizer", None))
        if opt is not None and hasattr(opt, "check_model"):
            opt.check_model(model, refresh_source="step")
        # Named inputs and token ids, before U is refreshed from them.
        check_inputs_fit(model, self.x)

    def on_train_begin(self, logs=None):
        self._optimizer()
        if int(getattr(self.model, "steps_per_execution", 1) or 1) > 1:
            raise ValueError(
                "PreconditionerRefresh needs compile(steps_per_execution=1): Keras "
                "calls batch callbacks once per execution, so refreshes due inside "
                'one would be skipped. Use refresh_source="step" instead.'
            )

    def _next_batch(self):
        if self._pos + self.batch_size > self._n:
            self._order, self._pos = self._rng.permutation(self._n), 0
        idx = self._order[self._pos : self._pos + self.batch_size]
        self._pos += self.batch_size
        return keras.tree.map_structure(lambda a: a[idx], (self.x, self.y))

    def on_train_batch_begin(self, batch, logs=None):
        opt = self._optimizer()
        if bool(ops.convert_to_numpy(opt.refresh_due())):
            xb, yb = self._next_batch()
            opt.refresh_now(self.model, xb, yb)
            self.num_refreshes += 1
