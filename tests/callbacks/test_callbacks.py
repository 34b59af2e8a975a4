"""Tests of keras_geosam.callbacks.SharpnessLogger inside `model.fit`.

The logged numbers are checked against direct calls of the sharpness
functions at the same weights and seed (those functions are checked against
explicit matrices in test_sharpness.py); float32 models, relative 1e-6.
"""

import csv
import glob
import math
import os
import warnings

import keras
import numpy as np
import pytest

from reference.dtypes import keras_dtype

import keras_geosam as kg
from keras_geosam import sharpness as ks
from keras_geosam.callbacks import SharpnessLogger

N, D, K = 32, 4, 3
TOL = 1e-6


@pytest.fixture(autouse=True)
def _float32():
    with keras_dtype("float32"):
        yield


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, D)).astype("float32")
    y = (rng.integers(0, K, size=N)).astype("int32")
    return x, y


def _model(lr=0.05, seed=0, activation="relu"):
    model = keras.Sequential(
        [keras.Input((D,)), keras.layers.Dense(8, activation=activation), keras.layers.Dense(K)]
    )
    rng = np.random.default_rng(seed)
    for v in model.trainable_variables:
        v.assign(0.5 * rng.normal(size=v.shape))
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=lr),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


KEYS = [
    "hessian_trace",
    "hessian_trace_stderr",
    "riemannian_sharpness",
    "riemannian_sharpness_stderr",
    "riemannian_sharpness_normalized",
]
# Each split measure's two parts, with their standard errors.
KEYS = KEYS[:2] + [f"hessian_trace_{p}" for p in ("ggn", "ggn_stderr", "residual", "residual_stderr")] + KEYS[2:] + [
    f"riemannian_sharpness_{p}" for p in ("ggn", "ggn_stderr", "residual", "residual_stderr")]


def test_history_keys_and_values_match_direct_calls():
    x, y = _data()
    model = _model(activation="tanh")  # smooth: probes are drawn, so num_probes and seed matter
    logger = SharpnessLogger(x, y, metrics=("hessian_trace", "riemannian_sharpness"), num_probes=4, seed=3)
    assert logger.keys() == KEYS
    hist = model.fit(x, y, epochs=2, batch_size=16, verbose=0, callbacks=[logger])
    for k in KEYS:
        assert k in hist.history and len(hist.history[k]) == 2
        assert all(np.isfinite(hist.history[k]))
    # the last epoch's values were taken at the final weights
    tr = ks.hessian_trace(model, x, y, num_probes=4, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        sr = ks.riemannian_sharpness(model, x, y, num_probes=4, seed=3)
    assert _rel(hist.history["hessian_trace"][-1], tr.value) < TOL
    assert _rel(hist.history["hessian_trace_stderr"][-1], tr.stderr) < TOL
    assert _rel(hist.history["riemannian_sharpness"][-1], sr.value) < TOL
    assert _rel(hist.history["riemannian_sharpness_stderr"][-1], sr.stderr) < TOL
    assert _rel(hist.history["riemannian_sharpness_normalized"][-1], sr.info["normalized"]) < TOL
    assert hist.history["hessian_trace_stderr"][-1] > 0 and hist.history["riemannian_sharpness_stderr"][-1] > 0
    # the weights moved, and so did the logged trace
    assert hist.history["hessian_trace"][0] != hist.history["hessian_trace"][1]
    assert [e for e, _ in logger.history] == [0, 1]


def test_piecewise_linear_warning_not_raised_during_fit():
    x, y = _data()
    model = _model()
    # damping 0 on a ReLU net: the call itself warns (checked), the logger not.
    with pytest.warns(UserWarning, match="piecewise linear"):
        ks.riemannian_sharpness(model, x, y, damping=0.0)
    logger = SharpnessLogger(x, y, metrics="riemannian_sharpness", num_probes=2, options={"riemannian_sharpness": {"damping": 0.0}})
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        model.fit(x, y, epochs=1, verbose=0, callbacks=[logger])
    assert not [w for w in rec if "piecewise linear" in str(w.message)]


def test_other_metrics_and_options():
    x, y = _data()
    model = _model()
    logger = SharpnessLogger(
        x,
        y,
        metrics=("lambda_max", "riemannian_sharpness", "riemannian_sharpness_kfac"),
        num_probes=3,
        seed=1,
        prefix="s/",
        options={"riemannian_sharpness": {"damping": 1e-3}, "lambda_max": {"max_iter": 10}},
    )
    hist = model.fit(x, y, epochs=1, verbose=0, callbacks=[logger])
    lam = ks.hessian_max_eigenvalue(model, x, y, max_iter=10, seed=1)
    sr = ks.riemannian_sharpness(model, x, y, damping=1e-3, num_probes=3, seed=1)
    kf = ks.riemannian_sharpness(model, x, y, structure="kfac", num_probes=3, seed=1)
    assert _rel(hist.history["s/lambda_max"][0], lam.value) < TOL
    assert _rel(hist.history["s/riemannian_sharpness"][0], sr.value) < TOL
    assert _rel(hist.history["s/riemannian_sharpness_kfac"][0], kf.value) < TOL
    assert "s/riemannian_sharpness_kfac_normalized" in hist.history
    assert SharpnessLogger.available() == sorted(
        ["hessian_trace", "lambda_max", "riemannian_sharpness", "riemannian_sharpness_kfac", "riemannian_sharpness_exact",
         "riemannian_lambda_max", "riemannian_lambda_max_kfac"]
    )


def test_every_n_epochs_writes_nan_on_skipped_epochs(tmp_path):
    x, y = _data()
    model = _model()
    logger = SharpnessLogger(x, y, metrics="hessian_trace", every_n_epochs=2, num_probes=2)
    path = str(tmp_path / "log.csv")
    hist = model.fit(x, y, epochs=4, verbose=0, callbacks=[logger, keras.callbacks.CSVLogger(path)])
    values = hist.history["hessian_trace"]
    assert math.isnan(values[0]) and math.isnan(values[2])
    assert np.isfinite(values[1]) and np.isfinite(values[3])
    assert math.isnan(hist.history["hessian_trace_stderr"][0])
    assert [e for e, _ in logger.history] == [1, 3]
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4
    assert rows[0]["hessian_trace"].lower() == "nan"
    assert float(rows[1]["hessian_trace"]) == pytest.approx(values[1], rel=TOL)


def _fake_clock_fit(logger, epochs, epoch_seconds, log_seconds, initial_epoch=0, first_compile=0.0):
    """Fits with a fake clock: each epoch's training takes `epoch_seconds`,
    each log `log_seconds` (a list: the first log's, then each later one's),
    of which the first log spends `first_compile` compiling; returns the
    logged epochs and the clock at each log's end."""
    t, compiled = [0.0], [0.0]
    costs = list(log_seconds)
    ends = []
    logger._clock = lambda: t[0]
    logger._compile_clock = lambda: compiled[0]

    def compute():
        t[0] += costs.pop(0) if len(costs) > 1 else costs[0]
        compiled[0] += first_compile if not ends else 0.0
        ends.append(t[0])
        return {k: 1.0 for k in logger.keys()}

    logger.compute = compute
    x, y = _data()
    tick = keras.callbacks.LambdaCallback(on_epoch_begin=lambda e, logs: t.__setitem__(0, t[0] + epoch_seconds))
    hist = _model().fit(x, y, epochs=epochs, initial_epoch=initial_epoch, verbose=0, callbacks=[logger, tick])
    logged = [e for e, _ in logger.history]
    values = hist.history["hessian_trace"]
    assert [i + initial_epoch for i, v in enumerate(values) if not math.isnan(v)] == logged  # NaN rows elsewhere
    return logged, ends, t[0]


def test_the_budget_logs_the_first_and_last_epochs_and_spaces_the_rest():
    """Epochs of 1 s, logs of 3 s, budget 0.5. Epoch 0 logs (t = 4, spent 3).
    A log at epoch k's end keeps spent + 3 <= 0.5 (elapsed + 3): next at
    elapsed 9 (epoch 5), then every 3 epochs; epoch 19 is the last."""
    x, y = _data()
    logger = SharpnessLogger(x, y, metrics="hessian_trace", budget=0.5)
    logged, ends, total = _fake_clock_fit(logger, 20, 1.0, [3.0])
    assert logged == [0, 5, 8, 11, 14, 17, 19]
    # Every log but the forced first and last keeps the logger within budget.
    for i, end in enumerate(ends[1:-1], start=2):
        assert 3.0 * i <= 0.5 * end + 1e-9
    assert logger._spent == pytest.approx(3.0 * len(logged))


def test_a_first_log_that_compiles_and_a_small_budget():
    x, y = _data()
    # The first log costs 10 s, 8 of them compiling; later ones 2 s; budget
    # 0.25: spent 10 + 2 <= 0.25 (elapsed + 2) needs elapsed >= 46 (epoch
    # 35), then spent + 2 <= 0.25 (elapsed + 2) every 6 epochs (elapsed + 8).
    logger = SharpnessLogger(x, y, metrics="hessian_trace", budget=0.25)
    logged, _, _ = _fake_clock_fit(logger, 50, 1.0, [10.0, 2.0], first_compile=8.0)
    assert logged == [0, 35, 41, 47, 49]
    # Without the compilation known, the next log is assumed to cost 10 s.
    logger = SharpnessLogger(x, y, metrics="hessian_trace", budget=0.25)
    assert _fake_clock_fit(logger, 50, 1.0, [10.0, 2.0])[0] == [0, 49]
    logger = SharpnessLogger(x, y, metrics="hessian_trace", budget=0.05)
    assert _fake_clock_fit(logger, 12, 1.0, [3.0])[0] == [0, 11]
    # A resumed fit: its first epoch is initial_epoch.
    logger = SharpnessLogger(x, y, metrics="hessian_trace", budget=0.05)
    assert _fake_clock_fit(logger, 12, 1.0, [3.0], initial_epoch=4)[0] == [4, 11]


def test_every_n_epochs_or_no_budget_ignore_the_clock(capsys):
    x, y = _data()
    logger = SharpnessLogger(x, y, metrics="hessian_trace", every_n_epochs=3, budget=0.01)
    assert _fake_clock_fit(logger, 7, 1.0, [100.0])[0] == [2, 5]
    logger = SharpnessLogger(x, y, metrics="hessian_trace", budget=None)
    assert _fake_clock_fit(logger, 4, 1.0, [100.0])[0] == [0, 1, 2, 3]
    # verbose=1 says once why epochs are skipped and what a log costs.
    logger = SharpnessLogger(x, y, metrics="hessian_trace", budget=0.5, verbose=1)
    _fake_clock_fit(logger, 6, 1.0, [3.0])
    out = capsys.readouterr().out
    assert out.count("a log costs 3.00 s, an epoch 1.00 s: it logs about every 3 epochs") == 1


def test_csv_logger_records_the_keys(tmp_path):
    x, y = _data()
    model = _model()
    path = str(tmp_path / "log.csv")
    logger = SharpnessLogger(x, y, metrics=("hessian_trace", "riemannian_sharpness"), num_probes=2)
    hist = model.fit(x, y, epochs=2, verbose=0, callbacks=[logger, keras.callbacks.CSVLogger(path)])
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2
    for k in KEYS:
        assert k in rows[0]
        for r, v in zip(rows, hist.history[k]):
            assert float(r[k]) == pytest.approx(v, rel=TOL)


def _read_tensorboard_scalars(logdir):
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.util import tensor_util

    out = {}
    for run in sorted(glob.glob(os.path.join(logdir, "*"))):
        acc = event_accumulator.EventAccumulator(run, size_guidance={"tensors": 0, "scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("tensors", []):
            if tag.startswith("epoch_"):  # (the model's config is a text summary)
                out[tag] = [float(tensor_util.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)]
        for tag in acc.Tags().get("scalars", []):
            if tag.startswith("epoch_"):
                out[tag] = [e.value for e in acc.Scalars(tag)]
    return out


def test_tensorboard_writes_the_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    x, y = _data()
    model = _model()
    logdir = str(tmp_path / "tb")
    logger = SharpnessLogger(x, y, metrics=("hessian_trace", "riemannian_sharpness"), num_probes=2)
    hist = model.fit(x, y, epochs=2, verbose=0, callbacks=[logger, keras.callbacks.TensorBoard(logdir)])
    events = glob.glob(os.path.join(logdir, "**", "events.out.tfevents.*"), recursive=True)
    assert events and all(os.path.getsize(e) > 0 for e in events)
    scalars = _read_tensorboard_scalars(logdir)
    for k in KEYS:
        assert f"epoch_{k}" in scalars, sorted(scalars)
        np.testing.assert_allclose(scalars[f"epoch_{k}"], hist.history[k], rtol=TOL)


def test_tensorboard_and_csv_placed_first_still_record_the_keys(tmp_path):
    """Keras hands callbacks one logs dict in list order; the logger moves
    itself to the front, so loggers placed before it see its keys."""
    pytest.importorskip("tensorboard")
    x, y = _data()
    model = _model()
    logdir, path = str(tmp_path / "tb"), str(tmp_path / "log.csv")
    logger = SharpnessLogger(x, y, metrics=("hessian_trace", "riemannian_sharpness"), num_probes=2)
    callbacks = [keras.callbacks.TensorBoard(logdir), keras.callbacks.CSVLogger(path), logger]
    hist = model.fit(x, y, epochs=2, verbose=0, callbacks=callbacks)
    scalars = _read_tensorboard_scalars(logdir)
    with open(path) as f:
        rows = list(csv.DictReader(f))
    for k in KEYS:
        assert f"epoch_{k}" in scalars, sorted(scalars)
        np.testing.assert_allclose(scalars[f"epoch_{k}"], hist.history[k], rtol=TOL)
        np.testing.assert_allclose([float(r[k]) for r in rows], hist.history[k], rtol=TOL)


def test_verbose_prints_each_metric_with_its_stderr(capsys):
    x, y = _data()
    model = _model()
    logger = SharpnessLogger(x, y, metrics=("hessian_trace", "riemannian_sharpness"), num_probes=2, verbose=1)
    model.fit(x, y, epochs=1, verbose=0, callbacks=[logger])
    out = capsys.readouterr().out
    assert out.count("SharpnessLogger:") == 2
    assert "hessian_trace = " in out and "±" in out


def test_wrong_loss_fails_before_the_first_epoch():
    x, y = _data()
    model = _model()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mae")
    weights = [v.numpy() if hasattr(v, "numpy") else keras.ops.convert_to_numpy(v) for v in model.trainable_variables]
    with pytest.raises(ValueError, match="mean_absolute_error.*no likelihood"):
        model.fit(x, np.eye(K)[y], epochs=1, verbose=0, callbacks=[SharpnessLogger(x, y, metrics="riemannian_sharpness")])
    for v, w in zip(model.trainable_variables, weights):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(v), w)


def test_fixed_seed_gives_identical_values_when_weights_do_not_change():
    x, y = _data()
    model = _model(lr=0.0, activation="tanh")
    logger = SharpnessLogger(x, y, metrics=("hessian_trace", "riemannian_sharpness"), num_probes=2, seed=7)
    hist = model.fit(x, y, epochs=2, batch_size=8, verbose=0, callbacks=[logger])
    for k in KEYS:
        v = hist.history[k]
        assert v[0] == v[1], (k, v)
    # and a second logger with the same seed on the same weights agrees
    again = SharpnessLogger(x, y, metrics=("hessian_trace", "riemannian_sharpness"), num_probes=2, seed=7)
    again.set_model(model)
    values = again.compute()
    for k in KEYS:
        assert values[k] == pytest.approx(hist.history[k][-1], rel=TOL)
    other = SharpnessLogger(x, y, metrics="hessian_trace", num_probes=2, seed=8)
    other.set_model(model)
    assert other.compute()["hessian_trace"] != hist.history["hessian_trace"][-1]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"metrics": ("hessian_trace", "sharpness")}, "Unknown sharpness metric"),
        ({"metrics": "trace"}, "Unknown sharpness metric"),
        ({"metrics": ()}, "at least one"),
        ({"every_n_epochs": 0}, "every_n_epochs"),
        ({"every_n_epochs": -2}, "every_n_epochs"),
        ({"every_n_epochs": 1.5}, "every_n_epochs"),
        ({"budget": 0.0}, "budget"),
        ({"budget": 1.0}, "budget"),
        ({"budget": -0.1}, "budget"),
        ({"budget": "often"}, "budget"),
        ({"num_probes": 0}, "num_probes"),
        ({"max_probes": 0}, "max_probes"),
        ({"rtol": 0.0}, "rtol"),
        ({"y": np.zeros(N - 1, "int32")}, "differ in length"),
        ({"options": {"lambda_maxx": {}}}, "options"),
    ],
)
def test_invalid_arguments_raise(kwargs, match):
    x, y = _data()
    kwargs = dict(kwargs)
    y = kwargs.pop("y", y)
    with pytest.raises(ValueError, match=match):
        SharpnessLogger(x, y, **kwargs)


def test_logs_none_is_tolerated():
    x, y = _data()
    logger = SharpnessLogger(x, y, metrics="hessian_trace", num_probes=2)
    logger.set_model(_model())
    logger.on_epoch_end(0, None)  # nothing to write into, nothing raised


# ------------------------------------------------------ RefreshMonitor ----
def _llqr_model(attach, **opt_kwargs):
    import keras

    import keras_geosam as kg

    keras.utils.set_random_seed(0)
    layers = [keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)]
    model = kg.attach(keras.Sequential(layers)) if attach else kg.Sequential(layers)
    base = keras.optimizers.SGD(0.1, gradient_accumulation_steps=opt_kwargs.pop("accumulate", None))
    model.compile(optimizer=kg.optimizers.LLQRSAM(base, **opt_kwargs),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("attach", [False, True])
def test_refresh_monitor_logs_count_and_time(attach):
    import numpy as np

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 4)).astype("float32"), rng.integers(0, 3, size=40)
    model = _llqr_model(attach, refresh_every=3)
    h = model.fit(x, y, batch_size=8, epochs=3, verbose=0, validation_data=(x, y))
    # 5 steps per epoch: refreshes at steps 0, 3, 6, 9, 12
    assert h.history["refreshes"] == [2.0, 4.0, 5.0]
    seconds = h.history["refresh_seconds"]
    assert all(b >= a >= 0 for a, b in zip(seconds, seconds[1:]))  # values are timings: not tested
    assert not any(k.startswith("val_refresh") for k in h.history)
    assert len(model.evaluate(x, y, verbose=0, return_dict=True)) == 1  # loss only


def test_refresh_seconds_include_the_step_zero_refresh_inside_the_step(capsys):
    """The step-0 refresh runs in the step that also compiles: it is
    counted (exactly on torch and TensorFlow, from step times less JAX's
    compile events on JAX), and a long one prints one line when verbose."""
    import time

    import numpy as np

    from keras_geosam.callbacks import RefreshMonitor

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 4)).astype("float32"), rng.integers(0, 3, size=64)
    model = _llqr_model(False, structure="kfac", refresh_every=1000, refresh_steps=3000)
    monitor = RefreshMonitor(notice_seconds=0.0)
    start = time.perf_counter()
    h = model.fit(x, y, batch_size=8, epochs=2, verbose=2, callbacks=[monitor])
    elapsed = time.perf_counter() - start
    assert h.history["refreshes"] == [1.0, 1.0]
    first, second = h.history["refresh_seconds"]
    assert 0.0 < first == second < elapsed
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("LLQR: a refresh of U")]
    assert len(printed) == 1 and "3000 inner steps" in printed[0]


def test_refresh_monitor_follows_accumulation_and_a_second_fit():
    import numpy as np

    from keras_geosam.callbacks import RefreshMonitor

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(48, 4)).astype("float32"), rng.integers(0, 3, size=48)
    model = _llqr_model(False, refresh_every=2, accumulate=3)
    mine = RefreshMonitor(prefix="u_")
    h = model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[mine])
    # 12 micro-batches = 4 optimizer steps: refreshes at steps 0 and 2
    assert h.history["u_refreshes"] == [2.0] and "refreshes" not in h.history
    assert mine.due_steps == 2
    h = model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[mine])
    assert h.history["u_refreshes"] == [4.0] and mine.due_steps == 2  # steps 4 and 6


def test_refresh_monitor_is_silent_without_u():
    import keras
    import numpy as np

    import keras_geosam as kg

    model = kg.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer=kg.optimizers.SAM(keras.optimizers.SGD(0.1)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    h = model.fit(np.zeros((8, 4), "float32"), np.zeros(8, "int32"), verbose=0,
                  callbacks=[kg.callbacks.RefreshMonitor()])
    assert "refreshes" not in h.history
    with pytest.raises(ValueError, match="prefix"):
        kg.callbacks.RefreshMonitor(prefix=1)
    with pytest.raises(ValueError, match="notice_seconds"):
        kg.callbacks.RefreshMonitor(notice_seconds=-1)


def test_refresh_monitor_keeps_keras_asynchronous_dispatch():
    """No batch-end hook: Keras does not read every step's logs on the host
    because of it (it waits for the device only around due steps)."""
    import keras

    from keras_geosam.callbacks import RefreshMonitor

    model = _llqr_model(False, refresh_every=3)
    plain = keras.callbacks.CallbackList([], model=model)
    ours = keras.callbacks.CallbackList([RefreshMonitor()], model=model)
    assert ours._async_train == plain._async_train


def test_preconditioner_refresh_takes_a_two_input_models_list():
    """``PreconditionerRefresh`` on a functional model with two inputs,
    given ``[x1, x2]`` as ``fit`` takes it: the U of a refresh from the
    callback on one batch equals the in-step refresh's on that batch (the
    callback reorders the batch's rows: float32 rounding). A mismatched
    length among the arrays is refused."""
    rng = np.random.default_rng(3)
    x1, x2 = rng.normal(size=(8, 3)).astype("float32"), rng.normal(size=(8, 2)).astype("float32")
    y = rng.integers(0, 3, 8)
    u = {}
    for source in ("step", "callback"):
        keras.utils.set_random_seed(0)
        a, b = keras.Input((3,)), keras.Input((2,))
        h = keras.layers.Dense(4, activation="tanh")(keras.layers.Concatenate()([a, b]))
        model = kg.Model([a, b], keras.layers.Dense(3)(h))
        opt = kg.optimizers.LLQRSAM(keras.optimizers.SGD(0.1), structure="kfac", refresh_every=100, refresh_steps=5,
                                    refresh_source=source)
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        callbacks = [kg.callbacks.PreconditionerRefresh([x1, x2], y, batch_size=8)] if source == "callback" else []
        model.fit([x1, x2], y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
        u[source] = [keras.ops.convert_to_numpy(v) for v in opt.preconditioner.variables]
    initial = lambda a: np.ones_like(a) if a.ndim == 1 else np.eye(len(a))  # noqa: E731  (K-FAC's start)
    assert max(np.max(np.abs(a - initial(a))) for a in u["step"]) > 1e-4  # the refresh moved U
    for a, b in zip(u["step"], u["callback"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="differ in length"):
        kg.callbacks.PreconditionerRefresh([x1, x2[:5]], y)


def test_progress_lines_print_values_and_stderrs_and_history_keeps_every_key(capsys):
    x, y = _data()
    model = _model()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    logger = SharpnessLogger(x, y, every_n_epochs=1, num_probes=2, rtol=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        history = model.fit(x, y, epochs=2, verbose=2, callbacks=[logger], validation_data=(x, y)).history
    lines = [line for line in capsys.readouterr().out.splitlines() if "loss" in line]
    assert lines and all("riemannian_sharpness_stderr" in line for line in lines)
    assert not any("_ggn" in line or "_residual" in line or "_normalized" in line for line in lines)
    assert max(len(line) for line in lines) <= 220, max(lines, key=len)
    assert {"hessian_trace_ggn", "riemannian_sharpness_residual_stderr", "riemannian_sharpness_normalized"} <= set(history)
