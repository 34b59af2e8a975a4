"""Every use of a private Keras name, behind one door.

Each function says why no public API serves. All were checked against
Keras 3.15.1; ``tests/package/test_keras_internals.py`` asserts that each name still
exists, so a Keras upgrade fails there, with the name, instead of deep
inside a train step. Nothing else in the package touches ``keras.src`` or a
private Keras attribute.
"""

import contextlib
import sys

import keras
from keras.src.models.functional import Functional as _Functional

KERAS_VERSION_CHECKED = "3.15.1"

# The functional-model class: kg.Model routes ``kg.Model(inputs, outputs)``
# to a subclass of it, as keras.Model does. Keras exports no name for it.
Functional = _Functional

# The TensorFlow trainer's hook that builds the model before tracing the
# train function (overridden to build a two-pass step's model and
# optimizer from the first batch); no public hook runs at that point.
BUILD_HOOK = "_maybe_symbolic_build"



def symbolic_build(model, data_batch):
    """Builds `model` (and its compiled metrics) from one batch, as ``fit``
    does before tracing; ``model.build`` takes shapes, not a data batch."""
    model._symbolic_build(data_batch=data_batch)


def distribute_strategy(model):
    """The tf.distribute strategy `model` was created under (None outside
    one): the TensorFlow trainer captures it at creation and exposes no
    accessor."""
    return getattr(model, "_distribute_strategy", None)


def multi_worker(strategy):
    """Whether `strategy` spans several workers (Keras' own test for its
    multi-worker reductions; TensorFlow's is private too)."""
    from keras.src.backend.tensorflow.trainer import _collective_all_reduce_multi_worker

    return _collective_all_reduce_multi_worker(strategy)


def layout_map(distribution):
    """A ``ModelParallel`` distribution's LayoutMap (None for others): the
    distribution takes it but has no getter."""
    return getattr(distribution, "_layout_map", None)


def variable_layout(variable):
    """The layout a variable was created with under a distribution (None
    without one); ``Variable`` has no public getter."""
    return getattr(variable, "_layout", None)


def jax_state(model):
    """The JAX trainer's newest state during ``fit`` (it holds the state
    outside the variables between steps; no public view of it)."""
    return getattr(model, "_jax_state", None) or {}


@contextlib.contextmanager
def losses_override(model, losses):
    """Makes `model`'s ``losses`` the regularisation `losses` of a
    ``stateless_call`` while Keras computes the loss (its own trainers do
    this; ``stateless_compute_loss`` has no argument for them)."""
    if losses:
        model._losses_override = losses
    try:
        yield
    finally:
        if losses:
            model._losses_override = []



def compute_loss(model, x, y, y_pred, sample_weight):
    """The training loss as Keras' trainers compute it: ``compute_loss``
    with ``training=True`` where an override takes that argument
    (``Trainer._compute_loss``; the public method needs it in the
    signature)."""
    return model._compute_loss(x, y, y_pred, sample_weight=sample_weight, training=True)


def plain_call(model):
    """Whether ``stateless_call`` would run ``model.call`` as it is: no
    quantised call and no rematerialisation (the remat mode is not public)."""
    return model.dtype_policy.quantization_mode is None and getattr(model, "_remat_mode", None) is None


def rematerialised_layers(model):
    """Names of the layers (`model` included) built under a
    ``keras.RematScope``: the mode is kept on a private attribute."""
    layers = [model] + list(model._flatten_layers(include_self=False))
    return [layer.name for layer in layers if getattr(layer, "_remat_mode", None) is not None]


@contextlib.contextmanager
def unlocked_tracking(model):
    """Lets attributes be added to a built model whose state Keras has
    locked (keras-hub models lock after building); there is no public
    unlock."""
    tracker = getattr(model, "_tracker", None)
    locked = bool(tracker is not None and tracker.locked)
    if locked:
        tracker.unlock()
    try:
        yield
    finally:
        if locked:
            tracker.lock()


def optimizer_step_counter(optimizer):
    """The optimizer's step counter variable, in micro-batches under
    gradient accumulation (the public ``iterations`` is derived from it by
    a division, so it cannot be assigned or located among the variables)."""
    return optimizer._iterations



def loss_weights(model):
    """The ``loss_weights`` a model was compiled with (None, a float, or a
    list or dict per output): kept only on its compiled loss object."""
    compiled = getattr(model, "_compile_loss", None)
    return None if compiled is None else getattr(compiled, "_user_loss_weights", None)


def handle_non_finite_grads(loss_scale_optimizer):
    """A LossScaleOptimizer's reaction to a non-finite step (halve the
    scale, reset the counter): public only inside its own ``apply``."""
    loss_scale_optimizer._stateful_handle_non_finite_grads()


def loss_fn_kwargs(loss):
    """The keyword arguments a ``LossFunctionWrapper`` passes its function
    (``get_config`` leaves some out, e.g. ``axis``)."""
    return dict(getattr(loss, "_fn_kwargs", {}) or {})


def flatten_layers(layer):
    """Every layer nested in `layer` (not itself), depth first: Keras' own
    walk; the public ``layers`` lists only a model's direct children."""
    return list(layer._flatten_layers(include_self=False))


def built_input_shapes(layer):
    """``{argument: shape}`` a layer was built with (the input rank of an
    EinsumDense whose equation uses ``...``; not recorded publicly)."""
    return getattr(layer, "_build_shapes_dict", None) or {}


def calls_of(layer):
    """How many times `layer` is called in the functional graphs it is in
    (weight sharing); nodes are not public."""
    return len(getattr(layer, "_inbound_nodes", []))


def call_output_shapes(layer):
    """The shapes of the outputs of each call of `layer` in the functional
    graphs it is in (nodes are not public): a list of shape tuples."""
    return [tuple(t.shape) for node in getattr(layer, "_inbound_nodes", []) or []
            for t in getattr(node, "output_tensors", None) or [] if getattr(t, "shape", None) is not None]


def consumers(layer):
    """The operations fed by `layer`'s output in its functional graphs."""
    return [node.operation for node in layer._outbound_nodes]


def inputs_struct(model):
    """The structure (dict, list or tensor) a functional model was built
    with, its input names included; None for other models."""
    return getattr(model, "_inputs_struct", None)


def producer(tensor):
    """The operation (an ``InputLayer`` for a model input) that made a
    symbolic tensor, or None."""
    history = getattr(tensor, "_keras_history", None)
    return None if history is None else history.operation


def keras_mask(tensor):
    """The mask Keras attached to a layer's output (``Embedding(mask_zero=
    True)`` and layers that propagate it), or None."""
    from keras.src.backend.common.masking import get_keras_mask

    return get_keras_mask(tensor)


def tensorflow_nn():
    """Keras' TensorFlow ``nn`` module, whose ``moments`` LayerNorm calls
    (swapped for second derivatives: ``tf.nn.moments`` stops the gradient
    through the mean)."""
    from keras.src.backend.tensorflow import nn

    return nn


def replace_compile_from_config(function):
    """Installs `function` as ``keras.Model.compile_from_config`` and returns
    the stock one. Loading an attached model must attach it before its
    two-pass optimizer is compiled; the optimizer is deserialised inside
    this method, and no registered object runs before it."""
    stock = keras.Model.compile_from_config
    keras.Model.compile_from_config = function
    return stock


def running_callback_list(callback, depth=4):
    """The CallbackList that is calling `callback` now (from its caller's
    frames), or None. Keras hands callbacks no handle to the list, and a
    callback that writes ``logs`` must run before the ones that read them."""
    frame = sys._getframe(2)
    for _ in range(depth):
        holder = frame.f_locals.get("self") if frame is not None else None
        if isinstance(holder, keras.callbacks.CallbackList) and callback in holder.callbacks:
            return holder
        frame = frame.f_back if frame is not None else None
    return None


# Names the tests check still exist: (object, attribute) pairs, built lazily
# (some exist only on the TensorFlow or JAX trainer).
def checked_names():
    """``[(description, exists)]`` for every private name used above."""
    import importlib

    def has_module_attr(module, name):
        try:
            return hasattr(importlib.import_module(module), name)
        except ImportError:
            return None  # that backend is not installed

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    opt = keras.optimizers.SGD()
    opt.build(model.trainable_variables)
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    loss = keras.losses.SparseCategoricalCrossentropy()
    backend = keras.backend.backend()
    checks = [
        ("keras.src.models.functional.Functional", has_module_attr("keras.src.models.functional", "Functional")),
        ("Model._symbolic_build", hasattr(model, "_symbolic_build")),
        ("Model._losses_override", hasattr(model, "_losses_override")),
        ("Model._compute_loss", hasattr(model, "_compute_loss")),
        ("Layer._remat_mode", hasattr(model, "_remat_mode")),
        ("Model._tracker", hasattr(model, "_tracker")),
        ("Layer._flatten_layers", hasattr(model, "_flatten_layers")),
        ("Layer._inbound_nodes", hasattr(model.layers[0], "_inbound_nodes")),
        ("Layer._outbound_nodes", hasattr(model.layers[0], "_outbound_nodes")),
        ("Functional._inputs_struct", hasattr(keras.Model(model.inputs, model.outputs), "_inputs_struct")),
        ("KerasTensor._keras_history", hasattr(model.inputs[0], "_keras_history")),
        ("Layer._build_shapes_dict", hasattr(model.layers[0], "_build_shapes_dict")),
        ("Variable._layout", hasattr(model.weights[0], "_layout")),
        ("Optimizer._iterations", hasattr(opt, "_iterations")),
        ("LossScaleOptimizer._stateful_handle_non_finite_grads", hasattr(lso, "_stateful_handle_non_finite_grads")),
        ("LossFunctionWrapper._fn_kwargs", hasattr(loss, "_fn_kwargs")),
        ("Model._compile_loss._user_loss_weights", hasattr(getattr(model, "_compile_loss", None), "_user_loss_weights")),
        ("keras.src.backend.common.masking.get_keras_mask",
         has_module_attr("keras.src.backend.common.masking", "get_keras_mask")),
        ("keras.distribution.ModelParallel._layout_map (constructor keyword layout_map)",
         "layout_map" in keras.distribution.ModelParallel.__init__.__code__.co_varnames),
        ("keras.Model.compile_from_config", hasattr(keras.Model, "compile_from_config")),
        ("sys._getframe", hasattr(sys, "_getframe")),
    ]
    if backend == "tensorflow":
        checks += [
            (f"Model.{BUILD_HOOK} (TensorFlow trainer)", hasattr(model, BUILD_HOOK)),
            ("Model._distribute_strategy (TensorFlow trainer)", hasattr(model, "_distribute_strategy")),
            ("keras.src.backend.tensorflow.trainer._collective_all_reduce_multi_worker",
             has_module_attr("keras.src.backend.tensorflow.trainer", "_collective_all_reduce_multi_worker")),
            ("keras.src.backend.tensorflow.nn.moments", has_module_attr("keras.src.backend.tensorflow.nn", "moments")),
        ]
    if backend == "jax":
        import numpy as np

        model.fit(np.zeros((2, 2), "float32"), np.zeros((2, 1), "float32"), epochs=1, verbose=0)
        checks.append(("Model._jax_state (JAX trainer, set during fit)", "_jax_state" in type(model).__dict__
                       or hasattr(model, "_jax_state") or _jax_trainer_sets_state()))
    return checks


def _jax_trainer_sets_state():
    import inspect

    from keras.src.backend.jax import trainer

    return "_jax_state" in inspect.getsource(trainer)
