"""SharpnessLogger: sharpness measures written into ``logs`` every N epochs."""

import math
import warnings

import keras

from keras_geosam import sharpness

# name -> (function, fixed keyword arguments)
_METRICS = {
    "hessian_trace": (sharpness.hessian_trace, {}),
    "lambda_max": (sharpness.hessian_max_eigenvalue, {}),
    "riemannian_sharpness": (sharpness.riemannian_sharpness, {"metric": "diagonal"}),
    "riemannian_sharpness_kfac": (sharpness.riemannian_sharpness, {"metric": "kfac"}),
    "riemannian_sharpness_exact": (sharpness.riemannian_sharpness, {"metric": "exact"}),
}
_PROBED = {"hessian_trace", "riemannian_sharpness", "riemannian_sharpness_kfac"}


class SharpnessLogger(keras.callbacks.Callback):
    """Adds sharpness measures to the epoch ``logs``.

    Every `every_n_epochs` epochs it evaluates each requested metric on the
    fixed data ``(x, y)`` with a fixed seed (so epochs are comparable and
    differences come from the weights, not the probes) and writes
    ``logs[prefix + name]`` and ``logs[prefix + name + "_stderr"]``. Callbacks
    after it in the list (History, CSVLogger, TensorBoard) record the keys; on
    epochs it skips, the keys hold NaN so every epoch has the same columns.
    For ``riemannian_sharpness`` it also writes ``..._normalized`` (value per
    parameter with nonzero Fisher; see the piecewise-linear caveat).

    Args:
        x, y: probe data (keep it small: every metric streams over it).
        metrics: names from ``SharpnessLogger.available()``.
        every_n_epochs: evaluate on epochs ``n-1, 2n-1, ...`` (0-based).
        num_probes: Hutchinson probes per estimate.
        seed: fixed seed for probes and sampled labels.
        batch_size: streaming batch size.
        prefix: prepended to every key.
        options: per-metric keyword overrides, e.g.
            ``{"riemannian_sharpness": {"damping": 1e-4}}``.
    """

    def __init__(
        self,
        x,
        y,
        metrics=("hessian_trace", "riemannian_sharpness"),
        every_n_epochs=1,
        num_probes=10,
        seed=0,
        batch_size=256,
        prefix="",
        options=None,
    ):
        super().__init__()
        if isinstance(metrics, str):
            metrics = (metrics,)
        unknown = [m for m in metrics if m not in _METRICS]
        if unknown:
            raise ValueError(f"Unknown sharpness metric(s) {unknown}; available: {sorted(_METRICS)}.")
        if not metrics:
            raise ValueError("metrics must name at least one metric.")
        if isinstance(every_n_epochs, bool) or not isinstance(every_n_epochs, int) or every_n_epochs < 1:
            raise ValueError(f"every_n_epochs must be an integer >= 1, got {every_n_epochs!r}.")
        if isinstance(num_probes, bool) or not isinstance(num_probes, int) or num_probes < 1:
            raise ValueError(f"num_probes must be an integer >= 1, got {num_probes!r}.")
        options = dict(options or {})
        stray = [k for k in options if k not in metrics]
        if stray:
            raise ValueError(
                f"options given for {stray}, which are not among the logged "
                f"metrics {list(metrics)}."
            )
        self.x, self.y = x, y
        self.metrics = tuple(metrics)
        self.every_n_epochs = every_n_epochs
        self.num_probes = num_probes
        self.seed = seed
        self.batch_size = batch_size
        self.prefix = prefix
        self.options = options
        self.history = []

    @staticmethod
    def available():
        return sorted(_METRICS)

    def keys(self):
        out = []
        for name in self.metrics:
            out += [self.prefix + name, self.prefix + name + "_stderr"]
            if name.startswith("riemannian_sharpness"):
                out.append(self.prefix + name + "_normalized")
        return out

    def compute(self):
        """Evaluates every metric now; returns ``{key: float}``."""
        model = self.model
        out = {}
        for name in self.metrics:
            fn, kwargs = _METRICS[name]
            kwargs = dict(kwargs, seed=self.seed, batch_size=self.batch_size)
            if name in _PROBED:
                kwargs["num_probes"] = self.num_probes
            kwargs.update(self.options.get(name, {}))
            with warnings.catch_warnings():
                # The piecewise-linear caveat is reported through _normalized.
                warnings.filterwarnings("ignore", message=".*piecewise linear.*")
                est = fn(model, self.x, self.y, **kwargs)
            out[self.prefix + name] = float(est.value)
            out[self.prefix + name + "_stderr"] = float(est.stderr)
            if "normalized" in est.info:
                out[self.prefix + name + "_normalized"] = float(est.info["normalized"])
            elif name.startswith("riemannian_sharpness"):
                out[self.prefix + name + "_normalized"] = float(est.value) / max(est.info.get("num_params", 1), 1)
        return out

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        if (epoch + 1) % self.every_n_epochs == 0:
            values = self.compute()
            self.history.append((epoch, values))
        else:
            values = {k: math.nan for k in self.keys()}
        logs.update(values)
