"""Friendly SAM (Li et al. 2024)."""

import keras
from keras import ops

from keras_geosam.optimizers.base import TwoPassOptimizer


@keras.saving.register_keras_serializable(package="keras_geosam")
class FSAM(TwoPassOptimizer):
    """F-SAM: perturb along the centre gradient minus its full-batch trend.

        d     = g_c - sigma * m          (m: EMA of *previous* centre gradients, m_0 = 0)
        eps   = rho * d / sqrt(||d||^2 + 1e-12)
        g_p   = grad L(theta + eps)
        m     <- momentum * m + (1 - momentum) * g_c     (after use)
        theta <- base_optimizer(theta, g_p)

    ``sigma = 0`` is SAM. Args: `rho` (>= 0), `sigma` (>= 0), `momentum`
    (EMA factor in [0, 1); 0.9 by default, 0.6 in the ImageNet reference).
    """

    def __init__(self, base_optimizer, rho=0.05, sigma=1.0, momentum=0.9, bn_stats="centre", dropout="fresh", perturbation="global", name="FSAM", **kwargs):
        super().__init__(base_optimizer, bn_stats=bn_stats, dropout=dropout, perturbation=perturbation, name=name, **kwargs)
        self.rho = self.check_hyperparameter("rho", rho)
        self.sigma = self.check_hyperparameter("sigma", sigma)
        self.momentum = self.check_hyperparameter("momentum", momentum)
        if self.momentum >= 1.0:
            raise ValueError(f"momentum must be < 1, got {momentum!r}.")

    def build_state(self, var_list):
        self._average = [self.own_variable(v, "grad_average") for v in var_list]

    def perturbation(self, centre_grads, values):
        d = [g - self.sigma * ops.cast(m, g.dtype) for g, m in zip(centre_grads, self._average)]
        norm = ops.sqrt(sum(ops.sum(ops.square(x)) for x in d) + 1e-12)
        return [(self.rho / norm) * x for x in d]

    def update_state(self, centre_grads, perturbed_grads):
        b = self.momentum
        for m, g in zip(self._average, centre_grads):
            m.assign(b * m + (1.0 - b) * ops.cast(g, m.dtype))

    def get_config(self):
        config = super().get_config()
        config.update(rho=self.rho, sigma=self.sigma, momentum=self.momentum)
        return config
