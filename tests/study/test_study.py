"""The sharpness / generalisation study (``keras_geosam.study``) and its guide.

The statistics are checked twice: against ``scipy.stats`` and against
brute-force references written here from the definitions (pair counting for
Kendall's tau-b with ties, average ranks for Spearman's rho), so that the
check does not merely repeat the implementation. The study itself runs in
its seconds-long smoke mode: end to end through the guide, then killed after
its first run and resumed, which must give the same rows.
"""

import csv
import doctest
import importlib.util
import itertools
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import scipy.stats

from keras_geosam import study
from keras_geosam.study import grid
from keras_geosam.study import stats
from locations import GUIDES, REPO

GUIDE = os.path.join(GUIDES, "sharpness_generalisation.py")

# Fixed tables: no ties; ties in both; a reversed order with ties.
TABLES = {
    "no_ties": ([3.1, 0.4, 2.2, 5.0, 1.7, 4.4, 0.9, 3.8, 2.9], [2.0, 0.3, 2.5, 4.1, 0.8, 3.0, 1.9, 4.4, 1.1]),
    "ties": ([1, 2, 2, 3, 3, 3, 4, 5, 5, 6], [2, 1, 2, 3, 5, 3, 4, 4, 6, 5]),
    "reversed": ([1, 2, 3, 4, 4, 5, 6, 7], [9, 7, 7, 6, 5, 5, 2, 1]),
}


# ---------------------------------------------------- brute-force references


def brute_tau_b(x, y):
    """Kendall's tau-b by counting pairs: (C - D) / sqrt((n0 - n1)(n0 - n2))."""
    n = len(x)
    concordant = discordant = tied_x = tied_y = 0
    for i, j in itertools.combinations(range(n), 2):
        dx, dy = np.sign(x[i] - x[j]), np.sign(y[i] - y[j])
        concordant += dx * dy > 0
        discordant += dx * dy < 0
        tied_x += dx == 0
        tied_y += dy == 0
    n0 = n * (n - 1) / 2
    return (concordant - discordant) / math.sqrt((n0 - tied_x) * (n0 - tied_y))


def brute_ranks(v):
    """Average ranks from 1: 1 + #smaller + (#equal - 1) / 2."""
    v = list(v)
    return [1 + sum(u < a for u in v) + (sum(u == a for u in v) - 1) / 2 for a in v]


def brute_rho(x, y):
    """Spearman's rho: Pearson's correlation of the average ranks."""
    rx, ry = brute_ranks(x), brute_ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return num / den


def rho_without_ties(x, y):
    """The textbook rank formula, valid without ties: 1 - 6 sum d^2 / (n (n^2 - 1))."""
    d = np.array(brute_ranks(x)) - np.array(brute_ranks(y))
    n = len(x)
    return 1 - 6 * float(d @ d) / (n * (n * n - 1))


# ---------------------------------------------------------------- statistics


@pytest.mark.parametrize("name", list(TABLES))
def test_kendall_matches_scipy_and_pair_counting(name):
    x, y = TABLES[name]
    tau, p = stats.kendall_tau(x, y)
    ref = scipy.stats.kendalltau(x, y)
    assert tau == pytest.approx(ref.statistic, abs=1e-12)
    assert p == pytest.approx(ref.pvalue, abs=1e-12)
    assert tau == pytest.approx(brute_tau_b(x, y), abs=1e-12)


@pytest.mark.parametrize("name", list(TABLES))
def test_spearman_matches_scipy_and_rank_formula(name):
    x, y = TABLES[name]
    rho, p = stats.spearman_rho(x, y)
    ref = scipy.stats.spearmanr(x, y)
    assert rho == pytest.approx(ref.statistic, abs=1e-12)
    assert p == pytest.approx(ref.pvalue, abs=1e-12)
    assert rho == pytest.approx(brute_rho(x, y), abs=1e-12)
    if name == "no_ties":
        assert rho == pytest.approx(rho_without_ties(x, y), abs=1e-12)


def test_known_values_and_constant_input():
    # tau-b by hand for one swapped pair out of six; rho = 1 - 6*2/(4*15).
    assert stats.kendall_tau([1, 2, 3, 4], [1, 3, 2, 4])[0] == pytest.approx(4 / 6)
    assert stats.spearman_rho([1, 2, 3, 4], [1, 3, 2, 4])[0] == pytest.approx(0.8)
    assert math.isnan(stats.kendall_tau([1, 1, 1], [1, 2, 3])[0])
    with pytest.raises(ValueError, match="same length"):
        stats.kendall_tau([1, 2, 3], [1, 2])


@pytest.mark.parametrize("method", stats.CORRELATION_METHODS)
@pytest.mark.parametrize("name", list(TABLES))
def test_bootstrap_interval_is_seeded_and_contains_the_estimate(method, name):
    x, y = TABLES[name]
    a = stats.correlation(x, y, method, n_resamples=500, seed=3)
    b = stats.correlation(x, y, method, n_resamples=500, seed=3)
    assert a == b
    ref = brute_tau_b(x, y) if method == "kendall" else brute_rho(x, y)
    assert a.value == pytest.approx(ref, abs=1e-12)
    assert a.ci_low <= a.value <= a.ci_high
    assert -1 <= a.ci_low <= a.ci_high <= 1
    assert a.n == len(x) and a.num_dropped == 0


def test_bootstrap_is_paired_percentile():
    """Against an independent resampling of runs (NumPy), with many
    resamples: the percentile ends agree to Monte-Carlo precision. An
    unpaired bootstrap would centre on 0 instead."""
    x, y = (np.array(v, float) for v in TABLES["no_ties"])
    ours = stats.bootstrap_interval(lambda a, b: scipy.stats.spearmanr(a, b).statistic, x, y,
                                    n_resamples=2000, seed=0)
    rng = np.random.default_rng(12345)
    idx = rng.integers(0, len(x), size=(2000, len(x)))
    dist = np.array([scipy.stats.spearmanr(x[i], y[i]).statistic for i in idx])
    dist = dist[np.isfinite(dist)]
    low, high = np.percentile(dist, [2.5, 97.5])
    assert ours.low == pytest.approx(low, abs=0.08)
    assert ours.high == pytest.approx(high, abs=0.08)
    assert ours.low > 0.2  # the table is clearly positively associated


def test_bootstrap_edge_cases():
    # A perfect order: every defined resample has tau = 1.
    c = stats.correlation([1, 2, 3, 4, 5, 6], [2, 4, 6, 8, 10, 12], n_resamples=300)
    assert c.value == pytest.approx(1) and c.ci_low == pytest.approx(1) and c.ci_high == pytest.approx(1)
    # Non-finite pairs are dropped and counted; too few runs: NaN interval.
    c = stats.correlation([1, 2, float("nan"), 4], [1, 2, 3, float("inf")], n_resamples=50)
    assert c.n == 2 and c.num_dropped == 2 and math.isnan(c.ci_low)
    with pytest.raises(ValueError, match="confidence"):
        stats.bootstrap_interval(lambda a, b: 0.0, [1, 2, 3], [1, 2, 3], confidence=1.5)
    with pytest.raises(ValueError, match="method"):
        stats.correlation([1, 2, 3], [1, 2, 3], method="pearson")


def test_correlation_difference():
    x1, x2, y = [1, 2, 3, 4, 5, 6, 7], [7, 6, 5, 4, 3, 2, 1], [1, 3, 2, 4, 5, 7, 6]
    d = stats.correlation_difference(x1, x2, y, n_resamples=300, seed=1)
    assert d["value"] == pytest.approx(2 * brute_tau_b(x1, y))
    assert d["ci_low"] <= d["value"] <= d["ci_high"] and d["ci_low"] > 0
    assert d == stats.correlation_difference(x1, x2, y, n_resamples=300, seed=1)


def test_absolute_correlation_difference_asks_which_measure_ranks_more_strongly():
    # x2 orders y strongly but backwards; x1 weakly forwards. The signed
    # difference favours x1, the |tau| difference favours x2.
    y = [1, 3, 2, 4, 5, 7, 6, 8]
    x1 = [2, 1, 4, 3, 6, 5, 8, 7]
    x2 = [8, 7, 6, 5, 4, 3, 2, 1]
    signed = stats.correlation_difference(x1, x2, y, n_resamples=300, seed=0)
    absolute = stats.correlation_difference(x1, x2, y, n_resamples=300, seed=0, absolute=True)
    t1, t2 = brute_tau_b(x1, y), brute_tau_b(x2, y)
    assert signed["value"] == pytest.approx(t1 - t2) and signed["value"] > 0
    assert absolute["value"] == pytest.approx(abs(t1) - abs(t2)) and absolute["value"] < 0
    assert (absolute["corr1"], absolute["corr2"]) == (pytest.approx(t1), pytest.approx(t2))
    # the interval is the paired bootstrap of |tau1| - |tau2| over the same resampled runs
    a, b, c = (np.asarray(v, "float64") for v in (x1, x2, y))
    ci = stats.bootstrap_interval(lambda p, q, r: abs(brute_tau_b(p, r)) - abs(brute_tau_b(q, r)), a, b, c,
                                  n_resamples=300, seed=0)
    assert (absolute["ci_low"], absolute["ci_high"]) == (pytest.approx(ci.low), pytest.approx(ci.high))
    words = stats.describe_comparison("sr_kfac - trace_h", absolute, "gap_loss")
    if absolute["ci_high"] < 0:
        assert words.startswith("tr H ranks the runs by the gap more strongly") and "negative direction" in words


def _table_with_collapsed_runs():
    rng = np.random.default_rng(3)
    rows = []
    for i in range(10):
        rows.append({"dataset": "d", "optimizer": "sgd" if i % 2 else "sam", "b_over_eta": 10.0 * (i + 1),
                     "sr_kfac": float(i + 1 + rng.normal(0, 0.3)), "trace_h": float(5 - i + rng.normal()),
                     "gap_loss": float(i + rng.normal(0, 1.5)), "test_acc": 0.9, "train_acc": 0.95, "valid": 1})
    for i in range(4):  # collapsed: S_R at the count of live parameters, huge B/eta
        rows.append({"dataset": "d", "optimizer": "sgd", "b_over_eta": 1e4, "sr_kfac": 9.0, "trace_h": 0.5,
                     "gap_loss": 0.0, "test_acc": 0.1, "train_acc": 0.1, "valid": 0})
    return rows


def test_summarize_leaves_collapsed_runs_out_of_every_statistic():
    rows = _table_with_collapsed_runs()
    kw = dict(measures=["sr_kfac", "trace_h"], gaps=["gap_loss"], n_resamples=200)
    with_collapsed = stats.summarize(rows, **kw)["d"]
    valid_only = stats.summarize([r for r in rows if r["valid"]], **kw)["d"]
    assert with_collapsed["n_invalid"] == 4 and valid_only["n_invalid"] == 0
    assert with_collapsed["n_runs"] == valid_only["n_runs"] == 10
    for key in ("correlations", "comparisons", "exponents", "optimizers"):
        assert with_collapsed[key] == valid_only[key], key
    # and the collapsed runs would have changed the answer
    everything = stats.summarize([dict(r, valid=1) for r in rows], **kw)["d"]
    assert everything["exponents"]["sr_kfac"] != valid_only["exponents"]["sr_kfac"]


def test_exponent_table_has_one_row_per_optimizer_and_all_only_with_several():
    rows = [r for r in _table_with_collapsed_runs() if r["valid"]]
    kw = dict(measures=["sr_kfac"], gaps=["gap_loss"], n_resamples=50)
    several = stats.summarize(rows, **kw)["d"]["exponents"]["sr_kfac"]
    assert set(several) == {"sgd", "sam", "all"}
    one = stats.summarize([r for r in rows if r["optimizer"] == "sgd"], **kw)["d"]["exponents"]["sr_kfac"]
    assert set(one) == {"sgd"} and one["sgd"] == several["sgd"]


B_ETA = np.array([80.0, 160, 320, 640, 1280, 2560, 80, 320, 1280, 5120])


def test_exponent_exact_on_a_noiseless_power_law():
    fit = stats.fit_exponent(B_ETA, 2.5 * B_ETA**0.8, n_resamples=200)
    assert fit.exponent == pytest.approx(0.8, abs=1e-12)
    assert fit.prefactor == pytest.approx(2.5, rel=1e-10)
    assert fit.stderr < 1e-12 and fit.r_squared == pytest.approx(1.0)
    assert fit.ci_low == pytest.approx(0.8, abs=1e-10) and fit.ci_high == pytest.approx(0.8, abs=1e-10)
    assert fit.boot_low == pytest.approx(0.8, abs=1e-10) and fit.boot_high == pytest.approx(0.8, abs=1e-10)


def test_exponent_interval_on_a_noisy_table():
    noise = np.array([0.21, -0.13, 0.05, -0.27, 0.18, -0.02, -0.15, 0.24, -0.09, 0.11])
    y = 2.5 * B_ETA**0.8 * np.exp(noise)
    fit = stats.fit_exponent(y=y, x=B_ETA, n_resamples=1000, seed=0)
    assert fit.ci_low < 0.8 < fit.ci_high
    assert fit.boot_low < 0.8 < fit.boot_high
    # The t interval, from the regression formulas written out.
    lx, ly = np.log(B_ETA), np.log(y)
    slope, intercept = np.polyfit(lx, ly, 1)
    resid = ly - (slope * lx + intercept)
    se = math.sqrt(resid @ resid / (len(lx) - 2) / ((lx - lx.mean()) @ (lx - lx.mean())))
    t = scipy.stats.t.ppf(0.975, len(lx) - 2)
    assert fit.exponent == pytest.approx(slope, abs=1e-12)
    assert fit.stderr == pytest.approx(se, rel=1e-9)
    assert (fit.ci_low, fit.ci_high) == pytest.approx((slope - t * se, slope + t * se), rel=1e-9)
    assert stats.fit_exponent(B_ETA, y, n_resamples=1000, seed=0) == fit


def test_exponent_degenerate_inputs():
    two = stats.fit_exponent([10, 100], [1, 10], n_resamples=20)
    assert two.exponent == pytest.approx(1.0) and math.isnan(two.stderr) and math.isnan(two.ci_low)
    assert math.isnan(stats.fit_exponent([5, 5, 5], [1, 2, 3]).exponent)
    dropped = stats.fit_exponent([1, 2, 4, -1, 8], [1, 2, 4, 3, 0], n_resamples=20)
    assert dropped.num_dropped == 2 and dropped.n == 3 and dropped.exponent == pytest.approx(1.0)


def test_mean_sem():
    m, se, n = stats.mean_sem([1.0, 2.0, float("nan"), 4.0])
    assert (m, n) == (pytest.approx(7 / 3), 3)
    assert se == pytest.approx(np.std([1, 2, 4], ddof=1) / math.sqrt(3))
    assert math.isnan(stats.mean_sem([3.0])[1])


def test_summarize_groups_by_dataset_and_drops_nan():
    rng = np.random.default_rng(0)
    rows = []
    for dataset, sign in (("a", 1), ("b", -1)):
        for i in range(8):
            rows.append({"dataset": dataset, "optimizer": "sgd" if i % 2 else "sam", "b_over_eta": 10.0 * (i + 1),
                         "sr_kfac": float(i + 1 + rng.normal(0, 0.1)), "trace_h": float(rng.normal()),
                         "gap_loss": sign * (i + rng.normal(0, 2)), "test_acc": 0.9})
    rows[3]["trace_h"] = float("nan")
    out = stats.summarize(rows, measures=["sr_kfac", "trace_h"], gaps=["gap_loss"], n_resamples=100)
    assert set(out) == {"a", "b"}
    for dataset in out:
        sub = [r for r in rows if r["dataset"] == dataset]
        x = [r["sr_kfac"] for r in sub]
        y = [r["gap_loss"] for r in sub]
        got = out[dataset]["correlations"]["gap_loss"]["sr_kfac"]
        assert got["kendall"]["value"] == pytest.approx(brute_tau_b(x, y))
        assert got["spearman"]["value"] == pytest.approx(brute_rho(x, y))
        assert out[dataset]["optimizers"]["sgd"]["test_acc"][2] == 4
        assert "sr_kfac - trace_h" in out[dataset]["comparisons"]["gap_loss"]
        assert out[dataset]["exponents"]["sr_kfac"]["all"]["n"] == 8
    assert out["a"]["correlations"]["gap_loss"]["trace_h"]["kendall"]["n"] == 7


def test_docstring_examples():
    for module in (stats, grid, study):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, module.__name__


# -------------------------------------------------------- the study itself


def _raw_rows(path):
    """The CSV's rows as strings, without the wall-time columns."""
    with open(path, newline="") as f:
        return [{k: v for k, v in r.items() if k not in grid.TIMING_FIELDS} for r in csv.DictReader(f)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The guide in smoke mode: an uninterrupted study."""
    spec = importlib.util.spec_from_file_location("sharpness_generalisation_guide", GUIDE)
    guide = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(guide)
    out = str(tmp_path_factory.mktemp("study_reference"))
    summary = guide.main(["--smoke", "--output", out])
    return out, summary


def test_guide_smoke_writes_csv_summary_and_figure(reference):
    out, summary = reference
    rows = _raw_rows(os.path.join(out, grid.CSV_NAME))
    assert len(rows) == len(grid.grid_runs(grid.resolve_settings("smoke"), ["digits"])) == 4
    assert all(r["complete"] == "1" and r["diverged"] == "0" for r in rows)
    for r in rows:
        for m in ("sr_kfac", "sr_diag", "trace_h", "lambda_max", "lambda_max_r"):
            assert float(r[m]) > 0 and float(r[m + "_stderr"]) >= 0
        assert float(r["gap_loss"]) == pytest.approx(float(r["test_loss"]) - float(r["train_loss"]))
    # Strict JSON: undefined numbers are null, not NaN.
    with open(os.path.join(out, grid.SUMMARY_NAME)) as f:
        strict = json.load(f, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert strict == summary and strict["num_runs"] == 4
    corr = strict["datasets"]["digits"]["correlations"]["gap_loss"]["sr_kfac"]["kendall"]
    assert corr["n"] == 4 and -1 <= corr["value"] <= 1
    with open(os.path.join(out, grid.FIGURE_NAME), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_interrupted_and_resumed_study_gives_the_same_rows(reference, tmp_path):
    """The SGD half of the smoke grid, stopped after its first run and
    resumed: its rows equal the uninterrupted reference's rows for the same
    runs (a run's row depends on nothing that ran before it)."""
    ref_out, _ = reference
    out = str(tmp_path)
    path = os.path.join(out, grid.CSV_NAME)

    def stop(row, index, total):
        raise study.StudyInterrupted("stopped after the first run")

    with pytest.raises(study.StudyInterrupted):
        study.run_study(out, "smoke", optimizers=("sgd",), on_run=stop, verbose=0, plot=False)
    assert len(study.read_rows(path)) == 1
    # Resume through the command-line entry point.
    assert study.main(["--smoke", "--optimizers", "sgd", "--output", out, "--quiet", "--no-plot"]) == 0
    expected = [r for r in _raw_rows(os.path.join(ref_out, grid.CSV_NAME)) if r["optimizer"] == "sgd"]
    assert len(expected) == 2
    assert _raw_rows(path) == expected

    # A kill during a write leaves a cut-off line: it is dropped and redone.
    with open(path) as f:
        lines = f.readlines()
    with open(path, "w") as f:
        f.writelines(lines[:-1] + [lines[-1][: len(lines[-1]) // 2]])
    result = study.run_study(out, "smoke", optimizers=("sgd",), verbose=0, plot=False)
    assert (result.num_run, result.num_skipped) == (1, 1)
    assert _raw_rows(path) == expected


def test_other_settings_are_refused(reference, tmp_path):
    ref_out, _ = reference
    for name in (grid.CSV_NAME, grid.CONFIG_NAME):
        shutil.copy(os.path.join(ref_out, name), tmp_path / name)
    with pytest.raises(ValueError, match="epochs"):
        study.run_study(str(tmp_path), "smoke", epochs=2, verbose=0)


def test_settings_validation():
    with pytest.raises(ValueError, match="preset"):
        study.resolve_settings("huge")
    with pytest.raises(ValueError, match="optimizer"):
        study.resolve_settings("smoke", optimizers=("sgd", "adamw-sam"))
    with pytest.raises(ValueError, match="setting"):
        study.resolve_settings("smoke", epoch=3)
    s = study.resolve_settings("smoke", learning_rates="0.1,0.2", batch_sizes=(8,))
    assert s["learning_rates"] == (0.1, 0.2) and s["batch_sizes"] == (8,)


def test_parser_and_help_without_keras():
    args = study.build_parser().parse_args(["--full", "--lrs", "0.1,0.3", "--seeds", "1,2"])
    assert (args.preset, args.learning_rates, args.seeds) == ("full", (0.1, 0.3), (1, 2))
    with pytest.raises(SystemExit):
        study.build_parser().parse_args(["--smoke", "--full"])
    # `python -m keras_geosam.study --help` answers before Keras is imported.
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "keras_geosam.study", "--help"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--batch-sizes" in proc.stdout
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line]
    assert not any(name == "keras" or name.startswith("keras.") for name in imported)


def test_sharpness_is_measured_on_training_examples_by_default():
    """``probe_data="train"`` (the default) measures the first probe_size
    training examples: the row equals kg.sharpness called by hand on them."""
    import keras

    from keras_geosam import sharpness as S
    from keras_geosam.experiments.data import probe_subset

    settings = grid.resolve_settings("smoke")
    assert settings["probe_data"] == "train"
    (x, y), (xt, yt), classes = grid.load_study_data("digits")
    x, y = x[:256], y[:256]
    model = grid.build_model(x.shape[1], classes, seed=0, width=16)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    model.fit(x, y, batch_size=32, epochs=3, verbose=0)
    probe = probe_subset((x, y), (xt, yt), settings["probe_size"], settings["probe_data"])
    assert np.array_equal(probe[0], x[: settings["probe_size"]])
    row = grid.measure_run(model, (x, y), (xt, yt), probe, settings, 32, 0.1, seed=0, num_classes=classes)
    by_hand = S.riemannian_sharpness(model, x[:48], y[:48], structure="kfac", damping=settings["damping"],
                                     num_probes=settings["num_probes"], seed=0)
    assert row["sr_kfac"] == pytest.approx(float(by_hand.value), rel=1e-6)
    tr = S.hessian_trace(model, x[:48], y[:48], num_probes=settings["num_probes"], seed=0)
    assert row["trace_h"] == pytest.approx(float(tr.value), rel=1e-6)
    assert row["valid"] == 1 and row["invalid_reason"] == ""
    # B >= the alignment subset is still measured (the subset grows to 4 batches)
    big = grid.measure_run(model, (x, y), (xt, yt), probe, dict(settings, alignment_size=64), 128, 0.1, seed=0,
                           num_classes=classes)
    assert math.isfinite(big["align_cosine"]) and big["align_note"] == ""
    full = grid.measure_run(model, (x, y), (xt, yt), probe, settings, 256, 0.1, seed=0, num_classes=classes)
    assert math.isnan(full["align_cosine"]) and full["align_note"].startswith("full batch")


def test_a_collapsed_run_is_flagged_invalid():
    settings = grid.resolve_settings("smoke")
    (x, y), (xt, yt), classes = grid.load_study_data("digits")
    model = grid.build_model(x.shape[1], classes, seed=0, width=16)
    import keras

    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    for w in model.trainable_weights[:-1]:  # a dead network: only the output bias lives
        w.assign(np.zeros(w.shape, w.dtype))
    row = grid.measure_run(model, (x[:256], y[:256]), (xt, yt), (x[:48], y[:48]), settings, 32, 0.05, seed=0,
                           num_classes=classes)
    assert row["valid"] == 0 and row["invalid_reason"].startswith("collapsed: train acc")
    assert row["diverged"] == 0


def test_label_noise_is_an_axis_of_the_grid_with_its_own_statistics(tmp_path):
    result = study.run_study(str(tmp_path), "smoke", optimizers=("sgd",), batch_sizes=(32,), label_noises=(0.0, 0.4),
                             plot=False, verbose=0)
    by_noise = {r["label_noise"]: r for r in result.rows}
    assert set(by_noise) == {0.0, 0.4}
    assert by_noise[0.0]["label_noise_changed"] == 0.0
    assert by_noise[0.4]["label_noise_changed"] == round(0.4 * 256) / 256  # the fraction actually changed
    assert set(result.summary["datasets"]) == {"digits", "digits, label noise 0.4"}
    # the noisy run trained on other labels: another train loss, the same test set
    assert by_noise[0.4]["train_loss"] != by_noise[0.0]["train_loss"]
    (x, y), (xt, yt), classes = grid.load_study_data("digits")
    from keras_geosam.experiments.data import symmetric_label_noise

    noisy, changed = symmetric_label_noise(y[:256], 0.4, classes, seed=0)
    assert changed == by_noise[0.4]["label_noise_changed"] and np.mean(noisy != y[:256]) == changed


def test_trajectory_logs_sharpness_along_training_and_ends_at_the_final_row(tmp_path):
    from keras_geosam.study import trajectory

    result = study.run_study(str(tmp_path), "smoke", optimizers=("sgd",), batch_sizes=(32, 128), trajectory=True,
                             trajectory_points=3, verbose=0)
    points = trajectory.read_rows(os.path.join(str(tmp_path), trajectory.CSV_NAME))
    for row in result.rows:
        mine = sorted((p for p in points if grid.run_key(p) == grid.run_key(row)), key=lambda p: p["step"])
        assert 2 <= len(mine) <= 4, mine
        last = mine[-1]
        assert last["step"] == row["steps"] == 24 and last["epoch"] == row["epochs_run"]
        # the last point is taken at the final weights, on the same probe, as the row
        for col in ("sr_kfac", "trace_h", "lambda_max", "lambda_max_r"):
            assert last[col] == pytest.approx(row[col], rel=1e-5), col
            assert all(math.isfinite(p[col]) and p[col + "_stderr"] >= 0 for p in mine)
    with open(os.path.join(str(tmp_path), trajectory.FIGURE_NAME), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
