"""U's configuration, state and refresh, owned by an LLQR / LLQRSAM optimizer.

The optimizer creates U's variables through its own ``add_variable`` (so they
are saved, restored and threaded through JAX's stateless step like any
optimizer variable) and asks this object for ``U v``, the descent direction
and the refresh. See ``objective.py`` for the refresh itself.
"""

import time

import keras
from keras import ops

from keras_geosam import keras_internals
from keras_geosam import backend
from keras_geosam._checks import check_int as _check_int
from keras_geosam._checks import check_number
from keras_geosam._checks import warn_at_caller
from keras_geosam.curvature.functional import model_functions
from keras_geosam.curvature.operators.base import cast_to
from keras_geosam.curvature.layers import is_convolutional
from keras_geosam.curvature.layers import kernel_views
from keras_geosam.curvature.losses import require_likelihood
from keras_geosam.curvature.losses import resolve_loss
from keras_geosam.preconditioner.schedule import RefreshSchedule
from keras_geosam.preconditioner import objective
from keras_geosam.preconditioner import structures

# Where the Fisher is undefined, the loss Hessian still is.
_NEWTON_HINT = ' divergence="newton" (the loss Hessian) works with any loss.'
DIVERGENCES = ("ngd", "newton")
REFRESH_SOURCES = ("step", "callback")
OPTIONS = (
    "refresh_source", "refresh_steps", "inner_learning_rate", "inner_momentum",
    "clip_norm", "beta", "min_diagonal", "coupled_weight_decay", "refresh_until", "decay_mask",
)
DECAY_MASKS = ("all", "kernels")


class RefreshClock:
    """Wall time of the refreshes the host runs itself, measured exactly:
    every refresh on eager torch (in the step or not), every refresh of
    JAX's ``fit`` (run between steps) and every ``refresh_now``
    (``PreconditionerRefresh``). A refresh inside a compiled TensorFlow step
    is timed by its device clock or by ``RefreshMonitor`` from the step
    times instead. Not saved: a count of this process's seconds."""

    def __init__(self):
        self.seconds, self.count, self.last = 0.0, 0, None
        self._device = None  # (model, timed, read) of a clock inside the step

    def in_step(self, model, fn):
        """`fn` timed inside the compiled step of `model` where the backend
        has a device clock (``backend.step_timer``), else None."""
        self.prepare(model)
        timed = self._device[1]
        return None if timed is None else timed(fn)

    def prepare(self, model):
        """Makes `model`'s device clock now, before its step is traced (a
        variable made while tracing would make TensorFlow trace twice)."""
        if self._device is None or self._device[0] is not model:
            timer = backend.step_timer(model)
            self._device = (model,) + (timer if timer is not None else (None, None))

    @property
    def exact_in_step(self):
        """Whether in-step refreshes are on this clock (eager torch, JAX's
        refresh between steps, or a device clock inside the step)."""
        return (backend.eager_steps or backend.refresh_between_steps
                or (self._device is not None and self._device[1] is not None))

    def total(self):
        """Seconds of every refresh timed so far (a device read where a
        clock runs inside the step)."""
        device = self._device[2]() if self._device is not None and self._device[2] is not None else 0.0
        return self.seconds + device

    def timed(self, fn):
        """`fn` that adds its time to the clock, waiting for the device at
        its end (a read of one element of its result)."""

        def run(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            ops.convert_to_numpy(ops.reshape(out[-1], (-1,))[0])
            self.add(time.perf_counter() - start)
            return out

        return run

    def add(self, seconds):
        self.seconds += seconds
        self.count += 1
        self.last = seconds


class LearnedPreconditioner:
    """LLQR's structured U, learned by heavy-ball descent on J(U).

    Args:
        structure: ``"diagonal"`` | ``"kfac"`` | ``"ekfac"``
            (``structures.py``).
        divergence: ``"ngd"`` (the Fisher = Gauss-Newton matrix of the
            compiled loss, summed over the preconditioner batch: categorical
            or binary cross-entropy, mean squared error) or ``"newton"``
            (Hessian of the mean loss, any loss).
        refresh_every: refresh U when ``iterations % refresh_every == 0``
            (step 0 included).
        refresh_source: ``"step"`` (default): refresh inside the compiled
            train step on the current training batch, which then also serves
            both SAM passes (the reference draws a separate fresh batch of
            128). Steps that are not due cost nothing extra: JAX and
            torch tell them apart on the host (JAX runs them as a second
            compiled step without the refresh, when ``refresh_every`` is
            above 2), TensorFlow's graph condition is free. ``"callback"``:
            U is refreshed only by
            ``kg.callbacks.PreconditionerRefresh(x, y)`` from a dataset you
            pass, before the step that is due.
        refresh_steps, inner_learning_rate, inner_momentum, clip_norm: the
            inner heavy-ball optimisation of J(U) (reference 50, 1e-3, 0.9,
            5.0). The gradient is clipped per group as the reference groups
            it: one norm per layer for a diagonal U (kernel and bias
            together); one per parameter tensor for K-FAC (A, B, each bias
            block) and EK-FAC (Q_A, Q_G, s).
        beta: EMA of U across refreshes (default 0.95 for ngd, 0.90 newton).
        min_diagonal: lower bound on diagonal entries (and EK-FAC's s) after
            each refresh.
        coupled_weight_decay: ``wd``; the base optimizer receives
            ``U g + wd * theta`` (decay added after U, never preconditioned).
        refresh_until: no refresh from this optimizer step on (None: never
            stop), as the reference's option to freeze U late in training.
        decay_mask: ``"all"`` (default) decays every tensor; ``"kernels"``
            only tensors of two or more axes, leaving biases and
            normalisation scales undecayed, as the reference's mask does.

    Raises:
        ValueError: if `structure`, `divergence`, `refresh_source` or
            `decay_mask` is not one of its values; `refresh_every`,
            `refresh_steps` or `refresh_until` is not an integer >= 1;
            `inner_learning_rate` or `clip_norm` is not positive;
            `inner_momentum` is outside [0, 1); `beta` is outside [0, 1];
            or `min_diagonal` or `coupled_weight_decay` is negative.

    Example:

    >>> U = kg.preconditioner.LearnedPreconditioner(structure="kfac", refresh_every=100)
    >>> U.beta, U.refresh_steps  # beta defaults to 0.95 for divergence="ngd"
    (0.95, 50)
    >>> opt = kg.optimizers.LLQRSAM(keras.optimizers.SGD(0.1), structure="kfac")
    >>> type(opt.preconditioner).__name__, opt.structure
    ('LearnedPreconditioner', 'kfac')
    >>> kg.preconditioner.LearnedPreconditioner(inner_momentum=1.0)
    Traceback (most recent call last):
    ...
    ValueError: inner_momentum must be < 1, got 1.0.
    """

    def __init__(
        self, structure="diagonal", divergence="ngd", refresh_every=1000, refresh_source="step",
        refresh_steps=50, inner_learning_rate=1e-3, inner_momentum=0.9, clip_norm=5.0, beta=None,
        min_diagonal=1e-8, coupled_weight_decay=0.0, refresh_until=None, decay_mask="all",
    ):
        if structure not in structures.STRUCTURES:
            raise ValueError(f"structure must be one of {structures.STRUCTURES}, got {structure!r}.")
        if divergence not in DIVERGENCES:
            raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}.")
        if refresh_source not in REFRESH_SOURCES:
            raise ValueError(f"refresh_source must be one of {REFRESH_SOURCES}, got {refresh_source!r}.")
        self.structure = structure
        self.divergence = divergence
        self.refresh_source = refresh_source
        self.refresh_steps = _check_int("refresh_steps", refresh_steps)
        self.inner_learning_rate = check_number("inner_learning_rate", inner_learning_rate, strict=True)
        self.inner_momentum = check_number("inner_momentum", inner_momentum, below=1)
        self.clip_norm = check_number("clip_norm", clip_norm, strict=True)
        if beta is None:
            beta = 0.95 if divergence == "ngd" else 0.90
        self.beta = check_number("beta", beta)
        if self.beta > 1:
            raise ValueError(f"beta must be in [0, 1], got {beta!r}.")
        self.min_diagonal = check_number("min_diagonal", min_diagonal)
        self.coupled_weight_decay = check_number("coupled_weight_decay", coupled_weight_decay)
        self.schedule = RefreshSchedule(_check_int("refresh_every", refresh_every),
                                        _check_int("refresh_until", refresh_until, allow_none=True))
        if decay_mask not in DECAY_MASKS:
            raise ValueError(f"decay_mask must be one of {DECAY_MASKS}, got {decay_mask!r}.")
        self.decay_mask = decay_mask
        self.variables = []
        self.paths = None
        self.refreshes = None
        self.clock = RefreshClock()

    @property
    def refresh_every(self):
        return self.schedule.every

    @refresh_every.setter
    def refresh_every(self, value):
        self.schedule.every = _check_int("refresh_every", value)

    @property
    def refresh_until(self):
        return self.schedule.until

    @refresh_until.setter
    def refresh_until(self, value):
        self.schedule.until = _check_int("refresh_until", value, allow_none=True)

    def get_config(self):
        return {
            "structure": self.structure, "divergence": self.divergence,
            "refresh_every": self.refresh_every, "refresh_source": self.refresh_source,
            "refresh_steps": self.refresh_steps, "inner_learning_rate": self.inner_learning_rate,
            "inner_momentum": self.inner_momentum, "clip_norm": self.clip_norm, "beta": self.beta,
            "min_diagonal": self.min_diagonal, "coupled_weight_decay": self.coupled_weight_decay,
            "refresh_until": self.refresh_until, "decay_mask": self.decay_mask,
        }

    # ------------------------------------------------------------ state ----
    def build(self, optimizer, var_list, model=None):
        """Creates U's variables (and the refresh counter) on `optimizer`;
        `model` (the one the optimizer trains) gives the kernels' K-FAC
        views (``structures.layout``)."""
        views = None if model is None or self.structure == "diagonal" else kernel_views(model, for_preconditioner=True)
        self.layout = structures.layout(var_list, self.structure, views)
        self.paths = [getattr(v, "path", None) or v.name for v in var_list]
        self.groups = structures.clip_groups(self.layout, var_list, self.structure)
        self.variables = []
        for i, name, shape, init, _ in structures.param_specs(self.layout):
            init = keras.initializers.Identity() if init == "identity" else init
            # A diagonal block is laid out like its weight (sharded with it
            # under keras.distribution.ModelParallel); Kronecker factors and
            # EK-FAC's bases are replicated: each product needs them whole.
            layout = keras_internals.variable_layout(var_list[i]) if tuple(shape) == tuple(var_list[i].shape) else None
            extra = {} if layout is None else {"layout": layout}
            self.variables.append(optimizer.add_variable(shape, initializer=init, name=f"U{i}_{name}", **extra))
        # dtype "int", as Keras' own `iterations`: int64 where the backend
        # has it, int32 on JAX without x64 (no truncation warning).
        self.refreshes = optimizer.add_variable((), initializer="zeros", dtype="int", name="refreshes")
        if model is not None and self.refresh_source == "step" and not backend.eager_steps:
            self.clock.prepare(model)

    def operator(self):
        """U now, as a :class:`~keras_geosam.curvature.BlockDiagonal`."""
        values = [p.value for p in self.variables]
        if not backend.eager_steps:  # traced: built once per trace anyway
            return structures.operator(self.layout, values, self.paths)
        # Eager (torch): a variable's value is one tensor that assignments
        # update in place, so the operator built from those tensors stays
        # right; building it walks every block (~0.4 ms on a 4-block
        # Transformer, twice per LLQR+SAM step). The cache holds the tensors
        # it was built from, so an identity check cannot be fooled.
        cached = self.__dict__.get("_operator_cache")
        if cached is not None and len(cached[0]) == len(values) and all(a is b for a, b in zip(cached[0], values)):
            return cached[1]
        op = structures.operator(self.layout, values, self.paths)
        self._operator_cache = (values, op)
        return op

    def summary(self, print_fn=print):
        """Prints each variable U acts on, its block type (Diagonal, KFAC,
        EKFAC, or their diagonal-input forms for an Embedding) and the 2-D
        view the block acts on."""
        if not self.variables:
            raise RuntimeError("U has no layout yet: build the optimizer (compile and build the model) first.")
        self.operator().summary(print_fn)

    def precondition(self, vectors, consume=False):
        """U v for a list like the trainable variables (in v's dtypes). With
        `consume` the caller reads `vectors` no more, and U v may be written
        into them (``LinearOperator.matvec_into``)."""
        op = self.operator()
        out = op.matvec_into(list(vectors)) if consume else op.matvec(vectors)
        return [cast_to(u, v.dtype) for u, v in zip(out, vectors)]

    def descent(self, grads, values):
        """``U g + coupled_weight_decay * theta``. Consumes `grads`: a
        diagonal U writes U g into them on eager torch (one copy of the
        weights less at the update)."""
        d = self.precondition(grads, consume=True)
        if self.coupled_weight_decay:
            wd = self.coupled_weight_decay
            decays = [self.decay_mask == "all" or len(shape) >= 2 for _, shape, _ in self.layout]
            d = [g + wd * ops.cast(v, g.dtype) if decayed else g for g, v, decayed in zip(d, values, decays)]
        return d

    # ---------------------------------------------------------- refresh ----
    def check_model(self, model, refresh_source=None):
        """Raises if `model`'s loss cannot drive this refresh (at compile)."""
        # Only a refresh needs the Fisher: U fixed by hand works with any loss.
        if (refresh_source or self.refresh_source) != "step":
            return
        if self.divergence == "ngd" and getattr(model, "loss", None) is not None:
            require_likelihood(resolve_loss(model), 'LLQR with divergence="ngd"', _NEWTON_HINT)

    def _problem(self, model, values, non_trainable, x, y):
        """gbar and the G-product at `values`, inference mode. The model is
        linearised once per refresh: every inner step's product reuses that
        one forward pass instead of running the network again."""
        fns = model_functions(model, None, training=False, include_regularization=False)
        if self.divergence == "ngd":
            require_likelihood(fns.spec, 'LLQR with divergence="ngd"', _NEWTON_HINT)
            # G = sum_n J_n^T Q_n J_n, the GGN summed over the batch (Q_n the
            # loss term's Hessian in its outputs: diag p_n - p_n p_n^T for
            # softmax cross-entropy; ``likelihoods.py``), and gbar = J^T r / N
            # with r_n = dl_n/dz_n. With outputs per position (a language
            # model's (N, T, V) logits) the loss terms are tokens: G sums
            # over them, gbar is their mean.
            z, jvp_fn, vjp_fn = backend.linearize(fns.logits, list(values), non_trainable, x)
            z = ops.stop_gradient(z)
            curvature = fns.spec.likelihood.hessian_at(z)
            r = fns.output_gradient(z, y)
            n = ops.cast(ops.size(z) // int(z.shape[-1]), z.dtype)  # examples (tokens); batch size may be unknown when traced
            gbar = [ops.cast(g, v.dtype) for g, v in zip(vjp_fn(r / n), values)]

            def gprod(u):
                w = jvp_fn([ops.cast(t, v.dtype) for t, v in zip(u, values)])
                return vjp_fn(curvature(ops.cast(w, z.dtype)))

            return gbar, gprod
        _, gbar = backend.value_and_grad(fns.loss, list(values), non_trainable, x, y)
        gprod = lambda u: backend.hvp(fns.loss, list(values), u, non_trainable, x, y)
        return gbar, gprod

    def refreshed(self, model, values, non_trainable, x, y, u=None):
        """New U parameters after one refresh on batch ``(x, y)``, starting
        from `u` (U's parameter values; default: its variables now)."""
        gbar, gprod = self._problem(model, values, non_trainable, x, y)
        return objective.refresh(
            self.layout, [p.value for p in self.variables] if u is None else list(u), gbar, gprod, self.groups,
            steps=self.refresh_steps, learning_rate=self.inner_learning_rate,
            momentum=self.inner_momentum, clip_norm=self.clip_norm, beta=self.beta,
            min_diagonal=self.min_diagonal, unroll=self._unroll(model),
        )

    def refresh_program(self, model):
        """``(u, values, non_trainable, x, y) -> new u``: one refresh as a
        pure function of U's parameter values, compiled once per model
        (``backend.compile``). ``refresh_now`` runs it, and so does JAX's
        ``fit`` between two steps (``training.step.gate_preparation``): the
        train step's own program then holds no refresh, compiles once and
        keeps no refresh temporaries in its memory."""
        cache = self.__dict__.setdefault("_programs", {})
        if id(model) not in cache:
            cache[id(model)] = backend.compile(
                lambda u, values, nt, x, y: self.refreshed(model, values, nt, x, y, u=u))
        return cache[id(model)]

    def _unroll(self, model):
        # XLA:CPU runs convolutions' kernel gradients many times slower
        # inside a compiled loop (a small ResNet's refresh: 52 s looped,
        # 2 s unrolled after a 46 s compile); other backends and devices,
        # and networks with attention (a Transformer, or a ViT with its one
        # patch convolution: unrolled, the first step compiled for minutes
        # to 25 minutes), keep the loop, which compiles once.
        unroll = backend.slow_convolutions_in_loops and is_convolutional(model)
        if unroll and not self.__dict__.get("_told_unroll"):
            self._told_unroll = True
            warn_at_caller(
                f"LLQR: the {self.refresh_steps} inner steps of U's refresh are unrolled in the compiled "
                "step, because XLA:CPU runs convolution kernel gradients about 10x slower inside a loop. "
                "The first step takes longer to compile; every refresh after it runs faster."
            )
        return unroll

    def prepare_step(self, due, model, values, non_trainable, x, y):
        """In-step refresh if `due` (a boolean tensor; ``refresh_source="step"``),
        without retracing. Returns ``[(variable, value before)]``: a step
        skipped for non-finite values restores them, so U and the refresh
        count do not move and the refresh happens on the next finite step
        (the iteration count does not advance on a skipped step)."""
        if self.refresh_source != "step":
            return []
        state = self.variables + [self.refreshes]
        held = [v.value for v in state]
        # Copies, when a refresh will overwrite them (torch assigns in place,
        # which would change a plain read); otherwise nothing changes.
        before = ops.cond(due, lambda: [ops.copy(v) for v in held], lambda: held)
        current = held[:-1]
        refresh = lambda: self.refreshed(model, values, non_trainable, x, y)  # noqa: E731
        if backend.eager_steps:  # the host runs it: time it exactly
            refresh = self.clock.timed(refresh)
        else:
            refresh = self.clock.in_step(model, refresh) or refresh
        new = ops.cond(due, refresh, lambda: current)
        for p, value in zip(self.variables, new):
            p.assign(value)
        self.refreshes.assign_add(ops.cast(due, self.refreshes.dtype))
        return list(zip(state, before))

    def refresh_now(self, model, x, y):
        """Refreshes U eagerly on batch ``(x, y)`` at the model's weights;
        `x` and `y` may be structures (a dict of named inputs), as in ``fit``."""
        values = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        x, y = (keras.tree.map_structure(ops.convert_to_tensor, a) for a in (x, y))
        u = [p.value for p in self.variables]
        new = self.clock.timed(self.refresh_program(model))(u, values, non_trainable, x, y)
        for p, value in zip(self.variables, new):
            p.assign(value)
        self.refreshes.assign_add(1)
