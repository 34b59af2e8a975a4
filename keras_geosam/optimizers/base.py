"""TwoPassOptimizer: the shared core of every SAM-family optimizer.

A two-pass optimizer wraps a base Keras optimizer the way
``keras.optimizers.LossScaleOptimizer`` does: its own variables plus the base
optimizer's, with ``learning_rate`` and ``iterations`` delegated, so learning
rate schedules, momentum, weight decay, clipping, EMA and gradient
accumulation all come from the base. It offers the two-pass train step
(``keras_geosam.training``) three pure pieces, written in ``keras.ops``:

- ``perturbation(centre_grads, values)`` -> eps (reads only its own state),
  or ``scaled_perturbation(centre_grads, values)`` -> ``(scale, direction)``
  when eps is a scalar times a direction (the step then forms theta + eps in
  one pass); whichever the most derived class defines is used;
- ``update_state(centre_grads, perturbed_grads)`` (e.g. F-SAM's average);
- ``descent_gradients(centre_grads, perturbed_grads, values)`` -> what the
  base optimizer receives (default: the perturbed gradient).

Keras hands an optimizer gradients only, never the loss, so a two-pass
optimizer cannot run inside a stock ``train_step``: its ``build`` refuses
unless a keras_geosam step owns it (``kg.Model``, ``kg.Sequential`` or
``kg.attach(model)``), so a plain model fails before any weight changes.
"""

import keras
from keras import ops

from keras_geosam import backend
from keras_geosam.curvature.operators.base import cast_to

_ATTACH_HINT = (
    "{name} is a two-pass optimizer: it needs the loss at perturbed weights, "
    "which a stock Keras train_step never gives an optimizer. Use "
    "kg.Model / kg.Sequential, or call `model = kg.attach(model)` on any "
    "existing keras.Model (keras-cv/keras-hub ones included) before "
    "compile() or fit()."
)
_BN_STATS = ("centre", "perturbed")
_DROPOUT = ("fresh", "same")
_PERTURBATION = ("global", "per_replica")
# Arguments that belong to the base optimizer, with Keras' defaults (passing
# the default is harmless, e.g. from a config; anything else is an error).
_BASE_ONLY_KWARGS = {
    "weight_decay": None, "clipnorm": None, "global_clipnorm": None,
    "clipvalue": None, "use_ema": False, "ema_momentum": 0.99,
    "ema_overwrite_frequency": None, "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}


def _defined_in(cls, name):
    return next(k for k in cls.__mro__ if name in k.__dict__)


def _scaled_is_newest(cls):
    """Whether `cls` takes eps from ``scaled_perturbation``: the class that
    defines it is at least as derived as the one defining ``perturbation``
    (so a subclass overriding ``perturbation`` alone is honoured)."""
    scaled = _defined_in(cls, "scaled_perturbation")
    return scaled is not TwoPassOptimizer and issubclass(scaled, _defined_in(cls, "perturbation"))


class _Untracked:
    """A plain holder: Keras' optimizer adopts any variable assigned to it
    (or held in an assigned list) as its own state, which the model's
    variables must not become."""

    def __init__(self, items):
        self.items = tuple(items)


class TwoPassOptimizer(keras.optimizers.Optimizer):
    """Base class of the two-pass optimizers: wraps a base optimizer.

    Subclasses define ``perturbation(centre_grads, values)`` (the step eps)
    or ``scaled_perturbation`` (eps as a scale and a direction), and may
    override ``update_state`` and ``descent_gradients`` (module doc). A
    subclass of SAM that overrides ``perturbation`` alone is honoured: the
    step uses whichever of the two the most derived class defines.
    Learning rate, iterations, momentum, weight decay and clipping all
    belong to the base optimizer. Train with ``kg.Model``,
    ``kg.Sequential`` or ``kg.attach(model)``.

    Args:
        base_optimizer: a ``keras.optimizers.Optimizer`` (or its config /
            identifier) that applies the descent step.
        bn_stats: which pass's BatchNorm moving statistics are kept,
            ``"centre"`` (default) or ``"perturbed"``; exactly one pass
            updates them.
        dropout: ``"fresh"`` (default) draws a new dropout mask in the
            perturbed pass; ``"same"`` reuses the centre pass's mask. On torch
            a Dropout layer created without a ``seed`` draws from torch's
            global RNG, so its masks differ between passes whatever this
            says; give such layers a seed for ``"same"``.
        grad_cosine: log ``grad_cosine``, cos(g_c, g_p), every step
            (default). It is the one statistic that needs the centre
            gradient after the perturbed pass: with `False` the step lets go
            of g_c once it has formed theta + eps, so SAM's step holds one
            copy of the weights more than its base optimizer's (the
            perturbed weights) instead of two (F-SAM keeps g_c for its
            average either way). ``sharpness_gap`` and ``grad_norm`` are
            logged either way.
        perturbation: under ``tf.distribute`` each replica sees its own
            gradient: ``"global"`` (default) all-reduces the centre gradient
            so every replica uses one perturbation; ``"per_replica"`` perturbs
            with each replica's own gradient ("m-sharpness", m = the
            per-replica batch). Under JAX ``keras.distribution`` gradients
            are already global, so only ``"global"`` is possible there.
        name: optimizer name. Defaults to `None`.

    Raises:
        ValueError: if `base_optimizer` is not a plain Keras optimizer (a
            two-pass or loss-scale optimizer is refused), if `bn_stats`,
            `dropout` or `perturbation` is not one of its values, or if a
            base-optimizer argument (``weight_decay``, ``clipnorm``, ...) or
            an unknown keyword is passed.
        RuntimeError: when built or applied outside a keras_geosam train
            step (a plain ``keras.Model``); the message names ``kg.attach``.

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> model = kg.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    >>> class HalfStep(kg.optimizers.TwoPassOptimizer):
    ...     # Ascends half a gradient step before taking the gradient.
    ...     def perturbation(self, centre_grads, values):
    ...         return [0.5 * g for g in centre_grads]
    >>> model.compile(
    ...     optimizer=HalfStep(keras.optimizers.SGD(0.1)),
    ...     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    ... )
    >>> history = model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    >>> int(model.optimizer.iterations)
    2
    >>> kg.optimizers.SAM(keras.optimizers.SGD(0.1), weight_decay=1e-4)
    Traceback (most recent call last):
    ...
    ValueError: SAM does not take `weight_decay`: set it on the base optimizer, ...
    """

    def __init__(self, base_optimizer, bn_stats="centre", dropout="fresh", perturbation="global", name=None,
                 grad_cosine=True, **kwargs):
        for key, default in _BASE_ONLY_KWARGS.items():
            if key in kwargs and kwargs.pop(key) != default:
                raise ValueError(
                    f"{type(self).__name__} does not take `{key}`: set it on "
                    f"the base optimizer, which applies the descent step."
                )
        if kwargs:
            raise ValueError(f"{type(self).__name__} got unexpected arguments {sorted(kwargs)}.")
        if isinstance(base_optimizer, (str, dict)):
            base_optimizer = keras.optimizers.get(base_optimizer)
        if not isinstance(base_optimizer, keras.optimizers.Optimizer):
            raise ValueError(
                f"base_optimizer must be a keras.optimizers.Optimizer, got {base_optimizer!r}."
            )
        if isinstance(base_optimizer, (TwoPassOptimizer, keras.optimizers.LossScaleOptimizer)):
            raise ValueError(
                "base_optimizer must be a plain optimizer (not a two-pass or "
                "loss-scale optimizer); mixed precision wraps the outer one."
            )
        if bn_stats not in _BN_STATS:
            raise ValueError(f"bn_stats must be one of {_BN_STATS}, got {bn_stats!r}.")
        if dropout not in _DROPOUT:
            raise ValueError(f"dropout must be one of {_DROPOUT}, got {dropout!r}.")
        if perturbation not in _PERTURBATION:
            raise ValueError(f"perturbation must be one of {_PERTURBATION}, got {perturbation!r}.")
        if not isinstance(grad_cosine, bool):
            raise ValueError(f"grad_cosine must be True or False, got {grad_cosine!r}.")
        super().__init__(learning_rate=0.0, name=name)
        self.base_optimizer = base_optimizer
        self.bn_stats = bn_stats
        self.dropout = dropout
        self.perturbation_mode = perturbation
        self.grad_cosine = grad_cosine
        self._owned_by_step = False

    # Gradients per step: 2 for the SAM family; LLQR alone needs only the
    # centre gradient but still the model (to refresh U), hence this step.
    num_passes = 2

    # Whether update_state or descent_gradients read the centre gradients
    # (F-SAM's average does); a subclass that does not says so, and the
    # step can then free them after the ascent (``keeps_centre_gradients``).
    reads_centre_gradients = True

    @property
    def keeps_centre_gradients(self):
        """Whether the step holds g_c through the perturbed pass: for
        ``grad_cosine`` or for this optimizer's own update."""
        return self.grad_cosine or self.reads_centre_gradients

    # Whether perturbation, update_state and descent_gradients take a sparse
    # gradient (TensorFlow's IndexedSlices for an Embedding) through the
    # backend's sparse-aware ops (vdot, add_scaled, scale); if not, the step
    # hands them dense gradients (one dense copy of such a gradient per pass).
    sparse_gradients = False

    @property
    def takes_sparse_gradients(self):
        """Whether the step may hand this optimizer sparse gradients: its own
        pieces take them (``sparse_gradients``) and so does its base. Keras'
        TensorFlow optimizers other than SGD (Adam, RMSprop, Adagrad, ...),
        and its norm and value clipping, treat the repeated rows of an
        IndexedSlices (a token seen twice in a batch) as separate entries,
        squaring before summing: their update differs from the dense one
        (and from JAX's and torch's), so those get dense gradients."""
        base = self.base_optimizer
        linear = type(base) is keras.optimizers.SGD and all(
            getattr(base, name, None) is None for name in ("clipnorm", "clipvalue", "global_clipnorm")
        )
        return self.sparse_gradients and linear

    # ---------------------------------------------------------- hooks ----
    # Whether prepare_step can do work; then ``preconditioner.schedule`` (host-side
    # bounds on the step counter) tells which steps may skip it.
    prepares_steps = False

    def prepare_step(self, model, values, non_trainable, x, y):
        """Runs before the centre pass at the unperturbed weights, with the
        step's batch (LLQR refreshes U here). Returns ``[(variable, value
        before)]`` for every variable it wrote: a step skipped for non-finite
        values puts them back. Nothing by default."""
        return []

    def check_model(self, model, refresh_source=None):
        """Raises if `model` (compiled) cannot be trained by this optimizer.
        Runs at compile time, before any JAX state leaves the variables."""

    def build_state(self, var_list):
        """Creates the optimizer's own variables (none by default)."""

    def perturbation(self, centre_grads, values):
        """The perturbation eps (a list like `values`). Subclasses define
        this or, when eps is a scalar times a direction,
        ``scaled_perturbation``."""
        scale, direction = self.scaled_perturbation(centre_grads, values)
        return [scale * d for d in direction]

    def scaled_perturbation(self, centre_grads, values):
        """eps as ``(scale, direction)``, eps = scale * direction, with
        `scale` a scalar tensor: the step then forms theta + eps in one
        pass over memory (``perturbed_weights``)."""
        raise NotImplementedError(f"{type(self).__name__} defines neither perturbation nor scaled_perturbation.")

    def perturbed_weights(self, centre_grads, values):
        """theta + eps, the weights of the perturbed pass."""
        if not _scaled_is_newest(type(self)):
            eps = self.perturbation(centre_grads, values)
            return [t + ops.cast(e, t.dtype) for t, e in zip(values, eps)]
        scale, direction = self.scaled_perturbation(centre_grads, values)
        scales = {}  # the scalar in each weight dtype, cast once
        for t in values:
            if t.dtype not in scales:
                scales[t.dtype] = ops.cast(scale, t.dtype)
        return [backend.add_scaled(t, cast_to(d, t.dtype), scales[t.dtype]) for t, d in zip(values, direction)]

    def update_state(self, centre_grads, perturbed_grads):
        """Updates own variables after both passes (nothing by default)."""

    def descent_gradients(self, centre_grads, perturbed_grads, values):
        return perturbed_grads

    # ------------------------------------------------------- plumbing ----
    def own_variable(self, reference, name, initializer="zeros"):
        return self.add_variable_from_reference(reference, name, initializer=initializer)

    def build(self, var_list):
        if self.built:  # Keras' loading calls build after compile has
            return
        if not self._owned_by_step:
            raise RuntimeError(_ATTACH_HINT.format(name=type(self).__name__))
        self.base_optimizer.build(var_list)
        super().build(var_list)
        self._built_for = _Untracked(var_list)
        self.build_state(var_list)

    @property
    def built_for(self):
        """The model variables this optimizer was built for, in order (the
        stateless JAX step maps new values onto them)."""
        return list(self._built_for.items)

    @property
    def variables(self):
        return super().variables + self.base_optimizer.variables

    @property
    def learning_rate(self):
        return self.base_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        self.base_optimizer.learning_rate = value

    @property
    def iterations(self):
        return self.base_optimizer.iterations

    def apply(self, grads, trainable_variables=None):
        raise RuntimeError(_ATTACH_HINT.format(name=type(self).__name__))

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise RuntimeError(_ATTACH_HINT.format(name=type(self).__name__))

    def apply_two_pass(self, centre_grads, perturbed_grads, trainable_variables):
        """Stateful update (TF, torch): own state, then the base optimizer."""
        values = [v.value for v in trainable_variables]
        self.update_state(centre_grads, perturbed_grads)
        descent = self.descent_gradients(centre_grads, perturbed_grads, values)
        self.base_optimizer.apply(descent, trainable_variables)

    def finalize_variable_values(self, var_list):
        self.base_optimizer.finalize_variable_values(var_list)

    def get_config(self):
        return {
            "name": self.name,
            "base_optimizer": keras.saving.serialize_keras_object(self.base_optimizer),
            "bn_stats": self.bn_stats,
            "dropout": self.dropout,
            "perturbation": self.perturbation_mode,
            "grad_cosine": self.grad_cosine,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["base_optimizer"] = keras.saving.deserialize_keras_object(
            config["base_optimizer"], custom_objects=custom_objects
        )
        return cls(**config)


def unwrap(optimizer):
    """``(two_pass_optimizer or None, loss_scale_optimizer or None)`` of a
    compiled optimizer (a two-pass one may sit inside a LossScaleOptimizer)."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        inner = optimizer.inner_optimizer
        return (inner if isinstance(inner, TwoPassOptimizer) else None), optimizer
    return (optimizer if isinstance(optimizer, TwoPassOptimizer) else None), None
