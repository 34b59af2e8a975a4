"""RefreshMonitor: U's refresh count and the wall time refreshes cost, in ``logs``."""

import time

import keras


class RefreshMonitor(keras.callbacks.Callback):
    """Adds ``refreshes`` and ``refresh_seconds`` to the epoch ``logs``.

    A refresh of LLQR's U runs inside the compiled train step (or, with
    ``refresh_source="callback"``, in ``PreconditionerRefresh`` before it),
    so a step that refreshes takes far longer than the others. This callback
    says how many refreshes U has had and how much wall time they took, so a
    pause in ``fit`` is explained. ``kg.Model``, ``kg.Sequential`` and
    attached models add it to ``fit`` by themselves when the optimizer is
    ``LLQR`` or ``LLQRSAM``; pass your own instance to change `prefix`.

    - ``refreshes``: U's refresh count, read from the optimizer's variable
      at the end of the epoch (exact, saved with the optimizer).
    - ``refresh_seconds``: wall time of the refreshes in this ``fit`` so
      far: for every step that was due a refresh, its time (the device is
      waited for before and after it) minus the mean time of the steps
      without one (settled at the epoch's end, so the total never
      decreases). Only due steps and epoch ends wait for the device: the
      callback has no batch-end hook, so Keras keeps dispatching steps
      asynchronously.
      Which steps are due is followed on the host from the optimizer's
      step count at the start of ``fit``, so no step reads the device. The
      first step of a ``fit`` also compiles the step, so a refresh there is
      counted but not timed; steps skipped for non-finite gradients are
      not seen by the host and may shift the attribution by a step.

    Attributes:
        due_steps: how many steps of this ``fit`` the host saw as due a
            refresh (equal to the change in ``refreshes`` unless a due
            step was skipped).

    Args:
        prefix: prepended to both keys.

    Raises:
        ValueError: if `prefix` is not a string.

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(16, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=16)
    >>> model = kg.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    >>> model.compile(
    ...     optimizer=kg.optimizers.LLQR(keras.optimizers.SGD(0.1), refresh_every=2),
    ...     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    ... )
    >>> history = model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    >>> history.history["refreshes"]
    [2.0, 4.0]
    >>> all(s >= 0 for s in history.history["refresh_seconds"])
    True
    """

    def __init__(self, prefix=""):
        super().__init__()
        if not isinstance(prefix, str):
            raise ValueError(f"prefix must be a string, got {prefix!r}.")
        self.prefix = prefix
        self._optimizer = None

    def on_train_begin(self, logs=None):
        from keras_geosam.optimizers.preconditioned import PreconditionedOptimizer
        from keras_geosam.training.step import unwrap

        opt = unwrap(getattr(self.model, "optimizer", None))[0]
        self._optimizer = opt if isinstance(opt, PreconditionedOptimizer) else None
        if self._optimizer is None:
            return
        base = opt.base_optimizer
        self._k = int(base.gradient_accumulation_steps or 1)
        # One read of the counters per fit; the host follows them from here.
        self._step = int(keras.ops.convert_to_numpy(opt.iterations))
        self._micro = int(keras.ops.convert_to_numpy(base._iterations)) % self._k if self._k > 1 else 0
        self._per_call = int(getattr(self.model, "steps_per_execution", 1) or 1)
        self.due_steps = 0
        self._kind = None  # what the interval since the last wait holds
        self._due_times = []
        self._plain_time, self._plain_calls = 0.0, 0
        self._seconds = 0.0

    def _due_and_advance(self):
        pre = self._optimizer.preconditioner
        due = False
        for _ in range(self._per_call):
            if self._micro == 0 and self._step % pre.refresh_every == 0:
                if pre.refresh_until is None or self._step < pre.refresh_until:
                    due = True
            self._micro = (self._micro + 1) % self._k
            if self._micro == 0:
                self._step += 1
        return due

    def _wait(self):
        """Waits for the queued steps; returns the time."""
        from keras_geosam import backend

        backend.wait_for_step(self.model)
        return time.perf_counter()

    def _close(self, now):
        if self._kind == "due":
            self._due_times.append(now - self._t)
        elif self._kind == "plain" and self._calls:
            self._plain_time += now - self._t
            self._plain_calls += self._calls

    def on_train_batch_begin(self, batch, logs=None):
        # Only "begin" hooks: a batch-end hook would make Keras read every
        # step's logs on the host (no asynchronous dispatch). The device is
        # waited for only around due steps and after the first step.
        if self._optimizer is None:
            return
        due = self._due_and_advance()
        self.due_steps += int(due)
        if self._kind is None:  # the first call of fit compiles: not timed
            self._t, self._kind, self._calls = self._wait(), "compile", 1
        elif due or self._kind != "plain":
            now = self._wait()
            self._close(now)
            self._t, self._kind, self._calls = now, ("due" if due else "plain"), 1
        else:
            self._calls += 1

    def on_test_begin(self, logs=None):
        # Validation inside fit is not a training step.
        if self._optimizer is not None and self._kind not in (None, "paused"):
            self._close(self._wait())
            self._kind = "paused"

    def refresh_seconds(self):
        """Wall time attributed to refreshes so far in this ``fit``. Each
        due step is settled once, against the mean of the plain steps
        seen by then, so the total never decreases."""
        if self._optimizer is None:
            return 0.0
        if self._due_times and self._plain_calls:
            typical = self._plain_time / self._plain_calls
            self._seconds += sum(max(t - typical, 0.0) for t in self._due_times)
            self._due_times = []
        return float(self._seconds)

    def on_epoch_end(self, epoch, logs=None):
        if self._optimizer is None or logs is None:
            return
        if self._kind not in (None, "paused"):
            self._close(self._wait())
            self._kind = "paused"
        logs[self.prefix + "refreshes"] = float(keras.ops.convert_to_numpy(self._optimizer.refreshes))
        logs[self.prefix + "refresh_seconds"] = self.refresh_seconds()
