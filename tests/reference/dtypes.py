"""Running a test module in one float dtype, whatever ran before it."""

import contextlib

import keras
from keras.src.backend.common import global_state


@contextlib.contextmanager
def keras_dtype(dtype):
    """Sets floatx and the global dtype policy to `dtype`, then restores both
    exactly. Keras caches its policy from floatx at the first layer it builds
    (later set_floatx calls do not change it), hence both, and "not yet
    cached" is restored too."""
    old, old_policy = keras.config.floatx(), global_state.get_global_attribute("dtype_policy", None)
    keras.config.set_floatx(dtype)
    keras.config.set_dtype_policy(dtype)
    try:
        yield dtype
    finally:
        keras.config.set_floatx(old)
        global_state.set_global_attribute("dtype_policy", old_policy)
