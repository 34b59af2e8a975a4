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

    Args:
        base_optimizer: the ``keras.optimizers.Optimizer`` applying the
            descent step.
        structure: U's block structure, ``"diagonal"``, ``"kfac"`` or
            ``"ekfac"``. Defaults to ``"diagonal"``.
        divergence: what U is learned against, ``"ngd"`` (the Fisher;
            needs a cross-entropy or a mean squared error) or ``"newton"`` (the Hessian).
            Defaults to ``"ngd"``.
        refresh_every: refresh U every this many steps, step 0 included.
            Defaults to `1000`.
        bn_stats, dropout, perturbation: see ``TwoPassOptimizer``.
        name: defaults to ``"LLQR"``.
        **kwargs: U's other options (``refresh_source``, ``refresh_steps``,
            ``inner_learning_rate``, ``inner_momentum``, ``clip_norm``,
            ``beta``, ``min_diagonal``, ``coupled_weight_decay``,
            ``refresh_until``, ``decay_mask``), see
            ``kg.preconditioner.LearnedPreconditioner``.

    Raises:
        ValueError: if `structure`, `divergence` or an option of U is
            invalid (see ``LearnedPreconditioner``), for the invalid
            arguments listed in ``TwoPassOptimizer``, and at ``compile``
            when ``divergence="ngd"`` meets a loss that is not a negative
            log-likelihood (``kg.curvature.resolve_loss``).

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> model = kg.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    >>> model.compile(
    ...     optimizer=kg.optimizers.LLQR(
    ...         keras.optimizers.SGD(0.1), structure="diagonal", refresh_every=2, refresh_steps=5
    ...     ),
    ...     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    ... )
    >>> history = model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    >>> int(model.optimizer.refreshes)  # at steps 0 and 2
    2
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
