"""LLQR's learned preconditioner U against explicit float64 matrices.

Runs on whichever Keras backend is active (one process per backend).
Spec: shared/spec/llqr-sam.md, section 1. Nothing on the reference side goes
through keras_geosam: the model is written by hand in ``jax.numpy``
(``reference.py``) and every operator is an explicit matrix over the flat
parameter vector (each tensor raveled row-major, tensors concatenated in
``model.trainable_variables`` order):

- blocks: ``diag(vec d)``; K-FAC ``kron(A, B)`` (``vec_row(A X B^T) =
  kron(A, B) vec_row(X)``); EK-FAC ``(QA kron QG) diag(vec s) (QA kron QG)^T``;
- ``G``: for ``divergence="ngd"`` the Gauss-Newton/Fisher matrix **summed**
  over the batch, ``sum_n J_n^T (diag p_n - p_n p_n^T) J_n``; for
  ``"newton"`` the Hessian of the mean loss (``jax.hessian``);
- ``gbar``: gradient of the mean loss with BatchNormalization in inference
  mode (moving statistics), so a training-mode linearisation would fail.

Tolerances. Where Keras evaluates the float64 model exactly (TensorFlow) the
comparisons hold to 1e-10. Keras 3.15 evaluates some float64 ops in float32
on other backends (``ops.matmul`` on torch, BatchNormalization on jax and
torch, ``ops.mean`` on jax: see ``test_curvature.py``); there the bound is
2e-6, still four orders below what a wrong convention, a missing batch sum
or a training-mode linearisation produces (checked by the negative
assertions below, which need a relative error of at least 0.1).
"""

import functools

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
from keras import ops

import keras_geosam as kg
from reference import curvature as ref
from keras_geosam import preconditioner as pc
from keras_geosam.curvature.functional import ModelFunctions

BACKEND = keras.backend.backend()
N, D_IN, HIDDEN, K = 6, 3, 4, 3
WRONG = 0.1  # a wrong operator is at least this far off (relative)
# Keras on torch turns Python scalars (learning rate, clip norm, floor) into
# float32 tensors before they meet float64 ones: 1e-7 relative at most.
SCALAR = 1e-6


@functools.lru_cache(maxsize=None)
def f64_tolerance():
    """1e-10 if Keras computes this model's float64 ops exactly, else 2e-6."""
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(4, 3)), rng.normal(size=(3, 2))
    var = np.array([0.5, 1.3, 2.0])
    bn = keras.layers.BatchNormalization(dtype="float64")
    bn.build((None, 3))
    bn.moving_variance.assign(var)
    probes = [
        (ops.matmul(ops.convert_to_tensor(a, "float64"), ops.convert_to_tensor(b, "float64")), a @ b),
        (ops.mean(ops.convert_to_tensor(a, "float64")), a.mean()),
        (bn(ops.convert_to_tensor(a, "float64"), training=False), a / np.sqrt(var + bn.epsilon)),
    ]
    exact = all(ref.rel_err(got, want) < 1e-13 for got, want in probes)
    return 1e-10 if exact else 2e-6


@pytest.fixture
def f64():
    """float64 layers. conftest's ``float64`` only sets floatx, which Keras
    ignores once any layer has been created in the process (the global dtype
    policy is fixed then); set and restore both here."""
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        yield "float64"
    finally:
        keras.config.set_floatx(floatx)
        keras.config.set_dtype_policy(policy)


def t64(a):
    return ops.convert_to_tensor(np.asarray(a, np.float64), "float64")


def np_list(ts):
    return [ref.to_numpy(t) for t in ts]


# ================================================================ blocks ==
def explicit_block(kind, params, shape):
    """The block's explicit (size x size) matrix on the row-major raveled tensor."""
    if kind == "diagonal":
        return np.diag(np.ravel(params[0]))
    if kind == "kfac":
        A, B = params
        return np.kron(A, B)
    QA, QG, s = params
    Q = np.kron(QA, QG)
    return Q @ np.diag(np.ravel(s)) @ Q.T


KINDS = {"diagonal": kg.curvature.Diagonal, "kfac": kg.curvature.KFAC, "ekfac": kg.curvature.EKFAC}


def spec(kind, shape):
    """A one-tensor layout entry ``(class, shape, split)``."""
    return (KINDS[kind], tuple(shape), None if kind == "diagonal" else len(shape) - 1)


def kind_of(entry):
    return {v: k for k, v in KINDS.items()}[entry[0]]


def param_specs(entry):
    cls, shape, split = entry
    return cls.param_specs(shape, split)


def random_params(entry, rng):
    out = []
    for name, shape, _, _ in param_specs(entry):
        if name in ("d", "s"):
            out.append(rng.uniform(0.2, 2.0, size=shape))
        else:  # A, B, QA, QG: generic (not symmetric, not orthogonal)
            out.append(np.eye(shape[0]) + 0.5 * rng.normal(size=shape))
    return out


def test_kron_convention():
    """The convention the explicit matrices rely on: U(X) = A X B^T equals
    kron(A, B) acting on vec_row(X), not kron(B, A)."""
    rng = np.random.default_rng(1)
    A, B, X = rng.normal(size=(3, 3)), rng.normal(size=(4, 4)), rng.normal(size=(3, 4))
    np.testing.assert_allclose(np.kron(A, B) @ X.ravel(), (A @ X @ B.T).ravel(), rtol=1e-12, atol=1e-12)
    assert ref.rel_err(np.kron(B, A) @ X.ravel(), (A @ X @ B.T).ravel()) > WRONG


@pytest.mark.parametrize("kind", ["diagonal", "kfac", "ekfac"])
@pytest.mark.parametrize("shape", [(3, 4), (2, 2, 3, 4)], ids=["dense", "conv"])
def test_block_apply_equals_explicit_matrix(kind, shape):
    rng = np.random.default_rng(2)
    entry = spec(kind, shape)
    params = random_params(entry, rng)
    x = rng.normal(size=shape)
    got = ref.to_numpy(pc.operator([entry], [t64(p) for p in params]).matvec([t64(x)])[0])
    assert got.shape == shape
    want = (explicit_block(kind, params, shape) @ x.ravel()).reshape(shape)
    assert ref.rel_err(got, want) < f64_tolerance()  # ops.matmul is float32 on torch
    if kind == "kfac":
        # Teeth: the transposed Kronecker convention is another operator.
        assert ref.rel_err(got.ravel(), np.kron(params[1], params[0]) @ x.ravel()) > WRONG


@pytest.mark.parametrize("kind", ["diagonal", "kfac", "ekfac"])
def test_block_initialisers_are_the_identity(kind):
    shape = (3, 4)
    specs = param_specs(spec(kind, shape))
    init = []
    for name, pshape, how, positive in specs:
        assert positive == (name in ("d", "s")), name
        assert how in ("ones", "identity"), (name, how)
        init.append(np.ones(pshape) if how == "ones" else np.eye(pshape[0]))
        if how == "identity":
            assert pshape[0] == pshape[1]
    np.testing.assert_allclose(explicit_block(kind, init, shape), np.eye(12), atol=0)
    expected = {"diagonal": [("d", (3, 4))], "kfac": [("A", (3, 3)), ("B", (4, 4))],
                "ekfac": [("QA", (3, 3)), ("QG", (4, 4)), ("s", (3, 4))]}[kind]
    assert [(s[0], tuple(s[1])) for s in specs] == expected


def test_precondition_applies_each_block_to_its_tensor():
    rng = np.random.default_rng(3)
    blocks = [spec("kfac", (3, 4)), spec("diagonal", (4,)), spec("ekfac", (4, 2)), spec("diagonal", (2,))]
    params = [random_params(b, rng) for b in blocks]
    vecs = [rng.normal(size=b[1]) for b in blocks]
    flat = [t64(p) for ps in params for p in ps]
    got = np_list(pc.operator(blocks, flat).matvec([t64(v) for v in vecs]))
    U = _block_diag([explicit_block(kind_of(b), p, b[1]) for b, p in zip(blocks, params)])
    assert ref.rel_err(ref.flatten(got), U @ ref.flatten(vecs)) < f64_tolerance()


def _block_diag(mats):
    size = sum(m.shape[0] for m in mats)
    out, i = np.zeros((size, size)), 0
    for m in mats:
        k = m.shape[0]
        out[i:i + k, i:i + k] = m
        i += k
    return out


@functools.lru_cache(maxsize=None)
def _zoo():
    z = {"kernel_initializer": "zeros"}  # no RNG kernels to compile: weights are never used
    inp = keras.Input((6, 6, 2))
    h = keras.layers.Conv2D(3, 3, name="conv", **z)(inp)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(5, name="dense", **z)(h)
    h = keras.layers.LayerNormalization(name="ln")(h)
    h = keras.layers.EinsumDense("ab,bc->ac", output_shape=4, bias_axes="c", name="einsum", **z)(h)
    return keras.Model(inp, keras.layers.Dense(3, use_bias=False, name="head", **z)(h))


@pytest.mark.parametrize("structure", ["diagonal", "kfac", "ekfac"])
def test_make_blocks_gives_matrix_blocks_only_to_kernels(structure):
    model = _zoo()
    variables = model.trainable_variables
    blocks = pc.layout(variables, structure)
    assert len(blocks) == len(variables)
    kernels = {"conv/kernel": (3 * 3 * 2, 3), "dense/kernel": (16 * 3, 5),
               "einsum/kernel": (5, 4), "head/kernel": (4, 3)}
    seen = set()
    for v, b in zip(variables, blocks):
        assert tuple(b[1]) == tuple(v.shape), v.path
        if structure != "diagonal" and v.path in kernels:
            assert kind_of(b) == structure, v.path
            view = (int(np.prod(b[1][: b[2]])), int(np.prod(b[1][b[2] :])))
            assert view == kernels[v.path], v.path
            seen.add(v.path)
        else:  # biases, BN/LN gamma and beta, and everything under "diagonal"
            assert kind_of(b) == "diagonal", v.path
    assert seen == (set(kernels) if structure != "diagonal" else set())


def test_make_blocks_rejects_an_unknown_structure():
    with pytest.raises(ValueError, match="structure"):
        pc.layout(_zoo().trainable_variables, "full")


# ======================================================= the objective ==
def _bn_mlp_logits(moving_mean, moving_var, epsilon):
    """Dense -> BatchNorm (inference) -> sigmoid -> Dense, in jax.numpy."""

    def logits_fn(params, x):
        W1, b1, gamma, beta, W2, b2 = params
        h = ref.dense(x, W1, b1)
        h = ref.batchnorm_inference(h, gamma, beta, moving_mean, moving_var, epsilon)
        return ref.dense(ref.ACTIVATIONS["sigmoid"](h), W2, b2)

    return logits_fn


def _random_block_params(blocks, rng):
    # one random set per layout entry
    return [p for b in blocks for p in random_params(b, rng)]


def _float64_scope():
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")

    def restore():
        keras.config.set_floatx(floatx)
        keras.config.set_dtype_policy(policy)

    return restore


@pytest.fixture(scope="module")
def objective_results():
    """One float64 Dense-BN-sigmoid-Dense classifier with non-trivial moving
    statistics; for each divergence, one compiled call of the package gives
    gbar, G v and the gradient and value of J for diagonal, K-FAC and EK-FAC
    U at random (non-identity) parameters. Returned with the explicit
    reference (gradient, summed Fisher, Hessian) for the tests below."""
    restore = _float64_scope()
    try:
        rng = np.random.default_rng(4)
        zeros = {"kernel_initializer": "zeros"}
        model = kg.Sequential([
            keras.Input((D_IN,)), keras.layers.Dense(HIDDEN, **zeros), keras.layers.BatchNormalization(),
            keras.layers.Activation("sigmoid"), keras.layers.Dense(K, **zeros),
        ])
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        params = []
        for v in model.trainable_variables:
            value = 1.0 + 0.2 * rng.normal(size=v.shape) if "gamma" in v.path else 0.8 * rng.normal(size=v.shape)
            v.assign(value)
            params.append(value)
        bn = model.layers[1]
        mm, mv = 0.5 * rng.normal(size=HIDDEN), rng.uniform(0.5, 2.0, size=HIDDEN)
        bn.moving_mean.assign(mm)
        bn.moving_variance.assign(mv)
        assert all(str(v.dtype) == "float64" for v in model.weights)
        x = rng.normal(size=(N, D_IN))
        y = rng.integers(0, K, size=N)
        reference = ref.Reference(_bn_mlp_logits(mm, mv, bn.epsilon), params, x, y)
        vec = [rng.normal(size=v.shape) for v in model.trainable_variables]
        blocks = {s: pc.layout(model.trainable_variables, s) for s in pc.STRUCTURES}
        uparams = {"diagonal": [rng.uniform(0.3, 3.0, size=v.shape) for v in model.trainable_variables]}
        uparams["kfac"] = _random_block_params(blocks["kfac"], rng)
        uparams["ekfac"] = _random_block_params(blocks["ekfac"], rng)
        values = [v.value for v in model.trainable_variables]
        nt = [v.value for v in model.non_trainable_variables]
        out = {"blocks": blocks, "uparams": uparams, "vec": vec,
               "g": reference.gradient(), "ngd": None, "newton": None,
               "G": {"ngd": reference.ggn("sum"), "newton": reference.hessian()}}
        for divergence in ("ngd", "newton"):
            opt = kg.optimizers.LLQR(keras.optimizers.SGD(0.1), divergence=divergence)

            def fn(values, nt, x, y, vec, up):
                gbar, gprod = opt.preconditioner._problem(model, values, nt, x, y)
                res = {"gbar": gbar, "Gv": gprod(vec)}
                for s in pc.STRUCTURES:
                    res["grad_" + s] = pc.objective_gradient(blocks[s], up[s], gbar, gprod)
                    res["J_" + s] = pc.objective(blocks[s], up[s], gbar, gprod)
                return res

            res = kg.backend.compile(fn)(
                values, nt, t64(x), ops.convert_to_tensor(y), [t64(v) for v in vec],
                {s: [t64(p) for p in ps] for s, ps in uparams.items()},
            )
            out[divergence] = keras.tree.map_structure(ref.to_numpy, res)

        def train_grad(values, nt, x, y):
            fns = ModelFunctions(model, training=True, include_regularization=False)
            return kg.backend.value_and_grad(fns.loss, values, nt, x, y)[1]

        out["train_gbar"] = np_list(kg.backend.compile(train_grad)(values, nt, t64(x), ops.convert_to_tensor(y)))
        return out
    finally:
        restore()


@pytest.mark.parametrize("divergence", ["ngd", "newton"])
def test_gbar_and_G_product_are_the_explicit_ones(objective_results, divergence):
    r, g, G = objective_results[divergence], objective_results["g"], objective_results["G"][divergence]
    tol = f64_tolerance()
    assert ref.rel_err(ref.flatten(r["gbar"]), g) < tol
    vec = ref.flatten(objective_results["vec"])
    assert ref.rel_err(ref.flatten(r["Gv"]), G @ vec) < tol
    if divergence == "ngd":
        # The Fisher is summed over the batch: the batch mean is N times too small.
        assert ref.rel_err(ref.flatten(r["Gv"]), (G / N) @ vec) > WRONG


def test_gbar_is_taken_in_inference_mode(objective_results):
    """The training-mode gradient (batch statistics in BatchNorm) is another vector."""
    r = objective_results["ngd"]
    assert ref.rel_err(ref.flatten(objective_results["train_gbar"]), ref.flatten(r["gbar"])) > WRONG


@pytest.mark.parametrize("divergence", ["ngd", "newton"])
def test_diagonal_objective_gradient_formula(objective_results, divergence):
    """grad_d J = -gbar*gbar + gbar * G (d * gbar), G explicit (summed Fisher
    for ngd, Hessian of the mean loss for newton); J = gbar.u + 1/2 u.G u."""
    r, g, G = objective_results[divergence], objective_results["g"], objective_results["G"][divergence]
    tol = f64_tolerance()
    d = ref.flatten(objective_results["uparams"]["diagonal"])
    got = ref.flatten(r["grad_diagonal"])
    assert ref.rel_err(got, -g * g + g * (G @ (d * g))) < tol
    u = -d * g
    assert float(r["J_diagonal"]) == pytest.approx(g @ u + 0.5 * u @ G @ u, rel=tol, abs=tol)
    if divergence == "ngd":
        assert ref.rel_err(got, -g * g + g * ((G / N) @ (d * g))) > WRONG


def _explicit_U(blocks, params):
    """Block-diagonal U(params) in jax.numpy (differentiable)."""
    mats, i = [], 0
    for b in blocks:
        k = len(param_specs(b))
        p = params[i:i + k]
        i += k
        if kind_of(b) == "diagonal":
            mats.append(jnp.diag(jnp.ravel(p[0])))
        elif kind_of(b) == "kfac":
            mats.append(jnp.kron(p[0], p[1]))
        else:
            Q = jnp.kron(p[0], p[1])
            mats.append(Q @ jnp.diag(jnp.ravel(p[2])) @ Q.T)
    return jax.scipy.linalg.block_diag(*mats)


def _explicit_J_grad(blocks, params, g, G):
    g, G = jnp.asarray(g), jnp.asarray(G)

    def J(ps):
        u = -_explicit_U(blocks, ps) @ g
        return g @ u + 0.5 * u @ G @ u

    ps = [jnp.asarray(p) for p in params]
    value, grad = jax.jit(jax.value_and_grad(J))(ps)
    return float(value), [np.asarray(w) for w in grad]


@pytest.mark.parametrize("structure", ["kfac", "ekfac"])
@pytest.mark.parametrize("divergence", ["ngd", "newton"])
def test_matrix_objective_gradient_equals_autodiff_of_explicit_J(objective_results, structure, divergence):
    """grad of J(U) w.r.t. (A, B) / (QA, QG, s) of both kernels and the
    diagonal blocks of biases and BN parameters, against jax.grad of J
    written with kron matrices and the explicit G."""
    r, g, G = objective_results[divergence], objective_results["g"], objective_results["G"][divergence]
    blocks = objective_results["blocks"][structure]
    params = objective_results["uparams"][structure]
    assert [kind_of(b) for b in blocks] == [structure, "diagonal", "diagonal", "diagonal", structure, "diagonal"]
    tol = f64_tolerance()
    J, want = _explicit_J_grad(blocks, params, g, G)
    got = r["grad_" + structure]
    assert [a.shape for a in got] == [w.shape for w in want]
    assert ref.rel_err(got, want) < tol
    assert float(r["J_" + structure]) == pytest.approx(J, rel=tol, abs=tol)
    if divergence == "ngd":
        _, wrong = _explicit_J_grad(blocks, params, g, G / N)
        assert ref.rel_err(got, wrong) > WRONG


# =============================================== the refresh's minimiser ==
def _logistic_logits(params, x):
    """Two logits [x W + b, 0]: no softmax shift invariance, so the Fisher
    (and the Hessian) is positive definite for enough examples."""
    W, b = params
    z = ref.dense(x, W, b)
    return jnp.concatenate([z, jnp.zeros_like(z)], axis=-1)


class _PadZeroLogit(keras.layers.Layer):
    def call(self, z):
        return ops.concatenate([z, ops.zeros_like(z)], axis=-1)


def test_many_inner_steps_reach_the_closed_form_minimiser(f64):
    """For diagonal U, J(d) = -b.d + 1/2 d.M d with M = diag(gbar) G diag(gbar)
    and b = gbar*gbar, so d* = M^{-1} b. A refresh with beta = 0, no
    clipping and many heavy-ball steps must land on d* (summed Fisher G),
    and J on J(d*) = -1/2 b.d*."""
    rng = np.random.default_rng(3)
    d_in, n = 2, 8
    x = rng.normal(size=(n, d_in))
    y = rng.integers(0, 2, size=n)
    model = kg.Sequential([keras.Input((d_in,)), keras.layers.Dense(1, kernel_initializer="zeros"),
                           _PadZeroLogit(name="pad_zero_logit")])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    params = [np.array([[0.9], [-0.6]]), np.array([0.3])]
    for v, p in zip(model.trainable_variables, params):
        v.assign(p)
    reference = ref.Reference(_logistic_logits, params, x, y)
    g = reference.gradient()
    G = reference.ggn("sum")
    M = np.diag(g) @ G @ np.diag(g)
    d_star = np.linalg.solve(M, g * g)
    eig = np.linalg.eigvalsh(M)
    # The test problem: positive minimiser (so the final clip is inactive)
    # and well conditioned: heavy ball with momentum 0.5 at lr = 1/lambda_max
    # contracts every eigen-direction by sqrt(0.5) per step when
    # lr * lambda lies in [(1 - sqrt(.5))^2, (1 + sqrt(.5))^2] = [0.086, 2.9],
    # i.e. for condition numbers below 11.6.
    assert np.all(d_star > 0.3), d_star
    assert eig[0] > 0 and eig[-1] / eig[0] < 11, eig

    blocks = pc.layout(model.trainable_variables, "diagonal")
    groups = [[0], [1]]
    opt = kg.optimizers.LLQR(keras.optimizers.SGD(0.1))
    steps, lr = 120, 1.0 / eig[-1]  # 0.707**120 ~ 1e-18

    def fn(values, nt, x, y, u):
        gbar, gprod = opt.preconditioner._problem(model, values, nt, x, y)
        new = pc.refresh(blocks, u, gbar, gprod, groups, steps=steps, learning_rate=lr, momentum=0.5,
                         clip_norm=1e30, beta=0.0, min_diagonal=1e-12)
        return new, pc.objective(blocks, new, gbar, gprod)

    new, J = kg.backend.compile(fn)(
        [v.value for v in model.trainable_variables], [], t64(x), ops.convert_to_tensor(y),
        [t64(np.ones(v.shape)) for v in model.trainable_variables])
    d = ref.flatten(new)
    tol = f64_tolerance()
    assert ref.rel_err(d, d_star) < 10 * tol, (d, d_star)
    assert float(ref.to_numpy(J)) == pytest.approx(-0.5 * (g * g) @ d_star, rel=10 * tol)
    # Against a batch-mean Fisher the minimiser is N times larger: the
    # summed scale is the one being minimised.
    assert ref.rel_err(d, n * d_star) > WRONG


def test_refresh_clips_diagonal_and_takes_the_ema(f64):
    """beta mixes old and learned factors leaf by leaf; diagonal entries are
    clipped to min_diagonal afterwards. G = 0 and a huge step drive the learned
    d far negative on one coordinate, positive on none."""
    blocks = [spec("diagonal", (3,)), spec("kfac", (2, 2))]
    groups = [[0], [1], [2]]
    old = [t64([1.0, 2.0, 0.5]), t64(np.eye(2)), t64(2 * np.eye(2))]
    gbar = [t64([1.0, 0.0, 2.0]), t64(np.zeros((2, 2)))]

    def gprod(u):
        return [ops.zeros_like(t) for t in u]

    # One plain step (momentum 0, no clipping): grad_d = -gbar^2 -> d grows.
    one = np_list(pc.refresh(blocks, old, gbar, gprod, groups, steps=1, learning_rate=0.5, momentum=0.0,
                             clip_norm=1e30, beta=0.25, min_diagonal=1e-8))
    learned = np.array([1.0, 2.0, 0.5]) + 0.5 * np.array([1.0, 0.0, 4.0])
    np.testing.assert_allclose(one[0], 0.25 * np.array([1.0, 2.0, 0.5]) + 0.75 * learned, rtol=SCALAR)
    np.testing.assert_allclose(one[1], np.eye(2), rtol=SCALAR)  # zero gradient: unchanged
    np.testing.assert_allclose(one[2], 2 * np.eye(2), rtol=SCALAR)
    # beta = 1 keeps the old factors; diagonal entries below the floor are raised to it.
    low = [t64([-1.0, 1e-12, 3.0]), old[1], old[2]]
    kept = np_list(pc.refresh(blocks, low, [t64(np.zeros(3)), gbar[1]], gprod, groups, steps=1,
                              learning_rate=0.5, momentum=0.0, clip_norm=1e30, beta=1.0,
                              min_diagonal=1e-3))
    np.testing.assert_allclose(kept[0], [1e-3, 1e-3, 3.0], rtol=SCALAR)
    np.testing.assert_allclose(kept[1], np.eye(2), rtol=SCALAR)  # matrix factors are not clipped


def test_refresh_clips_each_group_gradient_norm(f64):
    """Before momentum each group's gradient is scaled to L2 norm <= clip."""
    blocks = [spec("diagonal", (2,)), spec("diagonal", (1,))]
    old = [t64([1.0, 1.0]), t64([1.0])]
    gbar = [t64([3.0, 4.0]), t64([0.5])]  # grad_d = -gbar^2 = (-9, -16), (-0.25)

    def gprod(u):
        return [ops.zeros_like(t) for t in u]

    new = np_list(pc.refresh(blocks, old, gbar, gprod, [[0], [1]], steps=1, learning_rate=1.0, momentum=0.9,
                             clip_norm=5.0, beta=0.0, min_diagonal=1e-8))
    grad = np.array([-9.0, -16.0])
    np.testing.assert_allclose(new[0], 1.0 - 5.0 * grad / np.linalg.norm(grad), rtol=SCALAR)
    np.testing.assert_allclose(new[1], [1.25], rtol=SCALAR)  # norm 0.25 < 5: not clipped
    # One group for both tensors (a layer's kernel and bias under a diagonal
    # U): one norm over all three entries scales both.
    both = np_list(pc.refresh(blocks, old, gbar, gprod, [[0, 1]], steps=1, learning_rate=1.0, momentum=0.9,
                              clip_norm=5.0, beta=0.0, min_diagonal=1e-8))
    full = np.array([-9.0, -16.0, -0.25])
    scaled = 5.0 * full / np.linalg.norm(full)
    np.testing.assert_allclose(np.concatenate(both), 1.0 - scaled, rtol=SCALAR)
    assert abs(both[1][0] - new[1][0]) > 0.1  # the grouping changes U


@pytest.mark.parametrize("structure", ["diagonal", "kfac", "ekfac"])
def test_clip_groups_follow_the_reference(structure):
    """Diagonal U: one group per layer (kernel and bias together); K-FAC and
    EK-FAC: one group per parameter tensor (A, B, Q_A, Q_G, s, each bias)."""
    model = _zoo()
    variables = model.trainable_variables
    layout = pc.layout(variables, structure)
    groups = pc.clip_groups(layout, variables, structure)
    specs = pc.param_specs(layout)
    assert sorted(i for g in groups for i in g) == list(range(len(specs)))
    layer_of = [variables[i].path.rsplit("/", 1)[0] for i, *_ in specs]
    if structure == "diagonal":
        assert len(groups) == len(set(layer_of))
        for g in groups:
            assert len({layer_of[i] for i in g}) == 1
        assert any(len(g) == 2 for g in groups)  # kernel + bias of one layer
    else:
        assert all(len(g) == 1 for g in groups)
        assert len(groups) == len(specs)


def test_refresh_sanitises_non_finite_gradients(f64):
    blocks = [spec("diagonal", (3,))]
    old = [t64([1.0, 1.0, 1.0])]
    gbar = [t64([1.0, np.nan, 1.0])]

    def gprod(u):
        return [ops.zeros_like(t) for t in u]

    new = ref.to_numpy(pc.refresh(blocks, old, gbar, gprod, [[0]], steps=2, learning_rate=0.1, momentum=0.0,
                                  clip_norm=1e30, beta=0.0, min_diagonal=1e-8)[0])
    assert np.all(np.isfinite(new)), new
    np.testing.assert_allclose(new, [1.2, 1.0, 1.2], rtol=SCALAR)


@pytest.mark.parametrize("batched", [True, False])
def test_same_shaped_kronecker_blocks_are_multiplied_together(monkeypatch, batched):
    """Where the backend batches small products (torch, TensorFlow), K-FAC
    blocks of one matrix view go through one batched product
    (``BlockDiagonal.matvec``); either way each gets its own block's product."""
    from keras_geosam import backend
    from keras_geosam.curvature.operators import structured

    monkeypatch.setattr(backend, "batch_small_products", batched)

    rng = np.random.default_rng(4)
    blocks = [spec("kfac", (3, 4)), spec("diagonal", (4,)), spec("kfac", (3, 4)), spec("kfac", (4, 3)),
              spec("ekfac", (3, 4)), spec("kfac", (3, 4)), spec("kfac", (4, 3)), spec("kfac", (2, 2))]
    params = [random_params(b, rng) for b in blocks]
    vecs = [rng.normal(size=b[1]) for b in blocks]
    flat = [t64(p) for ps in params for p in ps]
    calls = []
    grouped = structured._kfac_group_matvec
    monkeypatch.setattr(structured, "_kfac_group_matvec", lambda bs, xs: calls.append(len(bs)) or grouped(bs, xs))
    got = np_list(pc.operator(blocks, flat).matvec([t64(v) for v in vecs]))
    # (3, 4) x3 and (4, 3) x2; (2, 2) and EK-FAC alone
    assert sorted(calls) == ([2, 3] if batched else [])
    U = _block_diag([explicit_block(kind_of(b), p, b[1]) for b, p in zip(blocks, params)])
    assert ref.rel_err(ref.flatten(got), U @ ref.flatten(vecs)) < f64_tolerance()
    for g, b, p, v in zip(got, blocks, params, vecs):  # block by block, not only in total
        assert ref.rel_err(np.ravel(g), explicit_block(kind_of(b), p, b[1]) @ np.ravel(v)) < f64_tolerance()
    # Factors over GROUP_MAX_FACTOR_ELEMENTS (3x3 + 4x4 = 25 > 24) go alone:
    # stacking would copy them every product.
    monkeypatch.setattr(structured, "GROUP_MAX_FACTOR_ELEMENTS", 24)
    calls.clear()
    alone = np_list(pc.operator(blocks, flat).matvec([t64(v) for v in vecs]))
    assert calls == [] and ref.rel_err(ref.flatten(alone), U @ ref.flatten(vecs)) < f64_tolerance()
