"""Fisher SAM (Kim et al. 2022), in the reference code's diagonal form."""

import keras
from keras import ops

from keras_geosam import backend
from keras_geosam.optimizers.base import TwoPassOptimizer
from keras_geosam._checks import check_number


@keras.saving.register_keras_serializable(package="keras_geosam")
class FisherSAM(TwoPassOptimizer):
    """Fisher-SAM: perturbation in the metric of a diagonal gradient Fisher.

        f     = g_c * g_c + eta
        eps   = rho * (g_c / f) / sqrt(g_c . (g_c / f) + 1e-12)
        g_p   = grad L(theta + eps)
        theta <- base_optimizer(theta, g_p)          (plain perturbed gradient)

    Args:
        base_optimizer: the ``keras.optimizers.Optimizer`` applying the
            descent step.
        rho: radius of the perturbation in the Fisher metric (>= 0).
            Defaults to `0.05`.
        eta: damping added to the squared gradient (> 0). Defaults to
            `0.1`.
        bn_stats, dropout, perturbation: see ``TwoPassOptimizer``.
        name: defaults to ``"FisherSAM"``.

    Raises:
        ValueError: if `rho` is negative, `eta` is not positive, either is
            not a finite number, and for the invalid arguments listed in
            ``TwoPassOptimizer``.

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> model = kg.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    >>> model.compile(
    ...     optimizer=kg.optimizers.FisherSAM(keras.optimizers.SGD(0.1), rho=0.05, eta=0.1),
    ...     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    ... )
    >>> history = model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    >>> "sharpness_gap" in history.history
    True
    >>> kg.optimizers.FisherSAM(keras.optimizers.SGD(0.1), eta=0.0)
    Traceback (most recent call last):
    ...
    ValueError: eta must be finite and > 0.0, got 0.0.
    """

    reads_centre_gradients = False  # the descent takes g_p alone

    def __init__(self, base_optimizer, rho=0.05, eta=0.1, bn_stats="centre", dropout="fresh", perturbation="global", name="FisherSAM", **kwargs):
        super().__init__(base_optimizer, bn_stats=bn_stats, dropout=dropout, perturbation=perturbation, name=name, **kwargs)
        self.rho = check_number("rho", rho)
        self.eta = check_number("eta", eta, strict=True)

    def scaled_perturbation(self, centre_grads, values):
        w = [g / (g * g + self.eta) for g in centre_grads]
        norm = ops.sqrt(backend.vdot(centre_grads, w) + 1e-12)
        return self.rho / norm, w

    def get_config(self):
        config = super().get_config()
        config.update(rho=self.rho, eta=self.eta)
        return config
