"""Argument checks of the main job's command line (no training here)."""

import pytest

from keras_geosam import cli


@pytest.mark.parametrize("argv", [
    ["--batch-sizes", "0"], ["--batch-sizes", "16,-4"], ["--batch-sizes", "x"], ["--batch-sizes", ","],
    ["--epochs", "0"], ["--probe-size", "0"], ["--num-probes", "-1"], ["--log-every", "0"], ["--lr", "0"],
    ["--log-budget", "0"], ["--log-budget", "1"],
])
def test_invalid_values_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli._parse(argv)
    assert info.value.code == 2
    assert "error: argument" in capsys.readouterr().err


def test_defaults_parse():
    args = cli._parse([])
    assert args.batch_sizes == [16, 256] and args.epochs == 20 and args.num_probes == 20
    assert cli._parse(["--batch-sizes", "8, 32"]).batch_sizes == [8, 32]


# ----------------------------------------------------------- start-up ----
def test_help_shows_defaults_and_backend_without_importing_keras(tmp_path):
    import os
    import subprocess
    import sys

    env = dict(os.environ, KERAS_BACKEND="torch")
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "keras_geosam", "--help"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = " ".join(proc.stdout.split())
    assert "torch backend (KERAS_BACKEND" in text
    assert "(default: 20)" in text and "(default: 0.05)" in text and "(default: geosam_output)" in text
    assert "keras-geosam study" in text
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    heavy = {m for m in imported if m.split(".")[0] in ("keras", "tensorflow", "jax", "torch")}
    assert not heavy, sorted(heavy)[:5]


def test_backend_that_will_run(monkeypatch, tmp_path):
    monkeypatch.setenv("KERAS_BACKEND", "jax")
    assert cli.backend_that_will_run() == ("jax", "KERAS_BACKEND")
    monkeypatch.delenv("KERAS_BACKEND")
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    assert cli.backend_that_will_run() == ("tensorflow", "Keras' default")
    (tmp_path / "keras.json").write_text('{"backend": "torch"}')
    assert cli.backend_that_will_run() == ("torch", "keras.json")


def test_logging_follows_a_time_budget_unless_log_every_is_given():
    args = cli._parse(["--epochs", "20"])
    assert (args.log_every, args.log_budget) == (None, 0.1)
    assert cli._parse(["--log-budget", "0.25"]).log_budget == 0.25
    args = cli._parse(["--epochs", "20", "--log-every", "2"])
    assert (args.log_every, args.log_budget) == (2, None)


# ------------------------------------------------------------ --data ----
def _npz(path, **overrides):
    import numpy as np

    r = np.random.default_rng(0)
    arrays = dict(
        x_train=r.normal(size=(20, 5)), y_train=np.arange(20) % 3,
        x_test=r.normal(size=(6, 5)), y_test=np.arange(6) % 3,
    )
    arrays.update(overrides)
    arrays = {k: v for k, v in arrays.items() if v is not None}
    np.savez(path, **arrays)
    return str(path)


def test_load_npz_reads_and_converts(tmp_path):
    import numpy as np

    from keras_geosam.datasets import load_npz

    onehot = np.eye(3)[np.arange(6) % 3]
    (x, y), (xt, yt), classes = load_npz(_npz(tmp_path / "d.npz", y_test=onehot))
    assert x.dtype == np.float32 and y.dtype == np.int32 and classes == 3
    assert yt.tolist() == (np.arange(6) % 3).tolist()
    (_, _), (_, yt), classes = load_npz(_npz(tmp_path / "e.npz", y_test=np.full(6, 4), num_classes=5))
    assert classes == 5


def test_load_npz_scales_integer_pixels_and_says_so(tmp_path):
    import numpy as np

    from keras_geosam.datasets import InputScalingWarning
    from keras_geosam.datasets import load_npz

    r = np.random.default_rng(1)
    pixels = r.integers(0, 256, size=(20, 5)).astype("uint8")
    test = r.integers(0, 256, size=(6, 5)).astype("uint8")
    with pytest.warns(InputScalingWarning, match=r"x_train.*uint8.*255"):
        (x, _), (xt, _), _ = load_npz(_npz(tmp_path / "u8.npz", x_train=pixels, x_test=test))
    np.testing.assert_array_equal(x, pixels.astype("float32") / np.float32(255))
    np.testing.assert_array_equal(xt, test.astype("float32") / np.float32(255))
    wide = (pixels.astype("uint16") * 257)  # 16-bit images reach 65535
    with pytest.warns(InputScalingWarning, match="65535"):
        (x, _), _, _ = load_npz(_npz(tmp_path / "u16.npz", x_train=wide, x_test=wide[:6]))
    assert x.max() <= 1.0 and x.min() >= 0.0


def test_load_npz_warns_of_inputs_far_outside_a_sane_range(tmp_path):
    import warnings

    import numpy as np

    from keras_geosam.datasets import InputScalingWarning
    from keras_geosam.datasets import load_npz

    raw = np.random.default_rng(2).uniform(0, 255, size=(6, 5))  # float pixels left unscaled
    with pytest.warns(InputScalingWarning, match="x_test.*magnitude"):
        (x, _), (xt, _), _ = load_npz(_npz(tmp_path / "raw.npz", x_test=raw))
    np.testing.assert_allclose(xt, raw.astype("float32"))  # used as it is
    with warnings.catch_warnings():
        warnings.simplefilter("error", InputScalingWarning)  # standardised data: silent
        load_npz(_npz(tmp_path / "ok.npz"))


@pytest.mark.parametrize("override, words", [
    ({"y_test": None}, ["y_test"]),
    ({"x_train": None}, ["x_train"]),
    ({"y_train": list(range(19))}, ["y_train", "19", "20"]),
    ({"y_test": [0, 1, 2, 0, 1, 7]}, ["y_test", "7", "num_classes"]),
    ({"y_train": [-1] + [1] * 19}, ["y_train", "-1"]),
    ({"y_train": [0.5] * 20}, ["y_train", "integer"]),
    ({"x_test": [[float("nan")] * 5] * 6}, ["x_test", "NaN"]),
    ({"x_test": [[0.0] * 4] * 6}, ["x_train", "x_test", "shape"]),
    ({"y_train": [0] * 20}, ["single class"]),
])
def test_load_npz_errors_name_the_key(tmp_path, override, words):
    from keras_geosam.datasets import load_npz

    path = _npz(tmp_path / "bad.npz", **override)
    with pytest.raises(ValueError) as info:
        load_npz(path)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_main_rejects_a_bad_data_file_before_training(tmp_path):
    path = _npz(tmp_path / "bad.npz", y_train=None)
    with pytest.raises(SystemExit) as info:
        cli.main(["--data", path, "--output", str(tmp_path / "out")])
    assert "y_train" in str(info.value) and "--data" in str(info.value)
    with pytest.raises(SystemExit) as info:
        cli.main(["--data", str(tmp_path / "missing.npz"), "--output", str(tmp_path / "out")])
    assert "missing.npz" in str(info.value)


# ------------------------------------------------------ results.csv ----
def test_results_file_appends_keys_and_drops_a_torn_line(tmp_path):
    path = tmp_path / "results.csv"
    rf = cli.ResultsFile(str(path))
    rf.append({"run": "a", "config": "c1", "test_acc": 0.5})
    rf.append({"run": "b", "config": "c1", "test_acc": 0.25})
    with open(path, "a") as f:
        f.write("c,c1,0.1")  # a kill mid-write: no newline
    again = cli.ResultsFile(str(path))
    assert [r["run"] for r in again.rows] == ["a", "b"]
    assert again.get("b", "c1")["test_acc"] == 0.25 and again.get("b", "c2") is None
    assert path.read_text().endswith("0.25\n")
    with pytest.raises(SystemExit):
        again.append({"run": "c", "other": 1})
    assert cli.ResultsFile(str(path), fresh=True).rows == []


def test_study_command_takes_backend_and_parses_without_keras():
    assert cli._pop_backend(["--smoke", "--backend", "jax", "--fresh"]) == (["--smoke", "--fresh"], "jax")
    assert cli._pop_backend(["--backend=torch"]) == ([], "torch")
    with pytest.raises(SystemExit):
        cli._pop_backend(["--backend", "numpy"])
    with pytest.raises(SystemExit) as info:
        cli.main(["study", "--help"])
    assert info.value.code == 0


def test_main_job_measures_training_data_and_flags_a_dead_network():
    import keras
    import numpy as np

    from keras_geosam import datasets

    args = cli._parse(["--probe-size", "32", "--num-probes", "4"])
    assert args.probe_data == "train" and args.damping == 0.1 and args.min_train_acc is None
    (x, y), (xt, yt), classes = datasets.load("digits")
    from keras_geosam.experiments.models import build_mlp

    model = build_mlp(x.shape[1], classes, seed=0, width=8)
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    for w in model.trainable_weights[:-1]:  # only the output bias lives: chance accuracy
        w.assign(np.zeros(w.shape, w.dtype))
    xp, yp = cli.probe_subset((x, y), (xt, yt), args.probe_size, args.probe_data)
    assert np.array_equal(xp, x[:32])
    row = cli.final_metrics(model, (x, y), (xt, yt), xp, yp, args, classes)
    assert row["note"].startswith("collapsed: train acc") and "dead network" in row["note"]
    assert row["train_acc"] < 0.2
    assert "note" in cli.COLUMNS and "collapsed" in cli.format_table([dict(row, run="r")])


def test_help_states_the_damping_and_probe_data(monkeypatch):
    import argparse

    seen = []
    real = argparse.ArgumentParser.parse_args

    def capture(self, argv=None, namespace=None):
        seen.append(self.format_help())
        return real(self, argv, namespace)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    cli._parse([])
    words = " ".join(seen[0].split())
    assert "(default: 0.1; the library's functions default to 1e-3)" in words
    assert "--probe-data {train,test}" in words and "(default: train)" in words


def test_history_files_are_strict_json_with_null_for_skipped_epochs(tmp_path):
    """An epoch the logger skipped holds NaN in Keras' history: the file
    writes null (bare NaN is not JSON) and reading it back gives NaN."""
    import json
    import math

    path = str(tmp_path / "h" / "history.json")
    cli._write_json(path, {"loss": [0.5, 0.25], "hessian_trace": [3.0, float("nan")]})
    with open(path) as f:
        text = f.read()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert "NaN" not in text and json.loads(text)["hessian_trace"] == [3.0, None]
    back = cli._read_json(path)
    assert back["loss"] == [0.5, 0.25] and back["hessian_trace"][0] == 3.0 and math.isnan(back["hessian_trace"][1])
