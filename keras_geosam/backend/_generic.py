"""Implementations in ``keras.ops`` for backends that compile a step (JAX,
TensorFlow): there the compiler removes the per-op dispatch cost that makes
a loop of small ops slow on eager torch.
"""

from keras import ops


def uncompiled(fn):
    """`fn` itself: JAX and TensorFlow trace a refresh into the step."""
    return fn


def add_scaled(y, x, alpha):
    """``y + alpha * x`` for a Python number `alpha` (XLA fuses the two)."""
    return y + alpha * x


def vdot(a, b, dtype=None):
    """``sum_i <a_i, b_i>`` over two lists of like-shaped tensors, computed
    in `dtype` (default: the tensors' own)."""
    if not a:
        return ops.zeros((), dtype or "float32")
    if dtype is not None:
        a = [ops.cast(x, dtype) for x in a]
        b = a if b is a else [ops.cast(y, dtype) for y in b]
    return sum(ops.sum(ops.multiply(x, y)) for x, y in zip(a, b))
