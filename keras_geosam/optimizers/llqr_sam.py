"""LLQR+SAM: geometry-aware sharpness minimisation on two timescales."""

import keras
from keras import ops

from keras_geosam import backend
from keras_geosam.optimizers.fsam import trend_removed
from keras_geosam.optimizers.fsam import update_trend
from keras_geosam.optimizers.preconditioned import PreconditionedOptimizer
from keras_geosam._checks import check_int
from keras_geosam._checks import check_number

NORMS = ("euclidean", "metric")
ASCENTS = ("sam", "fsam")


@keras.saving.register_keras_serializable(package="keras_geosam")
class LLQRSAM(PreconditionedOptimizer):
    """LLQR+SAM: U shapes both the perturbation and the descent step.

    Per step t, one batch B for both passes:

        if t % refresh_every == 0: refresh U at theta_t    (slow timescale)
        g_c   = grad L_B(theta_t)
        v     = g_c                    (ascent="sam")
        v     = g_c - sigma * m        (ascent="fsam"; m: EMA of previous g_c)
        w     = U v
        eps   = rho * w / sqrt(w.w + 1e-12)        (norm="euclidean", default)
        eps   = rho * w / sqrt(v.w + 1e-12)        (norm="metric"; the step is
                                                skipped if v.U v is not positive)
        eps   = 0                      while t < sam_start_step
        g_p   = grad L_B(theta_t + eps)
        theta <- base_optimizer(theta_t, U g_p + coupled_weight_decay * theta_t)

    rho = 0 gives LLQR; U = identity (refresh_every beyond the run, after
    step 0 is skipped via ``refresh_source="callback"``) gives SAM.
    BatchNorm statistics default to the perturbed pass, as in the reference.

    Args:
        base_optimizer: e.g. ``keras.optimizers.SGD(0.05, momentum=0.9)``.
        rho: perturbation radius (>= 0). Defaults to `0.1` (the reference;
            0.075 on ImageNet).
        norm: ``"euclidean"`` or ``"metric"`` (update rule above). Defaults
            to ``"euclidean"``.
        ascent: ``"sam"`` or ``"fsam"``. Defaults to ``"sam"``.
        sam_start_step: no perturbation before this step. Defaults to `0`.
        fsam_sigma, fsam_momentum: F-SAM's sigma (>= 0) and EMA factor (in
            [0, 1)) for ``ascent="fsam"``. Default to `1.0` and `0.9`.
        structure, divergence, refresh_every: U's structure, divergence and
            refresh period, as in ``kg.optimizers.LLQR``. Default to
            ``"diagonal"``, ``"ngd"`` and `1000`.
        bn_stats: defaults to ``"perturbed"``; with `dropout` and
            `perturbation`, see ``TwoPassOptimizer``.
        name: defaults to ``"LLQRSAM"``.
        **kwargs: U's other options, as in ``kg.optimizers.LLQR``.

    Raises:
        ValueError: if `rho` or `fsam_sigma` is negative, `fsam_momentum`
            is outside [0, 1), `norm` or `ascent` is not one of its values,
            `sam_start_step` is not an integer >= 0, for invalid options of
            U and the invalid arguments listed in ``TwoPassOptimizer``, and
            at ``compile`` when ``divergence="ngd"`` meets a loss that is
            not a negative log-likelihood (``kg.curvature.resolve_loss``).

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> model = kg.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    >>> model.compile(
    ...     optimizer=kg.optimizers.LLQRSAM(
    ...         keras.optimizers.SGD(0.1), rho=0.1, structure="kfac", refresh_every=2, refresh_steps=5
    ...     ),
    ...     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    ... )
    >>> history = model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    >>> int(model.optimizer.refreshes), "sharpness_gap" in history.history
    (1, True)
    >>> kg.optimizers.LLQRSAM(keras.optimizers.SGD(0.1), norm="fisher")
    Traceback (most recent call last):
    ...
    ValueError: norm must be one of ('euclidean', 'metric'), got 'fisher'.
    """

    def __init__(
        self, base_optimizer, rho=0.1, norm="euclidean", ascent="sam", sam_start_step=0,
        fsam_sigma=1.0, fsam_momentum=0.9, structure="diagonal", divergence="ngd",
        refresh_every=1000, bn_stats="perturbed", dropout="fresh", perturbation="global",
        name="LLQRSAM", **kwargs,
    ):
        super().__init__(
            base_optimizer, structure=structure, divergence=divergence, refresh_every=refresh_every,
            bn_stats=bn_stats, dropout=dropout, perturbation=perturbation, name=name, **kwargs,
        )
        self.rho = check_number("rho", rho)
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {norm!r}.")
        if ascent not in ASCENTS:
            raise ValueError(f"ascent must be one of {ASCENTS}, got {ascent!r}.")
        self.norm = norm
        self.ascent = ascent
        self.sam_start_step = check_int("sam_start_step", sam_start_step, 0)
        self.fsam_sigma = check_number("fsam_sigma", fsam_sigma)
        self.fsam_momentum = check_number("fsam_momentum", fsam_momentum, below=1)

    def build_state(self, var_list):
        super().build_state(var_list)
        self._average = [self.add_variable_from_reference(v, "grad_average") for v in var_list] if self.ascent == "fsam" else []

    def scaled_perturbation(self, centre_grads, values):
        v = centre_grads
        if self.ascent == "fsam":
            v = trend_removed(centre_grads, self._average, self.fsam_sigma)
        w = self.precondition(v)
        if self.norm == "euclidean":
            sq = backend.vdot(w, w)
        else:
            sq = backend.vdot(v, w)
        scale = self.rho / ops.sqrt(sq + 1e-12)
        if self.sam_start_step:
            scale = scale * ops.cast(ops.greater_equal(self.iterations, self.sam_start_step), scale.dtype)
        return scale, w

    @property
    def reads_centre_gradients(self):
        return self.ascent == "fsam"  # the trend's average

    def update_state(self, centre_grads, perturbed_grads):
        if self.ascent == "fsam":
            update_trend(self._average, centre_grads, self.fsam_momentum)

    def descent_gradients(self, centre_grads, perturbed_grads, values):
        return self.preconditioner.descent(perturbed_grads, values)

    def get_config(self):
        config = super().get_config()
        config.update(
            rho=self.rho, norm=self.norm, ascent=self.ascent, sam_start_step=self.sam_start_step,
            fsam_sigma=self.fsam_sigma, fsam_momentum=self.fsam_momentum,
        )
        return config
