"""SAM and ASAM (Foret et al. 2021; Kwon et al. 2021)."""

import keras
from keras import ops

from keras_geosam import backend

from keras_geosam.optimizers.base import TwoPassOptimizer
from keras_geosam._checks import check_number


@keras.saving.register_keras_serializable(package="keras_geosam")
class SAM(TwoPassOptimizer):
    """Sharpness-Aware Minimisation, and ASAM with ``adaptive=True``.

    Per step, on one batch:

        g_c   = grad L(theta)
        T     = 1                                    (SAM)
        T     = |theta| + eta  on kernels, 1 on vectors   (ASAM)
        eps   = rho * T^2 g_c / sqrt(||T g_c||^2 + 1e-12)
        g_p   = grad L(theta + eps)
        theta <- base_optimizer(theta, g_p)          (applied at theta)

    Args:
        base_optimizer: the ``keras.optimizers.Optimizer`` applying the
            descent step, e.g. ``keras.optimizers.SGD(0.05, momentum=0.9)``.
        rho: radius of the perturbation (>= 0; 0 gives the base optimizer).
            Defaults to `0.05`.
        adaptive: ASAM's element-wise scaling. Defaults to `False`.
        eta: ASAM's offset (>= 0). Defaults to `0.01`.
        bn_stats, dropout, perturbation: see ``TwoPassOptimizer``.
        name: defaults to ``"SAM"``, or ``"ASAM"`` when `adaptive`.

    Raises:
        ValueError: if `rho` or `eta` is negative or not a finite number,
            and for the invalid arguments listed in ``TwoPassOptimizer``.

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> model = kg.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    >>> model.compile(
    ...     optimizer=kg.optimizers.SAM(keras.optimizers.SGD(0.1), rho=0.05),
    ...     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    ... )
    >>> history = model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    >>> model.optimizer.name, model.optimizer.rho
    ('SAM', 0.05)
    >>> kg.optimizers.SAM(keras.optimizers.SGD(0.1), adaptive=True).name
    'ASAM'
    """

    reads_centre_gradients = False  # the descent takes g_p alone

    def __init__(self, base_optimizer, rho=0.05, adaptive=False, eta=0.01, bn_stats="centre", dropout="fresh", perturbation="global", name=None, **kwargs):
        super().__init__(base_optimizer, bn_stats=bn_stats, dropout=dropout, perturbation=perturbation, name=name or ("ASAM" if adaptive else "SAM"), **kwargs)
        self.rho = check_number("rho", rho)
        self.adaptive = bool(adaptive)
        self.eta = check_number("eta", eta)

    @property
    def sparse_gradients(self):
        # SAM's eps = rho g / ||g|| and its descent keep a sparse gradient
        # sparse; ASAM's element-wise T g needs it dense.
        return not self.adaptive

    def build_state(self, var_list):
        # ASAM's T = |theta| + eta on weight tensors, 1 on biases, whatever
        # their rank (MultiHeadAttention's are (heads, head_dim)).
        self._weight_tensor = [len(v.shape) > 1 and v.name.split("/")[-1] != "bias" for v in var_list]

    def _scale(self, values):
        if not self.adaptive:
            return [None] * len(values)
        return [ops.abs(v) + self.eta if w else None for v, w in zip(values, self._weight_tensor)]

    def scaled_perturbation(self, centre_grads, values):
        T = self._scale(values)
        tg = [g if t is None else t * g for g, t in zip(centre_grads, T)]
        norm = ops.sqrt(backend.vdot(tg, tg) + 1e-12)
        return self.rho / norm, [x if t is None else t * x for x, t in zip(tg, T)]

    def get_config(self):
        config = super().get_config()
        config.update(rho=self.rho, adaptive=self.adaptive, eta=self.eta)
        return config


__all__ = ["SAM"]
