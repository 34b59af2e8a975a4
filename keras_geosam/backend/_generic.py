"""Backend-neutral implementations: the ``keras.ops`` forms for backends
that compile a step (JAX, TensorFlow), where the compiler removes the
per-op dispatch cost that makes a loop of small ops slow on eager torch;
and the identity where a backend needs nothing of its own.
"""

from keras import ops


def uncompiled(fn):
    """`fn` itself: JAX and TensorFlow trace a refresh into the step."""
    return fn


def traced(fn):
    """`fn` itself (only TensorFlow's tracing is timed by hand)."""
    return fn


def step_timer(model):
    """None: no clock inside a compiled step (JAX; torch times on the host)."""
    return None


def compile_seconds():
    """Seconds spent compiling steps (none: steps run eagerly)."""
    return 0.0


def is_concrete(x):
    """Whether `x` holds values now (not a tensor being traced): always,
    where nothing is traced (torch runs eagerly)."""
    return True


def for_shapes(fn, *args):
    """``fn(*args)``: an eager forward compiles nothing (TensorFlow, torch)."""
    return fn(*args)


def sandwich(A, Y, B):
    """``A Y_k B^T`` for every ``Y_k`` of `Y` (k, m, n) (``Y_k B^T`` when `A`
    is None): a Kronecker product ``(A kron B) vec(Y_k)``."""
    if A is None:
        return ops.einsum("kjl,ml->kjm", Y, B)
    return ops.einsum("ij,kjl,ml->kim", A, Y, B)


def densify(x):
    """`x` itself: only TensorFlow has sparse gradients (IndexedSlices)."""
    return x


def scale(x, alpha):
    """``alpha * x`` (sparse on TensorFlow if `x` is)."""
    return x * ops.cast(alpha, x.dtype) if hasattr(alpha, "dtype") else x * alpha


def add_scaled(y, x, alpha):
    """``y + alpha * x`` for a Python number or scalar tensor `alpha` (XLA
    fuses the two)."""
    return y + alpha * x


def multiply_into(xs, ys):
    """``[x * y]`` over two lists of like-shaped tensors (traced backends
    reuse dead buffers themselves)."""
    return [x * y for x, y in zip(xs, ys)]


def vdot(a, b, dtype=None):
    """``sum_i <a_i, b_i>`` over two lists of like-shaped tensors, computed
    in `dtype` (default: the tensors' own)."""
    if not a:
        return ops.zeros((), dtype or "float32")
    if dtype is not None:
        a = [ops.cast(x, dtype) for x in a]
        b = a if b is a else [ops.cast(y, dtype) for y in b]
    return sum(ops.sum(ops.multiply(x, y)) for x, y in zip(a, b))


def gate_preparation(train_function, gate):
    """`train_function` itself: only JAX runs U's refresh between steps, as
    a program of its own (TensorFlow's graph cond is free; eager torch
    decides on the host inside the step)."""
    return train_function


def one_example(e):
    """An example (an array or a structure of arrays, e.g. named inputs) with
    its batch axis of one back: what per-example gradients differentiate."""
    import keras

    return keras.tree.map_structure(lambda a: a[None], e)


def host_available_memory():
    """Bytes of host memory free now (Linux's MemAvailable: free plus
    reclaimable caches), or None where /proc/meminfo is not there."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
