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
