"""Attaching the two-pass step: kg.Model, kg.Sequential, kg.attach.

Keras optimizers only ever see gradients, so SAM-family training needs a
model-level ``train_step`` (see ``step.py``). It is active only when the
compiled optimizer is a two-pass one; with any other optimizer these models
train exactly like their Keras parents.
"""

import types
import weakref

import keras

from keras_geosam import keras_internals
from keras_geosam._checks import check_rematerialisation
from keras_geosam.callbacks.refresh_monitor import RefreshMonitor
from keras_geosam.optimizers.preconditioned import PreconditionedOptimizer
from keras_geosam.training import step as _step

__all__ = ["Model", "Sequential", "attach"]


def _prepare(model):
    """Marks a compiled two-pass optimizer as owned by this step, creates the
    SAM statistics trackers and builds the optimizer before any tracing."""
    opt, _ = _step.unwrap(getattr(model, "optimizer", None))
    if opt is None:
        return
    if opt.perturbation_mode == "per_replica" and keras.backend.backend() == "jax":
        if keras.distribution.distribution() is not None:
            raise ValueError(
                'perturbation="per_replica" is not available on JAX: under '
                "keras.distribution the gradient of the sharded batch is "
                'already global. Use perturbation="global".'
            )
    opt.check_model(model)
    check_rematerialisation(model, "the two-pass step")
    owner = getattr(opt, "_geosam_owner", None)
    owner = owner() if owner is not None else None
    # The earlier model still compiled with this very optimizer: a conflict.
    if owner is not None and owner is not model and _step.unwrap(getattr(owner, "optimizer", None))[0] is opt:
        # On JAX the two models would silently share slots and U; TF and
        # torch fail later, less clearly.
        raise ValueError(
            f"This {type(opt).__name__} instance is already compiled into the model "
            f"{owner.name!r}: a two-pass optimizer holds one model's state (slots, U, "
            f"averages). Create one optimizer per model."
        )
    opt._geosam_owner = weakref.ref(model)
    opt._owned_by_step = True
    # A built subclassed model (keras-hub, keras-cv) locks its state; metrics
    # are no weights, so adding the trackers is safe.
    with keras_internals.unlocked_tracking(model):
        for name in _step.SAM_METRICS if opt.num_passes == 2 else ():
            if name == "grad_cosine" and not opt.grad_cosine:
                continue
            if getattr(model, "_geosam_" + name, None) is None:
                setattr(model, "_geosam_" + name, keras.metrics.Mean(name=name))
        if getattr(model, "_geosam_skipped_steps", None) is None:
            model._geosam_skipped_steps = keras.metrics.Sum(name="skipped_steps")
    if model.built and not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)


def _with_refresh_monitor(model, kwargs):
    """``fit``'s keyword arguments with a RefreshMonitor in front when the
    optimizer learns a U (so its stalls are explained in the logs)."""
    opt = _step.unwrap(getattr(model, "optimizer", None))[0]
    callbacks = kwargs.get("callbacks")
    if not isinstance(opt, PreconditionedOptimizer) or isinstance(callbacks, keras.callbacks.CallbackList):
        return kwargs
    callbacks = list(callbacks or [])
    if not any(isinstance(c, RefreshMonitor) for c in callbacks):
        callbacks.insert(0, RefreshMonitor())
    return dict(kwargs, callbacks=callbacks)


def _fit_x(args, kwargs):
    """The `x` of a ``fit(*args, **kwargs)`` call (None if absent)."""
    return kwargs.get("x", args[0] if args else None)


def _check_fit_batches(model, args, kwargs):
    """Array data under a keras.distribution or tf.distribute strategy:
    every batch must split evenly over the devices
    (``kg.distribution.check_batches``)."""
    from keras_geosam import backend
    from keras_geosam.distribution import check_batches

    if backend.data_parallel_shards(model) <= 1:
        return

    x = _fit_x(args, kwargs)
    first = keras.tree.flatten(x)[0] if x is not None and keras.tree.is_nested(x) else x
    if first is None or not hasattr(first, "shape") or not hasattr(first, "__len__"):
        return  # a dataset or generator sets its own batches
    batch_size = kwargs.get("batch_size", args[2] if len(args) > 2 else None) or 32
    check_batches(int(first.shape[0]), int(batch_size), model)


def _check_fit_inputs(model, args, kwargs):
    """Array inputs: named inputs present and token ids inside every
    Embedding's vocabulary, before the first step (``curvature.tokens``). A
    step on an out-of-range id is NaN on JAX and would only be skipped,
    without naming the id. A dataset or generator is not read ahead."""
    from keras_geosam.curvature.tokens import check_inputs_fit

    x = _fit_x(args, kwargs)
    leaves = keras.tree.flatten(x) if x is not None else []
    if leaves and all(hasattr(a, "shape") and hasattr(a, "__len__") for a in leaves):
        check_inputs_fit(model, x)


def _multi_worker(strategy):
    """Whether `strategy` is a MultiWorkerMirroredStrategy spanning several
    workers (Keras' own test for its multi-worker reductions)."""
    if strategy is None or keras.backend.backend() != "tensorflow":
        return False
    return keras_internals.multi_worker(strategy)


def _first_batch_for_build(model, iterator, data_batch):
    """TensorFlow trainer only. Keras 3.15 takes the shapes of the first
    distributed batch from strategy.reduce("MEAN", batch), which
    MultiWorkerMirroredStrategy cannot do on a nested (x, y) structure
    ("Attempt to convert a value (PerReplica...)", keras-team/keras#20585).
    A local replica's batch has the same shapes."""
    if iterator is not None and data_batch is None and _multi_worker(keras_internals.distribute_strategy(model)):
        return None, _local_batch(iterator)
    return iterator, data_batch


def _build_before_tracing(model, iterator, data_batch):
    """TensorFlow trainer only. Without a distribution strategy Keras 3.15
    builds the model and optimizer inside the first trace of the train
    function; the two-pass step needs both before it (``stateless_call`` on
    the model, U and its refresh count in the optimizer), so a model
    without an ``Input`` is built here from the first batch. Returns
    whether it built."""
    opt = _step.unwrap(getattr(model, "optimizer", None))[0]
    if opt is None or keras_internals.distribute_strategy(model) is not None:
        return False
    if model.built and model.optimizer.built:
        return False
    if data_batch is None and iterator is not None:
        data_batch = _local_batch(iterator)
    if data_batch is None:
        return False
    keras_internals.symbolic_build(model, data_batch)
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    return True


def _replica_axis(model, logs):
    """A step's logs, given a leading replica axis under a multi-worker
    strategy. Keras 3.15 averages them over multi-worker replicas with
    strategy.reduce("MEAN", v, axis=0), which fails on the scalars a step
    returns; along a replica axis it is the mean over replicas, as under
    MirroredStrategy."""
    if not _multi_worker(getattr(model, "distribute_strategy", None)):
        return logs
    return {k: keras.ops.expand_dims(v, 0) for k, v in logs.items()}


def _local_batch(iterator):
    """The first batch of a TF epoch iterator, its distributed values
    replaced by the first local replica's."""
    import tensorflow as tf

    for _, _, it in iterator:
        batch = next(it)
        break

    def local(value):
        if isinstance(value, tf.distribute.DistributedValues):
            return value.values[0]
        return value

    return keras.tree.map_structure(local, batch)


def _metrics_result(model, result):
    """`result` (Keras' get_metrics_result dict) without the step's trackers."""
    ours = {id(t) for t in _step.step_trackers(model)}
    if not ours:
        return result
    hidden = {m.name for m in model.metrics if id(m) in ours}
    return {k: v for k, v in result.items() if k not in hidden}


class TwoPassStepMixin:
    """Gives a keras.Model the exact two-pass train step."""

    def get_metrics_result(self):
        return _metrics_result(self, super().get_metrics_result())

    def compile(self, *args, **kwargs):
        super().compile(*args, **kwargs)
        _prepare(self)

    def compile_from_config(self, config):
        # Keras skips compiling on load when compile() is overridden.
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if hasattr(self, "optimizer") and self.built:
            self.optimizer.build(self.trainable_variables)

    def make_train_function(self, force=False):
        _prepare(self)
        result = super().make_train_function(force=force)
        _step.gate_preparation(self)
        return result

    def fit(self, *args, **kwargs):
        from keras_geosam.distribution import layout_errors

        _check_fit_batches(self, args, kwargs)
        with layout_errors():
            return super().fit(*args, **_with_refresh_monitor(self, kwargs))

    def train_step(self, *args):
        if _step.unwrap(self.optimizer)[0] is None:
            return _replica_axis(self, super().train_step(*args))
        return _replica_axis(self, _step.train_step(self, *args))

    def test_step(self, *args):
        return _replica_axis(self, super().test_step(*args))


def _build_hook(self, iterator=None, data_batch=None):
    """The TensorFlow trainer's build before tracing (``BUILD_HOOK``), first
    building a two-pass step's model and optimizer from the first batch."""
    iterator, data_batch = _first_batch_for_build(self, iterator, data_batch)
    if not _build_before_tracing(self, iterator, data_batch):
        stock = getattr(super(TwoPassStepMixin, self), keras_internals.BUILD_HOOK)
        return stock(iterator=iterator, data_batch=data_batch)


setattr(TwoPassStepMixin, keras_internals.BUILD_HOOK, _build_hook)


def _functional_arguments(args, kwargs):
    """Whether ``Model(*args, **kwargs)`` is a functional model's
    construction: inputs and outputs given, as Keras' ``Model.__new__``
    decides (it does not export its test)."""
    return len(args) == 2 or (len(args) == 1 and "outputs" in kwargs) or ("inputs" in kwargs and "outputs" in kwargs)


@keras.saving.register_keras_serializable(package="keras_geosam")
class Model(TwoPassStepMixin, keras.Model):
    """A ``keras.Model`` with the exact two-pass train step of the SAM family.

    Use it as ``keras.Model``: functionally, ``kg.Model(inputs, outputs)``,
    or as a base class, ``class Net(kg.Model)``. Compiled with a two-pass
    optimizer (``kg.optimizers.SAM``, ``FSAM``, ``FisherSAM``, ``LLQR``,
    ``LLQRSAM``), every step takes both gradients on the same batch (LLQR
    takes one, and refreshes U from the model) and the SAM variants add the
    ``sharpness_gap``, ``grad_norm`` and ``grad_cosine`` metrics to the
    logs; with any other optimizer it trains exactly as ``keras.Model``.

    Args:
        *args, **kwargs: the arguments of ``keras.Model``: ``inputs``,
            ``outputs`` and ``name`` for a functional model, or the
            subclass's own arguments.

    Raises:
        ValueError: from ``compile``, when the two-pass optimizer instance
            is already compiled into another model, or cannot train this
            one (e.g. LLQR's default ``divergence="ngd"`` without a
            cross-entropy loss).

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> inputs = keras.Input((4,))
    >>> model = kg.Model(inputs, keras.layers.Dense(3)(inputs))
    >>> model.compile(
    ...     optimizer=kg.optimizers.SAM(keras.optimizers.SGD(0.1), rho=0.05),
    ...     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    ... )
    >>> history = model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    >>> len(history.history["loss"]), "sharpness_gap" in history.history
    (2, True)
    """

    def __new__(cls, *args, **kwargs):
        # keras.Model(inputs, outputs) rebases the class onto Functional in
        # place, which would break `class Net(kg.Model)` for the rest of the
        # process; build functional instances from a fixed subclass instead.
        if cls is Model and _functional_arguments(args, kwargs):
            return keras.Model.__new__(FunctionalModel, *args, **kwargs)
        return super().__new__(cls, *args, **kwargs)


@keras.saving.register_keras_serializable(package="keras_geosam")
class FunctionalModel(Model, keras_internals.Functional):
    """What ``kg.Model(inputs, outputs)`` returns: a functional model with
    the two-pass step (``isinstance(m, kg.Model)`` holds)."""


@keras.saving.register_keras_serializable(package="keras_geosam")
class Sequential(TwoPassStepMixin, keras.Sequential):
    """A ``keras.Sequential`` with the exact two-pass train step.

    Behaves as ``keras.Sequential``; compiled with a two-pass optimizer,
    each step takes both gradients on the same batch (see ``kg.Model``).

    Args:
        layers: list of layers to add to the model. Defaults to `None`.
        trainable: whether the model's variables are trainable. Defaults
            to `True`.
        name: name of the model. Defaults to `None`.

    Raises:
        ValueError: from ``compile``, as for ``kg.Model``.

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> model = kg.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    >>> model.compile(
    ...     optimizer=kg.optimizers.SAM(keras.optimizers.SGD(0.1)),
    ...     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    ... )
    >>> history = model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    >>> isinstance(model, keras.Sequential), "grad_cosine" in history.history
    (True, True)
    """

    def __init__(self, *args, **kwargs):
        from keras_geosam.distribution import layout_errors

        with layout_errors():  # layers given with an Input build here
            super().__init__(*args, **kwargs)


def attach(model):
    """Gives an existing ``keras.Model`` the two-pass train step, in place.

    For models built elsewhere (functional, subclassed, keras-cv or
    keras-hub). Works before or after ``compile``. The instance's
    ``train_step`` and ``compile`` are overridden; the class is untouched.
    Saved to ``.keras`` with a two-pass optimizer, the model comes back
    attached, with all optimizer state, from ``keras.models.load_model``
    once keras_geosam is imported (see ``_compile_from_config``); without
    keras_geosam the load fails on the optimizer's registered name,
    ``keras_geosam>...``. A plain model compiled with a two-pass optimizer
    raises a ``RuntimeError`` naming ``kg.attach`` at its first step, before
    any weight changes.

    Args:
        model: a ``keras.Model``. Attaching twice is harmless.

    Returns:
        The same model object.

    Raises:
        TypeError: if `model` is not a ``keras.Model``.
        ValueError: from ``compile`` (here if `model` is already compiled),
            as for ``kg.Model``.

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    >>> model.compile(
    ...     optimizer=kg.optimizers.SAM(keras.optimizers.SGD(0.1)),
    ...     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    ... )
    >>> model.fit(x, y, verbose=0)
    Traceback (most recent call last):
    ...
    RuntimeError: SAM is a two-pass optimizer: ...kg.attach(model)...
    >>> model = kg.attach(model)
    >>> history = model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    >>> "sharpness_gap" in history.history
    True
    """
    if isinstance(model, TwoPassStepMixin) or getattr(model, "_geosam_attached", False):
        return model
    if not isinstance(model, keras.Model):
        raise TypeError(f"kg.attach needs a keras.Model, got {type(model).__name__}.")
    stock_step = type(model).train_step
    stock_test_step = type(model).test_step
    stock_build = getattr(type(model), keras_internals.BUILD_HOOK, None)
    stock_compile = model.compile
    stock_result = type(model).get_metrics_result
    stock_fit = model.fit
    stock_make_train_function = type(model).make_train_function

    def train_step(self, *args):
        if _step.unwrap(self.optimizer)[0] is None:
            return _replica_axis(self, stock_step(self, *args))
        return _replica_axis(self, _step.train_step(self, *args))

    def test_step(self, *args):
        return _replica_axis(self, stock_test_step(self, *args))

    def maybe_symbolic_build(self, iterator=None, data_batch=None):
        iterator, data_batch = _first_batch_for_build(self, iterator, data_batch)
        if not _build_before_tracing(self, iterator, data_batch):
            return stock_build(self, iterator=iterator, data_batch=data_batch)

    def compile(*args, **kwargs):
        stock_compile(*args, **kwargs)
        _prepare(model)

    def get_metrics_result(self):
        return _metrics_result(self, stock_result(self))

    def make_train_function(self, force=False):
        result = stock_make_train_function(self, force=force)
        _step.gate_preparation(self)
        return result

    def fit(*args, **kwargs):
        from keras_geosam.distribution import layout_errors

        _check_fit_batches(model, args, kwargs)
        _check_fit_inputs(model, args, kwargs)
        with layout_errors():
            return stock_fit(*args, **_with_refresh_monitor(model, kwargs))

    object.__setattr__(model, "fit", fit)
    object.__setattr__(model, "train_step", types.MethodType(train_step, model))
    object.__setattr__(model, "test_step", types.MethodType(test_step, model))
    if stock_build is not None:  # the TensorFlow trainer's
        object.__setattr__(model, keras_internals.BUILD_HOOK, types.MethodType(maybe_symbolic_build, model))
    object.__setattr__(model, "get_metrics_result", types.MethodType(get_metrics_result, model))
    object.__setattr__(model, "make_train_function", types.MethodType(make_train_function, model))
    object.__setattr__(model, "compile", compile)
    object.__setattr__(model, "_geosam_attached", True)
    model.train_function = None
    if model.compiled:
        _prepare(model)
    return model


# Loading a model that was attached: Keras rebuilds the plain model class,
# then compiles it from the saved compile config. When that config holds a
# keras_geosam two-pass optimizer, the model is attached first, so the
# optimizer is owned by the two-pass step and its saved state loads into it.
# Only such configs take this path; every other model compiles as Keras does.

def _names_two_pass_optimizer(config):
    opt = config.get("optimizer") if isinstance(config, dict) else None
    if isinstance(opt, dict) and opt.get("class_name") == "LossScaleOptimizer":
        opt = (opt.get("config") or {}).get("inner_optimizer")
    return isinstance(opt, dict) and str(opt.get("registered_name", "")).startswith("keras_geosam>")


def _compile_from_config(self, config):
    if isinstance(self, TwoPassStepMixin) or not _names_two_pass_optimizer(config):
        return _stock_compile_from_config(self, config)
    attach(self)
    self.compile(**keras.saving.deserialize_keras_object(config))
    if self.built:
        self.optimizer.build(self.trainable_variables)


_stock_compile_from_config = keras_internals.replace_compile_from_config(_compile_from_config)
