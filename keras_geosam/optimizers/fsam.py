"""Friendly SAM (Li et al. 2024)."""

import keras
from keras import ops

from keras_geosam import backend
from keras_geosam.optimizers.base import TwoPassOptimizer
from keras_geosam._checks import check_number



def trend_removed(grads, average, sigma):
    """F-SAM's ascent direction ``g - sigma m``: the gradient less `sigma`
    times its trend ``m`` (an EMA of past centre gradients)."""
    return [backend.add_scaled(g, ops.cast(m, g.dtype), -sigma) for g, m in zip(grads, average)]


def update_trend(average, grads, momentum):
    """``m <- b m + (1 - b) g`` on the trend's variables (a sparse `g` is
    scattered into the dense average)."""
    for m, g in zip(average, grads):
        m.assign(backend.add_scaled(momentum * m, ops.cast(g, m.dtype), 1.0 - momentum))

@keras.saving.register_keras_serializable(package="keras_geosam")
class FSAM(TwoPassOptimizer):
    """F-SAM: perturb along the centre gradient minus its full-batch trend.

        d     = g_c - sigma * m          (m: EMA of *previous* centre gradients, m_0 = 0)
        eps   = rho * d / sqrt(||d||^2 + 1e-12)
        g_p   = grad L(theta + eps)
        m     <- momentum * m + (1 - momentum) * g_c     (after use)
        theta <- base_optimizer(theta, g_p)

    ``sigma = 0`` is SAM.

    Args:
        base_optimizer: the ``keras.optimizers.Optimizer`` applying the
            descent step.
        rho: radius of the perturbation (>= 0). Defaults to `0.05`.
        sigma: weight of the removed trend (>= 0). Defaults to `1.0`.
        momentum: EMA factor of the trend, in [0, 1). Defaults to `0.9`
            (0.6 in the ImageNet reference).
        bn_stats, dropout, perturbation: see ``TwoPassOptimizer``.
        name: defaults to ``"FSAM"``.

    Raises:
        ValueError: if `rho` or `sigma` is negative, `momentum` is outside
            [0, 1), any of them is not a finite number, and for the invalid
            arguments listed in ``TwoPassOptimizer``.

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> model = kg.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    >>> model.compile(
    ...     optimizer=kg.optimizers.FSAM(keras.optimizers.SGD(0.1), rho=0.05, sigma=1.0),
    ...     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    ... )
    >>> history = model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    >>> len(model.optimizer.variables) > len(model.optimizer.base_optimizer.variables)
    True
    >>> kg.optimizers.FSAM(keras.optimizers.SGD(0.1), momentum=1.0)
    Traceback (most recent call last):
    ...
    ValueError: momentum must be < 1, got 1.0.
    """

    def __init__(self, base_optimizer, rho=0.05, sigma=1.0, momentum=0.9, bn_stats="centre", dropout="fresh", perturbation="global", name="FSAM", **kwargs):
        super().__init__(base_optimizer, bn_stats=bn_stats, dropout=dropout, perturbation=perturbation, name=name, **kwargs)
        self.rho = check_number("rho", rho)
        self.sigma = check_number("sigma", sigma)
        self.momentum = check_number("momentum", momentum, below=1)

    # d = g - sigma m and the EMA scatter a sparse g into the dense average.
    sparse_gradients = True

    def build_state(self, var_list):
        self._average = [self.own_variable(v, "grad_average") for v in var_list]

    def scaled_perturbation(self, centre_grads, values):
        d = trend_removed(centre_grads, self._average, self.sigma)
        norm = ops.sqrt(backend.vdot(d, d) + 1e-12)
        return self.rho / norm, d

    def update_state(self, centre_grads, perturbed_grads):
        update_trend(self._average, centre_grads, self.momentum)

    def get_config(self):
        config = super().get_config()
        config.update(rho=self.rho, sigma=self.sigma, momentum=self.momentum)
        return config
