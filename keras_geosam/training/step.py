"""The exact two-pass train step: one backend-neutral core, two thin wrappers.

Both gradients are taken on the same batch; the perturbed weights exist only
as values mapped onto the variables in a StatelessScope (nothing is
perturbed in place and restored), and the update is applied at the
unperturbed weights:

    g_c = grad L_B(theta)              centre pass
    eps = optimizer's perturbation of g_c
    g_p = grad L_B(theta + eps)        perturbed pass, same batch
    theta <- base_optimizer(theta, optimizer.descent_gradients(g_c, g_p))

Non-trainable state: float variables (BatchNorm statistics) are taken from
exactly one pass (``optimizer.bn_stats``), both passes starting from the same
values; integer variables (dropout seed state) advance through both passes,
so the perturbed pass draws a fresh mask (``optimizer.dropout="fresh"``).

Non-finite values: if the loss or either gradient holds NaN/Inf (or a
gradient's squared norm overflows the float type, i.e. a norm beyond ~1e19
in float32) the whole step is skipped: weights, optimizer state (a U
refreshed in this step included) and BatchNorm statistics stay as they were,
the ``skipped_steps`` metric counts
it, and under mixed_float16 the loss scale is halved. Nothing non-finite
reaches the weights. The check reuses the squared norms the SAM statistics
need anyway, instead of an element-wise isfinite pass over every gradient.

theta + eps comes from ``optimizer.perturbed_weights`` (one pass when the
optimizer gives eps as a scale and a direction).

The JAX trainer passes state explicitly (``train_step(state, data)``);
TensorFlow and torch mutate variables (``train_step(data)``).
"""

import contextlib
import contextvars
import time
from typing import NamedTuple

import keras
from keras import ops
from keras_geosam import backend
from keras_geosam import keras_internals
from keras_geosam.curvature.layers import takes_training
from keras_geosam.optimizers.base import unwrap

SAM_METRICS = ("sharpness_gap", "grad_norm", "grad_cosine")


class TwoPassResult(NamedTuple):
    """What both passes of a step computed (pure values, no variables)."""

    loss_centre: object
    loss_perturbed: object
    grads_centre: list
    grads_perturbed: list
    y_pred: object
    non_trainable: list  # the non-trainable values to keep (bn_stats, dropout)
    metric_values: list  # metric variables' values after the loss computation
    sq_norm_centre: object = None
    sq_norm_perturbed: object = None
    dot: object = None  # <g_c, g_p>
    finite: object = None  # loss and both gradients finite


def _finalise(result):
    """`result` with the squared norms, their dot product and the finite flag.
    A step that let go of g_c (``keeps_centre_gradients``) brings its
    squared norm instead, and has no dot product."""
    g_c, g_p = result.grads_centre, result.grads_perturbed
    sq_c = result.sq_norm_centre if g_c is None else backend.vdot(g_c, g_c, "float32")
    dot = None
    if g_p is g_c:
        sq_p = dot = sq_c
    else:
        sq_p = backend.vdot(g_p, g_p, "float32")
        if g_c is not None:
            dot = backend.vdot(g_c, g_p, "float32")
    # NaN or Inf anywhere in a gradient makes its squared norm non-finite.
    total = ops.cast(result.loss_centre, "float32") + ops.cast(result.loss_perturbed, "float32") + sq_c + sq_p
    return result._replace(sq_norm_centre=sq_c, sq_norm_perturbed=sq_p, dot=dot, finite=ops.isfinite(total))


def _forward(model, variables, trainable, non_trainable, metric_values, x, y, sample_weight, scale):
    """Loss at the `trainable` values (training mode), Keras' own loss code.

    One StatelessScope for the call and the loss: ``stateless_call`` and
    then ``stateless_compute_loss`` open two, each walking the model for its
    variables and mapping every one again (~2 ms a pass on an eager torch
    Transformer). `variables` are the model's trainable, non-trainable and
    metric variables, listed once per step."""
    kwargs = {"training": True} if takes_training(model) else {}
    if not keras_internals.plain_call(model):
        return _forward_keras(model, trainable, non_trainable, metric_values, x, y, sample_weight, scale, kwargs)
    tv, ntv, mv = variables
    mapping = list(zip(tv, trainable)) + list(zip(ntv, non_trainable)) + list(zip(mv, metric_values))
    # collect_losses: the layers' add_loss terms reach model.losses inside
    # the scope, as in stateless_call.
    with keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
        y_pred = model.call(x, **kwargs)
        loss = keras_internals.compute_loss(model, x, y, y_pred, sample_weight)
    non_trainable_new = [scope.get_current_value(v) for v in ntv]
    metric_values_new = [scope.get_current_value(v) for v in mv]
    scaled = loss if scale is None else loss * ops.cast(scale, loss.dtype)
    return scaled, (loss, y_pred, non_trainable_new, metric_values_new)


def _forward_keras(model, trainable, non_trainable, metric_values, x, y, sample_weight, scale, kwargs):
    """`_forward` through Keras' ``stateless_call`` (a quantised or
    rematerialised call) and ``stateless_compute_loss``."""
    y_pred, non_trainable_new, losses = model.stateless_call(trainable, non_trainable, x, return_losses=True, **kwargs)
    with keras_internals.losses_override(model, losses):
        loss, (_, _, metric_values_new) = model.stateless_compute_loss(
            trainable, non_trainable_new, metric_values, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
            training=True,
        )
    scaled = loss if scale is None else loss * ops.cast(scale, loss.dtype)
    return scaled, (loss, y_pred, non_trainable_new, metric_values_new)


def two_pass(model, optimizer, trainable, non_trainable, metric_values, x, y, sample_weight, scale=None):
    """Both passes on one batch. Pure: returns a :class:`TwoPassResult`."""
    # An optimizer that takes sparse gradients (an Embedding's, on
    # TensorFlow) gets them as they are; the others get them dense.
    sparse = optimizer.takes_sparse_gradients
    data = (metric_values, x, y, sample_weight, scale)
    variables = (model.trainable_variables, model.non_trainable_variables, model.metrics_variables)
    ((_, (loss_c, y_pred, ntv_c, mv_c)), g_c) = backend.value_and_grad(
        lambda p, *a: _forward(model, variables, p, *a), list(trainable), non_trainable, *data, has_aux=True,
        sparse=sparse
    )
    if scale is not None:
        g_c = _unscale(g_c, scale)
    # Under tf.distribute, Keras scales each replica's loss by 1/replicas:
    # the sum over replicas is the global mean gradient, and replicas times
    # the local one is the replica's own mean gradient.
    replicas = backend.replica_count()
    if replicas > 1:
        if optimizer.perturbation_mode == "global":
            g_c = backend.all_reduce_sum(g_c)
        else:
            g_c = [backend.scale(g, float(replicas)) for g in g_c]
    if optimizer.num_passes == 1:
        return _finalise(TwoPassResult(loss_c, loss_c, g_c, g_c, y_pred, ntv_c, mv_c))
    perturbed = optimizer.perturbed_weights(g_c, list(trainable))
    sq_c = None
    if not optimizer.keeps_centre_gradients:
        # Nothing after the ascent reads g_c: let go of it before the
        # perturbed pass (one copy of the weights less at the step's peak).
        sq_c, g_c = backend.vdot(g_c, g_c, "float32"), None
    # Floats restart from the step's values (one pass updates BN statistics);
    # integer RNG state continues from the centre pass unless dropout="same".
    fresh = optimizer.dropout == "fresh"
    ntv_in = [c if (fresh and not _is_float(v)) else v for v, c in zip(non_trainable, ntv_c)]
    ((_, (loss_p, _, ntv_p, _)), g_p) = backend.value_and_grad(
        lambda p, *a: _forward(model, variables, p, *a), perturbed, ntv_in, *data, has_aux=True, sparse=sparse
    )
    if scale is not None:
        g_p = _unscale(g_p, scale)
    keep = ntv_c if optimizer.bn_stats == "centre" else ntv_p
    new_ntv = [k if _is_float(v) else p for v, k, p in zip(non_trainable, keep, ntv_p)]
    return _finalise(TwoPassResult(loss_c, loss_p, g_c, g_p, y_pred, new_ntv, mv_c, sq_norm_centre=sq_c))


def _unscale(grads, scale):
    """Gradients of the loss-scaled loss, unscaled (the scale is a power
    of two, so multiplying by its inverse is exact)."""
    return [backend.scale(g, 1.0 / ops.cast(scale, g.dtype)) for g in grads]


def _is_float(value):
    return "float" in str(keras.backend.standardize_dtype(value.dtype))


def _sam_statistics(result):
    norm_c, norm_p = ops.sqrt(result.sq_norm_centre), ops.sqrt(result.sq_norm_perturbed)
    # Under tf.distribute both losses are scaled by 1/replicas (as the loss
    # tracker's is); unscaled, the replicas' mean is the global gap.
    gap = (ops.cast(_unscale_for_replicas(result.loss_perturbed), "float32")
           - ops.cast(_unscale_for_replicas(result.loss_centre), "float32"))
    stats = {"sharpness_gap": gap, "grad_norm": norm_c}
    if result.dot is not None:
        stats["grad_cosine"] = result.dot / (norm_c * norm_p + 1e-30)
    return stats


def _unscale_for_replicas(loss):
    """Keras scales each replica's loss by 1/replicas under tf.distribute
    (so that the sum over replicas is the mean); this undoes it."""
    replicas = backend.replica_count()
    return loss if replicas == 1 else loss * ops.cast(replicas, loss.dtype)


def _loss_tracker(model):
    """Keras' ``loss`` metric: a compiled model's first metric (the order
    ``Model.metrics`` keeps). On eager torch this walks the layers each step,
    about 80 microseconds on a 4-block Transformer; traced elsewhere."""
    tracker = model.metrics[0]
    if tracker.name != "loss":
        raise RuntimeError(f"{model.name}: expected Keras' loss tracker first among model.metrics, got {tracker.name!r}.")
    return tracker


def _update_trackers(model, result, x, y, sample_weight):
    """Loss tracker, compiled metrics and SAM statistics; returns the logs."""
    n = ops.shape(next(t for t in keras.tree.flatten(x) if t is not None))[0]
    _loss_tracker(model).update_state(_unscale_for_replicas(result.loss_centre), sample_weight=n)
    stats = _sam_statistics(result)
    finite = result.finite
    weight = ops.cast(finite, "float32")
    for name in SAM_METRICS:
        tracker = getattr(model, "_geosam_" + name, None)
        if tracker is not None and name in stats:
            # A skipped step contributes nothing to the epoch averages.
            tracker.update_state(ops.where(finite, stats[name], 0.0), sample_weight=weight)
    skipped = getattr(model, "_geosam_skipped_steps", None)
    if skipped is not None:
        skipped.update_state(1.0 - weight)
    logs = dict(model.compute_metrics(x, y, result.y_pred, sample_weight))
    # The step's statistics are reported by training only: they are kept
    # out of get_metrics_result, so evaluate() returns what Keras would.
    for tracker in step_trackers(model):
        logs[tracker.name] = tracker.result()
    return logs


def update_metrics(model, metric_values, result, x, y, sample_weight):
    """``_update_trackers`` on explicit metric values (the JAX step)."""
    with keras.StatelessScope(state_mapping=list(zip(model.metrics_variables, metric_values))) as scope:
        logs = _update_trackers(model, result, x, y, sample_weight)
    new_mv = []
    for v in model.metrics_variables:
        value = scope.get_current_value(v)
        new_mv.append(v.value if value is None else value)
    return logs, new_mv


def step_trackers(model):
    """The metrics this step adds to a model (absent ones skipped)."""
    names = SAM_METRICS + ("skipped_steps",)
    return [t for t in (getattr(model, "_geosam_" + n, None) for n in names) if t is not None]


def _scale_of(lso):
    return None if lso is None else lso.dynamic_scale


def stateful_train_step(model, data):
    """TensorFlow / torch: compute both passes, then assign and apply."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    opt, lso = unwrap(model.optimizer)
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    metric_values = [v.value for v in model.metrics_variables]
    written = opt.prepare_step(model, trainable, non_trainable, x, y)
    result = two_pass(model, opt, trainable, non_trainable, metric_values, x, y, sample_weight, _scale_of(lso))

    def apply(g_c, g_p, new_ntv):
        for v, value in zip(model.non_trainable_variables, new_ntv):
            v.assign(value)
        opt.apply_two_pass(g_c, g_p, model.trainable_variables)
        if lso is not None:
            _loss_scale_grow(lso)

    def skip():
        # A skipped step changes nothing: state prepare_step wrote (a refreshed
        # U, the refresh count) goes back.
        for v, value in written:
            v.assign(value)
        if lso is not None:
            keras_internals.handle_non_finite_grads(lso)

    state = model.trainable_variables + model.non_trainable_variables + model.optimizer.variables
    # An update that reads g_p alone gets it alone: eager torch then frees
    # g_c (kept for the cosine) before the update's temporaries exist, and
    # the descent may write into g_p (``LinearOperator.matvec_into``).
    g_c = result.grads_centre if opt.reads_centre_gradients or result.grads_centre is result.grads_perturbed else None
    args = (g_c, result.grads_perturbed, result.non_trainable)
    g_c, result = None, result._replace(grads_centre=None, grads_perturbed=None)
    backend.cond_apply(result.finite, apply, skip, args, state=state)
    # Metrics are variables here: keep what the loss computation wrote (the
    # per-output loss trackers of a multi-output model), then update in place.
    for v, before, after in zip(model.metrics_variables, metric_values, result.metric_values):
        if after is not before:
            v.assign(after)
    return _update_trackers(model, result, x, y, sample_weight)


def _loss_scale_grow(lso):
    """LossScaleOptimizer's growth rule after a finite step, without a nested
    cond (inside the JAX step's cond branch its tracers would leak)."""
    counter = ops.convert_to_tensor(lso.step_counter)
    scale = ops.convert_to_tensor(lso.dynamic_scale)
    grow = ops.equal(counter, lso.dynamic_growth_steps - 1)
    lso.step_counter.assign(ops.where(grow, ops.zeros_like(counter), counter + 1))
    lso.dynamic_scale.assign(ops.where(grow, scale * 2.0, scale))


class _RefreshGate:
    """The host's side of JAX's refresh between steps
    (``backend.gate_preparation``): U's refresh schedule on the optimizer's
    ``refresh_counter``, and the refresh itself as its own compiled program
    (``LearnedPreconditioner.refresh_program``) on the explicit state that
    Keras' JAX trainer threads from step to step."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt
        self.schedule = opt.preconditioner.schedule

    def _index(self, variable):
        return next((i for i, v in enumerate(self.model.optimizer.variables) if v is variable), None)

    def counter_index(self):
        return self._index(self.opt.refresh_counter)

    def restart(self):
        self.schedule.forget()

    def steps_per_execution(self):
        return int(getattr(self.model, "steps_per_execution", 1) or 1)

    def next_step(self, read_counter, can_read):
        return self.schedule.next_step(read_counter, can_read)

    @contextlib.contextmanager
    def outside(self):
        """Steps traced in this context leave ``prepare_step`` to ``prepare``."""
        token = _PREPARED_OUTSIDE.set(True)
        try:
            yield
        finally:
            _PREPARED_OUTSIDE.reset(token)

    def prepare(self, state, data, host):
        """``(state, undo)``: `state` with U refreshed on the batch `data`
        if a refresh is due before this step (the counter read from the
        device with ``host.read``: this waits for the step before). `undo`
        lets :meth:`settle` put U back if the step is then skipped for
        non-finite values."""
        trainable, non_trainable, opt_vars, metric_values = state
        counter = host.read(opt_vars[self.counter_index()])
        if not self.schedule.due_at(counter):
            return state, None
        pre = self.opt.preconditioner
        positions = [self._index(v) for v in pre.variables + [pre.refreshes]]
        old = [opt_vars[i] for i in positions]
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        start = time.perf_counter()
        new = pre.refresh_program(self.model)(old[:-1], trainable, non_trainable, x, y)
        new = list(new) + [host.increment(old[-1])]
        host.wait(new)  # the refresh's own time
        pre.clock.add(time.perf_counter() - start)
        opt_vars = list(opt_vars)
        for i, value in zip(positions, new):
            opt_vars[i] = value
        return (trainable, non_trainable, opt_vars, metric_values), (positions, old, counter)

    def settle(self, state, undo, host):
        """`state` after the step that `prepare` refreshed U for: a skipped
        step (its counter did not move) changes nothing, so U and the
        refresh count go back, and the next finite step refreshes."""
        if undo is None:
            return state
        positions, old, counter = undo
        if host.read(state[2][self.counter_index()]) != counter:
            return state
        opt_vars = list(state[2])
        for i, value in zip(positions, old):
            opt_vars[i] = value
        return (state[0], state[1], opt_vars, state[3])


_PREPARED_OUTSIDE = contextvars.ContextVar("keras_geosam_prepared_outside", default=False)


def gate_preparation(model):
    """JAX: ``fit``'s steps run one compiled program without U's refresh;
    before a step that is due one (the host bounds of U's refresh schedule
    tell which may be, reading the device only near due steps), the host
    runs the refresh as its own compiled program on the step's batch and
    state. Applied once per train function. The bounds restart at every
    ``make_train_function`` (each ``fit`` and ``train_on_batch``) and, on
    JAX, whenever Keras hands the step a counter it did not return (state
    re-read from the variables)."""
    opt = unwrap(getattr(model, "optimizer", None))[0]
    fn = model.train_function
    if opt is None or not opt.prepares_steps or fn is None:
        return
    opt.preconditioner.schedule.forget()  # the counter may have been set since the last call
    if getattr(fn, "_geosam_gated", False):
        return
    gated = backend.gate_preparation(fn, _RefreshGate(model, opt))
    if gated is not fn:
        gated._geosam_gated = True
        model.train_function = gated


def stateless_train_step(model, state, data):
    """JAX: the same core on explicit state, returning new state. A step
    traced inside ``gate_preparation``'s calls leaves ``prepare_step`` (U's
    refresh) to the host, which runs it between steps."""
    trainable, non_trainable, opt_vars, metric_values = state
    prepare = not _PREPARED_OUTSIDE.get()
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    outer = model.optimizer
    opt, lso = unwrap(outer)
    before = list(opt_vars)
    with keras.StatelessScope(state_mapping=list(zip(outer.variables, opt_vars))) as scope:
        if prepare:
            opt.prepare_step(model, trainable, non_trainable, x, y)
        scale = None if lso is None else ops.convert_to_tensor(lso.dynamic_scale)
        result = two_pass(model, opt, trainable, non_trainable, metric_values, x, y, sample_weight, scale)
    # prepare_step may have written optimizer state (a refreshed U).
    opt_vars = [scope.get_current_value(v) for v in outer.variables]
    opt_mapping = list(zip(outer.variables, opt_vars))

    def apply():
        built_for = opt.built_for
        mapping = opt_mapping + list(zip(built_for, trainable))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            opt.apply_two_pass(result.grads_centre, result.grads_perturbed, built_for)
            if lso is not None:
                _loss_scale_grow(lso)
        return (
            [scope.get_current_value(v) for v in built_for],
            [scope.get_current_value(v) for v in outer.variables],
        )

    def skip():
        # A skipped step changes nothing: the optimizer state from before
        # prepare_step (U and the refresh count as they were).
        with keras.StatelessScope(state_mapping=list(zip(outer.variables, before))) as scope:
            if lso is not None:
                keras_internals.handle_non_finite_grads(lso)
        return list(trainable), [scope.get_current_value(v) for v in outer.variables]

    new_trainable, new_opt_vars = ops.cond(result.finite, apply, skip)
    new_non_trainable = [ops.where(result.finite, n, o) for n, o in zip(result.non_trainable, non_trainable)]
    logs, new_metric_values = update_metrics(model, result.metric_values, result, x, y, sample_weight)
    return logs, (new_trainable, new_non_trainable, new_opt_vars, new_metric_values)


@backend.traced  # RefreshMonitor leaves a TensorFlow trace out of a refresh's time
def train_step(model, *args):
    if backend.name == "jax":
        return stateless_train_step(model, *args)
    return stateful_train_step(model, *args)
