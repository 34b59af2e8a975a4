"""Warnings point at the user's line, not at keras_geosam's or Keras' own.

Each warning is raised at some depth inside the package (and, for a
callback's, inside Keras' ``fit``); ``_checks.warn_at_caller`` attributes it
to the first frame outside both, so the file Python reports is this one.
"""

import warnings

import keras
import numpy as np

import keras_geosam as kg


def _relu_classifier():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(24, 4)).astype("float32")
    y = rng.integers(0, 3, size=24)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="relu"), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, x, y


def test_a_sharpness_warning_points_at_the_call():
    model, x, y = _relu_classifier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kg.sharpness.riemannian_sharpness(model, x, y, damping=0.0)  # the piecewise-linear caveat
    degenerate = [w for w in caught if "piecewise linear" in str(w.message)]
    assert degenerate, [str(w.message) for w in caught]
    assert all(w.filename == __file__ for w in degenerate), [w.filename for w in degenerate]


def test_a_probe_budget_warning_points_at_the_call():
    model, x, y = _relu_classifier()
    tanh = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(3)])
    tanh.compile(loss=model.loss)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kg.sharpness.hessian_trace(tanh, x, y, num_probes=2, rtol=1e-9, max_probes=4)
    missed = [w for w in caught if "rtol" in str(w.message)]
    assert missed and all(w.filename == __file__ for w in missed), [(w.filename, str(w.message)[:60]) for w in caught]


def test_a_callback_warning_points_at_the_fit_call():
    model, x, y = _relu_classifier()
    tanh = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(3)])
    tanh.compile(optimizer=keras.optimizers.SGD(0.1), loss=model.loss)
    logger = kg.callbacks.SharpnessLogger(x, y, metrics=("hessian_trace",), every_n_epochs=1, num_probes=2, rtol=1e-9,
                                          max_probes=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tanh.fit(x, y, epochs=1, batch_size=8, verbose=0, callbacks=[logger])
    said = [w for w in caught if "SharpnessLogger" in str(w.message)]
    assert said and all(w.filename == __file__ for w in said), [(w.filename, str(w.message)[:60]) for w in caught]
