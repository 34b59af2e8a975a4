"""LLQR: a learned, slowly refreshed structured preconditioner U."""

import keras
from keras import ops

from keras_geosam.optimizers.preconditioned import PreconditionedOptimizer


@keras.saving.register_keras_serializable(package="keras_geosam")
class LLQR(PreconditionedOptimizer):
    """LLQR: the base optimizer steps along a learned preconditioned gradient.

        if iterations % refresh_every == 0: refresh U
        g     = grad L_B(theta)
        theta <- base_optimizer(theta, U g + coupled_weight_decay * theta)

    U and its refresh: see ``keras_geosam.preconditioner.LearnedPreconditioner``
    (structure ``"diagonal"`` | ``"kfac"`` | ``"ekfac"``; divergence ``"ngd"``
    | ``"newton"``). One gradient per step; the model-level step is still
    needed because the refresh evaluates the model. With U = identity (no
    refresh) it is the base optimizer.
    """

    num_passes = 1

    def __init__(self, base_optimizer, structure="diagonal", divergence="ngd", refresh_every=1000, bn_stats="centre", dropout="fresh", perturbation="global", name="LLQR", **kwargs):
        super().__init__(
            base_optimizer, structure=structure, divergence=divergence, refresh_every=refresh_every,
            bn_stats=bn_stats, dropout=dropout, perturbation=perturbation, name=name, **kwargs,
        )

    def perturbation(self, centre_grads, values):
        return [ops.zeros_like(g) for g in centre_grads]

    def descent_gradients(self, centre_grads, perturbed_grads, values):
        return self.preconditioner.descent(centre_grads, values)
