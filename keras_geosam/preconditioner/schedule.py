"""When U is refreshed: one rule, read three ways.

A refresh is due before optimizer step ``t`` when ``t % every == 0`` and
``t < until`` (no ``until``: always), and, under the base optimizer's
k-step gradient accumulation, only on the step's first micro-batch (a step
refreshes once; every micro-batch of it sees the same U). In the base
optimizer's micro-batch counter ``m`` (``t = m // k``) that reads: due iff
``m % (k * every) == 0`` and ``m < k * until``.

- :meth:`RefreshSchedule.due`: the rule in ``keras.ops``, the device's
  decision inside the compiled step;
- :meth:`RefreshSchedule.due_at`: the rule on the host for a known count
  (``RefreshMonitor`` follows the count without reading the device);
- :meth:`RefreshSchedule.next_step`: host bounds on the counter
  (:class:`RefreshBounds`) that let JAX's gate and torch's eager step skip
  the refresh branch on steps that cannot be due, reading the device only
  near due steps.
"""

from keras import ops


class RefreshSchedule:
    """``every``, ``until`` (both settable between fits) and the base
    optimizer's accumulation steps (``accumulation()``, read at each use)."""

    def __init__(self, every, until=None, accumulation=lambda: 1):
        self.every = every
        self.until = until
        self.accumulation = accumulation
        self.bounds = RefreshBounds(self.in_micro_batches)

    def in_micro_batches(self):
        """``(every, until)`` in the micro-batch counter's units."""
        k = self.accumulation() or 1
        return self.every * k, None if self.until is None else self.until * k

    def due(self, micro_batches):
        """True (a tensor) when a refresh is due before the step the
        micro-batch counter `micro_batches` is at."""
        every, until = self.in_micro_batches()
        due = ops.equal(ops.mod(micro_batches, every), 0)
        if until is not None:
            due = ops.logical_and(due, ops.less(micro_batches, until))
        return due

    def due_at(self, micro_batches):
        """:meth:`due` on the host, for a known count."""
        every, until = self.in_micro_batches()
        return micro_batches % every == 0 and (until is None or micro_batches < until)

    def next_step(self, read_counter, can_read=True):
        """Whether the coming step may be due (see :class:`RefreshBounds`)."""
        return self.bounds.next_step(read_counter, can_read)

    def forget(self):
        """The counter may have changed behind the host's back."""
        self.bounds.forget()


class RefreshBounds:
    """Host-side bounds ``[low, high]`` on a step counter, so that most
    steps know without reading the device that no refresh is due: a refresh
    is due when the counter is a multiple of ``every`` below ``until``, both
    read from ``schedule()`` at every check (they may change between fits).

    A step advances the counter by at most one (not at all when it is
    skipped for non-finite values), so after each step ``high`` grows by
    one. Only when a due count lies within the bounds does the caller read
    the counter and ``collapse`` them onto it: about twice per refresh
    period. Unknown bounds (at the start, or after ``forget``) allow
    anything; the device-side rule decides every step the host lets
    through.
    """

    def __init__(self, schedule):
        self.schedule = schedule
        self.bounds = None

    @property
    def exact(self):
        return self.bounds is not None and self.bounds[0] == self.bounds[1]

    def may_be_due(self):
        if self.bounds is None:
            return True
        every, until = self.schedule()
        low, high = self.bounds
        if until is not None:
            high = min(high, until - 1)
        return -(-low // every) * every <= high  # a multiple of `every` in [low, high]

    def collapse(self, counter):
        self.bounds = (counter, counter)

    def advance(self):
        if self.bounds is not None:
            self.bounds = (self.bounds[0], self.bounds[1] + 1)

    def next_step(self, read_counter, can_read=True):
        """Whether the coming step may be due; then counts it. Calls
        ``read_counter()`` (a host read of the counter) only when the bounds
        allow a due count and are not exact, and `can_read`. With
        ``every <= 2`` every step may be due and nothing is read: reading
        would wait for the device on every step, for nothing."""
        if self.schedule()[0] <= 2:
            self.forget()
            return True
        if can_read and self.may_be_due() and not self.exact:
            self.collapse(read_counter())
        due = self.may_be_due()
        self.advance()
        return due

    def forget(self):
        self.bounds = None
