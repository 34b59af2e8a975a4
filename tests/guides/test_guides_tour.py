"""The guide ``guides/sharpness_tour.py`` end to end (its small default mode,
~30 s), and the facts it shows."""

import json
import sys

import pytest
from locations import GUIDES

sys.path.insert(0, GUIDES)


@pytest.fixture(scope="module")
def tour(tmp_path_factory):
    import sharpness_tour

    path = str(tmp_path_factory.mktemp("tour") / "tour.json")
    sharpness_tour.main(["--output", path])
    with open(path) as f:
        return json.load(f)


def test_operator_identity_and_exact_relu_sharpness(tour):
    assert tour["operator_identity_max_abs"] < 1e-5
    for metric in ("diagonal", "kfac"):
        value, stderr, exact = tour[f"sr_relu_{metric}"]
        assert stderr == 0.0 and value == exact
        value, stderr, exact = tour[f"sr_tanh_{metric}"]
        assert stderr > 0 and value != exact


def test_degeneracy_and_damping(tour):
    assert tour["warned"] and tour["degenerate_value"] == pytest.approx(tour["nonzero_fisher"], rel=1e-5)
    assert tour["sr_relu_damping_0"] > tour["sr_relu_damping_0.001"] > tour["sr_relu_damping_0.1"]


def test_rescaling_changes_euclidean_but_not_riemannian(tour):
    before, after = tour["invariance_before"], tour["invariance_after"]
    for key in ("trace", "lambda_max"):
        assert max(after[key] / before[key], before[key] / after[key]) > 5
    for key in ("sr_kfac", "riemannian_lambda_max"):
        assert after[key] == pytest.approx(before[key], rel=1e-3)
