"""SharpnessLogger: sharpness measures, with their standard errors, in ``logs``."""

import math
import time
import warnings

import keras

from keras_geosam import backend
from keras_geosam import keras_internals
from keras_geosam import sharpness
from keras_geosam._checks import check_int
from keras_geosam._checks import check_number
from keras_geosam._checks import warn_at_caller
from keras_geosam.curvature.functional import check_data
from keras_geosam.curvature.functional import check_labels
from keras_geosam.curvature.functional import model_functions
from keras_geosam.curvature.losses import require_likelihood
from keras_geosam.curvature.operators.model import MAX_EXACT_CLASSES
from keras_geosam.curvature.weights import output_shape
from keras_geosam.sharpness.riemannian import stderr_given_metric

# Metrics estimated as an exact (or sampled) GGN part plus a probed
# residual: each part is logged with its standard error too.
_SPLIT = ("hessian_trace", "riemannian_sharpness", "riemannian_sharpness_kfac")

# name -> (function, fixed keyword arguments, takes probes, needs a likelihood)
_METRICS = {
    "hessian_trace": (sharpness.hessian_trace, {}, True, False),
    "lambda_max": (sharpness.hessian_max_eigenvalue, {}, False, False),
    "riemannian_sharpness": (sharpness.riemannian_sharpness, {"structure": "diagonal"}, True, True),
    "riemannian_sharpness_kfac": (sharpness.riemannian_sharpness, {"structure": "kfac"}, True, True),
    "riemannian_sharpness_exact": (sharpness.riemannian_sharpness, {"structure": "exact"}, False, True),
    "riemannian_lambda_max": (sharpness.riemannian_max_eigenvalue, {"structure": "diagonal"}, False, True),
    "riemannian_lambda_max_kfac": (sharpness.riemannian_max_eigenvalue, {"structure": "kfac"}, False, True),
}


# Keys the progress bar leaves out (History keeps them): each metric's
# value and stderr are what a progress line has room for.
_DETAIL = ("_ggn", "_ggn_stderr", "_residual", "_residual_stderr", "_normalized", "_stderr_given_metric")


def _print_short(progbar):
    """Has Keras' progress bar print each epoch without the logger's detail
    keys (the parts, normalised values, flags), which made its lines about
    900 characters long; ``fit``'s History gets every key."""
    if getattr(progbar, "_kg_short", False):
        return
    full = progbar.on_epoch_end

    def on_epoch_end(epoch, logs=None):
        logs = {k: v for k, v in (logs or {}).items() if not k.endswith(_DETAIL)}
        return full(epoch, logs)

    progbar.on_epoch_end = on_epoch_end
    progbar._kg_short = True


class SharpnessLogger(keras.callbacks.Callback):
    """Adds sharpness measures and their standard errors to the epoch ``logs``.

    On the epochs it logs, it evaluates each requested metric on the
    fixed data ``(x, y)`` with a fixed seed (so epochs are comparable and
    differences come from the weights, not the probes) and writes
    ``logs[prefix + name]`` and ``logs[prefix + name + "_stderr"]``; for
    Riemannian sharpness also ``..._normalized`` (value per parameter with
    nonzero Fisher; see the piecewise-linear caveat). The split measures
    (``hessian_trace``, ``riemannian_sharpness``,
    ``riemannian_sharpness_kfac``) also write their two parts, each with its
    standard error: ``..._ggn`` (``tr(M^-1 GGN)``, exact or sampled) and
    ``..._residual`` (``tr(M^-1 (H - GGN))``, probed). When the residual
    outweighs the GGN part or `rtol` is not reached, one warning per metric
    and ``fit`` says which and what to do (the GGN part is then the number
    to read). Where a Riemannian measure's metric is built from sampled
    labels (``kind="mc"`` in `options`, or a vocabulary above
    ``max_exact_classes``) and drawn once, its stderr is given that metric
    and ``..._stderr_given_metric`` holds 1 (ask for ``metric_draws`` in
    `options` for a stderr that covers it). On epochs it skips the keys
    hold NaN, so every epoch has the same columns. Keras' progress bar
    prints each metric's value and stderr only; ``fit``'s History holds
    every key.

    Which epochs it logs: by default a time budget. It logs the first epoch
    and the last one of ``fit``, and in between an epoch only if, with
    that log, its own time (compilation included) stays within `budget` of
    the fit's wall time so far; a log is assumed to cost what the last one
    did, less what it compiled (as far as the backend reports compilation:
    JAX). The logs then come at an even spacing. ``every_n_epochs=k``
    logs every k epochs instead (no budget); ``budget=None`` every epoch.
    With several processes (multi-process JAX) each would read its own
    clock, so the budget gives way to logging every epoch, with a warning.

    Keras hands every callback the same ``logs`` in list order, so at the
    start of training the logger moves itself to the front of the
    callback list: History, CSVLogger, TensorBoard, EarlyStopping and
    ModelCheckpoint see its keys wherever it was placed.

    Args:
        x, y: probe data (keep it small: every metric streams over it).
        metrics: names from ``SharpnessLogger.available()``.
        every_n_epochs: evaluate on epochs ``n-1, 2n-1, ...`` (0-based),
            whatever the cost; None (default): the `budget` decides.
        budget: the largest share of the fit's wall time the logger may
            take, in (0, 1) (default 0.1); None logs every epoch.
        num_probes, rtol, max_probes: Hutchinson probes per round, the
            relative standard error to reach, and the cap.
        min_probes: the futility stop: after this many probes a measure
            stops when `rtol` is projected beyond `max_probes`
            (``min_probes >= max_probes`` turns it off). Defaults to `10`.
        seed: fixed seed for probes and sampled labels.
        batch_size: streaming batch size.
        prefix: prepended to every key.
        options: per-metric keyword overrides, e.g.
            ``{"riemannian_sharpness": {"damping": 1e-2}}``.
        verbose: 1 prints one line per metric (value, stderr, seconds).
        sample_weight: ``(N,)`` or per-token weights of the probe data's
            loss terms (a sequence model's padding; the model's own mask is
            applied too), or, for several outputs, one per output (a list in
            output order or a dict by name; each output's loss is then its
            own weighted mean).

    Raises:
        ValueError: if a metric is unknown or none is given,
            `every_n_epochs`, `num_probes`, `max_probes` or `min_probes` is not an integer
            >= 1, `rtol` is not positive, `budget` is not in (0, 1),
            `options` names a metric that is not logged, or the data is
            invalid; at the start of training,
            if a Riemannian metric meets a loss without a likelihood
            (``kg.curvature.resolve_loss``).

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    >>> model.compile(optimizer="sgd",
    ...               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> logger = kg.callbacks.SharpnessLogger(x, y, metrics=("hessian_trace", "riemannian_sharpness"))
    >>> history = model.fit(x, y, epochs=2, verbose=0, callbacks=[logger])
    >>> sorted(key for key in history.history if key != "loss")  # doctest: +NORMALIZE_WHITESPACE
    ['hessian_trace', 'hessian_trace_ggn', 'hessian_trace_ggn_stderr',
     'hessian_trace_residual', 'hessian_trace_residual_stderr', 'hessian_trace_stderr',
     'riemannian_sharpness', 'riemannian_sharpness_ggn', 'riemannian_sharpness_ggn_stderr',
     'riemannian_sharpness_normalized', 'riemannian_sharpness_residual',
     'riemannian_sharpness_residual_stderr', 'riemannian_sharpness_stderr']
    >>> len(history.history["hessian_trace"])
    2
    """

    def __init__(
        self,
        x,
        y,
        metrics=("hessian_trace", "riemannian_sharpness"),
        every_n_epochs=None,
        budget=0.1,
        num_probes=20,
        rtol=0.05,
        max_probes=100,
        min_probes=10,
        seed=0,
        batch_size=256,
        prefix="",
        options=None,
        verbose=0,
        sample_weight=None,
    ):
        super().__init__()
        if isinstance(metrics, str):
            metrics = (metrics,)
        unknown = [m for m in metrics if m not in _METRICS]
        if unknown:
            raise ValueError(f"Unknown sharpness metric(s) {unknown}; available: {sorted(_METRICS)}.")
        if not metrics:
            raise ValueError("metrics must name at least one metric.")
        for name, value in (("num_probes", num_probes), ("max_probes", max_probes), ("min_probes", min_probes)):
            check_int(name, value)
        if every_n_epochs is not None:
            check_int("every_n_epochs", every_n_epochs)
            budget = None  # every k epochs, whatever the cost
        else:
            budget = check_number("budget", budget, 0.0, strict=True, below=1.0, allow_none=True)
        rtol = check_number("rtol", rtol, 0.0, strict=True, allow_none=True)
        options = dict(options or {})
        stray = [k for k in options if k not in metrics]
        if stray:
            raise ValueError(
                f"options given for {stray}, which are not among the logged "
                f"metrics {list(metrics)}."
            )
        self.x, self.y = check_data(x, y, sample_weight=sample_weight)
        self.sample_weight = sample_weight
        self.metrics = tuple(metrics)
        self.every_n_epochs = 1 if every_n_epochs is None and budget is None else every_n_epochs
        self.budget = budget
        self._clock = time.perf_counter  # fake ones in tests
        self._compile_clock = backend.compile_seconds
        self._fit_start, self._spent, self._last_cost, self._epochs_seen, self._told = None, 0.0, None, 0, False
        self._last_epoch = None
        self.num_probes = num_probes
        self.rtol = rtol
        self.max_probes = max_probes
        self.min_probes = min_probes
        self.seed = seed
        self.batch_size = batch_size
        self.prefix = prefix
        self.options = options
        self.verbose = verbose
        self.history = []
        self._given_metric = None  # metrics whose stderr is given a sampled metric (a column says so)

    @staticmethod
    def available():
        return sorted(_METRICS)

    def keys(self):
        out = []
        for name in self.metrics:
            out += [self.prefix + name, self.prefix + name + "_stderr"]
            if name.startswith("riemannian_sharpness"):
                out.append(self.prefix + name + "_normalized")
            if name in _SPLIT:
                out += [self.prefix + name + part for part in ("_ggn", "_ggn_stderr", "_residual", "_residual_stderr")]
            if name in (self._given_metric or ()):
                out.append(self.prefix + name + "_stderr_given_metric")
        return out

    # ---------------------------------------------------------- checks ----
    def on_train_begin(self, logs=None):
        self._check_model()
        self._move_to_front()
        self._warned = set()
        self._fit_start = self._clock()
        self._spent, self._last_cost, self._epochs_seen, self._told = 0.0, None, 0, False
        self._last_epoch = (self.params or {}).get("epochs")
        self._last_epoch = None if self._last_epoch is None else self._last_epoch - 1
        if self.budget is not None and backend.process_count() > 1:
            # Each process reads its own clock: their choices could differ,
            # and a log is a collective computation.
            warn_at_caller(
                f"SharpnessLogger: budget={self.budget:g} needs one clock, and {backend.process_count()} "
                "processes each have theirs: logging every epoch. Pass every_n_epochs=k to log less often.",
                RuntimeWarning,
            )
            self.budget, self.every_n_epochs = None, 1

    def _check_model(self):
        # Before the first epoch trains: a wrong loss or bad data should not
        # cost an epoch of training to find out.
        fns = model_functions(self.model, None, training=False)
        if any(_METRICS[m][3] for m in self.metrics):
            require_likelihood(fns.spec, "SharpnessLogger's Riemannian metrics")
        # Named inputs, token ids and labels against this model (tokens.py).
        check_labels(fns, self.x, self.y)
        self._given_metric = self._stderr_given_metrics(fns)

    def _stderr_given_metrics(self, fns):
        return {m for m in self.metrics if self._stderr_given_metric(m, fns)}

    def _stderr_given_metric(self, name, fns):
        """Whether `name`'s stderr will be given one draw of a sampled metric
        (known before the first log, so every epoch has its column)."""
        fn, kwargs, _, _ = _METRICS[name]
        if fn is not sharpness.riemannian_sharpness:
            return False
        kwargs = dict(kwargs, **self.options.get(name, {}))
        return stderr_given_metric(
            kwargs.get("structure", kwargs.get("metric")), kwargs.get("kind", kwargs.get("fisher", "exact")),
            output_shape(fns, self.x)[-1], kwargs.get("max_exact_classes", MAX_EXACT_CLASSES),
            kwargs.get("metric_draws", 1))

    def _move_to_front(self):
        """Moves this callback to the front of the running CallbackList."""
        holder = keras_internals.running_callback_list(self)
        if holder is not None:
            callbacks = holder.callbacks
            # Safe while the list iterates over us: we leave index i, the
            # callbacks after us keep their positions.
            callbacks.insert(0, callbacks.pop(callbacks.index(self)))
            for callback in callbacks:
                if isinstance(callback, keras.callbacks.ProgbarLogger):
                    _print_short(callback)
            return
        warn_at_caller(
            "SharpnessLogger could not find Keras' callback list: callbacks placed before it "
            "in `callbacks=[...]` will not see its keys. Put it first.",
            RuntimeWarning,
        )

    # --------------------------------------------------------- compute ----
    def compute(self):
        """Evaluates every metric now; returns ``{key: float}``."""
        model = self.model
        if self._given_metric is None:  # called outside fit
            self._given_metric = self._stderr_given_metrics(model_functions(model, None, training=False))
        out = {}
        for name in self.metrics:
            fn, kwargs, probed, _ = _METRICS[name]
            kwargs = dict(kwargs, seed=self.seed, batch_size=self.batch_size)
            if probed:
                kwargs.update(num_probes=self.num_probes, rtol=self.rtol, max_probes=self.max_probes,
                              min_probes=self.min_probes)
            kwargs.update(self.options.get(name, {}))
            if self.sample_weight is not None:
                kwargs.setdefault("sample_weight", self.sample_weight)
            start = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                est = fn(model, self.x, self.y, **kwargs)
            self._forward(name, caught)
            out[self.prefix + name] = float(est.value)
            out[self.prefix + name + "_stderr"] = float(est.stderr)
            if name in self._given_metric:
                # One draw of a sampled metric: the stderr leaves out the
                # metric's own sampling (riemannian_sharpness, metric_draws).
                out[self.prefix + name + "_stderr_given_metric"] = float(bool(est.info.get("stderr_given_metric")))
            if "normalized" in est.info:
                out[self.prefix + name + "_normalized"] = float(est.info["normalized"])
            elif name.startswith("riemannian_sharpness"):
                out[self.prefix + name + "_normalized"] = float(est.value) / max(est.info.get("num_params", 1), 1)
            if name in _SPLIT:
                info = est.info
                for part, key in (("_ggn", "exact_part"), ("_residual", "residual")):
                    out[self.prefix + name + part] = float(info.get(key, math.nan))
                    out[self.prefix + name + part + "_stderr"] = float(info.get(key + "_stderr", math.nan))
            if self.verbose:
                parts = ""
                if name in _SPLIT and "exact_part" in est.info:
                    info = est.info
                    parts = (f" = GGN part {info['exact_part']:.4g} ± {info['exact_part_stderr']:.2g}"
                             f" + residual {info['residual']:.4g} ± {info['residual_stderr']:.2g}")
                print(
                    f"SharpnessLogger: {self.prefix + name} = {est.format()}{parts} "
                    f"({est.num_samples} samples, {time.perf_counter() - start:.2f}s)",
                    flush=True,
                )
        return out

    def _forward(self, name, caught):
        """Re-issues what a measure warned: the piecewise-linear caveat and an
        unmet rtol of an unsplit trace never (they show in ``_normalized`` and
        the stderr), a residual's diagnosis once per metric
        and ``fit`` (its numbers change every epoch; the keys keep them),
        anything else as it came."""
        warned = self.__dict__.setdefault("_warned", set())
        for w in caught:
            text = str(w.message)
            if "piecewise linear" in text or text.startswith("Hutchinson: relative standard error"):
                continue  # shown by _normalized / by the stderr beside the value
            if "This means" in text and "What to do" in text:
                if name in warned:
                    continue
                warned.add(name)
                text = f"SharpnessLogger, {self.prefix + name} (said once per fit; the '_ggn' and '_residual' keys follow it every epoch): {text}"
            warn_at_caller(text, w.category)

    # -------------------------------------------------------- schedule ----
    def _due(self, epoch):
        if self.budget is None:
            return (epoch + 1) % self.every_n_epochs == 0
        if self._fit_start is None:  # callbacks driven by hand, not by fit
            self._fit_start = self._clock()
        if self._last_cost is None or epoch == self._last_epoch:
            return True  # the first epoch this fit reaches, and the last
        elapsed = self._clock() - self._fit_start
        return self._spent + self._last_cost <= self.budget * (elapsed + self._last_cost)

    def _tell_once(self):
        if self._told or not self.verbose or self.budget is None:
            return
        self._told = True
        elapsed = self._clock() - self._fit_start
        epoch = (elapsed - self._spent) / max(self._epochs_seen, 1)
        every = math.ceil(self._last_cost * (1 - self.budget) / max(self.budget * epoch, 1e-12))
        print(
            f"SharpnessLogger: a log costs {self._last_cost:.2f} s, an epoch {epoch:.2f} s: it logs about every "
            f"{every} epochs, to stay within budget={self.budget:g} of fit's time (the first and last epochs "
            "always; every_n_epochs=k or budget=None to choose).",
            flush=True,
        )

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        self._epochs_seen += 1
        if self._due(epoch):
            start, compiled = self._clock(), self._compile_clock()
            values = self.compute()
            cost = self._clock() - start
            self._spent += cost
            # The next log is assumed to cost this one's time less what it
            # compiled (the first log's compilation is not paid again).
            self._last_cost = max(cost - (self._compile_clock() - compiled), 0.0)
            self.history.append((epoch, values))
        else:
            self._tell_once()
            values = {k: math.nan for k in self.keys()}
        logs.update(values)
