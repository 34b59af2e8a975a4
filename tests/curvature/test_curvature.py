"""Exactness tests of keras_geosam.curvature against an explicit float64 reference.

Runs on whichever Keras backend is active (one process per backend). Every
model is tiny, its weights are set from NumPy (never from a backend
initialiser), and each curvature product is compared with the explicit
matrix built by ``reference.py`` (hand-written jax.numpy model, full Hessian /
Gauss-Newton matrix / per-example Jacobian) times the same vectors.

Tolerances: relative error ``||a - b|| / ||b||`` over the flattened result.
float64 products vs the reference: 1e-8 (EXACT); forward pass, float64
reductions and streamed-vs-one-batch: 1e-12 (TIGHT); cross-backend float32:
1e-5. A case whose Keras layers themselves compute in float32 although floatx
is float64 (Keras 3.15 does so for some ops on jax and torch; detected by
probing Keras, see `keras_float32_ops`) is held to 1e-6 (KERAS_F32) instead,
and its failure message says which ops caused that.
"""

import functools

import keras
import numpy as np
import pytest

from keras_geosam import curvature as kc

from reference import curvature as ref
from locations import import_worker, start_on_other_backends

BACKEND = keras.backend.backend()

EXACT = 1e-8  # float64 curvature products vs explicit matrices
TIGHT = 1e-12  # forward passes; streamed vs single batch; float64 reductions
# Keras 3.15 computes some float64 ops in float32 on some backends (its
# `result_type` maps float64 -> float32 outside TensorFlow): `ops.matmul` (so
# every Dense layer) on torch, BatchNormalization and `ops.mean` on jax and
# torch, `ops.tanh` on jax. A case whose Keras layers do so is only float32
# accurate whatever the package does, and is checked at this tolerance
# (observed errors there: 3e-8 .. 2e-7); the ops concerned are detected by
# probing Keras (`keras_float32_ops`), not by backend name.
KERAS_F32 = 1e-6
CROSS_BACKEND = 1e-5  # float32, identical weights, different backends
# Sharpness estimates with the same seed: the same probes and labels on every
# backend, so probe values and exact parts agree like products do.
CROSS_BACKEND_ESTIMATES = 1e-5
ESTIMATES = ("trace_probes", "trace_split", "sr_diag", "sr_kfac", "fisher_mc", "lm_trace_split", "lm_sr_diag", "lm_sr_kfac",
             "lm_fisher_mc", "mo_sr_kfac", "mo_fisher_mc")

N, D, K = 7, 4, 3  # examples, input features, classes


def to_np(t):
    return ref.to_numpy(t)


def np_list(ts):
    return [to_np(t) for t in ts]


@functools.lru_cache(maxsize=None)
def keras_float32_ops():
    """Keras layer ops that evaluate float64 inputs in float32 on this backend."""
    from keras import ops

    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(4, 3)), rng.normal(size=(3, 2))
    x, k = rng.normal(size=(1, 4, 4, 2)), rng.normal(size=(2, 2, 2, 3))
    var = np.array([0.5, 1.3, 2.0])
    bn = keras.layers.BatchNormalization(dtype="float64")
    bn.build((None, 3))
    bn.moving_variance.assign(var)
    probes = {
        "matmul": (lambda: ops.matmul(a, b), a @ b),
        "tanh": (lambda: ops.tanh(a), np.tanh(a)),
        "mean": (lambda: ops.mean(a, axis=0), a.sum(0) / a.shape[0]),
        "conv": (
            lambda: ops.conv(x, k),
            sum(np.einsum("nhwc,cf->nhwf", x[:, i : i + 3, j : j + 3], k[i, j]) for i in range(2) for j in range(2)),
        ),
        "batchnorm": (lambda: bn(a, training=False), a / np.sqrt(var + bn.epsilon)),
    }
    lossy = set()
    for name, (fn, exact) in probes.items():
        if ref.rel_err(fn(), exact) > 1e-13:
            lossy.add(name)
    return frozenset(lossy)


# ------------------------------------------------------------- the cases --
class Case:
    """A Keras model plus the same function written by hand in reference.py.

    `keras_ops` names the Keras ops the model's layers rely on that
    `keras_float32_ops` probes; they decide the case's tolerance.
    """

    def __init__(self, name, model, ordered, logits_fn, x, y, keras_ops, regularizer=None, softmax_output=False):
        self.name = name
        self.model = model
        # The hand-written reference takes parameters in `ordered`; the
        # package returns lists in `model.trainable_variables` order: check
        # once that they are the same objects in the same order.
        tv = list(model.trainable_variables)
        assert len(tv) == len(ordered) and all(a is b for a, b in zip(tv, ordered)), (
            name,
            [v.path for v in tv],
        )
        self.x, self.y = x, y
        self.softmax_output = softmax_output
        self.lossy_ops = sorted(set(keras_ops) & keras_float32_ops())
        self.tol = KERAS_F32 if self.lossy_ops else EXACT
        self.tight = KERAS_F32 if self.lossy_ops else TIGHT
        self.ref = ref.Reference(logits_fn, [v.value for v in tv], x, y, regularizer)

    def why(self):
        if self.lossy_ops:
            return f" (tolerance {self.tol:g}: Keras evaluates {self.lossy_ops} in float32 on {BACKEND})"
        return f" (tolerance {self.tol:g})"

    @property
    def shapes(self):
        return self.ref.shapes

    def random_vectors(self, seed):
        rng = np.random.default_rng(seed)
        return [rng.normal(size=s) for s in self.shapes]

    @functools.cached_property
    def hessian(self):
        return self.ref.hessian()

    @functools.cached_property
    def ggn_mean(self):
        return self.ref.ggn("mean")

    def ggn(self, reduction):
        return self.ggn_mean if reduction == "mean" else self.ggn_mean * N


def _assign(variables, rng, scale=0.6):
    for v in variables:
        v.assign(scale * rng.normal(size=v.shape))


def _sparse_ce():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _data(rng, shape=(D,), one_hot=False):
    x = rng.normal(size=(N,) + shape)
    y = rng.integers(0, K, size=N).astype("int32")
    y[:K] = np.arange(K)  # every class present
    return x, (np.eye(K)[y] if one_hot else y)


def build_tanh_mlp():
    rng = np.random.default_rng(1)
    inp = keras.Input((D,))
    d1 = keras.layers.Dense(5, activation="tanh")
    d2 = keras.layers.Dense(4, activation="tanh")
    d3 = keras.layers.Dense(K)
    model = keras.Model(inp, d3(d2(d1(inp))))
    model.compile(loss=_sparse_ce())
    ordered = [d1.kernel, d1.bias, d2.kernel, d2.bias, d3.kernel, d3.bias]
    _assign(ordered, rng)
    x, y = _data(rng)
    return Case("tanh_mlp", model, ordered, ref.mlp(["tanh", "tanh", "linear"]), x, y, {"matmul", "tanh"})


def build_relu_mlp():
    rng = np.random.default_rng(2)
    d1 = keras.layers.Dense(6, activation="relu")
    d2 = keras.layers.Dense(5, activation="relu")
    d3 = keras.layers.Dense(K)
    model = keras.Sequential([keras.Input((D,)), d1, d2, d3])
    model.compile(loss=_sparse_ce())
    ordered = [d1.kernel, d1.bias, d2.kernel, d2.bias, d3.kernel, d3.bias]
    _assign(ordered, rng, 0.8)
    x, y = _data(rng)
    return Case("relu_mlp", model, ordered, ref.mlp(["relu", "relu", "linear"]), x, y, {"matmul"})


def build_conv():
    rng = np.random.default_rng(3)
    inp = keras.Input((5, 5, 2))
    conv = keras.layers.Conv2D(3, 3, activation="sigmoid")
    dense = keras.layers.Dense(K)
    model = keras.Model(inp, dense(keras.layers.Flatten()(conv(inp))))
    model.compile(loss=_sparse_ce())
    ordered = [conv.kernel, conv.bias, dense.kernel, dense.bias]
    _assign(ordered, rng, 0.5)
    x, y = _data(rng, (5, 5, 2))

    def logits(p, xx):
        h = ref.ACTIVATIONS["sigmoid"](ref.conv2d_valid(xx, p[0], p[1]))
        return ref.dense(h.reshape(h.shape[0], -1), p[2], p[3])

    return Case("conv", model, ordered, logits, x, y, {"conv", "matmul"})


def build_all_conv():
    """Conv2D -> Conv2D head covering the whole 3x3 map: no Dense (float64 on torch too)."""
    rng = np.random.default_rng(8)
    inp = keras.Input((5, 5, 2))
    c1 = keras.layers.Conv2D(3, 3, activation="softplus")
    c2 = keras.layers.Conv2D(K, 3)
    model = keras.Model(inp, keras.layers.Flatten()(c2(c1(inp))))
    model.compile(loss=_sparse_ce())
    ordered = [c1.kernel, c1.bias, c2.kernel, c2.bias]
    _assign(ordered, rng, 0.5)
    x, y = _data(rng, (5, 5, 2))

    def logits(p, xx):
        h = ref.ACTIVATIONS["softplus"](ref.conv2d_valid(xx, p[0], p[1]))
        return ref.conv2d_valid(h, p[2], p[3]).reshape(h.shape[0], -1)

    return Case("all_conv", model, ordered, logits, x, y, {"conv"})


def build_bn_dropout():
    rng = np.random.default_rng(4)
    inp = keras.Input((D,))
    d1 = keras.layers.Dense(6)
    bn = keras.layers.BatchNormalization()
    d2 = keras.layers.Dense(K)
    h = keras.layers.Activation("sigmoid")(bn(d1(inp)))
    model = keras.Model(inp, d2(keras.layers.Dropout(0.4, seed=3)(h)))
    model.compile(loss=_sparse_ce())
    ordered = [d1.kernel, d1.bias, bn.gamma, bn.beta, d2.kernel, d2.bias]
    _assign(ordered, rng, 0.7)
    bn.gamma.assign(1.0 + 0.3 * rng.normal(size=6))
    bn.moving_mean.assign(0.5 * rng.normal(size=6))
    bn.moving_variance.assign(rng.uniform(0.3, 2.0, size=6))
    mean, var = to_np(bn.moving_mean), to_np(bn.moving_variance)
    x, y = _data(rng)

    def logits(p, xx):
        h = ref.batchnorm_inference(ref.dense(xx, p[0], p[1]), p[2], p[3], mean, var, bn.epsilon)
        return ref.dense(ref.ACTIVATIONS["sigmoid"](h), p[4], p[5])

    return Case("bn_dropout", model, ordered, logits, x, y, {"matmul", "batchnorm"})


def build_softmax_onehot():
    rng = np.random.default_rng(5)
    inp = keras.Input((D,))
    d1 = keras.layers.Dense(5, activation="softplus")
    d2 = keras.layers.Dense(K, activation="softmax")
    model = keras.Model(inp, d2(d1(inp)))
    model.compile(loss="categorical_crossentropy")
    ordered = [d1.kernel, d1.bias, d2.kernel, d2.bias]
    _assign(ordered, rng)
    x, y = _data(rng, one_hot=True)
    # The reference returns the pre-softmax logits: the GGN of a softmax
    # output model is taken with respect to them.
    return Case(
        "softmax_onehot", model, ordered, ref.mlp(["softplus", "linear"]), x, y, {"matmul"}, softmax_output=True
    )


# Exactly representable in float32: Keras' regularisers cast their Python
# float coefficient with `ops.cast`, which on TensorFlow goes through a
# float32 constant (0.05 would become 0.0500000007).
L2_1, L2_2, L2_B = 0.0625, 0.03125, 0.046875


def build_regularized():
    rng = np.random.default_rng(6)
    inp = keras.Input((D,))
    d1 = keras.layers.Dense(5, activation="sigmoid", kernel_regularizer=keras.regularizers.L2(L2_1))
    d2 = keras.layers.Dense(
        K, kernel_regularizer=keras.regularizers.L2(L2_2), bias_regularizer=keras.regularizers.L2(L2_B)
    )
    model = keras.Model(inp, d2(d1(inp)))
    model.compile(loss=_sparse_ce())
    ordered = [d1.kernel, d1.bias, d2.kernel, d2.bias]
    _assign(ordered, rng, 0.8)
    x, y = _data(rng)

    def regularizer(p):
        return L2_1 * (p[0] ** 2).sum() + L2_2 * (p[2] ** 2).sum() + L2_B * (p[3] ** 2).sum()

    return Case("regularized", model, ordered, ref.mlp(["sigmoid", "linear"]), x, y, {"matmul"}, regularizer)


class Net(keras.Model):
    """The usual subclassed model: `call` takes no `training` argument."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(5, activation="softplus")
        self.out = keras.layers.Dense(K)

    def call(self, x):
        return self.out(self.hidden(x))


class NetWithTraining(Net):
    def call(self, x, training=False):
        return self.out(self.hidden(x, training=training), training=training)


def _build_subclassed(cls, name, seed):
    rng = np.random.default_rng(seed)
    model = cls()
    x, y = _data(rng)
    model(x[:2])  # build
    model.compile(loss=_sparse_ce())
    ordered = [model.hidden.kernel, model.hidden.bias, model.out.kernel, model.out.bias]
    _assign(ordered, rng)
    return Case(name, model, ordered, ref.mlp(["softplus", "linear"]), x, y, {"matmul"})


BUILDERS = {
    "tanh_mlp": build_tanh_mlp,
    "relu_mlp": build_relu_mlp,
    "conv": build_conv,
    "all_conv": build_all_conv,
    "bn_dropout": build_bn_dropout,
    "softmax_onehot": build_softmax_onehot,
    "regularized": build_regularized,
    "subclassed": lambda: _build_subclassed(Net, "subclassed", 7),
    "subclassed_training_arg": lambda: _build_subclassed(NetWithTraining, "subclassed_training_arg", 9),
}
_CASES = {}


def get_case(name):
    """Builds each case once per process (in float64) so compiled kernels are reused."""
    if name not in _CASES:
        assert keras.config.floatx() == "float64"
        _CASES[name] = BUILDERS[name]()
    return _CASES[name]


@pytest.fixture(params=list(BUILDERS))
def case(request, float64):
    return get_case(request.param)


def _loss_value(loss):
    return float(np.asarray(to_np(loss)).reshape(()))


# ------------------------------------------------------- sanity checks ----
def test_reference_computes_the_same_function(case):
    out = to_np(case.model(case.x, training=False))
    logits = np.asarray(case.ref.logits())
    expected = case.ref.probs() if case.softmax_output else logits
    err = ref.rel_err(out, expected)
    assert err <= case.tight, f"{case.name}: forward relative error {err:.2e}" + case.why()


def test_loss_is_float64_mean_of_model_outputs(case):
    """The package's own reductions add no rounding to the model's outputs.

    Independent of the layers' precision: the loss is recomputed in NumPy
    float64 from the outputs Keras itself gives for these weights.
    """
    out = to_np(case.model(case.x, training=False))
    if case.softmax_output:
        logp = np.log(out)
    else:
        z = out - out.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    y = np.asarray(case.y)
    per_ex = -logp[np.arange(N), y] if y.ndim == 1 else -(y * logp).sum(-1)
    expected = per_ex.sum() / N + float(case.ref.reg(case.ref.theta))
    loss, _ = kc.loss_and_gradient(case.model, case.x, case.y)
    err = abs(_loss_value(loss) - expected) / abs(expected)
    # (Where Keras' layers run in float32, jitted and eager calls may round differently.)
    assert err <= case.tight, (
        f"{case.name}: loss {_loss_value(loss)!r} vs float64 mean {expected!r}: {err:.2e}" + case.why()
    )


# ----------------------------------------------------- exact products ----
def test_hvp_matches_full_hessian(case):
    for seed in (0, 1):
        v = case.random_vectors(seed)
        hv = kc.hvp(case.model, case.x, case.y, v)
        assert [tuple(to_np(h).shape) for h in hv] == [tuple(s) for s in case.shapes]
        err = ref.rel_err(hv, case.hessian @ ref.flatten(v))
        assert err <= case.tol, f"{case.name}: hvp relative error {err:.2e}" + case.why()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_ggnvp_matches_explicit_ggn(case, reduction):
    for seed in (2, 3):
        v = case.random_vectors(seed)
        gv = kc.ggnvp(case.model, case.x, case.y, v, reduction=reduction)
        err = ref.rel_err(gv, case.ggn(reduction) @ ref.flatten(v))
        assert err <= case.tol, f"{case.name}/{reduction}: ggnvp relative error {err:.2e}" + case.why()


def test_loss_and_gradient(case):
    loss, grads = kc.loss_and_gradient(case.model, case.x, case.y)
    expected = float(case.ref.loss())
    err = abs(_loss_value(loss) - expected) / abs(expected)
    assert err <= case.tol, f"{case.name}: loss relative error {err:.2e}" + case.why()
    err = ref.rel_err(grads, case.ref.gradient())
    assert err <= case.tol, f"{case.name}: gradient relative error {err:.2e}" + case.why()


def test_per_example_gradients(case):
    pe = kc.per_example_gradients(case.model, case.x, case.y)
    assert [tuple(to_np(g).shape) for g in pe] == [(N,) + tuple(s) for s in case.shapes]
    err = ref.rel_err(ref.flatten_rows(pe), case.ref.per_example_gradients())
    assert err <= case.tol, f"{case.name}: per-example gradient relative error {err:.2e}" + case.why()


@pytest.mark.parametrize("name", ["regularized", "bn_dropout"])
def test_streaming_equals_one_batch(name, float64):
    """batch_size=3 on N=7 (batches 3 + 3 + 1, weighted by size) = one batch."""
    case = get_case(name)
    m, x, y = case.model, case.x, case.y
    v = case.random_vectors(5)
    bs = 3
    pairs = {
        "hvp": (kc.hvp(m, x, y, v, batch_size=bs), kc.hvp(m, x, y, v)),
        "ggnvp mean": (kc.ggnvp(m, x, y, v, batch_size=bs), kc.ggnvp(m, x, y, v)),
        "ggnvp sum": (
            kc.ggnvp(m, x, y, v, reduction="sum", batch_size=bs),
            kc.ggnvp(m, x, y, v, reduction="sum"),
        ),
        "gradient": (kc.loss_and_gradient(m, x, y, batch_size=bs)[1], kc.loss_and_gradient(m, x, y)[1]),
        "per-example": (
            [ref.flatten_rows(kc.per_example_gradients(m, x, y, batch_size=bs))],
            [ref.flatten_rows(kc.per_example_gradients(m, x, y))],
        ),
    }
    for what, (streamed, whole) in pairs.items():
        err = ref.rel_err(streamed, whole)
        assert err <= case.tight, f"{name}: {what} with batch_size={bs}: {err:.2e}" + case.why()
    # The streamed results are also right, not merely self-consistent.
    loss = _loss_value(kc.loss_and_gradient(m, x, y, batch_size=bs)[0])
    assert abs(loss - float(case.ref.loss())) <= case.tol * abs(float(case.ref.loss())), case.why()
    assert ref.rel_err(pairs["hvp"][0], case.hessian @ ref.flatten(v)) <= case.tol, case.why()
    assert ref.rel_err(pairs["ggnvp mean"][0], case.ggn("mean") @ ref.flatten(v)) <= case.tol, case.why()
    assert ref.rel_err(pairs["ggnvp sum"][0], case.ggn("sum") @ ref.flatten(v)) <= case.tol, case.why()
    assert ref.rel_err(pairs["gradient"][0], case.ref.gradient()) <= case.tol, case.why()
    assert ref.rel_err(pairs["per-example"][0], [case.ref.per_example_gradients()]) <= case.tol, case.why()


# ------------------------------------------------- targeted properties ----
def test_linear_model_hessian_equals_ggn(float64, rng):
    """Logits linear in the parameters: no second-order term, H = GGN exactly."""
    dense = keras.layers.Dense(K)
    model = keras.Sequential([keras.Input((D,)), dense])
    model.compile(loss=_sparse_ce())
    model.set_weights([rng.normal(size=(D, K)), rng.normal(size=K)])
    x, y = _data(rng)
    v = [rng.normal(size=(D, K)), rng.normal(size=K)]
    hv = kc.hvp(model, x, y, v)
    gv = kc.ggnvp(model, x, y, v)
    tol = KERAS_F32 if "matmul" in keras_float32_ops() else EXACT
    assert ref.rel_err(hv, gv) <= tol
    r = ref.Reference(ref.mlp(["linear"]), model.trainable_variables, x, y)
    assert ref.rel_err(gv, r.hessian() @ ref.flatten(v)) <= tol
    # Whereas a deeper net (even ReLU: products of weights) has one.
    relu = get_case("relu_mlp")
    v = relu.random_vectors(6)
    diff = ref.rel_err(kc.hvp(relu.model, relu.x, relu.y, v), kc.ggnvp(relu.model, relu.x, relu.y, v))
    assert diff > 1e-3


def test_hvp_includes_regularizer_hessian(float64):
    case = get_case("regularized")
    v = case.random_vectors(7)
    hv = ref.flatten(kc.hvp(case.model, case.x, case.y, v))
    data_only = ref.Reference(case.ref.logits_fn, case.ref.params, case.x, case.y)
    reg_part = hv - data_only.hessian() @ ref.flatten(v)
    # Hessian of l2 * ||W||^2 is 2 * l2 * I on W.
    expected = ref.flatten([2 * L2_1 * v[0], np.zeros_like(v[1]), 2 * L2_2 * v[2], 2 * L2_B * v[3]])
    assert np.linalg.norm(expected) > 0.1 * np.linalg.norm(hv)  # not negligible
    assert np.linalg.norm(reg_part - expected) <= case.tol * np.linalg.norm(hv), case.why()


def test_ggn_and_per_example_exclude_regularizer(float64):
    case = get_case("regularized")
    v = case.random_vectors(8)
    gv = kc.ggnvp(case.model, case.x, case.y, v)
    reg_hv = ref.flatten([2 * L2_1 * v[0], 0 * v[1], 2 * L2_2 * v[2], 2 * L2_B * v[3]])
    assert ref.rel_err(gv, case.ggn_mean @ ref.flatten(v)) <= case.tol
    assert ref.rel_err(gv, case.ggn_mean @ ref.flatten(v) + reg_hv) > 1e-2
    # Per-example gradients carry no regulariser: their mean is the data gradient.
    pe = ref.flatten_rows(kc.per_example_gradients(case.model, case.x, case.y))
    reg_grad = ref.flatten([2 * L2_1 * case.ref.params[0], 0 * case.ref.params[1], 2 * L2_2 * case.ref.params[2], 2 * L2_B * case.ref.params[3]])
    _, grads = kc.loss_and_gradient(case.model, case.x, case.y)
    assert ref.rel_err(pe.mean(0) + reg_grad, ref.flatten(grads)) <= case.tol


def test_loss_and_gradient_at_other_params(float64):
    case = get_case("regularized")
    before = np_list(case.model.trainable_variables)
    rng = np.random.default_rng(9)
    other = [p + 0.3 * rng.normal(size=p.shape) for p in before]
    loss, grads = kc.loss_and_gradient(case.model, case.x, case.y, params=other)
    r = ref.Reference(case.ref.logits_fn, other, case.x, case.y, case.ref.regularizer)
    assert abs(_loss_value(loss) - float(r.loss())) <= case.tol * abs(float(r.loss()))
    assert ref.rel_err(grads, r.gradient()) <= case.tol
    # Nothing was assigned.
    assert ref.rel_err(np_list(case.model.trainable_variables), before) == 0.0


def test_hvp_regression_loss_analytic(float64, rng):
    """hvp is not tied to classifiers: linear model + MSE has H = 2/(N K) [X 1]^T [X 1] (x) I."""
    model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(2)])
    model.compile(loss="mse")
    model.set_weights([rng.normal(size=(D, 2)), rng.normal(size=2)])
    x, y = rng.normal(size=(N, D)), rng.normal(size=(N, 2))
    vw, vb = rng.normal(size=(D, 2)), rng.normal(size=2)
    hw, hb = kc.hvp(model, x, y, [vw, vb])
    a = np.concatenate([x, np.ones((N, 1))], axis=1)
    h_full = 2.0 / (N * 2) * a.T @ a  # (D+1, D+1), acting on [W; b] per output column
    out = h_full @ np.concatenate([vw, vb[None]], axis=0)
    # Keras' own mean_squared_error reduces with ops.mean.
    tol = KERAS_F32 if {"matmul", "mean"} & keras_float32_ops() else EXACT
    assert ref.rel_err([hw, hb], [out[:D], out[D]]) <= tol


# ------------------------------------------------------ sampled labels ----
@pytest.mark.parametrize("name", ["tanh_mlp", "softmax_onehot"])
def test_sampled_label_gradients(name, float64):
    case = get_case(name)
    s = 3
    grads, labels = kc.sampled_label_gradients(case.model, case.x, num_samples=s, seed=11)
    labels = np.asarray(labels)
    assert labels.shape == (N * s,)
    assert np.issubdtype(labels.dtype, np.integer)
    assert labels.min() >= 0 and labels.max() < K
    assert [tuple(to_np(g).shape) for g in grads] == [(N * s,) + tuple(sh) for sh in case.shapes]

    # Deterministic for a seed (labels and gradients), different for another.
    grads2, labels2 = kc.sampled_label_gradients(case.model, case.x, num_samples=s, seed=11)
    np.testing.assert_array_equal(np.asarray(labels2), labels)
    assert ref.rel_err(grads2, grads) == 0.0
    _, labels3 = kc.sampled_label_gradients(case.model, case.x, num_samples=s, seed=12)
    assert not np.array_equal(np.asarray(labels3), labels)

    # Gradients of -log p(label | x), sample-major: row m is x[m % N].
    xs = np.concatenate([case.x] * s, axis=0)
    expected = case.ref.nll_gradients(xs, labels)
    err = ref.rel_err(ref.flatten_rows(grads), expected)
    assert err <= case.tol, f"{name}: sampled-label gradients relative error {err:.2e}" + case.why()

    # Streaming (N * s = 21 rows in batches of 7) gives the same draw and gradients.
    grads4, labels4 = kc.sampled_label_gradients(case.model, case.x, num_samples=s, seed=11, batch_size=N)
    np.testing.assert_array_equal(np.asarray(labels4), labels)
    assert ref.rel_err(grads4, grads) <= case.tight

    # The predictive distribution the labels are drawn from.
    probs = kc.predict_probs(case.model, case.x)
    assert ref.rel_err(probs, case.ref.probs()) <= case.tight


def test_sample_labels_follow_probabilities():
    probs = np.array([[0.7, 0.2, 0.1], [0.05, 0.05, 0.9], [0.0, 1.0, 0.0]])
    s = 20000
    labels = kc.sample_labels(probs, s, seed=0).reshape(s, 3)
    for i in range(3):
        freq = np.bincount(labels[:, i], minlength=3) / s
        np.testing.assert_allclose(freq, probs[i], atol=0.015)
    assert np.all(labels[:, 2] == 1)
    np.testing.assert_array_equal(kc.sample_labels(probs, 5, seed=3), kc.sample_labels(probs, 5, seed=3))
    with pytest.raises(ValueError, match="num_samples"):
        kc.sample_labels(probs, 0, seed=0)


# ----------------------------------------------------------- bad input ----
def test_losses_without_a_likelihood_or_labels_to_sample_raise(float64, rng):
    model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(2)])
    model.compile(loss="mse")
    v = [rng.normal(size=w.shape) for w in model.get_weights()]
    x = rng.normal(size=(N, D))
    # A Gaussian has no class labels to draw; MAE is no likelihood at all.
    with pytest.raises(ValueError, match="classifier"):
        kc.sampled_label_gradients(model, x)
    with pytest.raises(ValueError, match="mean_absolute_error.*no likelihood"):
        kc.ggnvp(model, x, None, v, loss=keras.losses.MeanAbsoluteError())


@pytest.mark.parametrize("fn", ["hvp", "ggnvp"])
def test_bad_vectors_raise(fn, float64):
    case = get_case("tanh_mlp")
    m, x, y = case.model, case.x, case.y
    v = case.random_vectors(0)

    def call(vectors):
        return getattr(kc, fn)(m, x, y, vectors)

    with pytest.raises(ValueError, match=r"one array per trainable variable \(6\).*length 5"):
        call(v[:-1])
    with pytest.raises(ValueError, match=r"one array per trainable variable \(6\).*length 7"):
        call(v + [v[0]])
    with pytest.raises(ValueError, match="one array per trainable variable"):
        call(ref.flatten(v))  # a flat vector, not a list
    bad = list(v)
    bad[2] = v[2].T  # (4, 5) instead of (5, 4)
    var = case.model.trainable_variables[2]
    with pytest.raises(ValueError, match=r"shape \(4, 5\) does not match variable") as info:
        call(bad)
    assert var.path in str(info.value) and "(5, 4)" in str(info.value)
    bad[2] = v[2].ravel()
    with pytest.raises(ValueError, match="does not match variable"):
        call(bad)


def test_other_bad_arguments_raise(float64, rng):
    case = get_case("tanh_mlp")
    m, x, y = case.model, case.x, case.y
    v = case.random_vectors(0)
    with pytest.raises(ValueError, match="reduction"):
        kc.ggnvp(m, x, y, v, reduction="max")
    with pytest.raises(ValueError, match="vectors"):
        kc.ggnvp(m, x, y)
    with pytest.raises(ValueError, match="batch_size"):
        kc.hvp(m, x, y, v, batch_size=0)
    with pytest.raises(ValueError, match="params"):
        kc.loss_and_gradient(m, x, y, params=v[:2])
    with pytest.raises(ValueError, match="not built"):
        kc.hvp(Net(), x, y, v)
    unc = keras.Sequential([keras.Input((D,)), keras.layers.Dense(K)])
    with pytest.raises(ValueError, match="loss"):
        kc.hvp(unc, x, y, [rng.normal(size=w.shape) for w in unc.get_weights()])


# --------------------------------------------------------- cross-backend ----
@pytest.mark.cross_backend
@pytest.mark.skipif(BACKEND != "jax", reason="runs once per suite, from the JAX process")
def test_float32_results_agree_across_backends(tmp_path):
    """Identical float32 weights and data give the same products, and the
    same seed the same probes and estimates, on all backends."""
    collect = start_on_other_backends("cross_backend_worker.py", tmp_path)
    # The JAX results are computed here, in float32, while the others run.
    assert keras.config.floatx() == "float32"
    cross_backend_worker = import_worker("cross_backend_worker")

    results = {"jax": cross_backend_worker.compute()}
    results.update(collect(timeout=300))

    base = results["jax"]
    problems = [f"{b}: {e}" for b in results for e in results[b]["errors"]]
    for b in ("tensorflow", "torch"):
        np.testing.assert_array_equal(results[b]["weights"], base["weights"])
        np.testing.assert_array_equal(results[b]["lm_weights"], base["lm_weights"])
        np.testing.assert_array_equal(results[b]["mo_weights"], base["mo_weights"])
        for key in ("loss", "grad", "hvp", "ggnvp", "per_example", "sampled", "labels",
                    "trace_probes", "trace_split", "sr_diag", "sr_kfac", "fisher_mc",
                    "lm_loss", "lm_grad", "lm_hvp", "lm_ggnvp", "lm_per_example",
                    "lm_trace_split", "lm_sr_diag", "lm_sr_kfac", "lm_fisher_mc",
                    "mo_loss", "mo_grad", "mo_ggnvp", "mo_per_example", "mo_sr_kfac", "mo_fisher_mc"):
            if key not in results[b] or key not in base:
                continue  # failed to compute: listed in `problems`
            if key == "labels":
                if not np.array_equal(results[b][key], base[key]):
                    problems.append(f"{b}: sampled labels differ from jax")
                continue
            if key not in ESTIMATES:  # estimates are float64 summaries of float32 work
                # the Transformer (lm_*) runs in float64 (cross_backend_worker.transformer)
                if key != "lm_loss":  # a scalar that TensorFlow reports in float32
                    assert results[b][key].dtype == (np.float64 if key.startswith("lm_") else np.float32), (b, key)
            err = ref.rel_err(results[b][key], base[key])
            # Estimates pass through (pseudo-)inverses of the metric: 1e-5.
            tol = CROSS_BACKEND_ESTIMATES if key in ESTIMATES else CROSS_BACKEND
            if not err <= tol:
                problems.append(f"{key}: {b} vs jax relative error {err:.2e}")
    assert not problems, "\n".join(problems)
