"""Data as the curvature routines stream it: the arrays of an input
structure, example slices and batches (split over the devices of an active
JAX distribution)."""

import keras
from keras import ops

from keras_geosam import backend
from keras_geosam._checks import check_int

# Examples per streamed batch when a routine is given ``batch_size=None``:
# memory stays bounded, and results equal one pass over all the data (the
# batches are weighted by size) up to rounding.
DEFAULT_BATCH_SIZE = 256

def input_arrays(x):
    """The arrays of `x`: one array, or a list, tuple or dict of them (a
    keras-hub model's named inputs)."""
    return keras.tree.flatten(x)


def rows_of(x, start, stop):
    """Examples ``start:stop`` of `x` (an array or a structure of them)."""
    return keras.tree.map_structure(lambda a: a[start:stop], x)


def num_examples(x):
    return int(ops.shape(input_arrays(x)[0])[0])


def batches(x, y=None, batch_size=None):
    """Yields `(x_b, y_b, n_b)` slices of at most `batch_size` examples."""
    n = num_examples(x)
    if n == 0:
        raise ValueError("Empty data: at least one example is needed.")
    batch_size = check_int("batch_size", DEFAULT_BATCH_SIZE if batch_size is None else batch_size)
    for start in range(0, n, batch_size):
        stop = min(start + batch_size, n)
        xb = _slice(x, start, stop)
        yb = None if y is None else _slice(y, start, stop)
        yield xb, yb, stop - start


def _slice(a, start, stop):
    # Split over the devices of an active distribution (JAX): every
    # compiled kernel then runs data-parallel.
    return keras.tree.map_structure(lambda e: backend.distribute_batch(e[start:stop]), a)
