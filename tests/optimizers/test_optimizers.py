"""SAM-family optimizers (SAM, ASAM, F-SAM, Fisher-SAM) against an
independent float64 NumPy implementation of the spec formulas
(shared/spec/llqr-sam.md, section 3), plus their reductions, configs and
argument validation.

Every step is taken with ``model.fit(x, y, batch_size=N, shuffle=False)`` on a
tiny float32 model whose weights are set from a seeded NumPy generator; the
reference (``reference/two_pass.py``) computes gradients with a hand-written
backward pass, never through Keras or keras_geosam.
"""

import math

import keras
import numpy as np
import pytest

import keras_geosam as kg
from reference import two_pass as ref
from keras_geosam.training import step as kg_step

BACKEND = keras.backend.backend()
LINEAR = [("dense", 3)]
from reference.two_pass import ATOL, BN_NET, MLP, RTOL, assert_weights_close, max_abs_diff, sce  # noqa: E402,F401


def make_optimizer(kind, base, **hp):
    if kind == "sam":
        return kg.optimizers.SAM(base, rho=hp["rho"])
    if kind == "asam":
        return kg.optimizers.SAM(base, rho=hp["rho"], adaptive=True, eta=hp.get("eta", 0.01))
    if kind == "fsam":
        return kg.optimizers.FSAM(base, rho=hp["rho"], sigma=hp.get("sigma", 1.0),
                                  momentum=hp.get("momentum", 0.9))
    if kind == "fisher":
        return kg.optimizers.FisherSAM(base, rho=hp["rho"], eta=hp.get("eta", 0.1))
    raise ValueError(kind)


def train(layers, optimizer, x, y, batch_size, epochs, seed=3, model_cls=None, sample_weight=None):
    model = ref.build_keras(layers, x.shape[1], kg_cls=model_cls)
    init = ref.set_weights(model, seed)
    model.compile(optimizer=optimizer, loss=sce())
    history = model.fit(x, y, sample_weight=sample_weight, batch_size=batch_size, epochs=epochs,
                        shuffle=False, verbose=0)
    return model, init, history


# ------------------------------------------------------------ reference ----
@pytest.mark.parametrize("layers", [MLP, BN_NET], ids=["mlp", "bn"])
def test_reference_gradient_matches_finite_differences(layers, rng):
    """The hand-written NumPy backward pass is right (central differences)."""
    x = rng.normal(size=(6, 4))
    y = rng.integers(0, 3, size=6)
    sw = rng.uniform(0.5, 2.0, size=6)
    shapes = [(4, 5), (5,)] + ([(5,), (5,)] if layers is BN_NET else []) + [(5, 3), (3,)]
    params = [rng.normal(size=s) for s in shapes]
    _, grads, _ = ref.loss_and_grad(layers, params, x, y, sw)
    h = 1e-6
    for i, p in enumerate(params):
        fd = np.zeros_like(p)
        for idx in np.ndindex(p.shape):
            plus = [q.copy() for q in params]
            minus = [q.copy() for q in params]
            plus[i][idx] += h
            minus[i][idx] -= h
            fd[idx] = (ref.loss_and_grad(layers, plus, x, y, sw)[0]
                       - ref.loss_and_grad(layers, minus, x, y, sw)[0]) / (2 * h)
        np.testing.assert_allclose(grads[i], fd, rtol=1e-6, atol=1e-8)


# ------------------------------------------------- one step vs NumPy ----
CASES = {
    # name: (layers, kind, hyperparameters, base momentum, batches per epoch, epochs)
    "sam-mlp": (MLP, "sam", {"rho": 0.5}, 0.0, 1, 1),
    "sam-mlp-momentum": (MLP, "sam", {"rho": 0.5}, 0.9, 1, 2),
    "asam-mlp": (MLP, "asam", {"rho": 1.0, "eta": 0.01}, 0.0, 1, 1),
    # F-SAM: two steps on two different batches, so the average of the first
    # step's centre gradient changes the second step's ascent direction.
    "fsam-mlp-2steps": (MLP, "fsam", {"rho": 0.5, "sigma": 1.0, "momentum": 0.9}, 0.0, 2, 1),
    "fsam-mlp-2steps-ema0.6": (MLP, "fsam", {"rho": 0.5, "sigma": 0.8, "momentum": 0.6}, 0.9, 2, 1),
    "fisher-mlp": (MLP, "fisher", {"rho": 0.5, "eta": 0.1}, 0.0, 1, 1),
    "fisher-linear-momentum": (LINEAR, "fisher", {"rho": 0.5, "eta": 0.1}, 0.9, 1, 2),
    "sam-bn": (BN_NET, "sam", {"rho": 0.5}, 0.0, 1, 1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_step_matches_numpy_reference(case):
    layers, kind, hp, momentum, n_batches, epochs = CASES[case]
    lr = 0.1
    x, y = ref.make_data(1, 8, 4, 3)
    bs = 8 // n_batches
    opt = make_optimizer(kind, keras.optimizers.SGD(lr, momentum=momentum), **hp)
    model, init, _ = train(layers, opt, x, y, batch_size=bs, epochs=epochs)
    batches = [(x[i * bs:(i + 1) * bs], y[i * bs:(i + 1) * bs]) for i in range(n_batches)] * epochs
    expected = ref.sgd_train(layers, kind, init, batches, lr, momentum, hp)
    assert_weights_close(ref.weights_of(model), expected)
    # The test has teeth: the two-pass result is far from plain SGD's.
    plain = ref.sgd_train(layers, None, init, batches, lr, momentum)
    assert max_abs_diff(expected, plain) > 1e-3
    if kind == "fsam":
        # ... and F-SAM's average matters after the first step (it is 0 there).
        sam = ref.sgd_train(layers, "sam", init, batches, lr, momentum, hp)
        assert max_abs_diff(expected, sam) > 2e-4  # 20x the tolerance


def test_step_with_sample_weights_matches_numpy_reference():
    x, y = ref.make_data(2, 8, 4, 3)
    sw = np.random.default_rng(0).uniform(0.2, 2.0, size=8).astype("float32")
    hp = {"rho": 0.5}
    model, init, _ = train(MLP, make_optimizer("sam", keras.optimizers.SGD(0.1), **hp),
                           x, y, batch_size=8, epochs=1, sample_weight=sw)
    expected = ref.sgd_train(MLP, "sam", init, [(x, y, sw)], 0.1, 0.0, hp)
    assert_weights_close(ref.weights_of(model), expected)


def test_several_batches_match_numpy_reference():
    """Two batches per epoch, two epochs: batch order and momentum carry over."""
    x, y = ref.make_data(4, 16, 4, 3)
    hp = {"rho": 0.3}
    model, init, _ = train(MLP, make_optimizer("sam", keras.optimizers.SGD(0.05, momentum=0.9), **hp),
                           x, y, batch_size=8, epochs=2)
    batches = [(x[:8], y[:8]), (x[8:], y[8:])] * 2
    expected = ref.sgd_train(MLP, "sam", init, batches, 0.05, 0.9, hp)
    assert_weights_close(ref.weights_of(model), expected)


# ------------------------------------------------------------ reductions ----
def _make_base(base):
    if base == "adamw":
        return keras.optimizers.AdamW(0.01, weight_decay=0.05)
    return keras.optimizers.SGD(0.05, momentum=0.9)


_PLAIN = {}


def _plain_run(base, x, y):
    """The same model trained by the base optimizer alone (cached per base)."""
    if base not in _PLAIN:
        model, init, _ = train(MLP, _make_base(base), x, y, 4, 2, model_cls=keras.Sequential)
        _PLAIN[base] = (init, ref.weights_of(model))
    return _PLAIN[base]


@pytest.mark.parametrize(
    "kind,base",
    [("sam", "sgd_momentum"), ("asam", "adamw"), ("fsam", "sgd_momentum"), ("fisher", "adamw")],
)
def test_rho_zero_is_the_base_optimizer(kind, base):
    """Eight steps (2 epochs x 4 batches) with rho = 0 equal the base optimizer's."""
    x, y = ref.make_data(5, 16, 4, 3)
    two_pass, init, _ = train(MLP, make_optimizer(kind, _make_base(base), rho=0.0), x, y, 4, 2)
    init2, plain = _plain_run(base, x, y)
    assert_weights_close(init, init2, rtol=0, atol=0)
    assert max_abs_diff(plain, init) > 1e-2  # it trained
    assert_weights_close(ref.weights_of(two_pass), plain, rtol=1e-5, atol=1e-6)


def test_fsam_with_sigma_zero_is_sam():
    x, y = ref.make_data(6, 16, 4, 3)

    def sgd():
        return keras.optimizers.SGD(0.1, momentum=0.9)

    fsam, _, _ = train(MLP, kg.optimizers.FSAM(sgd(), rho=0.4, sigma=0.0), x, y, 8, 3)
    sam, _, _ = train(MLP, kg.optimizers.SAM(sgd(), rho=0.4), x, y, 8, 3)
    assert_weights_close(ref.weights_of(fsam), ref.weights_of(sam), rtol=1e-6, atol=1e-7)


# ---------------------------------------- the perturbation is applied ----
@pytest.mark.parametrize("kind", ["sam", "asam", "fsam", "fisher"])
def test_two_pass_perturbed_gradient_is_taken_at_theta_plus_eps(kind):
    """Calls the step's core directly: g_c is the gradient at theta, g_p the
    gradient at theta + eps (both checked against NumPy), and they differ."""
    hp = {"rho": 0.5}
    x, y = ref.make_data(8, 8, 4, 3)
    model = ref.build_keras(MLP, 4)
    init = ref.set_weights(model, 9)
    opt = make_optimizer(kind, keras.optimizers.SGD(0.1), **hp)
    model.compile(optimizer=opt, loss=sce())
    if kind == "fsam":
        opt.build(model.trainable_variables)  # F-SAM's average (zeros)
    tv = [v.value for v in model.trainable_variables]
    ntv = [v.value for v in model.non_trainable_variables]
    mv = [v.value for v in model.metrics_variables]
    r = kg_step.two_pass(model, opt, tv, ntv, mv, keras.ops.convert_to_tensor(x),
                         keras.ops.convert_to_tensor(y), None)
    expected = ref.two_pass_reference(MLP, kind, init, x, y, hp, {"m": [np.zeros_like(p) for p in init]})
    g_c = [keras.ops.convert_to_numpy(g) for g in r.grads_centre]
    g_p = [keras.ops.convert_to_numpy(g) for g in r.grads_perturbed]
    assert_weights_close(g_c, expected["g_c"], rtol=1e-5, atol=1e-7)
    assert_weights_close(g_p, expected["g_p"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(r.loss_centre), expected["loss_c"], rtol=1e-6)
    np.testing.assert_allclose(float(r.loss_perturbed), expected["loss_p"], rtol=1e-6)
    assert max_abs_diff(g_p, g_c) > 1e-3
    assert float(r.loss_perturbed) > float(r.loss_centre)  # ascent step
    assert bool(keras.ops.convert_to_numpy(r.finite))
    # Nothing was perturbed in place.
    assert_weights_close(ref.weights_of(model), init, rtol=0, atol=0)


def test_regularisation_losses_count_in_both_passes_at_their_own_weights():
    """A weight (L2 kernel) and an activity (L2 output) regulariser on a
    linear model with squared error: the SAM step through ``fit`` equals the
    closed form, each regulariser taken at the weights of its pass."""
    rng = np.random.default_rng(11)
    n, d, lam, mu, rho, lr = 8, 3, 0.3, 0.5, 0.4, 0.1
    x = rng.standard_normal((n, d)).astype("float32")
    y = rng.standard_normal((n, 1)).astype("float32")
    w0 = rng.standard_normal((d, 1)).astype("float32")
    model = kg.Sequential([
        keras.Input((d,)),
        keras.layers.Dense(1, use_bias=False, kernel_regularizer=keras.regularizers.L2(lam)),
        keras.layers.ActivityRegularization(l2=mu),
    ])
    model.set_weights([w0])
    model.compile(optimizer=kg.optimizers.SAM(keras.optimizers.SGD(lr), rho=rho), loss="mse")
    model.fit(x, y, batch_size=n, epochs=1, shuffle=False, verbose=0)

    X, Y = x.astype("float64"), y.astype("float64")

    def grad(w):
        # mean (Xw - y)^2 + lam ||w||^2 + mu mean (Xw)^2 (Keras divides an
        # activity regulariser by the batch size).
        return 2 * X.T @ (X @ w - Y) / n + 2 * lam * w + 2 * mu * X.T @ (X @ w) / n

    w = w0.astype("float64")
    g_c = grad(w)
    g_p = grad(w + rho * g_c / np.linalg.norm(g_c))
    expected = w - lr * g_p
    np.testing.assert_allclose(model.get_weights()[0], expected, rtol=1e-5, atol=1e-6)
    # Each term matters: without either regulariser the step is elsewhere.
    for lam_, mu_ in [(0.0, mu), (lam, 0.0)]:
        def g(w, lam_=lam_, mu_=mu_):
            return 2 * X.T @ (X @ w - Y) / n + 2 * lam_ * w + 2 * mu_ * X.T @ (X @ w) / n
        c = g(w)
        assert np.abs(w - lr * g(w + rho * c / np.linalg.norm(c)) - expected).max() > 1e-3


@pytest.mark.parametrize("kind", ["sam", "asam", "fsam", "fisher"])
def test_public_perturbation_is_what_the_step_adds(kind):
    """The step forms theta + eps in one pass (``perturbed_weights``, from
    ``scaled_perturbation``); ``perturbation()`` still returns that eps."""
    model = ref.build_keras(MLP, 4)
    ref.set_weights(model, 9)
    opt = make_optimizer(kind, keras.optimizers.SGD(0.1), rho=0.5)
    model.compile(optimizer=opt, loss=sce())
    opt.build(model.trainable_variables)
    rng = np.random.default_rng(11)
    values = [v.value for v in model.trainable_variables]
    grads = [keras.ops.convert_to_tensor(rng.normal(size=v.shape).astype("float32")) for v in values]
    eps = [keras.ops.convert_to_numpy(e) for e in opt.perturbation(grads, values)]
    moved = [keras.ops.convert_to_numpy(p - v) for p, v in zip(opt.perturbed_weights(grads, values), values)]
    assert_weights_close(moved, eps, rtol=1e-4, atol=1e-6)
    if kind == "sam":
        assert math.isclose(math.sqrt(sum(float(np.sum(e * e)) for e in eps)), 0.5, rel_tol=1e-3)


def test_a_subclass_overriding_perturbation_alone_is_honoured():
    """A subclass of SAM that overrides ``perturbation`` (here: no
    perturbation at all) is what the step uses, although SAM itself
    defines ``scaled_perturbation``: it trains exactly as its base."""

    class NoAscent(kg.optimizers.SAM):
        def perturbation(self, centre_grads, values):
            return [keras.ops.zeros_like(g) for g in centre_grads]

    x, y = ref.make_data(5, 16, 4, 3)
    model, init, _ = train(MLP, NoAscent(_make_base("sgd_momentum"), rho=0.5), x, y, 4, 2)
    init2, plain = _plain_run("sgd_momentum", x, y)
    assert_weights_close(init, init2, rtol=0, atol=0)
    assert_weights_close(ref.weights_of(model), plain, rtol=1e-5, atol=1e-6)
    sam, _, _ = train(MLP, kg.optimizers.SAM(_make_base("sgd_momentum"), rho=0.5), x, y, 4, 2)
    assert max_abs_diff(ref.weights_of(sam), plain) > 1e-3  # SAM's own ascent matters here


def test_logged_statistics_show_the_perturbation():
    x, y = ref.make_data(10, 8, 4, 3)
    hp = {"rho": 0.5}
    model, init, history = train(MLP, make_optimizer("sam", keras.optimizers.SGD(0.1), **hp),
                                 x, y, batch_size=8, epochs=1)
    h = history.history
    expected = ref.two_pass_reference(MLP, "sam", init, x, y, hp, {})
    gap = expected["loss_p"] - expected["loss_c"]
    gc = np.concatenate([g.ravel() for g in expected["g_c"]])
    gp = np.concatenate([g.ravel() for g in expected["g_p"]])
    cos = gc @ gp / (np.linalg.norm(gc) * np.linalg.norm(gp))
    assert h["grad_cosine"][0] < 1.0 - 1e-4
    assert abs(h["sharpness_gap"][0]) > 1e-3
    np.testing.assert_allclose(h["sharpness_gap"][0], gap, rtol=1e-4)
    np.testing.assert_allclose(h["grad_norm"][0], np.linalg.norm(gc), rtol=1e-5)
    np.testing.assert_allclose(h["grad_cosine"][0], cos, rtol=1e-5)
    np.testing.assert_allclose(h["loss"][0], expected["loss_c"], rtol=1e-5)
    assert h["skipped_steps"][0] == 0


@pytest.mark.parametrize("kind", ["sam", "fsam", "fisher"])
def test_build_is_idempotent(kind):
    """Like every Keras optimizer, building twice creates no new variables
    (Keras' own compile_from_config and symbolic build may call build again)."""
    model = ref.build_keras(MLP, 4)
    model.compile(optimizer=make_optimizer(kind, keras.optimizers.SGD(0.1, momentum=0.9), rho=0.1),
                  loss=sce())
    opt = model.optimizer
    if not opt.built:
        opt.build(model.trainable_variables)
    n = len(opt.variables)
    opt.build(model.trainable_variables)
    assert len(opt.variables) == n


# ------------------------------------------------------------- configs ----
def all_optimizers():
    return {
        "sam": kg.optimizers.SAM(keras.optimizers.SGD(0.05, momentum=0.9), rho=0.07,
                                 bn_stats="perturbed", dropout="same"),
        "asam": kg.optimizers.SAM(keras.optimizers.AdamW(1e-3, weight_decay=0.3), rho=0.5,
                                  adaptive=True, eta=0.02),
        "fsam": kg.optimizers.FSAM(keras.optimizers.SGD(0.1, clipnorm=2.0), rho=0.1, sigma=0.7,
                                   momentum=0.6),
        "fisher": kg.optimizers.FisherSAM(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2),
                                          rho=0.2, eta=0.3),
    }


@pytest.mark.parametrize("name", ["sam", "asam", "fsam", "fisher"])
def test_get_config_from_config_round_trip(name):
    opt = all_optimizers()[name]
    config = opt.get_config()
    clone = type(opt).from_config(config)
    assert type(clone) is type(opt)
    assert clone.get_config() == config
    assert type(clone.base_optimizer) is type(opt.base_optimizer)
    assert clone.base_optimizer.get_config() == opt.base_optimizer.get_config()
    for attr in ("rho", "bn_stats", "dropout"):
        assert getattr(clone, attr) == getattr(opt, attr)
    for attr in ("adaptive", "eta", "sigma", "momentum"):
        if hasattr(opt, attr):
            assert getattr(clone, attr) == getattr(opt, attr)
    np.testing.assert_allclose(float(clone.learning_rate), float(opt.learning_rate))
    # Through Keras' generic (de)serialisation too (registered classes).
    again = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(again) is type(opt)
    assert again.get_config() == config


def test_learning_rate_and_iterations_delegate_to_the_base():
    base = keras.optimizers.SGD(0.05)
    opt = kg.optimizers.SAM(base, rho=0.1)
    np.testing.assert_allclose(float(opt.learning_rate), 0.05)
    opt.learning_rate = 0.02
    np.testing.assert_allclose(float(base.learning_rate), 0.02)
    assert opt.iterations is base.iterations


# ---------------------------------------------------------- validation ----
def _bad_constructions():
    sgd = keras.optimizers.SGD
    return {
        "negative_rho": lambda: kg.optimizers.SAM(sgd(0.1), rho=-0.1),
        "nan_rho": lambda: kg.optimizers.SAM(sgd(0.1), rho=float("nan")),
        "inf_rho": lambda: kg.optimizers.SAM(sgd(0.1), rho=math.inf),
        "string_rho": lambda: kg.optimizers.SAM(sgd(0.1), rho="big"),
        "fsam_negative_rho": lambda: kg.optimizers.FSAM(sgd(0.1), rho=-1.0),
        "fsam_nan_rho": lambda: kg.optimizers.FSAM(sgd(0.1), rho=float("nan")),
        "fisher_negative_rho": lambda: kg.optimizers.FisherSAM(sgd(0.1), rho=-0.5),
        "fisher_nan_rho": lambda: kg.optimizers.FisherSAM(sgd(0.1), rho=float("nan")),
        "fisher_zero_eta": lambda: kg.optimizers.FisherSAM(sgd(0.1), rho=0.1, eta=0.0),
        "asam_negative_eta": lambda: kg.optimizers.SAM(sgd(0.1), rho=0.1, adaptive=True, eta=-1.0),
        "fsam_negative_sigma": lambda: kg.optimizers.FSAM(sgd(0.1), rho=0.1, sigma=-1.0),
        "fsam_momentum_one": lambda: kg.optimizers.FSAM(sgd(0.1), rho=0.1, momentum=1.0),
        "bad_bn_stats": lambda: kg.optimizers.SAM(sgd(0.1), bn_stats="both"),
        "fsam_bad_bn_stats": lambda: kg.optimizers.FSAM(sgd(0.1), bn_stats=None),
        "bad_dropout": lambda: kg.optimizers.SAM(sgd(0.1), dropout="never"),
        "base_not_optimizer": lambda: kg.optimizers.SAM(0.1),
        "base_is_object": lambda: kg.optimizers.FisherSAM(object()),
        "base_is_model": lambda: kg.optimizers.SAM(keras.Sequential([keras.layers.Dense(1)])),
        "base_is_two_pass": lambda: kg.optimizers.SAM(kg.optimizers.SAM(sgd(0.1))),
        "base_is_loss_scale": lambda: kg.optimizers.SAM(keras.optimizers.LossScaleOptimizer(sgd(0.1))),
        "weight_decay_1e-4": lambda: kg.optimizers.SAM(sgd(0.1), weight_decay=1e-4),
        "weight_decay_0.5": lambda: kg.optimizers.FSAM(sgd(0.1), weight_decay=0.5),
        "weight_decay_0.99": lambda: kg.optimizers.SAM(sgd(0.1), weight_decay=0.99),
        "fisher_weight_decay": lambda: kg.optimizers.FisherSAM(sgd(0.1), weight_decay=5e-4),
        "clipnorm": lambda: kg.optimizers.SAM(sgd(0.1), clipnorm=1.0),
        "use_ema": lambda: kg.optimizers.SAM(sgd(0.1), use_ema=True),
        "gradient_accumulation": lambda: kg.optimizers.SAM(sgd(0.1), gradient_accumulation_steps=2),
        "unknown_kwarg": lambda: kg.optimizers.SAM(sgd(0.1), rhoo=0.1),
    }


@pytest.mark.parametrize("case", sorted(_bad_constructions()))
def test_bad_hyperparameters_raise_at_construction(case):
    with pytest.raises(ValueError):
        _bad_constructions()[case]()


def test_valid_edge_hyperparameters_construct():
    sgd = keras.optimizers.SGD
    kg.optimizers.SAM(sgd(0.1), rho=0.0)
    kg.optimizers.SAM(sgd(0.1), rho=0, adaptive=True, eta=0.0)
    kg.optimizers.FSAM(sgd(0.1), rho=0.0, sigma=0.0, momentum=0.0)
    kg.optimizers.FisherSAM(sgd(0.1), rho=0.0, eta=1e-12)
    kg.optimizers.SAM("sgd", rho=0.1)  # a base optimizer identifier
    opt = kg.optimizers.SAM(sgd(0.1), bn_stats="perturbed", dropout="same")
    assert (opt.bn_stats, opt.dropout) == ("perturbed", "same")
