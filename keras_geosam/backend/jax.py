"""JAX specialisation: jax.grad, forward-over-reverse HVP, vmap, jit."""

import itertools

import jax
import keras

from keras_geosam import keras_internals


# XLA:CPU runs a convolution's kernel gradient about 11x slower inside a
# while loop than unrolled (jax-ml/jax#12868): loops over convolutional
# networks are unrolled there (LLQR's refresh).
slow_convolutions_in_loops = jax.default_backend() == "cpu"

# XLA fuses many small matmuls well; stacking K-FAC blocks into one batched
# product only adds copies (the bench ViT's K-FAC step: +5%).
batch_small_products = False

# XLA runs the chunks of a Python-unrolled loop side by side, each chunk's
# cotangents and per-example squares alive at once (a GPT-2's Fisher: +0.68
# GB per sampled label); a compiled loop keeps one chunk's buffers.
loop_pullbacks = True

# vmap over the probes: a kernel's trace does not grow with their number.
max_probe_block = None

# XLA:CPU runs a convolution vmapped over probes far slower than the same
# convolutions one probe at a time (a Hessian product of 4 probes, warm:
# MobileNetV3Small 26.2 s vmapped, 1.24 s unrolled; a small CNN, 8 probes,
# 1.39 s against 0.77 s; an MLP the same either way): products over a
# convolutional network unroll their probes, in blocks of this many.
unrolled_probe_block = 8 if jax.default_backend() == "cpu" else None


# Steps are traced and compiled: their branches stay on the device.
eager_steps = False

# LLQR's refresh runs between steps as a program of its own, dispatched and
# timed by the host (``gate_preparation``).
refresh_between_steps = True


_COMPILE_SECONDS = [0.0]


def _on_duration(event, seconds, **kwargs):
    if event.startswith("/jax/core/compile/"):
        _COMPILE_SECONDS[0] += seconds


jax.monitoring.register_event_duration_secs_listener(_on_duration)


def compile_seconds():
    """Seconds JAX has spent tracing, lowering and compiling in this
    process (its own monitoring events), so a timed step can leave them out."""
    return _COMPILE_SECONDS[0]


def value_and_grad(f, params, *args, has_aux=False, sparse=False):
    """Returns ``(value, grads)`` or, with ``has_aux``, ``((value, aux), grads)``
    (JAX's gradients are always dense: `sparse` changes nothing)."""
    return jax.value_and_grad(f, has_aux=has_aux)(params, *args)


def jvp(f, params, tangents, *args):
    return jax.jvp(lambda p: f(p, *args), (params,), (tangents,))


def vjp(f, params, cotangent, *args):
    _, pullback = jax.vjp(lambda p: f(p, *args), params)
    return pullback(cotangent)[0]


def hvp(f, params, vectors, *args):
    # Forward-over-reverse: one linearisation of the gradient, ~2-3 gradients.
    grad_f = jax.grad(lambda p: f(p, *args))
    return jax.jvp(grad_f, (params,), (vectors,))[1]


def hvp_batched(f, params, vectors, *args, unroll=False):
    # One linearisation of the gradient serves every probe (leading axis k),
    # vmapped, or with `unroll` one tangent pass per probe in the trace.
    _, linear = jax.linearize(jax.grad(lambda p: f(p, *args)), params)
    if not unroll:
        return jax.vmap(linear)(vectors)
    rows = [linear([v[i] for v in vectors]) for i in range(int(vectors[0].shape[0]))]
    return [jax.numpy.stack(parts) for parts in zip(*rows)]


def value_and_vjp(f, params, *args):
    """``(f(params), pull)`` with ``pull(cotangent) = J^T cotangent`` from the
    same forward pass (``f`` may return a list)."""
    value, pull = jax.vjp(lambda p: f(p, *args), list(params))
    return value, lambda c: list(pull(c)[0])


def linearize(f, params, *args):
    """``(f(params), jvp_fn, vjp_fn)``: J t and J^T c of the tensor-valued
    ``f`` at `params`, from one forward pass that every call reuses."""
    out, linear = jax.linearize(lambda p: f(p, *args), list(params))
    transpose = jax.linear_transpose(linear, list(params))
    return out, lambda t: linear(list(t)), lambda c: list(transpose(c)[0])


def vjp_batched(f, params, *args, has_aux=False):
    """``(value, aux, pullback)``; ``pullback(cotangents)`` maps cotangents
    with a leading axis k to gradients with that axis, reusing one forward."""
    if has_aux:
        value, pull, aux = jax.vjp(lambda p: f(p, *args), params, has_aux=True)
    else:
        (value, pull), aux = jax.vjp(lambda p: f(p, *args), params), None
    return value, aux, lambda cot: jax.vmap(lambda c: pull(c)[0])(cot)


def eigh(x):
    import jax.numpy as jnp

    return jnp.linalg.eigh(x)


def is_concrete(x):
    """Whether `x` holds values now (not a tracer inside ``jax.jit``)."""
    return not isinstance(x, jax.core.Tracer)


def per_example_grads(f, params, *batch):
    def one(*example):
        return jax.grad(f)(params, *[one_example(e) for e in example])

    return jax.vmap(one)(*batch)


def compile(fn):
    return jax.jit(fn)


def block_kernel(fn, static_argnames=()):
    """`fn` compiled once per shape: each op JAX runs eagerly is itself a
    program compiled for its shapes, so the ~20 ops of a metric block's
    inverse, over the dozens of shapes of a convolutional network, made
    ~1500 small compiles on MobileNetV3Small's first K-FAC S_R."""
    return jax.jit(fn, static_argnames=static_argnames)


def for_shapes(fn, *args):
    """Traces ``fn(*args)`` for what it shows on the host (shapes, Python
    flags) without running it: an eager forward would compile every op of
    the model for its shapes, a third of a first sharpness call's compile."""
    return jax.eval_shape(fn, *args)


def device_constant(value):
    """A NumPy value sent to the device explicitly (a Python or NumPy
    scalar handed to a compiled function would be an implicit transfer)."""
    import numpy as np

    return jax.device_put(np.asarray(value))


def distribute_batch(a):
    """A streamed data batch placed for the active ``keras.distribution``.

    Under a distribution the batch axis is split over the devices of the
    data layout (every process passes the same global array), so compiled
    kernels run data-parallel and XLA reduces their sums over examples
    across devices and processes. A batch that does not divide evenly is
    replicated instead: correct, on every device. Without a distribution:
    ``a`` as a tensor.
    """
    import keras
    import numpy as np

    distribution = keras.distribution.distribution()
    if distribution is None:
        # Host data is sent explicitly (never an implicit transfer).
        return a if isinstance(a, jax.Array) else jax.device_put(np.asarray(a))
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        return a  # already a global array
    a = np.asarray(a)
    sharding = distribution.get_data_layout(a.shape).backend_layout
    axes = sharding.spec[0] if sharding.spec else None
    axes = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
    shards = int(np.prod([sharding.mesh.shape[name] for name in axes]))
    if a.ndim == 0 or a.shape[0] % shards:
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])


def wait_for_step(model):
    """Blocks until the steps queued by ``fit`` have run (Keras' JAX
    trainer keeps the newest state in ``model._jax_state`` during fit)."""
    state = keras_internals.jax_state(model)
    values = state.get("optimizer_variables") or [v.value for v in model.optimizer.variables]
    jax.block_until_ready(values)


def process_count():
    """Processes in the job (``jax.distributed``)."""
    return jax.process_count()


def data_parallel_shards(model=None):
    """Devices along the active keras.distribution's batch axis that one
    process's batch is split over (1 without a distribution)."""
    import keras

    distribution = keras.distribution.distribution()
    if distribution is None:
        return 1
    mesh = distribution.device_mesh
    name = getattr(distribution, "batch_dim_name", None)
    shards = mesh.shape[mesh.axis_names.index(name)] if name in mesh.axis_names else 1
    return max(1, shards // jax.process_count())


def save_from_primary(save):
    """Runs ``save()`` on process 0 only; every process waits for it.

    Keras' saving builds a reference optimizer, whose variable would be a
    cross-process collective under a multi-process distribution: process 0
    saves with the distribution unset (the replicated weights are all
    local), the others wait at a barrier.
    """
    import keras

    if jax.process_count() == 1:
        return save()
    from jax.experimental import multihost_utils

    if jax.process_index() == 0:
        distribution = keras.distribution.distribution()
        keras.distribution.set_distribution(None)
        try:
            save()
        finally:
            keras.distribution.set_distribution(distribution)
    multihost_utils.sync_global_devices("keras_geosam.save_from_primary")


_increment = jax.jit(lambda a: a + 1)


class _Host:
    """The gate's explicit reads from the device (never an implicit
    transfer, which ``jax.transfer_guard`` would refuse on an accelerator)."""

    @staticmethod
    def read(array):
        return int(jax.device_get(array.addressable_data(0)))

    @staticmethod
    def increment(array):
        """``array + 1`` on the device: a compiled program holds the 1 (an
        eager constant is a host transfer; a device_put array is committed,
        and the next step would compile again for it)."""
        return _increment(array)

    @staticmethod
    def wait(arrays):
        jax.block_until_ready(arrays)


def gate_preparation(train_function, gate):
    """Keras' JAX ``train_function(state, iterator)``, each of whose steps
    asks the host ``gate.next_step(read_counter, can_read)`` whether the
    optimizer's ``prepare_step`` (LLQR's refresh of U) may have work to do.
    The steps themselves never hold the refresh (traced under
    ``gate.outside()``): one program for every step, compiled once, without
    the refresh's temporaries. Before a step that may be due,
    ``gate.prepare(state, data, host)`` runs the refresh as its own program
    on the state, the step runs alone, and ``gate.settle`` undoes the
    refresh if the step was skipped (``host`` reads the step counter
    explicitly); runs of other steps go to ``train_function``
    together (``steps_per_execution``).

    ``gate.counter_index()`` locates the step counter among the optimizer
    variables at each call (building the optimizer adds variables before
    it); ``read_counter()`` reads it from the state the call started from,
    so only for the call's first step. When that counter is not the one the
    previous call returned, Keras re-read the state from the variables (a
    callback or the user may have set them): ``gate.restart()`` drops what
    the host knew."""
    returned = [None]

    def gated(state, iterator):
        index = gate.counter_index()
        if index is None:  # no counter to follow: the step refreshes itself
            return train_function(state, iterator)
        counter = state[2][index]
        if counter is not returned[0]:
            gate.restart()

        def read_counter():
            return _Host.read(counter)

        # Keras hands over the epoch's iterator: a call takes one execution's
        # batches (``steps_per_execution``), as Keras' own loop does.
        batches = itertools.islice(iterator, gate.steps_per_execution())
        can_read, plain, logs, ran = True, [], None, False
        with gate.outside():
            for data in batches:
                due = gate.next_step(read_counter, can_read)
                can_read = False
                if not due:
                    plain.append(data)
                    continue
                if plain:
                    logs, state = train_function(state, iter(plain))
                    plain = []
                state, undo = gate.prepare(state, data, _Host)
                logs, state = train_function(state, iter([data]))
                state, ran = gate.settle(state, undo, _Host), True
            if plain or not ran:  # no batch at all: Keras' own StopIteration
                logs, state = train_function(state, iter(plain))
        returned[0] = state[2][index]
        return logs, state

    return gated


# Keras offers no per-replica train step on this backend: gradients are global.
from keras_geosam.backend._single_device import all_reduce_sum  # noqa: E402,F401
from keras_geosam.backend._single_device import sum_over_replicas  # noqa: E402,F401
from keras_geosam.backend._single_device import cond_apply  # noqa: E402,F401
from keras_geosam.backend._single_device import replica_count  # noqa: E402,F401

# The step is compiled, so the keras.ops forms cost no per-op dispatch.
from keras_geosam.backend._generic import one_example  # noqa: E402
from keras_geosam.backend._generic import host_available_memory  # noqa: E402


def available_memory():
    """Bytes free on the default device now (the host's on a CPU), or None
    where the device does not say."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        return host_available_memory()
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
from keras_geosam.backend._generic import add_scaled  # noqa: E402,F401
from keras_geosam.backend._generic import multiply_into  # noqa: E402,F401
from keras_geosam.backend._generic import densify  # noqa: E402,F401
from keras_geosam.backend._generic import step_timer  # noqa: E402,F401
from keras_geosam.backend._generic import traced  # noqa: E402,F401
from keras_geosam.backend._generic import sandwich  # noqa: E402,F401
from keras_geosam.backend._generic import scale  # noqa: E402,F401
from keras_geosam.backend._generic import uncompiled  # noqa: E402,F401
from keras_geosam.backend._generic import vdot  # noqa: E402,F401
