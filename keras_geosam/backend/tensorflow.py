"""TensorFlow specialisation: GradientTape, ForwardAccumulator, vectorized_map."""

import tensorflow as tf

_ZERO = tf.UnconnectedGradients.ZERO


# Convolutions run as fast inside compiled loops as outside.
slow_convolutions_in_loops = False


# Steps are traced and compiled: their branches stay on the device.
eager_steps = False


def value_and_grad(f, params, *args, has_aux=False):
    with tf.GradientTape() as tape:
        tape.watch(params)
        out = f(params, *args)
    value = out[0] if has_aux else out
    grads = tape.gradient(value, params, unconnected_gradients=_ZERO)
    return out, grads


def jvp(f, params, tangents, *args):
    with tf.autodiff.ForwardAccumulator(params, tangents) as acc:
        out = f(params, *args)
    return out, acc.jvp(out, unconnected_gradients=_ZERO)


def vjp(f, params, cotangent, *args):
    with tf.GradientTape() as tape:
        tape.watch(params)
        out = f(params, *args)
    return tape.gradient(
        out, params, output_gradients=cotangent, unconnected_gradients=_ZERO
    )


def hvp(f, params, vectors, *args):
    # Forward-over-reverse: the accumulator pushes `vectors` through the tape's
    # backward pass, costing about two to three gradients.
    with tf.autodiff.ForwardAccumulator(params, vectors) as acc:
        with tf.GradientTape() as tape:
            tape.watch(params)
            loss = f(params, *args)
        grads = tape.gradient(loss, params, unconnected_gradients=_ZERO)
    return [acc.jvp(g, unconnected_gradients=_ZERO) for g in grads]


def hvp_batched(f, params, vectors, *args):
    # One forward and backward on a persistent tape, then one second backward
    # per probe (leading axis k of `vectors`; unrolled in the traced graph).
    # pfor over the probes was 1.8x slower per probe on convolutions, whose
    # filter-gradient ops it cannot vectorise, and no faster on an MLP.
    params = list(params)
    with tf.GradientTape(persistent=True) as outer:
        outer.watch(params)
        with tf.GradientTape() as inner:
            inner.watch(params)
            loss = f(params, *args)
        grads = inner.gradient(loss, params, unconnected_gradients=_ZERO)
    k = int(vectors[0].shape[0])
    rows = [
        outer.gradient(grads, params, output_gradients=[v[i] for v in vectors], unconnected_gradients=_ZERO)
        for i in range(k)
    ]
    return [tf.stack(parts) for parts in zip(*rows)]


def value_and_vjp(f, params, *args):
    """``(f(params), pull)`` with ``pull(cotangent) = J^T cotangent`` from the
    same forward pass (``f`` may return a list); `pull` is called once."""
    params = list(params)
    with tf.GradientTape() as tape:
        tape.watch(params)
        out = f(params, *args)
    return out, lambda c: tape.gradient(out, params, output_gradients=c, unconnected_gradients=_ZERO)


def linearize(f, params, *args):
    """``(f(params), jvp_fn, vjp_fn)``: J t and J^T c of the tensor-valued
    ``f`` at `params`, on persistent tapes of one forward pass. J t is the
    derivative of the (linear) map c -> J^T c, so it needs no forward-mode
    pass either."""
    params = list(params)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(params)
        out = f(params, *args)
    dummy = tf.zeros_like(out)
    with tf.GradientTape(persistent=True) as outer:
        outer.watch(dummy)
        pulled = tape.gradient(out, params, output_gradients=dummy, unconnected_gradients=_ZERO)

    def vjp_fn(c):
        return tape.gradient(out, params, output_gradients=c, unconnected_gradients=_ZERO)

    def jvp_fn(t):
        return outer.gradient(pulled, dummy, output_gradients=list(t), unconnected_gradients=_ZERO)

    return out, jvp_fn, vjp_fn


def vjp_batched(f, params, *args, has_aux=False):
    """``(value, aux, pullback)``; ``pullback(cotangents)`` maps cotangents
    with a leading axis k to gradients with that axis, reusing one forward."""
    params = list(params)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(params)
        out = f(params, *args)
    value, aux = out if has_aux else (out, None)

    def pullback(cot):
        return tf.vectorized_map(
            lambda c: tape.gradient(value, params, output_gradients=c, unconnected_gradients=_ZERO), cot
        )

    return value, aux, pullback


def eigh(x):
    # On the CPU LAPACK's syevd (NumPy) is 2x faster than TF's own solver on
    # the 500-800 wide K-FAC factors; on a GPU keep TF's.
    if tf.executing_eagerly() and "CPU" in (x.device or "CPU").upper():
        import numpy as np

        w, v = np.linalg.eigh(x.numpy())
        return tf.constant(w, dtype=x.dtype), tf.constant(v, dtype=x.dtype)
    return tf.linalg.eigh(x)


def per_example_grads(f, params, *batch):
    def one(example):
        return value_and_grad(f, params, *[e[None] for e in example])[1]

    return tf.vectorized_map(one, tuple(batch), fallback_to_while_loop=True)


def compile(fn):
    # Static shapes: a streamed last batch of another size costs one retrace,
    # and the curvature kernels size their chunks from shapes.
    return tf.function(fn)


def replica_count():
    """Replicas in sync under tf.distribute (1 without a strategy)."""
    ctx = tf.distribute.get_replica_context()
    return 1 if ctx is None else int(ctx.num_replicas_in_sync)


def all_reduce_sum(tensors):
    """Sums per-replica tensors across replicas (identity with one replica)."""
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return list(tensors)
    return ctx.all_reduce(tf.distribute.ReduceOp.SUM, list(tensors))


def cond_apply(pred, apply_fn, skip_fn, args, state=()):
    """Runs ``apply_fn(*args)`` if `pred` else ``skip_fn()``, where apply_fn
    may contain a synchronisation point (an optimizer's apply).

    tf.distribute forbids control flow around a merge_call in replica
    context, so under a strategy the branch is taken in cross-replica
    context on a flag reduced over all replicas (a step is skipped
    everywhere or nowhere), as Keras' LossScaleOptimizer does.
    """
    ctx = tf.distribute.get_replica_context()
    if ctx is None or tf.__internal__.distribute.strategy_supports_no_merge_call():
        return tf.cond(pred, lambda: _none(apply_fn(*args)), lambda: _none(skip_fn()))
    bad = tf.cast(tf.logical_not(pred), tf.float32)

    def cross_replica(distribution, bad, args):
        # Reduced here, in cross-replica context: a replica-context
        # all-reduce next to the optimizer's own would race for the
        # collective's instance key.
        flag = tf.equal(distribution.reduce(tf.distribute.ReduceOp.SUM, bad, axis=None), 0.0)

        def run():
            distribution.extended.call_for_each_replica(apply_fn, args=args)
            return tf.constant(True)

        def skip():
            skip_fn()
            return tf.constant(False)

        tf.cond(flag, run, skip)

    ctx.merge_call(cross_replica, args=(bad, args))


def _none(_):
    return tf.constant(0)


def data_parallel_shards(model=None):
    """Replicas a global batch is split over: `model`'s tf.distribute
    strategy, else the current one (1 without one)."""
    strategy = getattr(model, "_distribute_strategy", None)
    if strategy is None and tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
    return 1 if strategy is None else int(strategy.num_replicas_in_sync)


def sum_over_replicas(model, fn, x, y, offset):
    """``sum_r fn(x_r, y_r, offset_r, share_r)`` with the batch split evenly
    over the replicas of `model`'s tf.distribute strategy (or the current
    one), each replica computing on its own device; ``share_r`` is its
    fraction of the batch, ``offset_r`` the global index of its first
    example. Without a strategy (or a batch smaller than the replicas):
    ``fn(x, y, offset, None)``."""
    import numpy as np

    strategy = getattr(model, "_distribute_strategy", None)
    if strategy is None and tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
    n = int(tf.nest.flatten(x)[0].shape[0])
    replicas = 1 if strategy is None else int(strategy.num_replicas_in_sync)
    ctx = tf.distribute.get_replica_context()  # outside every scope: the default one
    inside_a_replica = ctx is not None and ctx.num_replicas_in_sync > 1
    if replicas == 1 or n < replicas or inside_a_replica:
        return fn(x, y, offset, None)
    bounds = np.linspace(0, n, replicas + 1).astype(int)
    devices = strategy.extended.worker_devices

    def spread(make):
        def on_device(ctx):
            r = ctx.replica_id_in_sync_group
            with tf.device(devices[r]):  # each replica's share lives on its device
                return make(r)

        return strategy.experimental_distribute_values_from_function(on_device)

    xs = tf.nest.map_structure(lambda a: spread(lambda r: tf.identity(a[bounds[r]:bounds[r + 1]])), x)
    ys = None if y is None else spread(lambda r: tf.identity(y[bounds[r]:bounds[r + 1]]))
    offsets = spread(lambda r: tf.constant(int(offset) + int(bounds[r]), tf.int32))
    shares = spread(lambda r: tf.constant((bounds[r + 1] - bounds[r]) / n, tf.float64))
    out = strategy.run(fn, args=(xs, ys, offsets, shares))
    return tf.nest.map_structure(lambda v: strategy.reduce(tf.distribute.ReduceOp.SUM, v, axis=None), out)


from keras_geosam.backend._single_device import device_constant  # noqa: E402,F401
from keras_geosam.backend._single_device import distribute_batch  # noqa: E402,F401
from keras_geosam.backend._single_device import process_count  # noqa: E402,F401
from keras_geosam.backend._single_device import wait_for_step  # noqa: E402,F401
from keras_geosam.backend._single_device import save_from_primary  # noqa: E402,F401

# The step is compiled, so the keras.ops forms cost no per-op dispatch.
from keras_geosam.backend._generic import add_scaled  # noqa: E402,F401
from keras_geosam.backend._generic import gate_preparation  # noqa: E402,F401
from keras_geosam.backend._generic import unwrap_unprepared  # noqa: E402,F401
from keras_geosam.backend._generic import uncompiled  # noqa: E402,F401
from keras_geosam.backend._generic import vdot  # noqa: E402,F401
