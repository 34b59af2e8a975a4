"""The pothole demonstration of shared/spec/llqr-sam.md, section 2, through
the guide ``guides/pothole.py`` (imported, and its ``main`` run end to end).

On L = 1/2 theta^T (Hbar + H_eps) theta with Hbar = diag(lb, 1/4, lb) and a
pothole H_eps = diag(1 - lb, 0, 0) (local curvature 1 along e1), a tiny Keras
model holding theta is trained with kg.optimizers.SAM and
kg.optimizers.LLQRSAM (diagonal U assigned to Hbar^-1, refresh_source=
"callback" so it stays there), SGD base, both at the same effective step
c = eta * (curvature seen by the method) along the pothole: SAM eta = c,
LLQR+SAM eta = c * lb.

Prediction (derived in the guide): along the pothole SAM settles on a
2-cycle +-rho c / (2 - c); LLQR+SAM with norm="metric" is SAM in the
coordinates Hbar^(1/2) theta, so it hovers at rho c / (2 - c) / sqrt(lb):
the ratio of envelopes is lb^(-1/2). With norm="euclidean" the envelope is
rho c / (2 - c) again (ratio 1).

Tolerance, rtol 1e-3 on envelopes and ratios. The "envelope" is
max |theta_1| over the last 20 steps. Its error has two sources: (1) the
other directions, which contract by at most 1 - c/kappa - (c/kappa)^2 per
step (kappa = 1/lb = 16 for LLQR+SAM; the same factor for SAM's e3 at c = 1),
so after >= 320 steps (0.934^320 ~ 3e-10 at c = 1; 0.969^400 ~ 3e-6 at
c = 1/2) they perturb the envelope only at second order; (2) float32
rounding, ~1e-7 relative, which does not accumulate because the 2-cycle is
attracting (its multiplier along e1 is 1 - c). 1e-3 is three orders above
both and far below what a wrong scaling gives (lb^(-1/2) = 4 vs
lb^(-1) = 16 or 1).
"""

import importlib.util
import json
import os

import numpy as np
import pytest
from locations import GUIDES

GUIDE = os.path.join(GUIDES, "pothole.py")
RTOL = 1e-3
RHO = 0.05


@pytest.fixture(scope="module")
def guide():
    spec = importlib.util.spec_from_file_location("pothole_guide", GUIDE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run_main(guide, tmp_path_factory):
    """The guide end to end: lb = 1/16 (left panel) and 1/4 (sweep)."""
    png = tmp_path_factory.mktemp("pothole") / "pothole.png"
    results = guide.main(["--output", str(png), "--rho", str(RHO), "--lambdabar", "0.0625",
                          "--sweep", "0.25", "--steps", "200"])
    return {r["lambdabar"]: r for r in results}, png


def test_guide_writes_the_plot_and_the_numbers(run_main):
    results, png = run_main
    assert png.exists() and png.stat().st_size > 10_000
    with open(png.with_suffix(".json")) as f:
        saved = json.load(f)
    assert [r["lambdabar"] for r in saved["results"]] == [0.0625, 0.25]
    assert saved["results"][0]["ratio_metric"] == pytest.approx(results[0.0625]["ratio_metric"])


@pytest.mark.parametrize("lb", [0.0625, 0.25])
def test_sam_hovers_at_rho_along_the_pothole(run_main, lb):
    r = run_main[0][lb]
    assert r["steps"] >= 200
    assert r["sam"]["pothole"] == pytest.approx(RHO, rel=RTOL)


@pytest.mark.parametrize("lb", [0.0625, 0.25])
def test_llqrsam_metric_hovers_at_rho_over_sqrt_lambdabar(run_main, lb):
    r = run_main[0][lb]
    assert r["llqrsam_metric"]["pothole"] == pytest.approx(RHO / np.sqrt(lb), rel=RTOL)
    assert r["ratio_metric"] == pytest.approx(lb ** -0.5, rel=RTOL)
    # Not the other conceivable scalings.
    assert abs(r["ratio_metric"] - 1.0 / lb) > 0.5 and abs(r["ratio_metric"] - 1.0) > 0.5


@pytest.mark.parametrize("lb", [0.0625, 0.25])
def test_llqrsam_euclidean_norm_does_not_amplify(run_main, lb):
    """The reference code's default normalisation: envelope rho, ratio 1."""
    r = run_main[0][lb]
    assert r["ratio_euclidean"] == pytest.approx(1.0, rel=RTOL)


@pytest.mark.parametrize("method", ["sam", "llqrsam_metric", "llqrsam_euclidean"])
def test_it_is_a_two_cycle_and_the_flat_basin_settles(run_main, method):
    """After transients theta_1 alternates between +a and -a; the directions
    without a pothole (e2, and the flat basin e3) settle at the minimum."""
    r = run_main[0][0.0625]
    tail = r["trajectories"][method][-20:]
    assert np.all(np.sign(tail[1:, 0]) == -np.sign(tail[:-1, 0]))
    np.testing.assert_allclose(np.abs(tail[:, 0]), r[method]["pothole"], rtol=RTOL)
    assert r[method]["e2"] < 1e-4 * RHO
    assert r[method]["flat_basin"] < 1e-4 * RHO


def test_ratio_holds_at_another_effective_step(guide):
    """c = 1/2: envelopes rho c/(2-c) = rho/3 and rho/(3 sqrt(lb)); same ratio."""
    lb, c = 0.0625, 0.5
    sam = guide.envelope(guide.run("sam", lb, RHO, steps=400, effective_step=c))
    llqr = guide.envelope(guide.run("llqrsam_metric", lb, RHO, steps=400, effective_step=c))
    assert sam[0] == pytest.approx(RHO / 3, rel=RTOL)
    assert llqr[0] == pytest.approx(RHO / 3 / np.sqrt(lb), rel=RTOL)
    assert llqr[0] / sam[0] == pytest.approx(lb ** -0.5, rel=RTOL)
