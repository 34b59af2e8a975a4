"""The main job (``python -m keras_geosam``) end to end, on the active backend."""

import csv
import math
import os
import subprocess
import sys
import time

import keras
import pytest

from keras_geosam import cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
COMMON = ["--probe-size", "64", "--num-probes", "2"]


def _table(stdout):
    """The printed table: (header cells, data rows as lists of cells)."""
    lines = stdout.splitlines()
    for i, line in enumerate(lines):
        cells = line.split()
        if cells[:2] == ["run", "test_acc"] and i + 1 < len(lines) and set(lines[i + 1].replace(" ", "")) == {"-"}:
            rows = []
            for row in lines[i + 2:]:
                if not row.strip():
                    break
                rows.append(row)
            return line, rows
    raise AssertionError(f"no results table (header starting 'run  test_acc') in the output:\n{stdout}")


def _check_outputs(stdout, out_dir, expected_runs, min_acc):
    header, rows = _table(stdout)
    # Every column the job promises: test accuracy, the S_R estimators, tr H, lambda_max.
    for col in cli.COLUMNS:
        assert col in header, f"column {col!r} missing from the table header {header!r}"
    for col in ("test_acc", "tr H", "lambda_max"):
        assert col in cli.COLUMNS
    assert any(c.startswith("S_R") for c in cli.COLUMNS)
    assert len(rows) == len(expected_runs), rows
    for label, row in zip(expected_runs, rows):
        assert all(part in row for part in label.split()), (label, row)
        assert row.count("±") >= 6, row  # value ± stderr for each estimate

    csv_path = os.path.join(out_dir, "results.csv")
    assert os.path.getsize(csv_path) > 0
    with open(csv_path, newline="") as f:
        records = list(csv.DictReader(f))
    assert len(records) == len(expected_runs)
    for col in cli.COLUMNS:
        assert col in records[0], f"column {col!r} missing from results.csv"
    for rec in records:
        for col in ("test_acc", "tr H", "lambda_max") + tuple(c for c in cli.COLUMNS if c.startswith("S_R")):
            assert math.isfinite(float(rec[col])), (rec["run"], col, rec[col])
        for col in cli.COLUMNS[1:]:
            try:
                value = float(rec[col])
            except ValueError:
                continue  # a non-numeric column
            assert math.isfinite(value), (rec["run"], col, rec[col])
        assert min_acc <= float(rec["test_acc"]) <= 1.0, (rec["run"], rec["test_acc"])
        # every estimate travels with its standard error
        for col in ("tr H", "lambda_max") + tuple(c for c in cli.COLUMNS if c.startswith("S_R") and "/" not in c):
            se = float(rec[col + " stderr"])
            assert math.isfinite(se) and se >= 0, (rec["run"], col, se)
        assert float(rec["lambda_max"]) > 0 and float(rec["tr H"]) > 0, rec

    png = os.path.join(out_dir, "sharpness.png")
    assert os.path.getsize(png) > 1000
    with open(png, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    return records


def test_main_job_subprocess(tmp_path, report):
    """`python -m keras_geosam` as a user runs it: exit status 0, table, files."""
    out = tmp_path / "out"
    env = dict(os.environ, KERAS_BACKEND=keras.backend.backend())
    cmd = [sys.executable, "-m", "keras_geosam", "--epochs", "2", "--output", str(out), "--batch-sizes", "32,256", *COMMON]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420)
    seconds = time.perf_counter() - t0
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-5000:]}"
    assert f"backend={keras.backend.backend()}" in proc.stdout
    records = _check_outputs(proc.stdout, out, ["sgd B=32", "sgd B=256"], min_acc=0.3)
    report(f"{seconds:.1f}s; " + ", ".join(f"{r['run']}: acc {float(r['test_acc']):.4f}" for r in records))


def _in_process(argv, capsys):
    t0 = time.perf_counter()
    code = cli.main(argv)
    seconds = time.perf_counter() - t0
    stdout = capsys.readouterr().out
    assert code in (0, None)
    return stdout, seconds


def test_main_job_mnist1d(tmp_path, capsys, report):
    out = tmp_path / "out"
    stdout, seconds = _in_process(
        ["--dataset", "mnist1d", "--epochs", "1", "--output", str(out), "--batch-sizes", "128", *COMMON], capsys
    )
    assert "dataset=mnist1d" in stdout
    records = _check_outputs(stdout, out, ["mnist1d sgd B=128"], min_acc=0.12)
    report(f"{seconds:.1f}s; " + ", ".join(f"{r['run']}: acc {float(r['test_acc']):.4f}" for r in records))


def test_main_job_two_pass_optimizer(tmp_path, capsys, report):
    from keras_geosam import optimizers  # noqa: F401  (registers two-pass optimizers, if it does)

    if "sam" not in cli.OPTIMIZERS:
        pytest.skip("'sam' is not registered in keras_geosam.cli.OPTIMIZERS; --optimizers sgd,sam is unavailable")
    out = tmp_path / "out"
    stdout, seconds = _in_process(
        ["--optimizers", "sgd,sam", "--epochs", "1", "--output", str(out), "--batch-sizes", "64", *COMMON], capsys
    )
    records = _check_outputs(stdout, out, ["sgd B=64", "sam B=64"], min_acc=0.3)
    report(f"{seconds:.1f}s; " + ", ".join(f"{r['run']}: acc {float(r['test_acc']):.4f}" for r in records))


def test_main_job_rejects_unknown_optimizer(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--optimizers", "no-such-optimizer", "--epochs", "1", "--output", str(tmp_path / "out")])
    assert "no-such-optimizer" in str(info.value)


def _rows_without_timings(path):
    with open(path, newline="") as f:
        return [{k: v for k, v in r.items() if "seconds" not in k} for r in csv.DictReader(f)]


def test_compare_killed_midway_resumes_to_the_same_rows(tmp_path, capsys, monkeypatch):
    """--compare writes each run's row as it finishes; a job killed after the
    first run and started again computes only the rest, and its rows equal
    an uninterrupted job's (timings aside)."""
    argv = ["--compare", "--optimizers", "sgd,sam", "--dataset", "digits", "--batch-sizes", "64",
            "--epochs", "1", "--no-plot", *COMMON]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    cli.main(argv + ["--output", str(whole)])
    capsys.readouterr()

    real_append = cli.ResultsFile.append
    calls = []

    def append_then_die(self, row):
        real_append(self, row)
        calls.append(row["run"])
        raise KeyboardInterrupt  # the kill, right after the first row is on disk

    monkeypatch.setattr(cli.ResultsFile, "append", append_then_die)
    with pytest.raises(KeyboardInterrupt):
        cli.main(argv + ["--output", str(resumed)])
    monkeypatch.setattr(cli.ResultsFile, "append", real_append)
    assert calls == ["digits sgd B=64"]
    assert len(_rows_without_timings(resumed / "results.csv")) == 1

    cli.main(argv + ["--output", str(resumed)])
    out = capsys.readouterr().out
    assert "digits sgd B=64: already in" in out and "digits sam B=64: training" in out
    assert "digits sam B=64 epoch 1: sharpness (" in out  # a line before each logging phase
    assert _rows_without_timings(resumed / "results.csv") == _rows_without_timings(whole / "results.csv")
    _table(out)  # the table lists both runs, the skipped one included
    assert out.count("digits s") >= 2


def test_main_job_on_your_own_npz(tmp_path, capsys):
    import numpy as np

    from keras_geosam import datasets

    (x, y), (xt, yt), _ = datasets.load("digits")
    path = tmp_path / "mine.npz"
    np.savez(path, x_train=x[:400], y_train=y[:400], x_test=xt[:100], y_test=yt[:100])
    stdout, _ = _in_process(["--data", str(path), "--epochs", "1", "--batch-sizes", "32",
                             "--output", str(tmp_path / "out"), "--no-plot", *COMMON], capsys)
    assert "dataset=mine train=400 test=100 classes=10" in stdout
    header, rows = _table(stdout)
    assert len(rows) == 1 and "mine sgd B=32" in rows[0]
