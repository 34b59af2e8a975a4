"""The guide "Does sharpness predict generalisation?" in its default small
mode (12 runs on digits; about 1-2 minutes on 2 CPU cores); only with
KERAS_GEOSAM_SMALL_GUIDES=1 (CI runs its smoke mode in tests/study/test_study.py).

It checks that the study completes and reports, not what the numbers say:
the guide exists to measure the claim, not to assume it.
"""

import importlib.util
import json
import os
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
GUIDE = os.path.join(HERE, os.pardir, "guides", "sharpness_generalisation.py")


@pytest.mark.small_guide
def test_small_mode_end_to_end(tmp_path, report, monkeypatch):
    monkeypatch.delenv("KERAS_GEOSAM_GUIDE_MODE", raising=False)  # the small mode, whatever CI sets
    spec = importlib.util.spec_from_file_location("sharpness_generalisation_guide", GUIDE)
    guide = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(guide)
    t0 = time.perf_counter()
    summary = guide.main(["--output", str(tmp_path)])
    seconds = time.perf_counter() - t0

    assert summary["settings"]["preset"] == "small"
    assert summary["num_runs"] == 12 and summary["num_diverged"] == 0
    digits = summary["datasets"]["digits"]
    for gap in ("gap_loss", "gap_acc"):
        for measure, c in digits["correlations"][gap].items():
            for method in ("kendall", "spearman"):
                r = c[method]
                assert r["n"] == 12
                assert r["ci_low"] <= r["value"] <= r["ci_high"], (gap, measure, method)
    fit = digits["exponents"]["sr_kfac"]["all"]
    assert fit["n"] == 12 and fit["ci_low"] < fit["exponent"] < fit["ci_high"]
    for opt, cols in digits["optimizers"].items():
        assert cols["test_acc"][0] > 0.5, opt  # every optimizer learned something
    for name in ("study.csv", "summary.json", "study.png"):
        assert os.path.getsize(tmp_path / name) > 0
    with open(tmp_path / "summary.json") as f:
        json.load(f, parse_constant=lambda c: (_ for _ in ()).throw(AssertionError(f"non-JSON {c}")))
    tau = digits["correlations"]["gap_loss"]["sr_kfac"]["kendall"]
    report(f"study guide small mode: {seconds:.0f}s; Kendall tau(S_R K-FAC, loss gap) = "
           f"{tau['value']:.3f} [{tau['ci_low']:.3f}, {tau['ci_high']:.3f}]")
