"""Friendly SAM (Li et al. 2024)."""

import keras
from keras import ops

from keras_geosam import backend
from keras_geosam.optimizers.base import TwoPassOptimizer


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
        self.rho = self.check_hyperparameter("rho", rho)
        self.sigma = self.check_hyperparameter("sigma", sigma)
        self.momentum = self.check_hyperparameter("momentum", momentum)
        if self.momentum >= 1.0:
            raise ValueError(f"momentum must be < 1, got {momentum!r}.")

    # d = g - sigma m and the EMA scatter a sparse g into the dense average.
    sparse_gradients = True

    def build_state(self, var_list):
        self._average = [self.own_variable(v, "grad_average") for v in var_list]

    def scaled_perturbation(self, centre_grads, values):
        d = [backend.add_scaled(g, ops.cast(m, g.dtype), -self.sigma) for g, m in zip(centre_grads, self._average)]
        norm = ops.sqrt(backend.vdot(d, d) + 1e-12)
        return self.rho / norm, d

    def update_state(self, centre_grads, perturbed_grads):
        b = self.momentum
        for m, g in zip(self._average, centre_grads):
            m.assign(backend.add_scaled(b * m, ops.cast(g, m.dtype), 1.0 - b))

    def get_config(self):
        config = super().get_config()
        config.update(rho=self.rho, sigma=self.sigma, momentum=self.momentum)
        return config
