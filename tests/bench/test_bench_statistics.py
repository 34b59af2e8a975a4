"""The bench's statistics (bench/ scripts, imported as modules): the paired
ratio interval of its goal table and the power-law fit of the overhead
exponent, against independent references. Backend-free (NumPy, scipy)."""

import math
import sys

import numpy as np
import pytest
from scipy import stats

from locations import REPO

sys.path.insert(0, f"{REPO}/bench")
import llqr as llqr_bench  # noqa: E402
import sam_step  # noqa: E402


def test_paired_ratio_interval_is_the_t_interval_of_the_log_ratios():
    rng = np.random.default_rng(0)
    sgd = 0.1 * (1 + 0.2 * rng.random(7))  # load moves both members of a pair
    sam = 2.05 * sgd * np.exp(0.02 * rng.standard_normal(7))
    lo, hi = sam_step.paired_ratio_interval(list(sam), list(sgd))
    logs = np.log(sam / sgd)
    ref = stats.t.interval(0.95, len(logs) - 1, loc=logs.mean(), scale=stats.sem(logs))
    np.testing.assert_allclose([lo, hi], np.exp(ref), rtol=1e-12)
    assert lo < 2.05 < hi
    # Load that moves both members of every pair alike leaves no uncertainty.
    lo, hi = sam_step.paired_ratio_interval([2.0 * t for t in sgd], list(sgd))
    assert lo == pytest.approx(2.0) and hi == pytest.approx(2.0)
    assert all(math.isnan(v) for v in sam_step.paired_ratio_interval([0.2], [0.1]))


def test_power_law_fit_recovers_the_exponent_with_its_interval():
    P = np.array([1e4, 3e4, 1e5, 3e5, 1e6])
    k, c = 1.07, 2e-6
    exact = llqr_bench.fit_power_law(P, c * P**k)
    assert exact["k"] == pytest.approx(k, rel=1e-12) and exact["r2"] == pytest.approx(1.0)
    noise = np.exp(np.array([0.05, -0.03, 0.02, -0.04, 0.01]))
    fit = llqr_bench.fit_power_law(P, c * P**k * noise)
    ref = stats.linregress(np.log(P), np.log(c * P**k * noise))
    half = stats.t.ppf(0.975, len(P) - 2) * ref.stderr
    assert fit["k"] == pytest.approx(ref.slope) and fit["n"] == 5
    np.testing.assert_allclose([fit["lo"], fit["hi"]], [ref.slope - half, ref.slope + half], rtol=1e-12)
    # Non-positive overheads are left out of the log-log fit.
    assert llqr_bench.fit_power_law(P, np.r_[-1.0, c * P[1:] ** k])["n"] == 4
