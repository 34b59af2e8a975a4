"""Ordinary Keras features keep working under the two-pass step:
multi-output models, steps_per_execution, jit_compile on and off, callbacks,
validation_split. Checked against the same model trained one step at a time
where the feature must not change the numbers."""

import keras
import numpy as np
import pytest

import keras_geosam as kg

BACKEND = keras.backend.backend()


def _data(n=32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 5)).astype("float32")
    return x, rng.integers(0, 3, size=n).astype("int32"), rng.normal(size=(n, 2)).astype("float32")


def _weights(model, seed=1):
    rng = np.random.default_rng(seed)
    model.set_weights([0.3 * rng.normal(size=v.shape).astype("float32") for v in model.weights])


def test_multi_output_model_trains_with_sam_and_both_losses_count():
    x, y_cls, y_reg = _data()
    inp = keras.Input((5,))
    h = keras.layers.Dense(8, activation="tanh")(inp)
    out_a = keras.layers.Dense(3, name="cls")(h)
    out_b = keras.layers.Dense(2, name="reg")(h)

    def build(weight_b):
        m = kg.Model(inp, [out_a, out_b])
        m.compile(
            optimizer=kg.optimizers.SAM(keras.optimizers.SGD(0.1), rho=0.05),
            loss=[keras.losses.SparseCategoricalCrossentropy(from_logits=True), "mse"],
            loss_weights=[1.0, weight_b],
        )
        return m

    m = build(1.0)
    _weights(m)
    w0 = [np.array(w) for w in m.get_weights()]
    hist = m.fit(x, [y_cls, y_reg], batch_size=16, epochs=3, verbose=0)
    assert all(np.isfinite(v[-1]) for v in hist.history.values())
    assert hist.history["loss"][-1] < hist.history["loss"][0]
    # Keras' per-output loss trackers are updated by the loss computation
    # inside the step; the epoch means add up to the total (equal weights).
    np.testing.assert_allclose(
        np.add(hist.history["cls_loss"], hist.history["reg_loss"]), hist.history["loss"], rtol=1e-5
    )
    reg_kernel_moved = np.abs(m.get_layer("reg").get_weights()[0] - w0[4]).max()
    assert reg_kernel_moved > 1e-4  # the second output's loss drives its head


def _mlp():
    m = kg.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
    _weights(m)
    return m


def _fit(steps_per_execution=1, jit_compile="auto", epochs=2, callbacks=None, validation_split=0.0, optimizer=None):
    x, y, _ = _data(48)
    m = _mlp()
    m.compile(
        optimizer=optimizer or kg.optimizers.FSAM(keras.optimizers.SGD(0.1, momentum=0.9), rho=0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=steps_per_execution, jit_compile=jit_compile,
    )
    h = m.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0,
              callbacks=callbacks or [], validation_split=validation_split)
    return m, h


@pytest.mark.skipif(BACKEND == "torch", reason="Keras' torch trainer supports steps_per_execution=1 only")
def test_steps_per_execution_gives_the_same_weights():
    a, _ = _fit(steps_per_execution=1)
    b, _ = _fit(steps_per_execution=3)
    for p, q in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(p, q, rtol=1e-5, atol=1e-6)


def _llqr_sam():
    # In-step refreshes at steps 0, 4 and 8: on torch with jit_compile=True
    # they run eagerly inside the torch.compile-d step (double backward).
    return kg.optimizers.LLQRSAM(
        keras.optimizers.SGD(0.1, momentum=0.9), rho=0.1, structure="kfac", refresh_every=4, refresh_steps=2
    )


@pytest.mark.parametrize("make", [None, _llqr_sam], ids=["fsam", "llqr_sam_kfac"])
def test_jit_compile_on_and_off_give_the_same_weights(make):
    # torch: jit_compile=True is torch.compile of the train step.
    a, ha = _fit(jit_compile=False, optimizer=make and make())
    b, hb = _fit(jit_compile=True, optimizer=make and make())
    state = lambda m: m.get_weights() + [keras.ops.convert_to_numpy(v) for v in m.optimizer.variables]  # noqa: E731
    for p, q in zip(state(a), state(b)):
        np.testing.assert_allclose(p, q, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ha.history["grad_cosine"], hb.history["grad_cosine"], rtol=1e-5)
    if make is not None:
        assert int(b.optimizer.refreshes) == 3


def test_callbacks_and_validation_split():
    stop = keras.callbacks.EarlyStopping(monitor="val_loss", patience=0, min_delta=10.0)
    seen = []
    record = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: seen.append(dict(logs)))
    _, h = _fit(epochs=5, callbacks=[stop, record], validation_split=0.25)
    assert len(h.history["loss"]) == 2  # EarlyStopping acted on val_loss
    assert "val_loss" in h.history and "val_sharpness_gap" not in h.history
    assert {"loss", "sharpness_gap", "grad_norm", "grad_cosine"} <= set(seen[-1])


@pytest.mark.parametrize("make", [
    lambda: kg.optimizers.SAM(keras.optimizers.SGD(0.1)),
    lambda: kg.optimizers.LLQRSAM(keras.optimizers.SGD(0.1), structure="kfac", refresh_every=2, refresh_steps=2),
])
def test_a_model_without_an_input_layer_builds_at_fit(make):
    # TensorFlow's trainer builds such a model inside the first trace; the
    # two-pass step needs it (and U) built before. No batch is lost to it.
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(12, 5)).astype("float32"), rng.integers(0, 3, size=12)
    model = kg.Sequential([keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(3)])
    model.compile(optimizer=make(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 6
    assert np.all(np.isfinite(history.history["loss"]))
    if hasattr(model.optimizer, "refreshes"):
        assert int(keras.ops.convert_to_numpy(model.optimizer.refreshes)) == 3


def _remat_run(remat):
    x, y, _ = _data(16)

    def build():
        return kg.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])

    if remat:
        with keras.RematScope(mode="full"):
            model = build()
    else:
        model = build()
    _weights(model)
    init = model.get_weights()
    model.compile(optimizer=kg.optimizers.SAM(keras.optimizers.SGD(0.1), rho=0.3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return init, model.get_weights()


@pytest.mark.skipif(BACKEND != "jax", reason="RematScope models train on JAX only")
def test_rematerialised_model_takes_the_same_steps():
    (init, plain), (_, remat) = _remat_run(False), _remat_run(True)
    assert max(float(np.abs(a - b).max()) for a, b in zip(plain, remat)) <= 1e-6
    assert max(float(np.abs(a - b).max()) for a, b in zip(plain, init)) > 1e-3  # it trained


@pytest.mark.skipif(BACKEND == "jax", reason="JAX trains RematScope models")
def test_rematerialised_model_is_refused_with_a_clear_error():
    # torch's recomputation would run outside the step's weights: a wrong
    # gradient, so it is refused before the first step.
    with pytest.raises(ValueError, match="RematScope"):
        _remat_run(True)
    with keras.RematScope(mode="full"):
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    with pytest.raises(ValueError, match="RematScope"):
        kg.curvature.ModelFunctions(model)
