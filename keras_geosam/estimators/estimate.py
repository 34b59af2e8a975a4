"""The result type of every stochastic sharpness estimate."""

import dataclasses
import math

import numpy as np


@dataclasses.dataclass
class Estimate:
    """A scalar estimate with its uncertainty.

    Attributes:
        value: the estimate (mean over probes or samples).
        stderr: standard error of `value` (sample standard deviation over
            probes / sqrt(num_samples)); for deterministic iterative methods
            (Lanczos) a bound on the error instead, documented there.
        num_samples: probes, samples or iterations behind `value`.
        per_layer: ``{variable path: contribution}``; contributions add up to
            `value` (the diagonal blocks' share of a trace).
        samples: the individual probe values, when there are any.
        info: what else a reader needs to interpret `value` (data size,
            damping used, excluded parameters, ...).
    """

    value: float
    stderr: float
    num_samples: int
    per_layer: dict = dataclasses.field(default_factory=dict)
    samples: np.ndarray = None
    info: dict = dataclasses.field(default_factory=dict)

    def __float__(self):
        return float(self.value)

    def __repr__(self):
        extra = ""
        if "num_nonzero_fisher" in self.info:
            extra = (
                f", nonzero_fisher={self.info['num_nonzero_fisher']}"
                f"/{self.info['num_params']}"
            )
        return (
            f"Estimate(value={self.value:.6g}, stderr={self.stderr:.3g}, "
            f"num_samples={self.num_samples}{extra})"
        )


def from_samples(samples, per_layer_samples=None, info=None):
    """Builds an Estimate from per-probe values (and per-layer per-probe values)."""
    samples = np.asarray(samples, dtype="float64")
    n = samples.size
    stderr = float(samples.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    per_layer = {}
    if per_layer_samples:
        per_layer = {k: float(np.mean(v)) for k, v in per_layer_samples.items()}
    return Estimate(
        value=float(samples.mean()),
        stderr=stderr,
        num_samples=int(n),
        per_layer=per_layer,
        samples=samples,
        info=dict(info or {}),
    )
