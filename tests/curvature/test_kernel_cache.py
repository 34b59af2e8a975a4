"""The one compiled-kernel cache: built once per function and options, and
two different functions never share an entry (not even two lambdas)."""

import numpy as np
from keras import ops

from keras_geosam.curvature.kernels import KernelCache


def test_one_entry_per_function_and_options_and_none_shared_by_name():
    cache = KernelCache()
    double = lambda x, scale=1.0: x * 2.0 * scale  # noqa: E731
    triple = lambda x, scale=1.0: x * 3.0 * scale  # noqa: E731
    x = ops.convert_to_tensor(np.array([1.0, 2.0], "float32"))
    assert cache.get(double) is cache.get(double)
    assert cache.get(double, scale=2.0) is not cache.get(double)
    np.testing.assert_allclose(ops.convert_to_numpy(cache.get(double)(x)), [2.0, 4.0])
    np.testing.assert_allclose(ops.convert_to_numpy(cache.get(triple)(x)), [3.0, 6.0])
    np.testing.assert_allclose(ops.convert_to_numpy(cache.get(double, scale=2.0)(x)), [4.0, 8.0])
