"""K-FAC factors of the Fisher for Dense, Conv and EinsumDense kernels.

For a kernel viewed as a matrix ``(m, n)`` (Dense: ``(d_in, d_out)``; Conv:
``(kh*kw*c_in, c_out)``) the Fisher block is approximated by ``A kron S``
("K-FAC expand": spatial positions and extra axes count as examples):

- ``A``: mean over examples and positions of ``a a^T``, ``a`` the layer's
  input row (Conv: the input patch, ordered like the kernel's rows);
- ``S = 1/N sum_n sum_t delta delta^T``, ``delta`` the gradient of the
  output factors of the chosen Fisher kind with respect to the layer's
  pre-activation output.

These are the factors of ``GGN(...).kfac()``, whose blocks are the
:class:`~keras_geosam.curvature.KFAC` operators that LLQR's U uses too.
"""

import numpy as np
from keras import ops

from keras_geosam.curvature.operators import GGN
from keras_geosam.curvature.operators import KFAC
from keras_geosam.sharpness import _common


def kfac_factors(model, x, y=None, kind="exact", num_samples=1, seed=0, batch_size=_common.DEFAULT_BATCH_SIZE, loss=None,
                 sample_weight=None, approximation="expand"):
    """K-FAC factors ``{kernel path: (A, S)}`` (float64 NumPy) of the Fisher.

    Variables not in the result (biases, other layers) get diagonal blocks
    in ``GGN(...).kfac()``.

    Args:
        model, x, y, kind, num_samples, seed, batch_size, loss,
            sample_weight: as for :func:`fisher_diagonal`.
        approximation: ``"expand"`` or ``"reduce"`` for layers applied at
            every position (``GGN.kfac``). Defaults to ``"expand"``.

    Returns:
        A dict from each covered kernel's variable path to ``(A, S)``:
        ``(m, m)`` and ``(n, n)`` float64 NumPy arrays for the kernel's
        ``(m, n)`` matrix view.

    Raises:
        ValueError: for the reasons :func:`fisher_diagonal` gives.

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, kernel_initializer="zeros")])
    >>> model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> factors = kg.sharpness.kfac_factors(model, x)
    >>> [(path.split("/")[-1], A.shape, S.shape) for path, (A, S) in factors.items()]
    [('kernel', (4, 4), (3, 3))]
    """
    _common.require_fisher(model, loss, "kfac_factors")
    op = GGN(model, x, y, kind=kind, num_samples=num_samples, seed=seed, loss=loss, batch_size=batch_size, sample_weight=sample_weight)
    out = {}
    for path, block in zip(op.fns.paths, op.kfac(approximation).blocks):
        if isinstance(block, KFAC):
            out[path] = tuple(np.asarray(ops.convert_to_numpy(t), dtype="float64") for t in (block.A, block.B))
    return out
