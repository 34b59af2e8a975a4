"""PreconditionedOptimizer: a two-pass optimizer that owns a learned U.

LLQR and LLQRSAM both hold a
:class:`~keras_geosam.preconditioner.LearnedPreconditioner` (U's
configuration, variables and refresh live in ``keras_geosam/preconditioner``)
and differ only in the perturbation. This class wires U into the two-pass
step: U's variables are created as optimizer variables, the in-step refresh
runs before the centre pass, and the descent direction is ``U g``.
"""

from keras_geosam import backend
from keras_geosam.optimizers.base import TwoPassOptimizer
from keras_geosam.preconditioner import OPTIONS
from keras_geosam.preconditioner import LearnedPreconditioner


class PreconditionedOptimizer(TwoPassOptimizer):
    """Base of LLQR and LLQRSAM. Keyword arguments of
    :class:`~keras_geosam.preconditioner.LearnedPreconditioner` (``structure``,
    ``divergence``, ``refresh_every``, ``refresh_source``, ``refresh_steps``,
    ``inner_learning_rate``, ``inner_momentum``, ``clip_norm``, ``beta``,
    ``min_diagonal``, ``coupled_weight_decay``) configure U."""

    def __init__(self, base_optimizer, structure="diagonal", divergence="ngd", refresh_every=1000, **kwargs):
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in OPTIONS}
        super().__init__(base_optimizer, **kwargs)
        self.preconditioner = LearnedPreconditioner(structure=structure, divergence=divergence, refresh_every=refresh_every, **options)

    refreshes = property(lambda self: self.preconditioner.refreshes, doc="How many refreshes U has had (an integer optimizer variable).")

    def build_state(self, var_list):
        owner = getattr(self, "_geosam_owner", None)
        self.preconditioner.build(self, var_list, owner() if owner is not None else None)

    def check_model(self, model, refresh_source=None):
        self.preconditioner.check_model(model, refresh_source)

    def refresh_due(self):
        """True (a tensor) when U is due for a refresh before this step: the
        optimizer step is a multiple of ``refresh_every`` and, under the base
        optimizer's gradient accumulation, this is the step's first
        micro-batch (so a step refreshes once, and every micro-batch of it
        is preconditioned by the same U)."""
        from keras import ops

        due = ops.equal(ops.mod(self.iterations, self.refresh_every), 0)
        if self.preconditioner.refresh_until is not None:
            due = ops.logical_and(due, ops.less(self.iterations, self.preconditioner.refresh_until))
        k = self.base_optimizer.gradient_accumulation_steps
        if k:
            micro = self.base_optimizer._iterations
            due = ops.logical_and(due, ops.equal(ops.mod(micro, k), 0))
        return due

    @property
    def prepares_steps(self):
        """Whether ``prepare_step`` can do work (U refreshed in the step)."""
        return self.preconditioner.refresh_source == "step"

    @property
    def refresh_counter(self):
        """The variable the host's ``refresh_bounds`` count: the base
        optimizer's step counter, in micro-batches under gradient
        accumulation (where ``iterations`` is derived from it)."""
        return self.base_optimizer._iterations

    def refresh_schedule(self):
        """``(every, until)`` in ``refresh_counter``'s units: with k-step
        gradient accumulation a refresh is due at micro-batch counts that
        are multiples of k * refresh_every (the first micro-batch of a due
        optimizer step), exactly as ``refresh_due`` decides on the device."""
        k = self.base_optimizer.gradient_accumulation_steps or 1
        until = self.preconditioner.refresh_until
        return self.preconditioner.refresh_every * k, None if until is None else until * k

    @property
    def refresh_bounds(self):
        """The host's :class:`RefreshBounds` on ``refresh_counter``."""
        bounds = self.__dict__.get("_refresh_bounds")
        if bounds is None:
            bounds = self._refresh_bounds = RefreshBounds(self.refresh_schedule)
        return bounds

    def prepare_step(self, model, values, non_trainable, x, y):
        if not self.prepares_steps:
            return []  # a callback refreshes U, outside the step
        refresh = self.__dict__.get("_refresh_fn")
        if refresh is None:  # wrapped once (torch: run eagerly under torch.compile)
            refresh = self._refresh_fn = backend.uncompiled(self._refresh_in_step)
        return refresh(model, values, non_trainable, x, y)

    def _refresh_in_step(self, model, values, non_trainable, x, y):
        if backend.eager_steps and not self._maybe_due():
            return []  # certainly not due: no condition to read on the host
        return self.preconditioner.prepare_step(self.refresh_due(), model, values, non_trainable, x, y)

    def _maybe_due(self):
        """Eager steps (torch) decide ``refresh_due`` on the host, which on
        an accelerator means waiting for the device: the counter is read
        only when the host's bounds on it allow a due step."""
        from keras import ops

        return self.refresh_bounds.next_step(lambda: int(ops.convert_to_numpy(self.refresh_counter)))

    def forget_step_bounds(self):
        """The step counter may have changed behind the host's back."""
        self.refresh_bounds.forget()

    def load_own_variables(self, store):
        self.forget_step_bounds()
        super().load_own_variables(store)

    def set_weights(self, weights):
        self.forget_step_bounds()
        super().set_weights(weights)

    def precondition(self, vectors):
        """U v for a list like the trainable variables."""
        return self.preconditioner.precondition(vectors)

    def refresh_now(self, model, x, y):
        """Refreshes U eagerly on batch ``(x, y)`` at the model's weights."""
        if not self.built:
            raise RuntimeError("Build the optimizer (compile and build the model) before refreshing U.")
        self.preconditioner.refresh_now(model, x, y)

    def get_config(self):
        config = super().get_config()
        config.update(self.preconditioner.get_config())
        return config


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
    anything; the device-side ``refresh_due`` decides every step the host
    lets through.
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


# U's settings read like the optimizer's own (opt.structure, opt.clip_norm, ...).
for _name in ("structure", "divergence", "refresh_every") + OPTIONS:
    setattr(PreconditionedOptimizer, _name, property(lambda self, _n=_name: getattr(self.preconditioner, _n)))
