"""The two-pass train step in real training: BatchNorm statistics, dropout
masks, save/load, attachment, non-finite batches, mixed precision, gradient
accumulation, logged statistics, sample/class weights, model styles,
agreement across backends and JAX data parallelism.

Numbers are checked against the float64 NumPy reference in
``reference/two_pass.py`` (hand-written forward/backward passes and spec formulas),
never against keras_geosam itself.
"""


import keras
import numpy as np
import pytest

import keras_geosam as kg
from reference import two_pass as ref
from locations import import_worker, start_on_other_backends

BACKEND = keras.backend.backend()
from reference.two_pass import ATOL, BN_NET, MLP, RTOL, assert_weights_close, max_abs_diff, sce  # noqa: E402,F401


def to_np(v):
    return np.asarray(keras.ops.convert_to_numpy(v), np.float64)


def all_finite(model):
    return all(np.all(np.isfinite(to_np(v.value))) for v in model.weights)


def compiled(layers, optimizer, seed=3, d_in=4, kg_cls=None, **compile_kwargs):
    model = ref.build_keras(layers, d_in, kg_cls=kg_cls)
    init = ref.set_weights(model, seed)
    model.compile(optimizer=optimizer, loss=sce(), **compile_kwargs)
    return model, init


def fit(model, x, y, batch_size, epochs=1, **kwargs):
    return model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, **kwargs)


class WeightRecorder(keras.callbacks.Callback):
    """Trainable weights after every batch (`self.model` syncs JAX state)."""

    def __init__(self):
        super().__init__()
        self.weights = []

    def on_train_batch_end(self, batch, logs=None):
        self.weights.append([to_np(v.value) for v in self.model.trainable_variables])


@pytest.fixture
def restore_policy():
    yield
    keras.mixed_precision.set_global_policy("float32")


# ------------------------------------------------------------ BatchNorm ----
@pytest.mark.parametrize("bn_stats", ["centre", "perturbed"])
def test_batchnorm_statistics_come_from_exactly_one_pass(bn_stats):
    """Two SAM steps: each updates the moving statistics once, from the
    chosen pass's batch statistics (checked against NumPy)."""
    bn_momentum, lr, hp = 0.9, 0.1, {"rho": 0.8}
    x, y = ref.make_data(12, 8, 4, 3)
    model = ref.build_keras(BN_NET, 4, bn_momentum=bn_momentum)
    params = ref.set_weights(model, 13)
    bn = next(l for l in model.layers if isinstance(l, keras.layers.BatchNormalization))
    rng = np.random.default_rng(14)
    mean = rng.normal(size=5).astype("float32")
    var = rng.uniform(0.5, 2.0, size=5).astype("float32")
    bn.moving_mean.assign(mean)
    bn.moving_variance.assign(var)
    model.compile(optimizer=kg.optimizers.SAM(keras.optimizers.SGD(lr), bn_stats=bn_stats, **hp),
                  loss=sce())
    fit(model, x, y, batch_size=8, epochs=2)

    mean, var = mean.astype(np.float64), var.astype(np.float64)
    params = [p.astype(np.float64) for p in params]
    for _ in range(2):
        r = ref.two_pass_reference(BN_NET, "sam", params, x, y, hp, {})
        (mc, vc), = r["stats_c"]
        (mp, vp), = r["stats_p"]
        assert np.max(np.abs(mc - mp)) > 1e-3  # the two passes' statistics differ (>> tolerance)
        bm, bv = (mc, vc) if bn_stats == "centre" else (mp, vp)
        mean = bn_momentum * mean + (1 - bn_momentum) * bm
        var = bn_momentum * var + (1 - bn_momentum) * bv
        params = [p - lr * g for p, g in zip(params, r["g_p"])]
    np.testing.assert_allclose(to_np(bn.moving_mean.value), mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(to_np(bn.moving_variance.value), var, rtol=1e-5, atol=1e-6)
    assert_weights_close(ref.weights_of(model), params)


# -------------------------------------------------------------- dropout ----
def _dropout_gap(mode, seed):
    """rho = 0 isolates the mask: the two passes see the same weights, so the
    loss gap is exactly 0 iff the perturbed pass reuses the centre's mask."""
    x, y = ref.make_data(15, 16, 6, 3)
    model = kg.Sequential([
        keras.Input((6,)), keras.layers.Dense(8), keras.layers.Dropout(0.5, seed=seed),
        keras.layers.Dense(3),
    ])
    ref.set_weights(model, 16)
    model.compile(optimizer=kg.optimizers.SAM(keras.optimizers.SGD(0.1), rho=0.0, dropout=mode),
                  loss=sce())
    h = fit(model, x, y, batch_size=16).history
    return h["sharpness_gap"][0], h["grad_cosine"][0]


@pytest.mark.parametrize("seed", [None, 7], ids=["unseeded", "seeded"])
def test_dropout_fresh_draws_a_new_mask(seed):
    gap, cos = _dropout_gap("fresh", seed)
    assert abs(gap) > 1e-3
    assert cos < 1.0 - 1e-3


def test_dropout_same_reuses_the_mask_seeded_layer():
    gap, cos = _dropout_gap("same", 7)
    assert gap == pytest.approx(0.0, abs=1e-6)
    assert cos == pytest.approx(1.0, abs=1e-5)


def test_dropout_same_reuses_the_mask_unseeded_layer():
    gap, cos = _dropout_gap("same", None)
    if BACKEND == "torch":
        # Documented limitation (TwoPassOptimizer docstring, spec keras3.md):
        # a Dropout layer created without a seed draws from torch's global
        # RNG, so the two passes' masks differ whatever `dropout` says.
        assert abs(gap) > 1e-3
        assert cos < 1.0 - 1e-3
    else:
        assert gap == pytest.approx(0.0, abs=1e-6)
        assert cos == pytest.approx(1.0, abs=1e-5)


# ------------------------------------------------------------ save/load ----
@pytest.mark.parametrize(
    "kind,style", [("sam", "sequential"), ("fsam", "functional")]
)
def test_save_load_mid_training_equals_uninterrupted(kind, style, tmp_path):
    x, y = ref.make_data(17, 16, 4, 3)

    def make():
        base = keras.optimizers.SGD(0.05, momentum=0.9)
        if kind == "sam":
            opt = kg.optimizers.SAM(base, rho=0.3)
        else:
            opt = kg.optimizers.FSAM(base, rho=0.3, sigma=1.0, momentum=0.6)
        if style == "functional":
            inp = keras.Input((4,))
            h = keras.layers.Dense(5, activation="tanh")(inp)
            model = kg.Model(inp, keras.layers.Dense(3)(h))
        else:
            model = ref.build_keras(MLP, 4)
        ref.set_weights(model, 18)
        model.compile(optimizer=opt, loss=sce())
        return model

    def check(loaded):
        assert isinstance(loaded, kg.Sequential if style == "sequential" else kg.Model)
        if kind == "fsam":
            avg = [to_np(v.value) for v in loaded.optimizer._average]
            assert max(np.abs(a).max() for a in avg) > 1e-3  # the EMA was restored, not zeros

    loaded = resume_equals_uninterrupted(make, x, y, tmp_path, check, atol=1e-7)
    assert int(to_np(loaded.optimizer.iterations)) == 8


def resume_equals_uninterrupted(make, x, y, tmp_path, check=None, atol=1e-7):
    """Trains make() 4 epochs; a second make() 2 epochs, saved to .keras and
    reloaded with keras.saving.load_model, every optimizer variable restored
    (`check(loaded)` for more), then 2 more epochs: the same weights."""
    full = make()
    fit(full, x, y, 8, epochs=4)
    first = make()
    fit(first, x, y, 8, epochs=2)
    path = str(tmp_path / "model.keras")
    first.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.compiled and getattr(loaded, "optimizer", None) is not None, (
        "load_model returned an uncompiled model: the two-pass optimizer and its "
        "state were not restored"
    )
    assert type(loaded.optimizer) is type(first.optimizer)
    assert int(to_np(loaded.optimizer.iterations)) == 4
    assert len(loaded.optimizer.variables) == len(first.optimizer.variables)
    for a, b in zip(loaded.optimizer.variables, first.optimizer.variables):
        np.testing.assert_array_equal(to_np(a.value), to_np(b.value), err_msg=a.path)
    if check is not None:
        check(loaded)
    fit(loaded, x, y, 8, epochs=2)
    assert_weights_close(ref.weights_of(loaded), ref.weights_of(full), rtol=1e-6, atol=atol)
    return loaded


# ------------------------------------------------------------ attachment ----
def test_plain_keras_model_refuses_with_a_hint_and_keeps_weights():
    x, y = ref.make_data(19, 8, 4, 3)
    model, init = compiled(MLP, kg.optimizers.SAM(keras.optimizers.SGD(0.1), rho=0.3),
                           kg_cls=keras.Sequential)
    with pytest.raises(Exception, match="kg.attach"):
        fit(model, x, y, 8)
    assert_weights_close(ref.weights_of(model), init, rtol=0, atol=0)


def _one_sam_step_expected(init, x, y, hp):
    return ref.sgd_train(MLP, "sam", init, [(x, y)], 0.1, 0.0, hp)


@pytest.mark.parametrize("when", ["before_compile", "after_compile", "after_failed_fit"])
def test_attach_gives_a_plain_model_the_two_pass_step(when):
    x, y = ref.make_data(20, 8, 4, 3)
    hp = {"rho": 0.5}
    model = ref.build_keras(MLP, 4, kg_cls=keras.Sequential)
    init = ref.set_weights(model, 21)
    opt = kg.optimizers.SAM(keras.optimizers.SGD(0.1), **hp)
    if when == "before_compile":
        assert kg.attach(model) is model
        model.compile(optimizer=opt, loss=sce())
    else:
        model.compile(optimizer=opt, loss=sce())
        if when == "after_failed_fit":
            with pytest.raises(Exception, match="kg.attach"):
                fit(model, x, y, 8)
        assert kg.attach(model) is model
    h = fit(model, x, y, 8).history
    assert "sharpness_gap" in h
    assert_weights_close(ref.weights_of(model), _one_sam_step_expected(init, x, y, hp))


class PlainNet(keras.Model):
    """A subclassed keras.Model (as keras-cv / keras-hub models are)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(5, activation="tanh")
        self.out = keras.layers.Dense(3)

    def call(self, x):
        return self.out(self.hidden(x))


@pytest.mark.parametrize("when", ["before_compile", "after_compile"])
def test_attach_on_a_built_subclassed_keras_model(when):
    x, y = ref.make_data(36, 8, 4, 3)
    hp = {"rho": 0.5}
    model = PlainNet()
    model(x[:1])  # built, as any pretrained / inspected model is
    init = ref.set_weights(model, 37)
    opt = kg.optimizers.SAM(keras.optimizers.SGD(0.1), **hp)
    if when == "before_compile":
        kg.attach(model)
        model.compile(optimizer=opt, loss=sce())
    else:
        model.compile(optimizer=opt, loss=sce())
        kg.attach(model)
    h = fit(model, x, y, 8).history
    assert "sharpness_gap" in h
    assert_weights_close(ref.weights_of(model), _one_sam_step_expected(init, x, y, hp))


def test_kg_model_with_a_plain_optimizer_trains_like_keras():
    x, y = ref.make_data(22, 16, 4, 3)
    a, _ = compiled(MLP, keras.optimizers.SGD(0.1, momentum=0.9))
    b, _ = compiled(MLP, keras.optimizers.SGD(0.1, momentum=0.9), kg_cls=keras.Sequential)
    ha = fit(a, x, y, 8, epochs=2).history
    fit(b, x, y, 8, epochs=2)
    assert "sharpness_gap" not in ha
    assert_weights_close(ref.weights_of(a), ref.weights_of(b), rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------- non-finite ----
def test_nan_batch_alone_is_skipped(step_branching):
    x, y = ref.make_data(23, 8, 4, 3)
    x[3, 1] = np.nan
    model, init = compiled(BN_NET, kg.optimizers.SAM(keras.optimizers.SGD(0.1, momentum=0.9), rho=0.3))
    bn_before = [to_np(v.value) for v in model.non_trainable_variables]
    h = fit(model, x, y, 8).history
    assert h["skipped_steps"] == [1.0]
    assert all_finite(model)
    assert_weights_close(ref.weights_of(model), init, rtol=0, atol=0)
    for v, b in zip(model.non_trainable_variables, bn_before):
        np.testing.assert_array_equal(to_np(v.value), b)
    assert int(to_np(model.optimizer.iterations)) == 0


@pytest.mark.parametrize("kind", ["sam", "fsam"])
def test_nan_batch_is_skipped_and_training_continues(kind, step_branching):
    """Batches [NaN, good, good] equal the reference on [good, good]: weights,
    momentum, F-SAM's average and BN statistics untouched by the bad batch."""
    hp = {"rho": 0.3, "sigma": 1.0, "momentum": 0.9}
    x, y = ref.make_data(24, 12, 4, 3)
    x[1, 2] = np.nan
    base = keras.optimizers.SGD(0.1, momentum=0.9)
    opt = (kg.optimizers.SAM(base, rho=0.3) if kind == "sam"
           else kg.optimizers.FSAM(base, rho=0.3, sigma=1.0, momentum=0.9))
    model, init = compiled(BN_NET, opt)
    h = fit(model, x, y, 4).history
    assert h["skipped_steps"] == [1.0]
    assert all_finite(model)
    expected = ref.sgd_train(BN_NET, kind, init, [(x[4:8], y[4:8]), (x[8:], y[8:])], 0.1, 0.9, hp)
    assert_weights_close(ref.weights_of(model), expected)
    assert int(to_np(model.optimizer.iterations)) == 2
    for name in ("sharpness_gap", "grad_norm", "grad_cosine"):
        assert np.isfinite(h[name][0]), name


# ------------------------------------------------------ mixed precision ----
@pytest.mark.parametrize("kind", ["sam", "fisher"])
def test_mixed_float16_trains_and_matches_float32(kind, restore_policy, step_branching):
    """The loss scale is applied to both passes and removed from both
    gradients (Fisher-SAM's perturbation is not scale-invariant)."""
    x, y = ref.make_data(25, 16, 4, 3)

    def make():
        base = keras.optimizers.SGD(0.1)
        return (kg.optimizers.SAM(base, rho=0.3) if kind == "sam"
                else kg.optimizers.FisherSAM(base, rho=0.3, eta=0.1))

    ref_model, init = compiled(MLP, make())
    fit(ref_model, x, y, 4)
    moved = max_abs_diff(ref.weights_of(ref_model), init)
    assert moved > 1e-2

    keras.mixed_precision.set_global_policy("mixed_float16")
    model, _ = compiled(MLP, make())
    lso = model.optimizer
    assert isinstance(lso, keras.optimizers.LossScaleOptimizer)
    scale0 = float(to_np(lso.dynamic_scale))
    h = fit(model, x, y, 4).history
    assert all_finite(model)
    assert h["skipped_steps"] == [0.0]
    assert np.isfinite(h["loss"][0])
    # Four finite steps: the scale is kept and the growth counter advanced.
    assert float(to_np(lso.dynamic_scale)) == scale0
    assert int(to_np(lso.step_counter)) == 4
    # float16 compute: close to the float32 run, far closer than the distance moved
    # (an unscaled gradient would move the weights by the loss scale times more).
    assert_weights_close(ref.weights_of(model), ref.weights_of(ref_model), rtol=0, atol=2e-3)

    # A non-finite batch: skipped, and the loss scale halves.
    before = ref.weights_of(model)
    x_bad = x[:4].copy()
    x_bad[0, 0] = np.nan
    h = fit(model, x_bad, y[:4], 4).history
    assert h["skipped_steps"] == [1.0]
    assert_weights_close(ref.weights_of(model), before, rtol=0, atol=0)
    assert float(to_np(lso.dynamic_scale)) == scale0 / 2
    assert all_finite(model)


def test_mixed_bfloat16_trains(restore_policy):
    x, y = ref.make_data(26, 16, 4, 3)
    ref_model, _ = compiled(MLP, kg.optimizers.SAM(keras.optimizers.SGD(0.1), rho=0.3))
    fit(ref_model, x, y, 4)
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    model, init = compiled(MLP, kg.optimizers.SAM(keras.optimizers.SGD(0.1), rho=0.3))
    h = fit(model, x, y, 4).history
    assert all_finite(model)
    assert np.isfinite(h["loss"][0]) and h["skipped_steps"] == [0.0]
    assert max_abs_diff(ref.weights_of(model), init) > 1e-2  # it trained
    assert_weights_close(ref.weights_of(model), ref.weights_of(ref_model), rtol=0, atol=2e-2)


# ------------------------------------------------ gradient accumulation ----
def _record(model, x, y, batch_size):
    rec = WeightRecorder()
    fit(model, x, y, batch_size, callbacks=[rec])
    return rec.weights


def test_gradient_accumulation_rho_zero_equals_base_with_accumulation():
    x, y = ref.make_data(27, 16, 4, 3)

    def base():
        return keras.optimizers.SGD(0.1, momentum=0.9, gradient_accumulation_steps=2)

    a, _ = compiled(MLP, kg.optimizers.SAM(base(), rho=0.0))
    b, _ = compiled(MLP, base(), kg_cls=keras.Sequential)
    wa, wb = _record(a, x, y, 4), _record(b, x, y, 4)
    for step, (p, q) in enumerate(zip(wa, wb)):
        assert_weights_close(p, q, rtol=1e-5, atol=1e-6)


def test_gradient_accumulation_averages_perturbed_gradients():
    """Weights move every second step, by lr times the mean of the two
    micro-batches' perturbed gradients (each taken at the same weights)."""
    hp, lr = {"rho": 0.5}, 0.1
    x, y = ref.make_data(28, 16, 4, 3)
    model, init = compiled(
        MLP, kg.optimizers.SAM(keras.optimizers.SGD(lr, gradient_accumulation_steps=2), **hp)
    )
    steps = _record(model, x, y, 4)
    assert len(steps) == 4
    theta = [p.astype(np.float64) for p in init]
    for k in range(2):
        b1 = (x[8 * k:8 * k + 4], y[8 * k:8 * k + 4])
        b2 = (x[8 * k + 4:8 * k + 8], y[8 * k + 4:8 * k + 8])
        # Odd step: nothing applied yet.
        assert_weights_close(steps[2 * k], theta, rtol=1e-6, atol=1e-7)
        g1 = ref.two_pass_reference(MLP, "sam", theta, *b1, hp, {})["g_p"]
        g2 = ref.two_pass_reference(MLP, "sam", theta, *b2, hp, {})["g_p"]
        theta = [t - lr * (a + b) / 2 for t, a, b in zip(theta, g1, g2)]
        assert_weights_close(steps[2 * k + 1], theta)
    assert max_abs_diff(theta, init) > 1e-2


# ------------------------------------------------------------- metrics ----
def test_sam_statistics_in_history_are_epoch_averages():
    """sharpness_gap, grad_norm, grad_cosine and skipped_steps reach History
    and callbacks' logs; each epoch's value is the mean over its steps
    (checked against the NumPy reference for 2 epochs x 2 batches)."""
    hp, lr = {"rho": 0.5}, 0.1
    x, y = ref.make_data(29, 16, 4, 3)
    model, init = compiled(MLP, kg.optimizers.SAM(keras.optimizers.SGD(lr), **hp),
                           metrics=["accuracy"])
    seen = []
    cb = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append(dict(logs)))
    h = fit(model, x, y, 8, epochs=2, callbacks=[cb]).history
    for key in ("loss", "accuracy", "sharpness_gap", "grad_norm", "grad_cosine", "skipped_steps"):
        assert key in h, key
        assert len(h[key]) == 2
        assert all(np.isfinite(h[key])), key
        assert key in seen[-1], key
    assert h["skipped_steps"] == [0.0, 0.0]

    theta = [p.astype(np.float64) for p in init]
    stats = {"grad_norm": [], "sharpness_gap": [], "grad_cosine": [], "loss": []}
    for k in (0, 1) * 2:
        r = ref.two_pass_reference(MLP, "sam", theta, x[8 * k:8 * k + 8], y[8 * k:8 * k + 8], hp, {})
        gc = np.concatenate([g.ravel() for g in r["g_c"]])
        gp = np.concatenate([g.ravel() for g in r["g_p"]])
        stats["grad_norm"].append(np.linalg.norm(gc))
        stats["sharpness_gap"].append(r["loss_p"] - r["loss_c"])
        stats["grad_cosine"].append(gc @ gp / (np.linalg.norm(gc) * np.linalg.norm(gp)))
        stats["loss"].append(r["loss_c"])
        theta = [t - lr * g for t, g in zip(theta, r["g_p"])]
    for key, values in stats.items():
        for epoch in (0, 1):
            expected = np.mean(values[2 * epoch:2 * epoch + 2])
            rtol = 1e-4 if key == "sharpness_gap" else 1e-5
            np.testing.assert_allclose(h[key][epoch], expected, rtol=rtol, err_msg=f"{key} epoch {epoch}")
    assert all(c < 1.0 - 1e-4 for c in h["grad_cosine"])
    assert all(g > 1e-3 for g in h["sharpness_gap"])


# ------------------------------------------ weights, validation, styles ----
def test_class_weight_matches_reference():
    hp, lr = {"rho": 0.5}, 0.1
    x, y = ref.make_data(31, 8, 4, 3)
    cw = {0: 0.5, 1: 2.0, 2: 1.5}
    model, init = compiled(MLP, kg.optimizers.SAM(keras.optimizers.SGD(lr), **hp))
    h = fit(model, x, y, 8, class_weight=cw).history
    assert np.isfinite(h["loss"][0])
    sw = np.array([cw[int(c)] for c in y])
    expected = ref.sgd_train(MLP, "sam", init, [(x, y, sw)], lr, 0.0, hp)
    assert_weights_close(ref.weights_of(model), expected)


def test_sample_weight_and_validation_data():
    hp, lr = {"rho": 0.5}, 0.1
    x, y = ref.make_data(32, 8, 4, 3)
    xv, yv = ref.make_data(33, 6, 4, 3)
    sw = np.linspace(0.2, 2.0, 8).astype("float32")
    model, init = compiled(MLP, kg.optimizers.FisherSAM(keras.optimizers.SGD(lr), **hp),
                           metrics=["accuracy"])
    h = fit(model, x, y, 8, sample_weight=sw, validation_data=(xv, yv)).history
    expected = ref.sgd_train(MLP, "fisher", init, [(x, y, sw)], lr, 0.0, hp)
    assert_weights_close(ref.weights_of(model), expected)
    for key in ("loss", "val_loss", "val_accuracy", "grad_norm"):
        assert np.isfinite(h[key][0]), key
    # Validation runs at the final weights, unperturbed.
    val_loss = ref.loss_and_grad(MLP, expected, xv, yv)[0]
    np.testing.assert_allclose(h["val_loss"][0], val_loss, rtol=1e-5)
    # evaluate is unaffected by the two-pass step.
    np.testing.assert_allclose(model.evaluate(xv, yv, verbose=0)[0], val_loss, rtol=1e-5)


def test_functional_use_does_not_break_subclassing_kg_model():
    """kg.Model serves both kg.Model(inputs, outputs) and `class Net(kg.Model)`
    in one process: building a functional kg.Model must leave the class
    usable for subclassing."""
    inp = keras.Input((4,))
    kg.Model(inp, keras.layers.Dense(3)(inp))
    try:
        net = Net()
    except TypeError as e:
        pytest.fail(
            "class Net(kg.Model) cannot be instantiated after a functional kg.Model "
            f"was built (kg.Model.__bases__ is now {kg.Model.__bases__}): {e}"
        )
    net(np.zeros((1, 4), "float32"))  # builds the sub-layers
    assert len(net.trainable_variables) == 4


class Net(kg.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(5, activation="tanh")
        self.out = keras.layers.Dense(3)

    def call(self, x):
        return self.out(self.hidden(x))


@pytest.mark.parametrize("style", ["functional", "subclassed"])
def test_functional_and_subclassed_kg_models_train(style):
    hp, lr = {"rho": 0.5}, 0.1
    x, y = ref.make_data(34, 8, 4, 3)
    if style == "functional":
        inp = keras.Input((4,))
        model = kg.Model(inp, keras.layers.Dense(3)(keras.layers.Dense(5, activation="tanh")(inp)))
    else:
        model = Net()
        model(x[:1])  # builds the sub-layers
    init = ref.set_weights(model, 35)
    model.compile(optimizer=kg.optimizers.SAM(keras.optimizers.SGD(lr), **hp), loss=sce())
    h = fit(model, x, y, 8, epochs=1).history
    assert "sharpness_gap" in h and np.isfinite(h["loss"][0])
    assert_weights_close(ref.weights_of(model), _one_sam_step_expected(init, x, y, hp))


# -------------------------------------------------------- cross-backend ----
@pytest.mark.cross_backend
@pytest.mark.skipif(BACKEND != "jax", reason="runs once per suite, from the JAX process")
def test_same_steps_give_same_parameters_on_all_backends(tmp_path):
    collect = start_on_other_backends("training_worker.py", tmp_path, "cross")
    results = {"jax": import_worker("training_worker").cross_backend_results()}
    results.update(collect(timeout=300))
    base = results["jax"]
    assert set(base) == {"sam", "asam", "fsam", "fisher"}
    for name, value in base.items():
        assert value.dtype == np.float32
        assert np.all(np.isfinite(value))
        for b in ("tensorflow", "torch"):
            np.testing.assert_allclose(results[b][name], value, rtol=1e-5, atol=1e-6,
                                       err_msg=f"{name}: {b} vs jax")
    # Different optimizers really produced different parameters.
    for a, b in (("sam", "asam"), ("sam", "fsam"), ("sam", "fisher")):
        assert np.max(np.abs(base[a] - base[b])) > 1e-4, (a, b)


@pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution is JAX-only here")
def test_jax_data_parallel_equals_one_device(tmp_path):
    collect = start_on_other_backends("training_worker.py", tmp_path, "dp", backends=("jax",),
                                      env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    result = collect(timeout=300)["jax"]
    single, multi = result["single"], result["multi"]
    assert np.all(np.isfinite(single))
    np.testing.assert_allclose(multi, single, rtol=1e-5, atol=1e-6)


def test_one_optimizer_instance_in_two_models_is_refused():
    """A two-pass optimizer holds one model's state: a second model gets a
    clear error at compile, on every backend (JAX used to share silently)."""
    def net():
        return kg.Sequential([keras.Input((6,)), keras.layers.Dense(3)])

    opt = kg.optimizers.SAM(keras.optimizers.SGD(0.1), rho=0.05)
    first = net()
    first.compile(optimizer=opt, loss=sce())
    first.compile(optimizer=opt, loss=sce())  # the same model again: fine
    with pytest.raises(ValueError, match="one optimizer per model"):
        net().compile(optimizer=opt, loss=sce())


class _Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d1 = keras.layers.Dense(5, activation="tanh")
        self.d2 = keras.layers.Dense(3)

    def call(self, x):
        return self.d2(self.d1(x))


keras.saving.register_keras_serializable(package="geosam_tests")(_Subclassed)


@pytest.mark.parametrize("kind,style", [("sam", "functional"), ("llqrsam", "subclassed"), ("fsam", "sequential")])
def test_attached_models_reload_with_all_optimizer_state(kind, style, tmp_path):
    """kg.attach on a plain functional, subclassed or Sequential model, saved
    mid-training: keras.models.load_model gives the attached model back with
    every optimizer variable, and training on equals an uninterrupted run."""
    x, y = ref.make_data(27, 16, 4, 3)

    def make():
        base = keras.optimizers.SGD(0.05, momentum=0.9)
        opt = {"sam": lambda: kg.optimizers.SAM(base, rho=0.3),
               "fsam": lambda: kg.optimizers.FSAM(base, rho=0.3, momentum=0.6),
               "llqrsam": lambda: kg.optimizers.LLQRSAM(base, rho=0.2, refresh_every=3)}[kind]()
        if style == "functional":
            inp = keras.Input((4,))
            model = keras.Model(inp, keras.layers.Dense(3)(keras.layers.Dense(5, activation="tanh")(inp)))
        elif style == "subclassed":
            model = _Subclassed()
            model(x[:1])
        else:
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)])
        rng = np.random.default_rng(28)
        for v in model.trainable_variables:
            v.assign(0.5 * rng.normal(size=v.shape).astype("float32"))
        model = kg.attach(model)
        model.compile(optimizer=opt, loss=sce())
        return model

    def check(loaded):
        assert getattr(loaded, "_geosam_attached", False)

    resume_equals_uninterrupted(make, x, y, tmp_path, check, atol=1e-6)


def test_loading_without_keras_geosam_names_it(tmp_path):
    """In a process that has not imported keras_geosam, loading a model saved
    with a two-pass optimizer fails with an error that names keras_geosam."""
    import os
    import subprocess
    import sys

    inp = keras.Input((4,))
    model = kg.attach(keras.Model(inp, keras.layers.Dense(3)(inp)))
    model.compile(optimizer=kg.optimizers.SAM(keras.optimizers.SGD(0.1), rho=0.1), loss=sce())
    x, y = ref.make_data(29, 8, 4, 3)
    fit(model, x, y, 8)
    path = str(tmp_path / "m.keras")
    model.save(path)
    code = f"import keras\nkeras.models.load_model({path!r})\n"
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "keras_geosam" in out.stderr


def test_the_model_classes_are_registered_for_saving():
    for name, cls in (("Model", kg.Model), ("Sequential", kg.Sequential), ("FunctionalModel", kg.training.models.FunctionalModel)):
        assert keras.saving.get_registered_object(f"keras_geosam>{name}") is cls, name
