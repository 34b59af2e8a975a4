"""Backend-specific automatic differentiation, chosen once at import time.

Everything outside this folder is written in ``keras.ops``; what Keras does
not offer (gradients, Hessian-vector products, per-example gradients,
compilation, a few fused kernels and distribution hooks) comes from the
active backend through one thin module each. ``active.py`` picks the module
and states the contract they all keep.
"""

from keras_geosam.backend.active import *  # noqa: F401,F403 (the contract's names)
from keras_geosam.backend.active import __all__  # noqa: F401
