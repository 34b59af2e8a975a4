"""Distribution helpers for backends whose step sees global gradients.

Under JAX ``keras.distribution`` the gradient of the sharded batch is already
global, and Keras 3 ``fit`` has no multi-device torch support, so there are
no per-replica gradients to reduce and no cross-replica context to respect.
"""

from keras import ops


def sum_over_replicas(model, fn, x, y, offset):
    """``fn(x, y, offset, None)``: one program sees the whole batch (on JAX
    the compiled kernels split it over a keras.distribution's devices)."""
    return fn(x, y, offset, None)


def device_constant(value):
    """A NumPy value as a tensor."""
    return ops.convert_to_tensor(value)


def distribute_batch(a):
    """A streamed data batch as a tensor (no data-parallel placement)."""
    return ops.convert_to_tensor(a)


def wait_for_step(model):
    """Blocks until the steps queued by ``fit`` have run (reading the step
    counter waits for every op that writes it)."""
    ops.convert_to_numpy(model.optimizer.iterations)


def process_count():
    """Processes in the job (one)."""
    return 1


def data_parallel_shards(model=None):
    """Devices a batch is split over (none: 1)."""
    return 1


def save_from_primary(save):
    """Runs ``save()`` (one process)."""
    return save()


def replica_count():
    return 1


def all_reduce_sum(tensors):
    return list(tensors)


def cond_apply(pred, apply_fn, skip_fn, args, state=()):
    """Runs ``apply_fn(*args)`` if `pred` else ``skip_fn()`` (`state`: the
    variables either may write; unused here)."""
    ops.cond(pred, lambda: apply_fn(*args), skip_fn)
