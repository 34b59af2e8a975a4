"""PreconditionedOptimizer: a two-pass optimizer that owns a learned U.

LLQR and LLQRSAM both hold a
:class:`~keras_geosam.preconditioner.LearnedPreconditioner` (U's
configuration, variables and refresh live in ``keras_geosam/preconditioner``)
and differ only in the perturbation. This class wires U into the two-pass
step: U's variables are created as optimizer variables, the in-step refresh
runs before the centre pass, and the descent direction is ``U g``.
"""

from keras import ops

from keras_geosam import keras_internals
from keras_geosam import backend
from keras_geosam.optimizers.base import TwoPassOptimizer
from keras_geosam.preconditioner import OPTIONS
from keras_geosam.preconditioner import LearnedPreconditioner


class _FromU:
    """A read-only optimizer attribute that is U's setting of the same name."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, optimizer, owner=None):
        return self if optimizer is None else getattr(optimizer.preconditioner, self.name)

    def __set__(self, optimizer, value):
        raise AttributeError(f"{self.name} is U's setting: set optimizer.preconditioner.{self.name}.")


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
        # The schedule counts micro-batches under the base's gradient accumulation.
        self.preconditioner.schedule.accumulation = lambda: self.base_optimizer.gradient_accumulation_steps or 1

    refreshes = property(lambda self: self.preconditioner.refreshes, doc="How many refreshes U has had (an integer optimizer variable).")

    # U's settings read like the optimizer's own (opt.structure, opt.clip_norm, ...).
    structure = _FromU()
    divergence = _FromU()
    refresh_every = _FromU()
    refresh_source = _FromU()
    refresh_steps = _FromU()
    refresh_until = _FromU()
    inner_learning_rate = _FromU()
    inner_momentum = _FromU()
    clip_norm = _FromU()
    beta = _FromU()
    min_diagonal = _FromU()
    coupled_weight_decay = _FromU()
    decay_mask = _FromU()

    def build_state(self, var_list):
        owner = getattr(self, "_geosam_owner", None)
        self.preconditioner.build(self, var_list, owner() if owner is not None else None)

    def check_model(self, model, refresh_source=None):
        self.preconditioner.check_model(model, refresh_source)

    def refresh_due(self):
        """True (a tensor) when U is due for a refresh before this step
        (``preconditioner.schedule``: a multiple of ``refresh_every`` below
        ``refresh_until``, on an accumulated step's first micro-batch)."""
        return self.preconditioner.schedule.due(self.refresh_counter)

    @property
    def prepares_steps(self):
        """Whether ``prepare_step`` can do work (U refreshed in the step)."""
        return self.preconditioner.refresh_source == "step"

    @property
    def refresh_counter(self):
        """The counter the schedule reads: the base optimizer's step
        counter, in micro-batches under gradient accumulation (where
        ``iterations`` is derived from it)."""
        return keras_internals.optimizer_step_counter(self.base_optimizer)

    def prepare_step(self, model, values, non_trainable, x, y):
        if not self.prepares_steps:
            return []  # a callback refreshes U, outside the step
        refresh = self.__dict__.get("_refresh_fn")
        if refresh is None:  # wrapped once (torch: run eagerly under torch.compile)
            refresh = self._refresh_fn = backend.uncompiled(self._refresh_in_step)
        return refresh(model, values, non_trainable, x, y)

    def _refresh_in_step(self, model, values, non_trainable, x, y):
        # Eager steps (torch) would decide the branch on the host, which on
        # an accelerator means waiting for the device: the schedule's host
        # bounds read the counter only near due steps.
        if backend.eager_steps and not self.preconditioner.schedule.next_step(self._read_counter):
            return []  # certainly not due
        return self.preconditioner.prepare_step(self.refresh_due(), model, values, non_trainable, x, y)

    def _read_counter(self):
        return int(ops.convert_to_numpy(self.refresh_counter))

    def load_own_variables(self, store):
        self.preconditioner.schedule.forget()  # the counter changes behind the host's back
        super().load_own_variables(store)

    def set_weights(self, weights):
        self.preconditioner.schedule.forget()
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
