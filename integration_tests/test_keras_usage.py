"""Switching SGD for a two-pass optimizer leaves ordinary Keras usage as is."""

import keras
import pytest

import keras_geosam as kg


def test_evaluate_and_validation_logs_match_plain_keras(digits, mlp):
    (x_tr, y_tr), (x_te, y_te), classes = digits
    model = mlp(x_tr.shape[1], classes, width=32, seed=0)
    model.compile(
        optimizer=kg.optimizers.SAM(keras.optimizers.SGD(0.05, momentum=0.9), rho=0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    hist = model.fit(x_tr, y_tr, batch_size=256, epochs=1, verbose=0, validation_data=(x_te, y_te))
    # What a plain keras.Sequential with SGD gives for the same compile():
    loss, acc = model.evaluate(x_te, y_te, batch_size=len(x_te), verbose=0)
    assert 0.0 <= acc <= 1.0 and loss > 0
    assert sorted(k for k in hist.history if k.startswith("val_")) == ["val_accuracy", "val_loss"]
