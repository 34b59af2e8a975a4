"""Statistics of the sharpness / generalisation study (NumPy and SciPy only).

Every function here works on plain arrays or on the study's rows (dicts, as
read back from its CSV), so it runs without Keras:

- :func:`correlation`: Kendall's tau-b or Spearman's rho (``scipy.stats``)
  with a paired, percentile bootstrap confidence interval over runs;
- :func:`fit_exponent`: the exponent ``b`` in ``y ~ a x^b`` by least squares
  in log-log, with a t-based interval from the regression and a paired
  percentile bootstrap interval;
- :func:`mean_sem`: a mean and its standard error over seeds;
- :func:`summarize`: all of the above for a list of study rows, per dataset.
"""

import dataclasses
import inspect
import math
import warnings

import numpy as np
import scipy.stats

from keras_geosam._checks import check_int
from keras_geosam._checks import check_number

CORRELATION_METHODS = ("kendall", "spearman")


def _finite_pairs(x, y):
    x = np.asarray(x, dtype="float64").ravel()
    y = np.asarray(y, dtype="float64").ravel()
    if x.shape != y.shape:
        raise ValueError(f"x and y must have the same length, got {x.size} and {y.size}.")
    keep = np.isfinite(x) & np.isfinite(y)
    return x[keep], y[keep], int(x.size - keep.sum())


def _quiet(fn, *args):
    # Constant inputs (a degenerate resample, a measure that never moves)
    # make SciPy warn and return NaN; NaN is the answer we want, silently.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args)


def kendall_tau(x, y):
    """Kendall's tau-b between `x` and `y` (ties handled) with its p-value.

    A thin wrapper over ``scipy.stats.kendalltau``.

    Args:
        x: 1-D array-like of numbers.
        y: 1-D array-like, same length as `x`.

    Returns:
        ``(tau, pvalue)`` as floats; NaN when either input is constant.

    Raises:
        ValueError: if `x` and `y` differ in length.

    Example:

    >>> round(kendall_tau([1, 2, 3, 4], [1, 3, 2, 4])[0], 6)
    0.666667
    """
    x, y, _ = _finite_pairs(x, y)
    r = _quiet(lambda: scipy.stats.kendalltau(x, y, variant="b"))
    return float(r.statistic), float(r.pvalue)


def spearman_rho(x, y):
    """Spearman's rank correlation rho between `x` and `y` with its p-value.

    A thin wrapper over ``scipy.stats.spearmanr`` (average ranks for ties).

    Args:
        x: 1-D array-like of numbers.
        y: 1-D array-like, same length as `x`.

    Returns:
        ``(rho, pvalue)`` as floats; NaN when either input is constant.

    Raises:
        ValueError: if `x` and `y` differ in length.

    Example:

    >>> round(spearman_rho([1, 2, 3, 4], [1, 3, 2, 4])[0], 6)
    0.8
    """
    x, y, _ = _finite_pairs(x, y)
    r = _quiet(lambda: scipy.stats.spearmanr(x, y))
    return float(r.statistic), float(r.pvalue)


def _seeded(seed):
    # SciPy >= 1.15 takes ``rng``; older releases only ``random_state``.
    name = "rng" if "rng" in inspect.signature(scipy.stats.bootstrap).parameters else "random_state"
    return {name: np.random.default_rng(seed)}


@dataclasses.dataclass
class BootstrapInterval:
    """A percentile bootstrap interval.

    low, high: the interval's ends (NaN when it cannot be formed).
    confidence: its nominal coverage, e.g. 0.95.
    n_resamples: resamples drawn.
    num_degenerate: resamples whose statistic was undefined (e.g. a
        resample of identical runs); they are left out of the percentiles.
    """

    low: float
    high: float
    confidence: float
    n_resamples: int
    num_degenerate: int

    def to_dict(self):
        return dataclasses.asdict(self)


def bootstrap_interval(statistic, *samples, n_resamples=2000, confidence=0.95, seed=0):
    """Paired percentile bootstrap interval of ``statistic(*samples)`` over runs.

    Runs (the i-th entries of every sample together) are resampled with
    replacement by ``scipy.stats.bootstrap`` (``paired=True``); the interval
    is the ``(1 - confidence) / 2`` and ``(1 + confidence) / 2`` percentiles
    of the resampled statistic, ignoring resamples where it is undefined
    (e.g. every resampled run identical; counted in ``num_degenerate``).

    Args:
        statistic: ``f(*samples) -> float``; may return NaN or raise
            ValueError (both count as degenerate).
        *samples: 1-D array-likes of equal length (runs with a non-finite
            entry in any of them are left out).
        n_resamples: number of bootstrap resamples.
        confidence: nominal coverage in (0, 1).
        seed: seeds the resampling: the same seed gives the same interval.

    Returns:
        A :class:`BootstrapInterval`; NaN ends for fewer than 3 runs or when
        every resample is degenerate.

    Raises:
        ValueError: if `confidence` is not in (0, 1), `n_resamples` < 1, or
            the samples differ in length.

    Example:

    >>> x, y = [1, 2, 3, 4, 5, 6], [1, 3, 2, 4, 6, 5]
    >>> ci = bootstrap_interval(lambda a, b: kendall_tau(a, b)[0], x, y, n_resamples=200)
    >>> bool(ci.low <= kendall_tau(x, y)[0] <= ci.high)
    True
    """
    check_number("confidence", confidence, 0.0, strict=True, below=1)
    n_resamples = check_int("n_resamples", n_resamples)
    arrays = [np.asarray(a, dtype="float64").ravel() for a in samples]
    if len({a.size for a in arrays}) > 1:
        raise ValueError(f"samples must have the same length, got {[a.size for a in arrays]}.")
    keep = np.logical_and.reduce([np.isfinite(a) for a in arrays])
    arrays = [a[keep] for a in arrays]
    nan = BootstrapInterval(math.nan, math.nan, confidence, int(n_resamples), int(n_resamples))
    if arrays[0].size < 3:
        return nan

    def safe(*a):
        try:
            return _quiet(statistic, *a)
        except (ValueError, FloatingPointError, ZeroDivisionError):
            return math.nan

    with warnings.catch_warnings():
        # SciPy warns that a percentile interval over NaNs is undefined; we
        # take the percentiles ourselves, over the defined resamples.
        warnings.simplefilter("ignore")
        res = scipy.stats.bootstrap(
            tuple(arrays), safe, paired=True, vectorized=False, method="percentile",
            n_resamples=int(n_resamples), confidence_level=confidence, **_seeded(seed),
        )
    dist = np.asarray(res.bootstrap_distribution, dtype="float64")
    ok = np.isfinite(dist)
    if not ok.any():
        return nan
    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(dist[ok], [tail, 100 - tail])
    return BootstrapInterval(float(low), float(high), confidence, int(n_resamples), int((~ok).sum()))


@dataclasses.dataclass
class Correlation:
    """A rank correlation with its p-value and bootstrap interval.

    method: ``"kendall"`` (tau-b) or ``"spearman"``.
    value, pvalue: from ``scipy.stats`` on all finite pairs.
    ci_low, ci_high, confidence, num_degenerate: the paired percentile
        bootstrap interval (:func:`bootstrap_interval`).
    n: finite pairs used; num_dropped: pairs with a NaN/inf left out.
    """

    method: str
    value: float
    pvalue: float
    ci_low: float
    ci_high: float
    confidence: float
    n: int
    num_dropped: int
    num_degenerate: int

    def to_dict(self):
        return dataclasses.asdict(self)

    def format(self):
        """``"0.123 [-0.1, 0.4]"``: the value and its interval."""
        return f"{_g(self.value)} [{_g(self.ci_low)}, {_g(self.ci_high)}]"


def _g(v, digits=3):
    return "nan" if v is None or not np.isfinite(v) else f"{v:.{digits}f}"


def correlation(x, y, method="kendall", n_resamples=2000, confidence=0.95, seed=0):
    """Rank correlation of `x` with `y`, with a bootstrap interval over runs.

    Args:
        x: 1-D array-like, e.g. one sharpness measure per run.
        y: 1-D array-like, e.g. the generalisation gap per run.
        method: ``"kendall"`` (tau-b, ``scipy.stats.kendalltau``) or
            ``"spearman"`` (``scipy.stats.spearmanr``).
        n_resamples: bootstrap resamples for the interval.
        confidence: nominal coverage of the interval.
        seed: bootstrap seed (deterministic).

    Returns:
        A :class:`Correlation`. Pairs with a non-finite entry are dropped and
        counted.

    Raises:
        ValueError: for an unknown `method`, mismatched lengths, or a
            `confidence` outside (0, 1).

    Example:

    >>> c = correlation([1, 2, 3, 4, 5, 6], [2, 1, 4, 3, 6, 5], "spearman", n_resamples=200)
    >>> round(c.value, 4), c.ci_low <= c.value <= c.ci_high
    (0.8286, True)
    """
    if method not in CORRELATION_METHODS:
        raise ValueError(f"method must be one of {CORRELATION_METHODS}, got {method!r}.")
    fn = kendall_tau if method == "kendall" else spearman_rho
    xf, yf, dropped = _finite_pairs(x, y)
    value, pvalue = fn(xf, yf) if xf.size >= 2 else (math.nan, math.nan)
    ci = bootstrap_interval(lambda a, b: fn(a, b)[0], xf, yf, n_resamples=n_resamples, confidence=confidence, seed=seed)
    return Correlation(method, value, pvalue, ci.low, ci.high, confidence, int(xf.size), dropped, ci.num_degenerate)


def correlation_difference(x1, x2, y, method="kendall", n_resamples=2000, confidence=0.95, seed=0, absolute=False):
    """Does measure `x1` order `y` better than measure `x2`?

    The difference ``corr(x1, y) - corr(x2, y)`` with a paired percentile
    bootstrap interval: each resample draws runs, and both correlations are
    computed on the same runs, so their dependence is kept. With
    ``absolute=True`` it is ``|corr(x1, y)| - |corr(x2, y)|``: which measure
    ranks the runs more strongly, in either direction. The signed
    difference can favour `x1` only because `x2` correlates negatively.

    Args:
        x1: 1-D array-like, the first measure per run.
        x2: 1-D array-like, the second measure per run.
        y: 1-D array-like, e.g. the gap per run.
        method: ``"kendall"`` or ``"spearman"``.
        n_resamples, confidence, seed: for the interval.
        absolute: compare the correlations' magnitudes.

    Returns:
        A dict with ``value``, ``ci_low``, ``ci_high``, ``confidence``,
        ``n`` (runs with all three finite), ``num_degenerate``,
        ``absolute``, and ``corr1`` and ``corr2`` (the two signed
        correlations on those runs).

    Raises:
        ValueError: for an unknown `method` or mismatched lengths.

    Example:

    >>> d = correlation_difference([1, 2, 3, 4], [4, 3, 2, 1], [1, 2, 3, 4], n_resamples=100)
    >>> d["value"]
    2.0
    >>> correlation_difference([1, 2, 3, 4], [4, 3, 2, 1], [1, 2, 3, 4], n_resamples=100, absolute=True)["value"]
    0.0
    """
    if method not in CORRELATION_METHODS:
        raise ValueError(f"method must be one of {CORRELATION_METHODS}, got {method!r}.")
    fn = kendall_tau if method == "kendall" else spearman_rho
    a, b, c = (np.asarray(v, dtype="float64").ravel() for v in (x1, x2, y))
    if not a.size == b.size == c.size:
        raise ValueError(f"x1, x2 and y must have the same length, got {a.size}, {b.size}, {c.size}.")
    keep = np.isfinite(a) & np.isfinite(b) & np.isfinite(c)
    a, b, c = a[keep], b[keep], c[keep]
    size = abs if absolute else (lambda v: v)
    stat = lambda p, q, r: size(fn(p, r)[0]) - size(fn(q, r)[0])
    value = stat(a, b, c) if a.size >= 2 else math.nan
    ci = bootstrap_interval(stat, a, b, c, n_resamples=n_resamples, confidence=confidence, seed=seed)
    corr1, corr2 = (float(fn(v, c)[0]) if a.size >= 2 else math.nan for v in (a, b))
    return {"value": float(value), "ci_low": ci.low, "ci_high": ci.high, "confidence": confidence,
            "n": int(a.size), "num_degenerate": ci.num_degenerate, "absolute": bool(absolute),
            "corr1": corr1, "corr2": corr2}


@dataclasses.dataclass
class ExponentFit:
    """Result of :func:`fit_exponent` for ``y ~ prefactor * x^exponent``.

    exponent, stderr: the least-squares slope of log y on log x and its
        standard error (``scipy.stats.linregress``).
    prefactor: ``exp(intercept)``.
    ci_low, ci_high: t-based interval ``exponent +- t_{n-2} * stderr``.
    boot_low, boot_high: paired percentile bootstrap interval over points.
    r_squared, n, num_dropped (non-positive or non-finite points left out),
    confidence.
    """

    exponent: float
    stderr: float
    prefactor: float
    ci_low: float
    ci_high: float
    boot_low: float
    boot_high: float
    r_squared: float
    confidence: float
    n: int
    num_dropped: int

    def to_dict(self):
        return dataclasses.asdict(self)

    def format(self):
        """``"1.02 ± 0.1 (t 95% [0.8, 1.2]; bootstrap [0.7, 1.3])"``."""
        pct = f"{100 * self.confidence:g}%"
        return (f"{_g(self.exponent)} ± {_g(self.stderr)} (t {pct} [{_g(self.ci_low)}, {_g(self.ci_high)}]; "
                f"bootstrap [{_g(self.boot_low)}, {_g(self.boot_high)}])")


def _slope(lx, ly):
    if np.ptp(lx) == 0:
        return math.nan
    return float(scipy.stats.linregress(lx, ly).slope)


def fit_exponent(x, y, confidence=0.95, n_resamples=2000, seed=0):
    """Fits ``y ~ a x^b``: least squares of ``log y`` on ``log x``.

    Two intervals for ``b`` are reported, because they answer different
    questions: the t-based one assumes independent Gaussian scatter around
    the line in log space (``b +- t_{n-2, (1+confidence)/2} * stderr``); the
    paired percentile bootstrap over points does not, but is unreliable with
    few distinct `x` values.

    Args:
        x: 1-D array-like of positive numbers, e.g. ``B / eta`` per run.
        y: 1-D array-like of positive numbers, e.g. S_R per run.
        confidence: nominal coverage of both intervals.
        n_resamples: bootstrap resamples.
        seed: bootstrap seed.

    Returns:
        An :class:`ExponentFit`. Points with a non-positive or non-finite
        coordinate are dropped (``num_dropped``); with fewer than 3 points
        or a single distinct `x` the intervals are NaN.

    Raises:
        ValueError: for mismatched lengths or `confidence` outside (0, 1).

    Example:

    >>> fit = fit_exponent([1, 2, 4, 8], [3, 12, 48, 192])
    >>> round(fit.exponent, 9), round(fit.prefactor, 9)
    (2.0, 3.0)
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}.")
    x = np.asarray(x, dtype="float64").ravel()
    y = np.asarray(y, dtype="float64").ravel()
    if x.shape != y.shape:
        raise ValueError(f"x and y must have the same length, got {x.size} and {y.size}.")
    keep = np.isfinite(x) & np.isfinite(y) & (x > 0) & (y > 0)
    lx, ly = np.log(x[keep]), np.log(y[keep])
    n, dropped = int(keep.sum()), int(x.size - keep.sum())
    nan = math.nan
    if n < 2 or np.ptp(lx) == 0:
        return ExponentFit(nan, nan, nan, nan, nan, nan, nan, nan, confidence, n, dropped)
    reg = scipy.stats.linregress(lx, ly)
    lo = hi = nan
    stderr = float(reg.stderr) if n >= 3 else nan  # two points fit exactly: no scatter to estimate
    if n >= 3:
        t = scipy.stats.t.ppf((1 + confidence) / 2, n - 2)
        lo, hi = reg.slope - t * reg.stderr, reg.slope + t * reg.stderr
    boot = bootstrap_interval(_slope, lx, ly, n_resamples=n_resamples, confidence=confidence, seed=seed)
    return ExponentFit(
        float(reg.slope), stderr, float(np.exp(reg.intercept)), float(lo), float(hi),
        boot.low, boot.high, float(reg.rvalue**2), confidence, n, dropped,
    )


def mean_sem(values):
    """Mean and standard error of the mean of the finite `values`.

    Args:
        values: 1-D array-like.

    Returns:
        ``(mean, sem, n)``; ``sem`` is NaN for fewer than two values.

    Raises:
        Nothing: an empty input gives ``(nan, nan, 0)``.

    Example:

    >>> mean_sem([1.0, 2.0, 3.0])
    (2.0, 0.5773502691896258, 3)
    """
    v = np.asarray(values, dtype="float64").ravel()
    v = v[np.isfinite(v)]
    if v.size == 0:
        return math.nan, math.nan, 0
    sem = float(scipy.stats.sem(v)) if v.size > 1 else math.nan
    return float(v.mean()), sem, int(v.size)


# The measures a study row carries, by CSV column, with the display name;
# each has a ``<column>_stderr`` partner. ``b_over_eta`` is the baseline:
# does the bare hyperparameter ratio order the gap as well as a measure?
MEASURES = {
    "sr_kfac": "S_R K-FAC",
    "sr_diag": "S_R diag",
    "trace_h": "tr H",
    "lambda_max": "lambda_max",
    "lambda_max_r": "lambda_max R",
    "b_over_eta": "B/eta",
}
GAPS = {
    "gap_loss": "test loss - train loss",
    "gap_acc": "train acc - test acc",
}
EXPONENT_MEASURES = ("sr_kfac", "sr_diag")
# Riemannian against Euclidean: the claim is that the first orders the gap
# better. Each pair is (Riemannian, Euclidean); compared by |tau|, since a
# signed difference rewards a Euclidean measure for correlating negatively.
COMPARISONS = (("sr_kfac", "trace_h"), ("sr_diag", "trace_h"), ("lambda_max_r", "lambda_max"))


def describe_comparison(pair, c, gap):
    """A sentence saying which measure of a ``"a - b"`` comparison
    (:func:`correlation_difference` with ``absolute=True``) tracks the gap
    more strongly, and in which direction.

    Example:

    >>> c = {"value": -0.4, "ci_low": -0.6, "ci_high": -0.1, "corr1": 0.1, "corr2": -0.5}
    >>> describe_comparison("sr_kfac - trace_h", c, "gap_loss")
    'tr H ranks the runs by the gap more strongly than S_R K-FAC (|tau| 0.50 vs 0.10), in the negative direction (higher tr H, smaller gap).'
    """
    a, b = pair.split(" - ")
    names = {a: MEASURES.get(a, a), b: MEASURES.get(b, b)}
    if c.get("ci_low") is None or not math.isfinite(c["ci_low"]) or not math.isfinite(c["ci_high"]):
        return f"{names[a]} vs {names[b]}: too few runs for an interval."
    if c["ci_low"] <= 0 <= c["ci_high"]:
        return (f"neither {names[a]} (tau {_g(c['corr1'], 2)}) nor {names[b]} (tau {_g(c['corr2'], 2)}) ranks the "
                f"runs by the gap more strongly (the |tau| difference's interval contains 0).")
    strong, weak = (a, b) if c["ci_low"] > 0 else (b, a)
    tau = {a: c["corr1"], b: c["corr2"]}
    sign = "positive" if tau[strong] > 0 else "negative"
    more = "larger" if tau[strong] > 0 else "smaller"
    return (f"{names[strong]} ranks the runs by the gap more strongly than {names[weak]} (|tau| "
            f"{_g(abs(tau[strong]), 2)} vs {_g(abs(tau[weak]), 2)}), in the {sign} direction (higher "
            f"{names[strong]}, {more} gap).")


def _is_valid(row):
    v = row.get("valid", 1)
    try:
        return bool(int(float(v)))
    except (TypeError, ValueError):
        return False


def _column(rows, key):
    out = []
    for r in rows:
        try:
            out.append(float(r.get(key, math.nan)))
        except (TypeError, ValueError):
            out.append(math.nan)
    return np.asarray(out, dtype="float64")


def summarize(rows, measures=None, gaps=None, n_resamples=2000, confidence=0.95, seed=0, extra_columns=()):
    """All of the study's statistics for a list of rows, per dataset.

    Correlations mix no datasets: the gap's scale differs between them.
    Rows with a false ``valid`` (runs that collapsed or diverged) are left
    out of every statistic and counted in ``n_invalid``.

    Args:
        rows: dicts with at least ``dataset``, ``optimizer``, the measure and
            gap columns and ``b_over_eta`` (the study's CSV rows; strings
            are converted, unparsable entries count as NaN).
        measures: columns to correlate with each gap (default
            :data:`MEASURES`).
        gaps: gap columns (default :data:`GAPS`).
        n_resamples, confidence, seed: for every bootstrap interval.
        extra_columns: more columns to average per optimizer (e.g. the
            noise/Fisher alignment).

    Returns:
        ``{dataset: {"n_runs" (valid), "n_invalid", "correlations": {gap: {measure: {"kendall":
        ..., "spearman": ...}}}, "comparisons": {gap: {"a - b":
        correlation_difference(..., absolute=True)}}, "exponents": {measure:
        {optimizer: ..., "all": ... (only with several optimizers)}},
        "optimizers": {optimizer: {column: [mean, sem, n]}}}}`` with every
        result as a plain dict (JSON-ready).

    Raises:
        ValueError: if `confidence` is not in (0, 1).

    Example:

    >>> rows = [{"dataset": "d", "optimizer": "sgd", "sr_kfac": s, "gap_loss": g,
    ...          "b_over_eta": b} for s, g, b in [(1, .1, 10), (2, .3, 20), (4, .2, 40), (8, .5, 80)]]
    >>> out = summarize(rows, measures=["sr_kfac"], gaps=["gap_loss"], n_resamples=100)
    >>> round(out["d"]["correlations"]["gap_loss"]["sr_kfac"]["kendall"]["value"], 4)
    0.6667
    """
    measures = list(MEASURES if measures is None else measures)
    gaps = list(GAPS if gaps is None else gaps)
    out = {}
    for dataset in dict.fromkeys(r["dataset"] for r in rows):
        everything = [r for r in rows if r["dataset"] == dataset]
        sub = [r for r in everything if _is_valid(r)]
        corr = {}
        for gap in gaps:
            y = _column(sub, gap)
            corr[gap] = {
                m: {meth: correlation(_column(sub, m), y, meth, n_resamples, confidence, seed).to_dict()
                    for meth in CORRELATION_METHODS}
                for m in measures
            }
        compare = {}
        for gap in gaps:
            y = _column(sub, gap)
            compare[gap] = {
                f"{a} - {b}": correlation_difference(_column(sub, a), _column(sub, b), y, "kendall",
                                                     n_resamples, confidence, seed, absolute=True)
                for a, b in COMPARISONS if a in measures and b in measures
            }
        b_eta = _column(sub, "b_over_eta")
        optimizers = list(dict.fromkeys(r["optimizer"] for r in sub))
        exponents = {}
        for m in EXPONENT_MEASURES:
            if m not in measures:
                continue
            fits = {}
            for opt in optimizers:
                mine = [r for r in sub if r["optimizer"] == opt]
                fits[opt] = fit_exponent(_column(mine, "b_over_eta"), _column(mine, m), confidence, n_resamples, seed).to_dict()
            if len(optimizers) > 1:  # with one optimizer "all" would repeat its row
                fits["all"] = fit_exponent(b_eta, _column(sub, m), confidence, n_resamples, seed).to_dict()
            exponents[m] = fits
        per_opt = {}
        for opt in optimizers:
            mine = [r for r in sub if r["optimizer"] == opt]
            per_opt[opt] = {c: list(mean_sem(_column(mine, c))) for c in ("test_acc", "train_acc", *gaps, *measures, *extra_columns)}
        out[dataset] = {"n_runs": len(sub), "n_invalid": len(everything) - len(sub), "correlations": corr,
                        "comparisons": compare, "exponents": exponents,
                        "optimizers": per_opt}
    return out
