"""LLQR: a learned, slowly refreshed structured preconditioner U."""

import keras
from keras import ops

from keras_geosam import backend
from keras_geosam import preconditioner
from keras_geosam.curvature.functional import model_functions
from keras_geosam.curvature.losses import require_classifier
from keras_geosam.optimizers.base import TwoPassOptimizer

DIVERGENCES = ("ngd", "newton")
REFRESH_SOURCES = ("step", "callback")


class LearnedPreconditioner:
    """U's state, its refresh and its product; shared by LLQR and LLQRSAM.

    Args (all keyword):
        structure: ``"diagonal"`` | ``"kfac"`` | ``"ekfac"`` (see
            ``keras_geosam.preconditioner``).
        divergence: ``"ngd"`` (Fisher = Gauss-Newton of softmax cross-entropy,
            summed over the preconditioner batch) or ``"newton"`` (Hessian of
            the mean loss).
        refresh_every: refresh U when ``iterations % refresh_every == 0``
            (step 0 included).
        refresh_source: ``"step"`` (default): refresh inside the compiled
            train step on the current training batch, which then also serves
            both SAM passes (the reference draws a separate fresh batch of
            128); ``"callback"``: U is refreshed only by
            ``kg.callbacks.PreconditionerRefresh(x, y)`` from a dataset you
            pass, before the step that is due.
        refresh_steps, inner_learning_rate, inner_momentum, clip_norm: the
            inner heavy-ball optimisation of J(U) (reference 50, 1e-3, 0.9,
            5.0).
        beta: EMA of U across refreshes (default 0.95 for ngd, 0.90 newton).
        min_diagonal: lower bound on diagonal entries after each refresh.
        coupled_weight_decay: ``wd``; the base optimizer receives
            ``U g + wd * theta`` (decay added after U, never preconditioned).
    """

    def _init_preconditioner(
        self, structure="diagonal", divergence="ngd", refresh_every=1000, refresh_source="step",
        refresh_steps=50, inner_learning_rate=1e-3, inner_momentum=0.9, clip_norm=5.0, beta=None,
        min_diagonal=1e-8, coupled_weight_decay=0.0,
    ):
        if structure not in preconditioner.STRUCTURES:
            raise ValueError(f"structure must be one of {preconditioner.STRUCTURES}, got {structure!r}.")
        if divergence not in DIVERGENCES:
            raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}.")
        if refresh_source not in REFRESH_SOURCES:
            raise ValueError(f"refresh_source must be one of {REFRESH_SOURCES}, got {refresh_source!r}.")
        for name, value in (("refresh_every", refresh_every), ("refresh_steps", refresh_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        self.structure = structure
        self.divergence = divergence
        self.refresh_every = refresh_every
        self.refresh_source = refresh_source
        self.refresh_steps = refresh_steps
        self.inner_learning_rate = self.check_hyperparameter("inner_learning_rate", inner_learning_rate, strict=True)
        self.inner_momentum = self.check_hyperparameter("inner_momentum", inner_momentum)
        if self.inner_momentum >= 1:
            raise ValueError(f"inner_momentum must be < 1, got {inner_momentum!r}.")
        self.clip_norm = self.check_hyperparameter("clip_norm", clip_norm, strict=True)
        if beta is None:
            beta = 0.95 if divergence == "ngd" else 0.90
        self.beta = self.check_hyperparameter("beta", beta)
        if self.beta > 1:
            raise ValueError(f"beta must be in [0, 1], got {beta!r}.")
        self.min_diagonal = self.check_hyperparameter("min_diagonal", min_diagonal)
        self.coupled_weight_decay = self.check_hyperparameter("coupled_weight_decay", coupled_weight_decay)

    def _preconditioner_config(self):
        return {
            "structure": self.structure, "divergence": self.divergence,
            "refresh_every": self.refresh_every, "refresh_source": self.refresh_source,
            "refresh_steps": self.refresh_steps, "inner_learning_rate": self.inner_learning_rate,
            "inner_momentum": self.inner_momentum, "clip_norm": self.clip_norm, "beta": self.beta,
            "min_diagonal": self.min_diagonal, "coupled_weight_decay": self.coupled_weight_decay,
        }

    def _build_preconditioner(self, var_list):
        self._blocks = preconditioner.make_blocks(var_list, self.structure)
        self._u = []
        for i, block in enumerate(self._blocks):
            for name, shape, init in block.param_specs():
                init = keras.initializers.Identity() if init == "identity" else init
                self._u.append(self.add_variable(shape, initializer=init, name=f"U{i}_{name}"))
        self.refreshes = self.add_variable((), initializer="zeros", dtype="int64", name="refreshes")

    def check_model(self, model, refresh_source=None):
        # Only a refresh needs the Fisher: U fixed by hand (no refresh) works
        # with any loss.
        if (refresh_source or self.refresh_source) != "step":
            return
        if self.divergence == "ngd" and getattr(model, "loss", None) is not None:
            from keras_geosam.curvature.losses import resolve_loss

            require_classifier(resolve_loss(model), f'{type(self).__name__} with divergence="ngd"')

    # ------------------------------------------------------ products ----
    def precondition(self, vectors):
        """U v for a list like the trainable variables."""
        return [
            ops.cast(u, v.dtype)
            for u, v in zip(preconditioner.precondition(self._blocks, [p.value for p in self._u], vectors), vectors)
        ]

    def _descent(self, grads, values):
        d = self.precondition(grads)
        if self.coupled_weight_decay:
            wd = self.coupled_weight_decay
            d = [g + wd * ops.cast(v, g.dtype) for g, v in zip(d, values)]
        return d

    # ------------------------------------------------------- refresh ----
    def _refresh_problem(self, model, values, non_trainable, x, y):
        """gbar and the G-product at `values`, inference mode."""
        fns = model_functions(model, None, training=False, include_regularization=False)
        if self.divergence == "ngd":
            require_classifier(fns.spec, 'LLQR with divergence="ngd"')
            gprod = lambda u: backend.hvp(fns.ggn_surrogate, list(values), u, non_trainable, x, 1.0)
        else:
            gprod = lambda u: backend.hvp(fns.loss, list(values), u, non_trainable, x, y)
        _, gbar = backend.value_and_grad(fns.loss, list(values), non_trainable, x, y)
        return gbar, gprod

    def _refreshed(self, model, values, non_trainable, x, y):
        gbar, gprod = self._refresh_problem(model, values, non_trainable, x, y)
        return preconditioner.refresh(
            self._blocks, [p.value for p in self._u], gbar, gprod,
            steps=self.refresh_steps, learning_rate=self.inner_learning_rate,
            momentum=self.inner_momentum, clip_norm=self.clip_norm, beta=self.beta,
            min_diagonal=self.min_diagonal,
        )

    def prepare_step(self, model, values, non_trainable, x, y):
        if self.refresh_source != "step":
            return
        due = ops.equal(ops.mod(self.iterations, self.refresh_every), 0)
        current = [p.value for p in self._u]
        new = ops.cond(due, lambda: self._refreshed(model, values, non_trainable, x, y), lambda: current)
        for p, value in zip(self._u, new):
            p.assign(value)
        self.refreshes.assign_add(ops.cast(due, "int64"))

    def refresh_now(self, model, x, y):
        """Refreshes U eagerly on batch ``(x, y)`` at the model's weights."""
        if not self.built:
            raise RuntimeError("Build the optimizer (compile and build the model) before refreshing U.")
        values = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        new = self._refresh_compiled(model)(values, non_trainable, ops.convert_to_tensor(x), ops.convert_to_tensor(y))
        for p, value in zip(self._u, new):
            p.assign(value)
        self.refreshes.assign_add(1)

    def _refresh_compiled(self, model):
        key = id(model)
        cache = self.__dict__.setdefault("_refresh_cache", {})
        if key not in cache:
            def fn(values, non_trainable, x, y, _u=None):
                return self._refreshed(model, values, non_trainable, x, y)
            cache[key] = backend.compile(fn) if backend.name != "jax" else _jax_refresh(self, model)
        return cache[key]


def _jax_refresh(opt, model):
    # Under jit, U's current values must be arguments, not captured constants.
    import jax

    @jax.jit
    def fn(u_values, values, non_trainable, x, y):
        with keras.StatelessScope(state_mapping=list(zip(opt._u, u_values))):
            return opt._refreshed(model, values, non_trainable, x, y)

    return lambda values, non_trainable, x, y: fn([p.value for p in opt._u], values, non_trainable, x, y)


@keras.saving.register_keras_serializable(package="keras_geosam")
class LLQR(LearnedPreconditioner, TwoPassOptimizer):
    """LLQR: the base optimizer steps along a learned preconditioned gradient.

        if iterations % refresh_every == 0: refresh U (see LearnedPreconditioner)
        g     = grad L_B(theta)
        theta <- base_optimizer(theta, U g + coupled_weight_decay * theta)

    One gradient per step; the model-level step is still needed because the
    refresh evaluates the model. With U = identity (no refresh) it is the
    base optimizer.
    """

    num_passes = 1

    def __init__(self, base_optimizer, structure="diagonal", divergence="ngd", refresh_every=1000, bn_stats="centre", dropout="fresh", perturbation="global", name="LLQR", **kwargs):
        pre = {k: kwargs.pop(k) for k in list(kwargs) if k in _PRECONDITIONER_ARGS}
        super().__init__(base_optimizer, bn_stats=bn_stats, dropout=dropout, perturbation=perturbation, name=name, **kwargs)
        self._init_preconditioner(structure=structure, divergence=divergence, refresh_every=refresh_every, **pre)

    def build_state(self, var_list):
        self._build_preconditioner(var_list)

    def perturbation(self, centre_grads, values):
        return [ops.zeros_like(g) for g in centre_grads]

    def descent_gradients(self, centre_grads, perturbed_grads, values):
        return self._descent(centre_grads, values)

    def get_config(self):
        config = super().get_config()
        config.update(self._preconditioner_config())
        return config


_PRECONDITIONER_ARGS = (
    "refresh_source", "refresh_steps", "inner_learning_rate", "inner_momentum",
    "clip_norm", "beta", "min_diagonal", "coupled_weight_decay",
)
