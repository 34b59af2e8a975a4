"""Helpers for training under ``keras.distribution`` / ``tf.distribute``.

keras_geosam builds no distribution layer of its own: its train step and
estimators run under the engines' own (JAX ``keras.distribution``, with
``jax.distributed`` across processes; TensorFlow ``tf.distribute``). Under a
JAX distribution the estimators (``kg.sharpness``, ``kg.curvature``) split
every streamed batch over the devices, so each process passes the same
global data; ``fit`` takes each process's own share of every global batch,
as Keras does. What the engines lack is here.
"""

import contextlib
import re

import keras

from keras_geosam import keras_internals
from keras_geosam import backend

__all__ = ["save_model", "check_batches", "layout_errors"]


@contextlib.contextmanager
def layout_errors():
    """Rewrites a weight layout that does not divide its weight's shape
    (JAX's ``IndivisibleError`` at variable creation under
    ``keras.distribution.ModelParallel``) as a ValueError that names the
    variable and the fix. kg.Sequential's construction and ``fit`` (where
    subclassed models build) run inside it.

    Returns:
        A context manager.

    Raises:
        ValueError: in place of such an error.

    Example:

    >>> with kg.distribution.layout_errors():
    ...     model = kg.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    """
    try:
        yield
    except Exception as e:
        if type(e).__name__ != "IndivisibleError":
            raise
        what = "a weight"
        match = re.search(r"full shape: \(([\d, ]*)\)", str(e))
        if match:
            shape = tuple(int(d) for d in match.group(1).replace(" ", "").split(",") if d)
            keys = _misfit_keys(shape)
            what = f"a weight of shape {shape}" + (f" (LayoutMap entry {', '.join(map(repr, keys))})" if keys else "")
        raise ValueError(
            f"The layout that {type(keras.distribution.distribution()).__name__} gives {what} does not fit it: "
            f"every sharded axis must be divisible by the size of its mesh axis. Change that weight's entry in "
            f"the LayoutMap (shard another axis, or leave it None to replicate), the mesh shape, or the layer's "
            f"size. ({e})"
        ) from e


def _misfit_keys(shape):
    """LayoutMap keys whose layout cannot split a weight of `shape`."""
    distribution = keras.distribution.distribution()
    layout_map = keras_internals.layout_map(distribution)
    if layout_map is None:
        return []
    mesh = distribution.device_mesh
    size = dict(zip(mesh.axis_names, mesh.shape))
    keys = []
    for key in layout_map:
        axes = layout_map[key].axes
        if len(axes) == len(shape) and any(a is not None and shape[i] % size.get(a, 1) for i, a in enumerate(axes)):
            keys.append(key)
    return keys


def _local_batch_shards(model=None):
    """Devices one process's batch is split over (None: no data parallelism)."""
    shards = backend.data_parallel_shards(model)
    return None if shards <= 1 else shards


def check_batches(num_examples, batch_size, model=None):
    """Raises, naming the fix, if ``fit`` would hand the active
    ``keras.distribution`` a batch it cannot split over its devices.

    Each process feeds ``batch_size`` examples per step (the last step of
    an epoch ``num_examples % batch_size``), and both must divide evenly
    among the devices it is split over: JAX would otherwise fail mid-epoch
    with an ``IndivisibleError`` about shardings, and ``tf.distribute``
    would silently give replicas unequal shares (a step's gradient then is
    no longer the mean over its batch). Without data parallelism this does
    nothing.

    Args:
        num_examples: examples this process feeds per epoch (None: unknown,
            e.g. a dataset).
        batch_size: examples per step on this process.
        model: the model to be trained (its tf.distribute strategy).
            Defaults to `None` (the current distribution or strategy).

    Returns:
        None.

    Raises:
        ValueError: if a batch does not divide among the devices.

    Example:

    >>> kg.distribution.check_batches(100, 32)  # no distribution: nothing to check
    """
    shards = _local_batch_shards(model)
    if shards is None or shards == 1 or batch_size is None:
        return
    if batch_size % shards:
        raise ValueError(
            f"batch_size={batch_size} does not split evenly over the {shards} data-parallel devices: "
            f"pass a batch_size divisible by "
            f"{shards} (e.g. {max(shards, batch_size - batch_size % shards)})."
        )
    rest = 0 if num_examples is None else num_examples % batch_size
    if rest % shards:
        raise ValueError(
            f"The last batch of each epoch holds {rest} examples ({num_examples} % {batch_size}), which do not "
            f"split evenly over the {shards} data-parallel devices: pass a number of examples that leaves a "
            f"remainder divisible by {shards} (e.g. drop the last {rest % shards}), or a tf.data.Dataset "
            f"batched with drop_remainder=True."
        )


def save_model(model, filepath, **kwargs):
    """Saves `model` from the first process only; every process waits.

    One process is the same as ``model.save(filepath, **kwargs)``. Under a
    multi-process JAX distribution, Keras' own ``model.save`` must not be
    called on one process alone (it creates a variable, a collective every
    process would have to join); this saves on process 0 and holds the
    others at a barrier until the file is written, after which every
    process can ``keras.saving.load_model`` it.

    Args:
        model: the model to save (optimizer state, U included).
        filepath: a ``.keras`` path that process 0 can write and every
            process can read.
        **kwargs: passed to ``model.save``.

    Returns:
        None.

    Raises:
        Whatever ``model.save`` raises on process 0.

    Example:

    >>> import os, tempfile
    >>> model = kg.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    >>> model.compile(optimizer=kg.optimizers.SAM(keras.optimizers.SGD(0.1)), loss="mse")
    >>> path = os.path.join(tempfile.mkdtemp(), "model.keras")
    >>> kg.distribution.save_model(model, path)
    >>> type(keras.saving.load_model(path).optimizer).__name__
    'SAM'
    """
    backend.save_from_primary(lambda: model.save(filepath, **kwargs))
