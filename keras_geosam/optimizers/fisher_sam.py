"""Fisher SAM (Kim et al. 2022), in the reference code's diagonal form."""

import keras
from keras import ops

from keras_geosam.optimizers.base import TwoPassOptimizer


@keras.saving.register_keras_serializable(package="keras_geosam")
class FisherSAM(TwoPassOptimizer):
    """Fisher-SAM: perturbation in the metric of a diagonal gradient Fisher.

        f     = g_c * g_c + eta
        eps   = rho * (g_c / f) / sqrt(g_c . (g_c / f) + 1e-12)
        g_p   = grad L(theta + eps)
        theta <- base_optimizer(theta, g_p)          (plain perturbed gradient)

    Args: `rho` (>= 0), `eta` (> 0).
    """

    def __init__(self, base_optimizer, rho=0.05, eta=0.1, bn_stats="centre", dropout="fresh", perturbation="global", name="FisherSAM", **kwargs):
        super().__init__(base_optimizer, bn_stats=bn_stats, dropout=dropout, perturbation=perturbation, name=name, **kwargs)
        self.rho = self.check_hyperparameter("rho", rho)
        self.eta = self.check_hyperparameter("eta", eta, strict=True)

    def perturbation(self, centre_grads, values):
        w = [g / (g * g + self.eta) for g in centre_grads]
        norm = ops.sqrt(sum(ops.sum(g * x) for g, x in zip(centre_grads, w)) + 1e-12)
        return [(self.rho / norm) * x for x in w]

    def get_config(self):
        config = super().get_config()
        config.update(rho=self.rho, eta=self.eta)
        return config
