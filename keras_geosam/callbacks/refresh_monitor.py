"""RefreshMonitor: U's refresh count and the wall time refreshes cost, in ``logs``."""

import time

import keras

from keras_geosam import backend
from keras_geosam._checks import check_number
from keras_geosam.optimizers.base import unwrap
from keras_geosam.optimizers.preconditioned import PreconditionedOptimizer


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
      far, the in-step refreshes included:

      - timed exactly where the host runs the refresh itself: every
        refresh on eager torch, and every refresh of
        ``refresh_source="callback"`` (``PreconditionerRefresh``);
      - inside a compiled step (JAX, TensorFlow), from the step times: for
        every step that was due a refresh, its time (the device is waited
        for before and after it) minus the mean time of the steps without
        one, both without the time spent tracing and compiling (JAX's own
        compile events; on TensorFlow the trace of the step, not the graph
        optimisation after it), settled at the epoch's end so the total
        never decreases. The step-0 refresh, in the step that also
        compiles, is counted this way too.

      Only due steps and epoch ends wait for the device: the callback has
      no batch-end hook, so Keras keeps dispatching steps asynchronously.
      Which steps are due is followed on the host from the optimizer's
      step count at the start of ``fit``, so no step reads the device;
      steps skipped for non-finite gradients are not seen by the host and
      may shift the attribution by a step.

    With ``fit(verbose=1)`` (or 2), the first refresh that takes more than
    ``notice_seconds`` prints one line with its time.

    Attributes:
        due_steps: how many steps of this ``fit`` the host saw as due a
            refresh (equal to the change in ``refreshes`` unless a due
            step was skipped).

    Args:
        prefix: prepended to both keys.
        notice_seconds: a refresh longer than this prints one line when
            ``fit`` is verbose. Defaults to `5.0`.

    Raises:
        ValueError: if `prefix` is not a string or `notice_seconds` is
            negative.

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

    def __init__(self, prefix="", notice_seconds=5.0):
        super().__init__()
        if not isinstance(prefix, str):
            raise ValueError(f"prefix must be a string, got {prefix!r}.")
        self.prefix = prefix
        self.notice_seconds = check_number("notice_seconds", notice_seconds)
        self._optimizer = None
        self._noticed = False

    def on_train_begin(self, logs=None):
        opt = unwrap(getattr(self.model, "optimizer", None))[0]
        self._optimizer = opt if isinstance(opt, PreconditionedOptimizer) else None
        if self._optimizer is None:
            return
        # One read of the counter per fit; the host follows it from here.
        self._count = int(keras.ops.convert_to_numpy(opt.refresh_counter))
        self._per_call = int(getattr(self.model, "steps_per_execution", 1) or 1)
        self.due_steps = 0
        self._kind = None  # what the interval since the last wait holds
        self._due_times = []
        self._plain_time, self._plain_calls = 0.0, 0
        self._seconds = 0.0
        clock = opt.preconditioner.clock
        # Refreshes the host runs itself, or that a device clock times inside
        # the step, are on the clock, exactly (decided at the first step,
        # once the step is traced).
        self._exact = None
        self._clock_start, self._clock_count = clock.total(), clock.count

    def _due_and_advance(self):
        """Whether the coming call (``steps_per_execution`` micro-batches)
        holds a due step, by U's schedule on the followed counter."""
        schedule = self._optimizer.preconditioner.schedule
        due = any(schedule.due_at(self._count + i) for i in range(self._per_call))
        self._count += self._per_call
        return due

    def _wait(self):
        """Waits for the queued steps; returns ``(time, compile seconds so
        far)``."""
        backend.wait_for_step(self.model)
        return time.perf_counter(), backend.compile_seconds()

    def _close(self, now):
        if self._kind is None:
            return
        (t1, c1), (t0, c0) = now, self._t
        compiling = c1 - c0
        if self._kind == "due":
            self._due_times.append(t1 - t0 - compiling)
        elif self._kind == "plain" and self._calls and compiling == 0:
            # A plain interval that compiled (the first call of a program)
            # says nothing about a typical step: compiling costs more than
            # its events count.
            self._plain_time += t1 - t0
            self._plain_calls += self._calls

    def on_train_batch_begin(self, batch, logs=None):
        # Only "begin" hooks: a batch-end hook would make Keras read every
        # step's logs on the host (no asynchronous dispatch). The device is
        # waited for only around due steps and after the first step.
        if self._optimizer is None:
            return
        due = self._due_and_advance()
        self.due_steps += int(due)
        if self._exact is None and self._kind is not None:
            # The first step has been traced: the clock knows whether it
            # runs inside the step.
            pre = self._optimizer.preconditioner
            self._exact = pre.refresh_source == "callback" or pre.clock.exact_in_step
        if self._exact:
            self._notice_clock()
            return
        if due or self._kind != "plain":
            now = self._wait()
            self._close(now)
            self._t, self._kind, self._calls = now, ("due" if due else "plain"), 1
        else:
            self._calls += 1

    def on_test_begin(self, logs=None):
        # Validation inside fit is not a training step.
        if self._optimizer is not None and not self._exact and self._kind not in (None, "paused"):
            self._close(self._wait())
            self._kind = "paused"

    def refresh_seconds(self, epoch_end=False):
        """Wall time attributed to refreshes so far in this ``fit``. Each
        due step of a compiled step is settled once, against the mean of
        the plain steps seen by then, so the total never decreases."""
        if self._optimizer is None:
            return 0.0
        if self._exact:
            return float(self._optimizer.preconditioner.clock.total() - self._clock_start)
        if self._due_times and (self._plain_calls or epoch_end):
            # Without a typical step yet (an epoch of one plain interval,
            # which compiled), a due step counts whole: at most one step over.
            typical = self._plain_time / self._plain_calls if self._plain_calls else 0.0
            settled = [max(t - typical, 0.0) for t in self._due_times]
            self._seconds += sum(settled)
            self._due_times = []
            self._notice(max(settled))
        return float(self._seconds)

    def _notice_clock(self, epoch_end=False):
        clock = self._optimizer.preconditioner.clock
        if clock.count > self._clock_count:  # host-timed refreshes
            self._clock_count = clock.count
            self._notice(clock.last)
        elif epoch_end and not backend.eager_steps:
            # Timed inside the step: read once per epoch (a device read),
            # the epoch's refresh time (the longest refresh, if just one).
            total = clock.total()
            self._notice(total - getattr(self, "_clock_epoch", self._clock_start))
            self._clock_epoch = total

    def _notice(self, seconds):
        """One line, once, for a refresh longer than ``notice_seconds``."""
        if self._noticed or seconds <= self.notice_seconds or not (self.params or {}).get("verbose", 0):
            return
        self._noticed = True
        pre = self._optimizer.preconditioner
        print(
            f"LLQR: a refresh of U ({pre.structure}, {pre.refresh_steps} inner steps) took {seconds:.1f} s; "
            f"refresh_seconds in the logs counts them all (one every {pre.refresh_every} steps)."
        )

    def on_epoch_end(self, epoch, logs=None):
        if self._optimizer is None or logs is None:
            return
        if self._exact:
            self._notice_clock(epoch_end=True)
        elif self._kind not in (None, "paused"):
            self._close(self._wait())
            self._kind = "paused"
        logs[self.prefix + "refreshes"] = float(keras.ops.convert_to_numpy(self._optimizer.refreshes))
        logs[self.prefix + "refresh_seconds"] = self.refresh_seconds(epoch_end=True)
