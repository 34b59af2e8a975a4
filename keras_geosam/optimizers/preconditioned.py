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
        self.preconditioner.build(self, var_list)

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

    def prepare_step(self, model, values, non_trainable, x, y):
        if self.preconditioner.refresh_source != "step":
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
        an accelerator means waiting for the device. The host instead keeps
        bounds on the step counter: it advances by at most one per step and
        stays put on a skipped step. Only when a due step lies within the
        bounds is the counter read (and the bounds collapse to it): about
        twice per refresh period instead of every step."""
        from keras import ops

        bounds = self.__dict__.get("_step_bounds")  # the counter's range at this call
        every, until = self.preconditioner.refresh_every, self.preconditioner.refresh_until
        if bounds is not None:
            low, high = bounds
            never = until is not None and low >= until
            if never or -(-low // every) * every > high:  # no multiple of `every` in [low, high]
                self._step_bounds = (low, high + 1)
                return False
        step = int(ops.convert_to_numpy(self.iterations))
        self._step_bounds = (step, step + 1)
        return True

    def _forget_step_bounds(self):
        self.__dict__.pop("_step_bounds", None)

    def load_own_variables(self, store):
        self._forget_step_bounds()  # the counter may change under the host
        super().load_own_variables(store)

    def set_weights(self, weights):
        self._forget_step_bounds()
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


# U's settings read like the optimizer's own (opt.structure, opt.clip_norm, ...).
for _name in ("structure", "divergence", "refresh_every") + OPTIONS:
    setattr(PreconditionedOptimizer, _name, property(lambda self, _n=_name: getattr(self.preconditioner, _n)))
