"""The result type of every estimate: a value that travels with its uncertainty."""

import dataclasses
import math

import numpy as np


@dataclasses.dataclass
class Estimate:
    """A scalar estimate with its uncertainty.

    Attributes:
        value: the estimate.
        stderr: standard error of `value` (standard deviation of the probe
            values / sqrt(number of probes) for stochastic parts; 0 for an
            exact result); for Lanczos a bound on the error instead,
            documented there.
        num_samples: probes, samples or iterations behind `value`.
        per_layer: ``{variable path: contribution}``; contributions add up to
            `value` (the diagonal blocks' share of a trace).
        samples: the individual probe values, when there are any.
        info: what else a reader needs to interpret `value`: data size,
            damping, which parts are exact (``info["exact_part"]``,
            ``info["residual"]``), excluded parameters, ...

    ``float(estimate)`` is ``estimate.value``; ``format()`` gives
    ``"value ± stderr"`` (ending "(given M)" when ``info
    ["stderr_given_metric"]``: the stderr leaves out the sampling of a
    metric built from sampled labels), and ``within_noise`` says whether
    the value is within two standard errors of zero.

    Example:

    >>> est = kg.estimators.Estimate(value=2.5, stderr=0.1, num_samples=10)
    >>> est
    Estimate(value=2.5, stderr=0.1, num_samples=10)
    >>> float(est), est.format(), est.within_noise
    (2.5, '2.5 ± 0.1', False)
    """

    value: float
    stderr: float
    num_samples: int
    per_layer: dict = dataclasses.field(default_factory=dict)
    samples: np.ndarray = None
    info: dict = dataclasses.field(default_factory=dict)

    def __float__(self):
        return float(self.value)

    @property
    def relative_stderr(self):
        return abs(self.stderr) / abs(self.value) if self.value else math.inf

    @property
    def within_noise(self):
        """True when the value is within two standard errors of zero: its
        sign is not resolved."""
        return bool(abs(self.value) <= 2 * abs(self.stderr))

    def format(self, digits=4):
        """``"value ± stderr"``, flagged with ``(~0)`` when within noise."""
        flag = " (~0)" if self.stderr and self.within_noise else ""
        flag += " (given M)" if self.info.get("stderr_given_metric") else ""
        return f"{self.value:.{digits}g} ± {self.stderr:.2g}{flag}"

    def __repr__(self):
        extra = ""
        if "num_nonzero_fisher" in self.info:
            extra = f", nonzero_fisher={self.info['num_nonzero_fisher']}/{self.info['num_params']}"
        if self.stderr and self.within_noise:
            extra += ", within 2 stderr of zero"
        if self.info.get("stderr_given_metric"):
            extra += ", stderr given the sampled metric"
        return (
            f"Estimate(value={self.value:.6g}, stderr={self.stderr:.3g}, "
            f"num_samples={self.num_samples}{extra})"
        )


def from_samples(samples, per_layer_samples=None, info=None, shift=0.0):
    """An Estimate from per-probe values (and per-layer per-probe values);
    `shift` is an exact part added to the value (and to nothing else)."""
    samples = np.asarray(samples, dtype="float64")
    n = samples.size
    stderr = float(samples.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    per_layer = {}
    if per_layer_samples:
        per_layer = {k: float(np.mean(v)) for k, v in per_layer_samples.items()}
    return Estimate(
        value=float(samples.mean()) + shift,
        stderr=stderr,
        num_samples=int(n),
        per_layer=per_layer,
        samples=samples,
        info=dict(info or {}),
    )
