"""TensorFlow specialisation: GradientTape, ForwardAccumulator, vectorized_map."""

import functools

import tensorflow as tf

from keras_geosam import keras_internals

_ZERO = tf.UnconnectedGradients.ZERO


# Convolutions run as fast inside compiled loops as outside.
slow_convolutions_in_loops = False

# Every op in a graph costs the executor a fixed few microseconds: a ViT's
# same-shaped K-FAC blocks run faster as one batched product (K-FAC step
# over its FLOP floor 1.11 -> 0.99 on the bench ViT).
batch_small_products = True

# A tape's gradient cannot run inside a tf.while_loop on a forward pass
# recorded outside it: cotangent chunks are pulled back in an unrolled loop.
loop_pullbacks = False

# hvp_batched unrolls one second backward pass per probe in its graph (a
# tape cannot be differentiated inside a tf.while_loop, nor vectorised
# over convolutions): operators hand it at most this many probes per call,
# so a graph's length and trace time do not grow with the probe count.
max_probe_block = 8

# Probes are unrolled already (``hvp_batched``), within ``max_probe_block``.
unrolled_probe_block = None


# Steps are traced and compiled: their branches stay on the device.
eager_steps = False

# LLQR's refresh is a branch of the step's graph (a cond not taken costs nothing).
refresh_between_steps = False


_TRACE_SECONDS = [0.0]


def traced(fn):
    """`fn`, whose Python run while TensorFlow traces a graph is counted in
    ``compile_seconds`` (the train step's body runs only then)."""
    import functools
    import time

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if tf.executing_eagerly():
            return fn(*args, **kwargs)
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _TRACE_SECONDS[0] += time.perf_counter() - start

    return run


def step_timer(model):
    """A device clock for work inside the traced train step: ``(timed,
    read)`` with ``timed(fn)`` running `fn` between two in-graph
    timestamps (`fn`'s ops depend on the first, the second on its results)
    and adding the difference to a variable ``read()`` returns. None under
    XLA (``jit_compile=True``: no timestamp op) or tf.distribute (the
    variable would need a replica-aware aggregation)."""
    if getattr(model, "jit_compile", False) or tf.distribute.has_strategy() or keras_internals.distribute_strategy(model) is not None:
        return None
    with tf.init_scope():  # eager even when asked during a trace
        total = tf.Variable(0.0, dtype=tf.float64, trainable=False, name="geosam_step_timer")

    def timed(fn):
        def run(*args, **kwargs):
            start = tf.timestamp()
            with tf.control_dependencies([start]):
                out = fn(*args, **kwargs)
            with tf.control_dependencies(tf.nest.flatten(out)):
                added = total.assign_add(tf.timestamp() - start)
            with tf.control_dependencies([added]):
                return tf.nest.map_structure(tf.identity, out)

        return run

    return timed, lambda: float(total.numpy())


def compile_seconds():
    """Seconds spent tracing train steps in this process (graph
    optimisation and XLA compilation after tracing are not counted)."""
    return _TRACE_SECONDS[0]


# A gather (an Embedding's lookup) has a sparse gradient, tf.IndexedSlices:
# rows and their indices, repeated indices meaning sums. Only the train step
# asks for it (``value_and_grad(..., sparse=True)``: the statistics, the
# perturbation and the base optimizer's update take it as it is); every
# other derivative here is dense, since what consumes it (a product with U,
# an HVP, a probe's dot product) needs the whole vector.
def densify(x, shape=None):
    """`x` as a dense tensor (an IndexedSlices' rows summed into place),
    with the static `shape` where given (the conversion may lose it)."""
    if not isinstance(x, tf.IndexedSlices):
        return x
    dense = tf.convert_to_tensor(x)
    if shape is not None:
        dense = tf.ensure_shape(dense, shape)
    return dense


def _dense(grads, params=None):
    """Dense gradients, with the shapes of `params` (or of their own
    values' rows) kept static."""
    if params is None:
        return [densify(g) for g in grads]
    return [densify(g, p.shape) for g, p in zip(grads, params)]


def scale(x, alpha):
    """``alpha * x``, sparse if `x` is."""
    if isinstance(x, tf.IndexedSlices):
        return tf.IndexedSlices(x.values * tf.cast(alpha, x.values.dtype), x.indices, x.dense_shape)
    return x * tf.cast(alpha, x.dtype)


def value_and_grad(f, params, *args, has_aux=False, sparse=False):
    with tf.GradientTape() as tape:
        tape.watch(params)
        out = f(params, *args)
    value = out[0] if has_aux else out
    grads = tape.gradient(value, params, unconnected_gradients=_ZERO)
    return out, (list(grads) if sparse else _dense(grads, params))


def jvp(f, params, tangents, *args):
    with tf.autodiff.ForwardAccumulator(params, tangents) as acc:
        out = f(params, *args)
    return out, acc.jvp(out, unconnected_gradients=_ZERO)


def vjp(f, params, cotangent, *args):
    with tf.GradientTape() as tape:
        tape.watch(params)
        out = f(params, *args)
    return _dense(tape.gradient(out, params, output_gradients=cotangent, unconnected_gradients=_ZERO), params)


def _exact_moments(fn):
    """`fn` run with Keras' TensorFlow moments (LayerNormalization, and
    BatchNormalization in training mode) computed so that their second
    derivatives are right.

    Keras takes them from ``tf.nn.moments``, whose variance is the mean of
    ``(x - stop_gradient(mean))^2``: the same first derivatives (deviations
    from the mean sum to zero), but a Hessian without the mean's own
    curvature. Found on a LayerNorm Transformer, whose Hessian came out 5%
    off on TensorFlow alone. Keras reads the function from its module at
    each call (checked against keras 3.12-3.15), so replacing it while a
    second-order product is traced reaches every normalisation layer.
    """
    import functools

    keras_tf_nn = keras_internals.tensorflow_nn()

    def moments(x, axes, keepdims=False):
        mean = tf.reduce_mean(x, axes, keepdims=True)
        variance = tf.reduce_mean(tf.square(x - mean), axes, keepdims=True)
        if not keepdims:
            mean, variance = tf.squeeze(mean, axes), tf.squeeze(variance, axes)
        return mean, variance

    @functools.wraps(fn)
    def run(*args, **kwargs):
        original = keras_tf_nn._compute_moments
        keras_tf_nn._compute_moments = moments
        try:
            return fn(*args, **kwargs)
        finally:
            keras_tf_nn._compute_moments = original

    return run


@_exact_moments
def hvp(f, params, vectors, *args):
    # Forward-over-reverse: the accumulator pushes `vectors` through the tape's
    # backward pass, costing about two to three gradients. The gradient is
    # made dense under the accumulator, which has no rule for IndexedSlices.
    with tf.autodiff.ForwardAccumulator(params, vectors) as acc:
        with tf.GradientTape() as tape:
            tape.watch(params)
            loss = f(params, *args)
        grads = _dense(tape.gradient(loss, params, unconnected_gradients=_ZERO), params)
    return [acc.jvp(g, unconnected_gradients=_ZERO) for g in grads]


@_exact_moments
def hvp_batched(f, params, vectors, *args, unroll=True):
    # One forward and backward on a persistent tape, then one second backward
    # per probe (leading axis k of `vectors`; always unrolled in the traced
    # graph, whatever `unroll` says).
    # pfor over the probes was 1.8x slower per probe on convolutions, whose
    # filter-gradient ops it cannot vectorise, and no faster on an MLP.
    params = list(params)
    with tf.GradientTape(persistent=True) as outer:
        outer.watch(params)
        with tf.GradientTape() as inner:
            inner.watch(params)
            loss = f(params, *args)
        grads = _dense(inner.gradient(loss, params, unconnected_gradients=_ZERO), params)
    k = int(vectors[0].shape[0])
    rows = [
        _dense(outer.gradient(grads, params, output_gradients=[v[i] for v in vectors], unconnected_gradients=_ZERO), params)
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
    return out, lambda c: _dense(tape.gradient(out, params, output_gradients=c, unconnected_gradients=_ZERO), params)


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
        pulled = _dense(tape.gradient(out, params, output_gradients=dummy, unconnected_gradients=_ZERO), params)

    def vjp_fn(c):
        return _dense(tape.gradient(out, params, output_gradients=c, unconnected_gradients=_ZERO), params)

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
            lambda c: _dense(tape.gradient(value, params, output_gradients=c, unconnected_gradients=_ZERO), params), cot
        )

    return value, aux, pullback


def _rows(x, dtype):
    """An IndexedSlices' rows with repeated indices summed: ``(unique
    indices, rows)``. Squares and products of the raw rows would be wrong
    where a token occurs twice in the batch."""
    unique, position = tf.unique(x.indices)
    rows = tf.math.unsorted_segment_sum(tf.cast(x.values, dtype), position, tf.shape(unique)[0])
    return unique, rows


def _sparse_vdot(x, y, dtype):
    """``<x, y>`` where `x` or `y` is an IndexedSlices, without a dense copy."""
    if not isinstance(x, tf.IndexedSlices):
        x, y = y, x
    dtype = dtype or x.values.dtype
    if y is x:
        _, rows = _rows(x, dtype)
        return tf.reduce_sum(tf.square(rows))
    if not isinstance(y, tf.IndexedSlices):
        # Linear in x: repeated indices may stay.
        picked = tf.gather(tf.cast(y, dtype), x.indices)
        return tf.reduce_sum(tf.cast(x.values, dtype) * picked)
    n = tf.shape(x.indices)[0]
    unique, position = tf.unique(tf.concat([x.indices, y.indices], 0))
    count = tf.shape(unique)[0]
    a = tf.math.unsorted_segment_sum(tf.cast(x.values, dtype), position[:n], count)
    b = tf.math.unsorted_segment_sum(tf.cast(y.values, dtype), position[n:], count)
    return tf.reduce_sum(a * b)


def vdot(a, b, dtype=None):
    """``sum_i <a_i, b_i>`` over two lists of like-shaped tensors, in
    `dtype` (default: their own); IndexedSlices entries are summed over
    their rows (``_sparse_vdot``), the rest as ``keras.ops`` would."""
    sparse = [i for i, (x, y) in enumerate(zip(a, b)) if isinstance(x, tf.IndexedSlices) or isinstance(y, tf.IndexedSlices)]
    if not sparse:
        return _generic_vdot(a, b, dtype)
    dense = [i for i in range(len(a)) if i not in sparse]
    parts = [_sparse_vdot(a[i], b[i], dtype) for i in sparse]
    if dense:
        da = [a[i] for i in dense]
        parts.append(_generic_vdot(da, da if b is a else [b[i] for i in dense], dtype))
    return tf.add_n([tf.cast(p, parts[0].dtype) for p in parts])


def add_scaled(y, x, alpha):
    """``y + alpha * x`` for a number or scalar tensor `alpha`; an
    IndexedSlices `x` or `y` is scattered into the other (dense) operand,
    never made dense itself."""
    if isinstance(x, tf.IndexedSlices):
        if isinstance(y, tf.IndexedSlices):
            y = densify(y)
        update = x.values * tf.cast(alpha, x.values.dtype)
        return tf.tensor_scatter_nd_add(y, x.indices[:, None], tf.cast(update, y.dtype))
    if isinstance(y, tf.IndexedSlices):
        return tf.tensor_scatter_nd_add(x * tf.cast(alpha, x.dtype), y.indices[:, None], tf.cast(y.values, x.dtype))
    return _generic_add_scaled(y, x, alpha)


def is_concrete(x):
    """Whether `x` holds values now (eager, not a graph being traced)."""
    return tf.executing_eagerly() and hasattr(x, "numpy")


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
        return value_and_grad(f, params, *[one_example(e) for e in example])[1]

    batch = tuple(batch)
    traced, unvectorisable = _one_example_grad(f, params, batch)
    if not unvectorisable:
        return tf.vectorized_map(one, batch, fallback_to_while_loop=True)
    # pfor's vectorisation of a batched matmul's gradient (tf.einsum lowers
    # to BatchMatMulV2: EinsumDense, MultiHeadAttention) corrupts the heap
    # (TF 2.21 CPU: "free(): invalid pointer", a segfault or an abort a few
    # ops later), and that of a recurrent layer's while loop fails ("dtype
    # variant is not compatible", its TensorList state): a loop over the
    # examples instead, one gradient each, the body a call of the function
    # traced once.
    signature = [tf.TensorSpec(p.shape, p.dtype) for p in params]
    return tf.map_fn(lambda example: traced(list(params), example), batch, fn_output_signature=signature)


_BATCH_MATMUL = ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum")
# A recurrent layer (LSTM, GRU, SimpleRNN, Bidirectional) runs a while loop
# whose state pfor cannot vectorise.
_LOOPS = ("While", "StatelessWhile")
_UNVECTORISABLE = _BATCH_MATMUL + _LOOPS
# The last function traced by `_one_example_grad`: the exact Fisher asks for
# per-example gradients of the same `f` once per class, and tracing a
# Transformer's gradient each time cost minutes.
_LAST_TRACED = {}


def _one_example_grad(f, params, batch):
    """``(traced, unvectorisable)``: the gradient of `f` for one example
    as a concrete function of ``(params, example)``, and whether it contains
    a batched matmul or a while loop (in its graph or a function it
    calls)."""
    specs = (
        tuple(tf.TensorSpec(p.shape, p.dtype) for p in params),
        tf.nest.map_structure(lambda a: tf.TensorSpec(a.shape[1:], a.dtype), batch),
    )
    key = (specs[0], tuple(tf.nest.flatten(specs[1])), str(tf.nest.map_structure(lambda _: 0, batch)))
    if _LAST_TRACED.get("f") is f and _LAST_TRACED.get("key") == key:
        return _LAST_TRACED["traced"], _LAST_TRACED["batch_matmul"]

    def grad(p, example):
        return value_and_grad(f, list(p), *[one_example(e) for e in example])[1]

    traced = tf.function(grad).get_concrete_function(list(specs[0]), specs[1])
    graph = traced.graph
    found = any(op.type in _UNVECTORISABLE for op in graph.get_operations())
    if not found:
        library = graph.as_graph_def().library
        found = any(node.op in _UNVECTORISABLE for fn in library.function for node in fn.node_def)
    _LAST_TRACED.update(f=f, key=key, traced=traced, batch_matmul=found)
    return traced, found


def block_kernel(fn, static_argnames=()):
    """`fn` traced once per argument signature (shapes, dtypes, Python
    values). Run eagerly, a metric's per-block arithmetic dispatched ~21,800
    ops on MobileNetV3Small's 284 blocks, 4.9 of a warm K-FAC S_R's 7.9 s.
    One tf.function per signature, each of a function object of its own:
    none ever retraces, so TensorFlow never warns that it does."""
    traced = {}

    def call(*args, **kwargs):
        key = _signature(args, kwargs)
        f = traced.get(key)
        if f is None:
            f = traced[key] = tf.function(functools.partial(fn))
        return f(*args, **kwargs)

    return call


def _signature(args, kwargs):
    def leaf(a):
        if hasattr(a, "shape") and hasattr(a, "dtype"):
            return tuple(a.shape), str(a.dtype)
        return a

    return tuple(leaf(a) for a in tf.nest.flatten((args, sorted(kwargs.items()))))


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


def _strategy_of(model):
    """`model`'s tf.distribute strategy, else the current one (None outside
    every strategy)."""
    strategy = keras_internals.distribute_strategy(model)
    if strategy is None and tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
    return strategy


def data_parallel_shards(model=None):
    """Replicas a global batch is split over: `model`'s tf.distribute
    strategy, else the current one (1 without one)."""
    strategy = _strategy_of(model)
    return 1 if strategy is None else int(strategy.num_replicas_in_sync)


def sum_over_replicas(model, fn, x, y, offset):
    """``sum_r fn(x_r, y_r, offset_r, share_r)`` with the batch split evenly
    over the replicas of `model`'s tf.distribute strategy (or the current
    one), each replica computing on its own device; ``share_r`` is its
    fraction of the batch, ``offset_r`` the global index of its first
    example. Without a strategy (or a batch smaller than the replicas):
    ``fn(x, y, offset, None)``."""
    import numpy as np

    strategy = _strategy_of(model)
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
from keras_geosam.backend._generic import one_example  # noqa: E402
from keras_geosam.backend._generic import for_shapes  # noqa: E402,F401
from keras_geosam.backend._generic import add_scaled as _generic_add_scaled  # noqa: E402
from keras_geosam.backend._generic import multiply_into  # noqa: E402,F401
from keras_geosam.backend._generic import gate_preparation  # noqa: E402,F401
from keras_geosam.backend._generic import sandwich  # noqa: E402,F401
from keras_geosam.backend._generic import uncompiled  # noqa: E402,F401
from keras_geosam.backend._generic import vdot as _generic_vdot  # noqa: E402


from keras_geosam.backend._generic import host_available_memory  # noqa: E402


def available_memory():
    """Bytes of host memory free now on a CPU; None with a GPU (TensorFlow
    reports what it uses there, not what is free)."""
    if tf.config.list_logical_devices("GPU"):
        return None
    return host_available_memory()
