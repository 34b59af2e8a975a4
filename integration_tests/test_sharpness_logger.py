"""SharpnessLogger inside a real fit, recorded by CSVLogger and History."""

import csv
import math

import keras
import numpy as np
import pytest

import keras_geosam as kg

METRICS = ("hessian_trace", "lambda_max", "riemannian_sharpness", "riemannian_sharpness_kfac")
EPOCHS = 2


@pytest.mark.parametrize("optimizer", ["sgd", "sam"])
def test_sharpness_logger_with_csv_logger(optimizer, digits, mlp, tmp_path, report):
    (x_tr, y_tr), (x_te, y_te), classes = digits
    base = keras.optimizers.SGD(0.05, momentum=0.9)
    opt = base if optimizer == "sgd" else kg.optimizers.SAM(base, rho=0.05)
    model = mlp(x_tr.shape[1], classes, width=64, seed=0)
    model.compile(
        optimizer=opt,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    logger = kg.callbacks.SharpnessLogger(
        x_te[:64], y_te[:64], metrics=METRICS, every_n_epochs=1, num_probes=2, seed=0,
        options={"riemannian_sharpness": {"damping": 0.1}},
    )
    csv_path = tmp_path / "log.csv"
    # The logger must come before the loggers that record its keys.
    hist = model.fit(
        x_tr, y_tr, batch_size=64, epochs=EPOCHS, verbose=0, validation_data=(x_te, y_te),
        callbacks=[logger, keras.callbacks.CSVLogger(str(csv_path))],
    )

    keys = logger.keys()
    for name in METRICS:
        assert name in keys and name + "_stderr" in keys
    assert "riemannian_sharpness_normalized" in keys

    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == list(range(EPOCHS))
    for row in rows:
        for key in keys:
            assert key in row, f"{key} missing from the CSVLogger columns {sorted(row)}"
            assert math.isfinite(float(row[key])), (row["epoch"], key, row[key])
        assert math.isfinite(float(row["loss"])) and math.isfinite(float(row["val_accuracy"]))
    for key in keys:
        values = hist.history[key]
        assert len(values) == EPOCHS and np.all(np.isfinite(values)), (key, values)
    for name in ("hessian_trace", "lambda_max"):
        assert all(v > 0 for v in hist.history[name]), (name, hist.history[name])
        assert all(s >= 0 for s in hist.history[name + "_stderr"])
    # CSV and History agree, and match the logger's own record.
    assert [e for e, _ in logger.history] == list(range(EPOCHS))
    for (epoch, values), row in zip(logger.history, rows):
        for key, value in values.items():
            assert float(row[key]) == pytest.approx(value, rel=1e-6, abs=1e-9)
    last = rows[-1]
    report(
        f"epoch {last['epoch']}: val_acc {float(last['val_accuracy']):.4f} "
        + " ".join(f"{m}={float(last[m]):.4g}" for m in METRICS)
    )
