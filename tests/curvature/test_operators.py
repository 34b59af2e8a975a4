"""Reference tests of keras_geosam.curvature's linear operators (float64).

Runs on whichever Keras backend is active (one process per backend). Each
tiny model is written a second time by hand in ``jax.numpy`` (an explicit
im2col for convolutions, BatchNormalization from its moving statistics) and
fed the Keras model's weights; the forward passes are checked to agree
before anything else. Every operator is then compared with an explicit
matrix over the flattened parameter vector:

- Hessian: ``jax.hessian`` of the mean cross-entropy;
- GGN exact: ``1/N sum_n J_n^T (diag p_n - p_n p_n^T) J_n`` (``ref.ggn``);
  GGN "empirical": ``1/N sum_n g_n g_n^T``; GGN "mc": ``1/(NS) sum g_ns
  g_ns^T`` with the labels of ``ref.hash_labels`` (global example index);
- GGNResidual: ``H - GGN``;
- K-FAC factors from explicit layer inputs / im2col patches and output
  gradients ``delta`` taken by jax with respect to additive perturbations
  of each pre-activation, pushed back from the columns of a square root of
  the output curvature;
- structured operators against ``np.kron`` / ``scipy.linalg.block_diag`` /
  ``np.linalg.inv`` / ``pinv`` of the dense matrices they stand for.

Tolerances (relative Frobenius error ``||a - b|| / ||b||`` unless said
otherwise): EXACT = 1e-8 where Keras computes every op the model (or the
structured operator) uses exactly in float64; KERAS_F32 = 1e-6 where
Keras 3.15 evaluates one of them in float32 even for float64 inputs (found
by probing Keras, see ``keras_float32_ops``: e.g. matmul and
BatchNormalization on torch, tanh and BatchNormalization on JAX). H - GGN
is compared relative to ``||H||`` (it is a difference of H-sized terms),
as are the k=3 products. Undamped pseudo-inverses and the traces behind them
are held to the same tolerances (they meet them with a 10x margin here).
"""

import functools

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
import scipy.linalg
from keras import ops

from reference import curvature as ref
from reference.dtypes import keras_dtype
from keras_geosam import curvature as cv

EXACT = 1e-8
KERAS_F32 = 1e-6
N, K = 12, 3


# ------------------------------------------------ float64 and lossy ops ----
@pytest.fixture(scope="module", autouse=True)
def _module_float64():
    with keras_dtype("float64"):
        yield


@functools.lru_cache(maxsize=None)
def keras_float32_ops():
    """Keras ops / layers that evaluate float64 inputs in float32 on this backend."""
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(4, 3)), rng.normal(size=(3, 2))
    x3, k2 = rng.normal(size=(2, 3, 4)), rng.normal(size=(4, 5))
    x, k = rng.normal(size=(1, 4, 4, 2)), rng.normal(size=(2, 2, 2, 3))
    conv = sum(np.einsum("nhwc,cf->nhwf", x[:, i : i + 3, j : j + 3], k[i, j]) for i in range(2) for j in range(2))
    bn = keras.layers.BatchNormalization(dtype="float64")
    bn.build((None, 3))
    mm, mv, gamma, beta = rng.normal(size=3), rng.uniform(0.5, 2.0, size=3), rng.normal(size=3), rng.normal(size=3)
    for var, value in zip((bn.moving_mean, bn.moving_variance, bn.gamma, bn.beta), (mm, mv, gamma, beta)):
        var.assign(value)
    sym = a.T @ a + np.eye(3)
    w, q = np.linalg.eigh(sym)
    probes = {
        "matmul": (lambda: ops.matmul(a, b), a @ b),
        "einsum": (lambda: ops.einsum("abc,cd->abd", x3, k2), np.einsum("abc,cd->abd", x3, k2)),
        "conv": (lambda: ops.conv(x, k), conv),
        "sigmoid": (lambda: ops.sigmoid(a), 1.0 / (1.0 + np.exp(-a))),
        "tanh": (lambda: ops.tanh(a), np.tanh(a)),
        "relu": (lambda: ops.relu(a), np.maximum(a, 0.0)),
        "batchnorm": (lambda: bn(a, training=False), gamma * (a - mm) / np.sqrt(mv + 1e-3) + beta),
        "eigh": (lambda: (lambda r: (ref.to_numpy(r[1]) * ref.to_numpy(r[0])) @ ref.to_numpy(r[1]).T)(ops.eigh(sym)), (q * w) @ q.T),
    }
    return frozenset(n for n, (fn, exact) in probes.items() if ref.rel_err(fn(), exact) > 1e-13)


def tol_for(*names):
    return KERAS_F32 if set(names) & keras_float32_ops() else EXACT


def rel(a, b):
    return ref.rel_err(a, b)


def tensors(arrays):
    return [ops.convert_to_tensor(np.asarray(a, dtype="float64"), dtype="float64") for a in arrays]


def split_flat(V, shapes):
    """(k, P) NumPy -> list of (k,) + shape tensors."""
    k, out, start = V.shape[0], [], 0
    for s in shapes:
        size = int(np.prod(s))
        out.append(V[:, start : start + size].reshape((k,) + tuple(s)))
        start += size
    return tensors(out)


def offsets(shapes):
    return np.cumsum([0] + [int(np.prod(s)) for s in shapes])


# --------------------------------------------- hand-written models ----
class Tape:
    """Records each K-FAC layer's input rows (N, T, m) and pre-activation
    shape, and adds the perturbation `perts[l]` to pre-activation l."""

    def __init__(self, perts=None):
        self.perts, self.rows, self.shapes = perts, [], []

    def layer(self, rows, z):
        i = len(self.rows)
        self.rows.append(rows)
        self.shapes.append(tuple(z.shape))
        return z if self.perts is None else z + self.perts[i]


def patches(x, kh, kw, stride, padding):
    """Explicit im2col, channels last: (N, ho, wo, kh*kw*C), ordered (kh, kw, C)."""
    n, h, w, c = x.shape
    if padding == "same":
        ho, wo = -(-h // stride), -(-w // stride)
        th, tw = max((ho - 1) * stride + kh - h, 0), max((wo - 1) * stride + kw - w, 0)
        x = jnp.pad(x, ((0, 0), (th // 2, th - th // 2), (tw // 2, tw - tw // 2), (0, 0)))
    else:
        ho, wo = (h - kh) // stride + 1, (w - kw) // stride + 1
    cols = [
        x[:, i : i + (ho - 1) * stride + 1 : stride, j : j + (wo - 1) * stride + 1 : stride, :]
        for i in range(kh)
        for j in range(kw)
    ]
    return jnp.concatenate(cols, axis=-1)


def conv(tape, x, kernel, bias, stride=1, padding="valid"):
    kh, kw, _, f = kernel.shape
    pt = patches(x, kh, kw, stride, padding)
    n, ho, wo, m = pt.shape
    return tape.layer(pt.reshape(n, ho * wo, m), pt @ kernel.reshape(m, f) + bias)


def dense(tape, h, w, b):
    return tape.layer(h[:, None, :], h @ w + b)


def sigmoid(z):
    return 1.0 / (1.0 + jnp.exp(-z))


def relu(z):
    return jnp.maximum(z, 0.0)


class Case:
    """A Keras model and the same function written by hand."""

    def __init__(self, name, model, fwd, x, y, ops_used, batch_size=None):
        self.name, self.model, self.fwd, self.x, self.y = name, model, fwd, x, y
        self.tol = tol_for(*ops_used)
        self.batch_size = batch_size
        self.variables = list(model.trainable_variables)
        self.shapes = [tuple(v.shape) for v in self.variables]
        self.P = int(sum(np.prod(s) for s in self.shapes))
        self.position = {id(v): i for i, v in enumerate(self.variables)}
        # kernels of Dense / Conv / EinsumDense layers, in forward order (= tape order)
        self.kernels = [self.position[id(l.kernel)] for l in model.layers if hasattr(l, "kernel")]
        # per-layer groups of variable indices (kernel+bias, gamma+beta)
        self.groups = [[self.position[id(v)] for v in l.trainable_variables] for l in model.layers if l.trainable_variables]

    def weights(self):
        return [ref.to_numpy(v.value) for v in self.variables]

    def logits_fn(self, p, x):
        return self.fwd(p, x, Tape())

    @functools.cached_property
    def reference(self):
        return ref.Reference(self.logits_fn, self.weights(), self.x, self.y)

    @functools.cached_property
    def hessian(self):
        return self.reference.hessian()

    @functools.cached_property
    def probs(self):
        return self.reference.probs()

    def ggn(self, kind="exact", num_samples=2, seed=0):
        return self._ggn(kind, num_samples, seed)

    @functools.lru_cache(maxsize=None)
    def _ggn(self, kind, num_samples, seed):
        if kind == "exact":
            return self.reference.ggn()
        if kind == "empirical":
            g = self.reference.per_example_gradients()
            return g.T @ g / N
        labels = ref.hash_labels(self.probs, num_samples, seed)  # (S, N)
        g = self.reference.nll_gradients(np.concatenate([self.x] * num_samples), labels.reshape(-1))
        return g.T @ g / (N * num_samples)

    def block(self, M, i, j=None):
        o = offsets(self.shapes)
        j = i if j is None else j
        return M[o[i] : o[i + 1], o[j] : o[j + 1]]

    def group_slice(self, group):
        o = offsets(self.shapes)
        return slice(o[min(group)], o[max(group) + 1])


def _assign(variables, rng, scale):
    for v in variables:
        v.assign(scale * rng.normal(size=v.shape))


def _data(rng, shape):
    x = rng.normal(size=(N,) + shape)
    y = rng.integers(0, K, size=N).astype("int32")
    y[:K] = np.arange(K)
    return x, y


def _compile(model):
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def build_sigmoid_mlp():
    rng = np.random.default_rng(11)
    model = _compile(keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="sigmoid"), keras.layers.Dense(K)]))
    _assign(model.trainable_variables, rng, 1.0)
    x, y = _data(rng, (4,))

    def fwd(p, x, tape):
        h = sigmoid(dense(tape, x, p[0], p[1]))
        return dense(tape, h, p[2], p[3])

    return Case("sigmoid_mlp", model, fwd, x, y, ("matmul", "sigmoid"), batch_size=5)


def build_relu_mlp():
    """Unit 0 of the first layer never fires: exact zeros in the GGN."""
    rng = np.random.default_rng(12)
    layers = [keras.layers.Dense(5, activation="relu"), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(K)]
    model = _compile(keras.Sequential([keras.Input((4,))] + layers))
    _assign(model.trainable_variables, rng, 0.8)
    b1 = ref.to_numpy(layers[0].bias.value).copy()
    b1[0] = -50.0
    layers[0].bias.assign(b1)
    x, y = _data(rng, (4,))

    def fwd(p, x, tape):
        h = relu(dense(tape, x, p[0], p[1]))
        h = relu(dense(tape, h, p[2], p[3]))
        return dense(tape, h, p[4], p[5])

    return Case("relu_mlp", model, fwd, x, y, ("matmul", "relu"))


def build_conv():
    """Conv 'same' stride 2 (asymmetric padding), conv 'valid', flatten, dense."""
    rng = np.random.default_rng(13)
    model = _compile(
        keras.Sequential(
            [
                keras.Input((5, 5, 2)),
                keras.layers.Conv2D(2, (2, 2), strides=2, padding="same", activation="relu"),
                keras.layers.Conv2D(2, (2, 2), padding="valid", activation="relu"),
                keras.layers.Flatten(),
                keras.layers.Dense(K),
            ]
        )
    )
    _assign(model.trainable_variables, rng, 0.7)
    x, y = _data(rng, (5, 5, 2))

    def fwd(p, x, tape):
        h = relu(conv(tape, x, p[0], p[1], stride=2, padding="same"))
        h = relu(conv(tape, h, p[2], p[3]))
        return dense(tape, h.reshape(h.shape[0], -1), p[4], p[5])

    return Case("conv", model, fwd, x, y, ("conv", "relu", "matmul"))


def build_conv_bn():
    """Conv -> BatchNormalization (inference, non-trivial moving statistics) -> ReLU -> dense."""
    rng = np.random.default_rng(14)
    bn = keras.layers.BatchNormalization()
    model = _compile(
        keras.Sequential(
            [
                keras.Input((3, 3, 2)),
                keras.layers.Conv2D(2, (2, 2)),
                bn,
                keras.layers.Activation("relu"),
                keras.layers.Flatten(),
                keras.layers.Dense(K),
            ]
        )
    )
    _assign(model.trainable_variables, rng, 0.7)
    mm, mv = 0.5 * rng.normal(size=2), rng.uniform(0.3, 2.0, size=2)
    bn.moving_mean.assign(mm)
    bn.moving_variance.assign(mv)
    x, y = _data(rng, (3, 3, 2))

    def fwd(p, x, tape):
        z = conv(tape, x, p[0], p[1])
        h = relu(ref.batchnorm_inference(z, p[2], p[3], mm, mv, 1e-3))
        return dense(tape, h.reshape(h.shape[0], -1), p[4], p[5])

    return Case("conv_bn", model, fwd, x, y, ("conv", "batchnorm", "relu", "matmul"))


def build_einsum():
    """EinsumDense 'abc,cd->abd' on (N, 3, 4) with bias 'd', sigmoid, flatten, dense."""
    rng = np.random.default_rng(15)
    model = _compile(
        keras.Sequential(
            [
                keras.Input((3, 4)),
                keras.layers.EinsumDense("abc,cd->abd", output_shape=(3, 3), bias_axes="d", activation="sigmoid"),
                keras.layers.Flatten(),
                keras.layers.Dense(K),
            ]
        )
    )
    _assign(model.trainable_variables, rng, 0.8)
    x, y = _data(rng, (3, 4))

    def fwd(p, x, tape):
        z = tape.layer(x, jnp.einsum("abc,cd->abd", x, p[0]) + p[1])
        h = sigmoid(z)
        return dense(tape, h.reshape(h.shape[0], -1), p[2], p[3])

    return Case("einsum", model, fwd, x, y, ("einsum", "sigmoid", "matmul"))


BUILDERS = {
    "sigmoid_mlp": build_sigmoid_mlp,
    "relu_mlp": build_relu_mlp,
    "conv": build_conv,
    "conv_bn": build_conv_bn,
    "einsum": build_einsum,
}
NAMES = list(BUILDERS)
_CASES = {}


def get_case(name):
    """Built once per process in float64; the hand-written forward must
    reproduce the Keras model's logits first."""
    if name not in _CASES:
        assert keras.config.floatx() == "float64"
        case = BUILDERS[name]()
        assert all(keras.backend.standardize_dtype(v.dtype) == "float64" for v in case.model.weights)
        out = ref.to_numpy(case.model(case.x, training=False))
        logits = np.asarray(case.logits_fn([jnp.asarray(w) for w in case.weights()], jnp.asarray(case.x)))
        assert rel(out, logits) < (1e-12 if case.tol == EXACT else KERAS_F32), name
        _CASES[name] = case
    return _CASES[name]


def test_hand_written_conv_matches_reference_conv():
    """The im2col convolution agrees with reference.py's 'valid' conv."""
    rng = np.random.default_rng(0)
    x, k, b = rng.normal(size=(2, 4, 5, 3)), rng.normal(size=(2, 3, 3, 2)), rng.normal(size=2)
    ours = conv(Tape(), jnp.asarray(x), jnp.asarray(k), jnp.asarray(b))
    assert rel(ours, ref.conv2d_valid(jnp.asarray(x), jnp.asarray(k), jnp.asarray(b))) < 1e-13
    # 'same' with stride 2 on 5 x 5: 3 x 3 outputs, padding (0, 1) after (the
    # Keras forward pass of the "conv" case checks the values)
    p = np.asarray(patches(jnp.asarray(x[:, :, :4]), 2, 2, 2, "same"))
    assert p.shape == (2, 2, 2, 12)
    p = np.asarray(patches(jnp.ones((1, 5, 5, 1)), 2, 2, 2, "same"))
    assert p.shape == (1, 3, 3, 4) and p[0, 2, 2].tolist() == [1.0, 0.0, 0.0, 0.0]


# -------------------------------------- 1. Hessian, GGN, H - GGN ----
@pytest.mark.parametrize("name", NAMES)
def test_model_operators_match_explicit_matrices(name):
    case = get_case(name)
    H_ref, G_ref = case.hessian, case.ggn("exact")
    R_ref = H_ref - G_ref
    args = (case.model, case.x, case.y)
    H = cv.Hessian(*args, batch_size=case.batch_size)
    G = cv.GGN(case.model, case.x, batch_size=case.batch_size)
    R = cv.GGNResidual(*args, batch_size=case.batch_size)
    assert H.shapes == case.shapes and H.dim == case.P
    H_d, G_d, R_d = H.to_dense(), G.to_dense(), R.to_dense()
    assert H_d.shape == (case.P, case.P) and H_d.dtype == np.float64
    assert rel(H_d, H_ref) < case.tol
    assert rel(G_d, G_ref) < case.tol
    assert np.linalg.norm(R_d - R_ref) < case.tol * np.linalg.norm(H_ref)
    # the residual is not trivially zero (nor the GGN equal to H)
    assert np.linalg.norm(R_ref) > 1e-3 * np.linalg.norm(H_ref)
    # a block of k=3 random vectors
    V = np.random.default_rng(1).normal(size=(3, case.P))
    for op, M in ((H, H_ref), (G, G_ref), (R, R_ref)):
        out = op.matmat(split_flat(V, case.shapes))
        assert [tuple(o.shape) for o in out] == [(3,) + s for s in case.shapes]
        assert np.linalg.norm(ref.flatten_rows(out) - V @ M.T) < case.tol * np.linalg.norm(V @ H_ref.T)
    if case.batch_size is not None:
        # teeth: an unweighted mean of the batch means (5, 5, 2) is visibly different
        starts = range(0, N, case.batch_size)
        per_batch = [
            ref.Reference(case.logits_fn, case.weights(), case.x[s : s + case.batch_size], case.y[s : s + case.batch_size]).ggn()
            for s in starts
        ]
        assert rel(np.mean(per_batch, axis=0), G_ref) > 1e-2


# ----------------------------------------------- 2. GGN diagonals ----
KIND_CASES = [(n, k) for n in NAMES for k in ("exact", "mc", "empirical")]


@pytest.mark.parametrize("name,kind", KIND_CASES)
def test_ggn_diagonal_of_each_kind(name, kind):
    case = get_case(name)
    # num_samples matters for "mc" only (the exact kernel is then reused from above)
    S = 2 if kind == "mc" else 1
    M = case.ggn(kind, num_samples=S, seed=7)
    G = cv.GGN(case.model, case.x, case.y, kind=kind, num_samples=S, seed=7, batch_size=case.batch_size)
    diag = G.diagonal()
    assert [tuple(d.shape) for d in diag] == case.shapes
    assert rel(ref.flatten(diag), np.diag(M)) < case.tol
    dense = G.to_dense()
    assert rel(dense, M) < case.tol
    assert rel(ref.flatten(diag), np.diag(dense)) < case.tol
    assert float(ops.convert_to_numpy(G.trace())) == pytest.approx(np.trace(M), rel=case.tol)
    if kind != "exact":
        # teeth: the kinds differ on these data
        assert rel(np.diag(M), np.diag(case.ggn("exact"))) > 1e-2


def test_matvec_and_application_to_a_list():
    case = get_case("sigmoid_mlp")
    v = np.random.default_rng(2).normal(size=case.P)
    vector = [x[0] for x in split_flat(v[None], case.shapes)]
    H = cv.Hessian(case.model, case.x, case.y, batch_size=case.batch_size)
    for out in (H.matvec(vector), H @ vector):  # `@` on a list applies the operator
        assert [tuple(o.shape) for o in out] == case.shapes
        assert rel(ref.flatten(out), case.hessian @ v) < case.tol


def test_many_probes_reach_the_kernels_in_blocks(monkeypatch):
    """With ``backend.max_probe_block`` at 3, a Hessian product of 7
    probes hands the kernel 3, 3 and 1 probes and equals the explicit
    product; TensorFlow caps by default (its batched HVP unrolls one
    backward pass per probe, so a graph stays a block long whatever the
    probe count), JAX and torch do not."""
    from keras_geosam import backend

    assert backend.max_probe_block == (8 if keras.backend.backend() == "tensorflow" else None)
    case = get_case("sigmoid_mlp")
    model = build_sigmoid_mlp().model  # the same weights, no kernel compiled yet
    seen = []
    hvp_batched = backend.hvp_batched

    def spy(f, params, vectors, *args, **options):
        seen.append(int(vectors[0].shape[0]))  # at trace time where the kernel is compiled
        return hvp_batched(f, params, vectors, *args, **options)

    monkeypatch.setattr(backend, "hvp_batched", spy)
    monkeypatch.setattr(backend, "max_probe_block", 3)
    V = np.random.default_rng(4).normal(size=(7, case.P))
    H = cv.Hessian(model, case.x, case.y, batch_size=case.batch_size)
    out = H.matmat(split_flat(V, case.shapes))
    assert set(seen) == {3, 1}
    assert rel(ref.flatten_rows(out), V @ case.hessian) < case.tol


def test_convolutional_products_unroll_their_probes_where_vmap_is_slow():
    """On XLA:CPU a convolutional network's products take their probes one
    at a time in the trace (vmapped convolutions ran 2-21x slower there),
    in blocks of ``backend.unrolled_probe_block``; elsewhere, and for an
    MLP, nothing changes. Either way the product of 10 probes equals the
    explicit Hessian, and on JAX the unrolled kernel equals the vmapped one."""
    from keras_geosam import backend
    from keras_geosam.curvature.functional import model_functions

    on_xla_cpu = keras.backend.backend() == "jax" and jax.default_backend() == "cpu"
    case = get_case("conv")
    fns = model_functions(case.model)
    assert fns.unroll_probes == on_xla_cpu
    assert fns.probe_block == (8 if on_xla_cpu else backend.max_probe_block)
    assert not model_functions(get_case("relu_mlp").model).unroll_probes
    V = np.random.default_rng(5).normal(size=(10, case.P))
    vectors = split_flat(V, case.shapes)
    out = cv.Hessian(case.model, case.x, case.y, batch_size=case.batch_size).matmat(vectors)
    assert rel(ref.flatten_rows(out), V @ case.hessian) < case.tol
    unrolled = backend.hvp_batched(fns.loss, fns.params(), vectors, fns.non_trainable(), case.x, case.y, None, unroll=True)
    vmapped = backend.hvp_batched(fns.loss, fns.params(), vectors, fns.non_trainable(), case.x, case.y, None, unroll=False)
    assert rel(ref.flatten_rows(unrolled), ref.flatten_rows(vmapped)) < 1e-12


def test_mc_labels_use_the_global_example_index():
    """Streaming (batches of 5): labels follow the global row, so the
    operator equals the unstreamed one; per-batch row numbering would draw
    other labels (teeth)."""
    case = get_case("sigmoid_mlp")
    assert case.batch_size == 5
    labels = ref.hash_labels(case.probs, 2, 7)
    local = np.concatenate(
        [ref.hash_labels(case.probs[s : s + 5], 2, 7) for s in range(0, N, 5)], axis=1
    )
    assert (labels != local).any()
    a = cv.GGN(case.model, case.x, kind="mc", num_samples=2, seed=7, batch_size=5).diagonal()
    b = cv.GGN(case.model, case.x, kind="mc", num_samples=2, seed=7).diagonal()
    assert rel(a, b) < case.tol
    c = cv.GGN(case.model, case.x, kind="mc", num_samples=2, seed=8).diagonal()
    assert rel(c, b) > 1e-3
    assert cv.Fisher is cv.GGN


# --------------------------------------------------- 3. K-FAC factors ----
def explicit_kfac(case, kind="exact", num_samples=2, seed=7):
    """A, B of every K-FAC layer from explicit rows and deltas (tape order)."""
    p = [jnp.asarray(w) for w in case.weights()]
    x = jnp.asarray(case.x)
    tape = Tape()
    z = np.asarray(case.fwd(p, x, tape))
    probs = np.asarray(jnp.exp(ref.log_softmax(z)))
    eye = np.eye(K)
    if kind == "exact":
        c = np.sqrt(probs.T)[:, :, None] * (eye[:, None, :] - probs[None])  # (K, N, K)
    elif kind == "empirical":
        c = (probs - eye[case.y])[None]
    else:
        labels = ref.hash_labels(probs, num_samples, seed)  # (S, N)
        c = (eye[labels] - probs[None]) / np.sqrt(num_samples)
    # sum_j c_j c_j^T is the output curvature of the kind
    if kind == "exact":
        np.testing.assert_allclose(np.einsum("jnk,jnl->nkl", c, c), np.einsum("nk,kl->nkl", probs, eye) - np.einsum("nk,nl->nkl", probs, probs), atol=1e-15)

    def projection(perts, cj):
        return jnp.sum(cj * case.fwd(p, x, Tape(perts)))

    grad = jax.jit(jax.grad(projection))
    zeros = [jnp.zeros(s) for s in tape.shapes]
    deltas = [grad(zeros, jnp.asarray(cj)) for cj in c]
    A, B = [], []
    for l, rows in enumerate(tape.rows):
        a = np.asarray(rows)
        A.append(np.einsum("ntm,ntl->ml", a, a) / (a.shape[0] * a.shape[1]))
        d = np.stack([np.asarray(dj[l]) for dj in deltas])
        d = d.reshape(d.shape[0], d.shape[1], -1, d.shape[-1])
        B.append(np.einsum("kntj,kntl->jl", d, d) / N)
    return A, B, [a.shape[1] for a in tape.rows]


def explicit_kfac_dense(case, A, B, M):
    blocks, kernel_of = [], dict(zip(case.kernels, range(len(case.kernels))))
    for i in range(len(case.shapes)):
        if i in kernel_of:
            blocks.append(np.kron(A[kernel_of[i]], B[kernel_of[i]]))
        else:
            blocks.append(np.diag(np.diag(case.block(M, i))))
    return scipy.linalg.block_diag(*blocks)


KFAC_CASES = [
    ("sigmoid_mlp", "exact"),
    ("relu_mlp", "exact"),
    ("conv", "exact"),
    ("conv", "mc"),
    ("conv_bn", "exact"),
    ("einsum", "empirical"),
]


@pytest.mark.parametrize("name,kind", KFAC_CASES)
def test_kfac_factors_match_explicit_rows_and_deltas(name, kind):
    case = get_case(name)
    S = 2 if kind == "mc" else 1
    A_ref, B_ref, _ = explicit_kfac(case, kind, num_samples=S)
    M = case.ggn(kind, num_samples=S, seed=7)
    G = cv.GGN(case.model, case.x, case.y, kind=kind, num_samples=S, seed=7, batch_size=case.batch_size)
    op = G.kfac()
    assert isinstance(op, cv.BlockDiagonal) and len(op.blocks) == len(case.shapes)
    kernel_of = dict(zip(case.kernels, range(len(case.kernels))))
    for i, blk in enumerate(op.blocks):
        if i in kernel_of:
            l = kernel_of[i]
            assert isinstance(blk, cv.KFAC) and blk.shapes == [case.shapes[i]]
            assert rel(blk.A, A_ref[l]) < case.tol, (i, "A")
            assert rel(blk.B, B_ref[l]) < case.tol, (i, "B")
        else:
            assert isinstance(blk, cv.Diagonal)
            assert rel(blk.values[0], np.diag(case.block(M, i)).reshape(case.shapes[i])) < case.tol
    expected = explicit_kfac_dense(case, A_ref, B_ref, M)
    dense = op.to_dense()
    assert rel(dense, expected) < case.tol
    # teeth: the Kronecker order matters, and K-FAC is not the exact GGN block
    wrong = scipy.linalg.block_diag(
        *[
            np.kron(B_ref[kernel_of[i]], A_ref[kernel_of[i]]) if i in kernel_of else np.diag(np.diag(case.block(M, i)))
            for i in range(len(case.shapes))
        ]
    )
    assert rel(wrong, expected) > 1e-2
    i0 = case.kernels[0]
    assert rel(case.block(dense, i0), case.block(M, i0)) > 1e-3


# --------------------------------------- 4. structured operators ----
STRUCT_OPS = ("einsum", "eigh")  # what the package's structured operators use


def _sym_psd(rng, n, rank=None):
    R = rng.normal(size=(n, n if rank is None else rank))
    return R @ R.T + (0.0 if rank is not None else 0.1 * np.eye(n))


def _orthogonal(rng, n):
    return np.linalg.qr(rng.normal(size=(n, n)))[0]


def _dense_eig_fn(M, fn, cutoff_rel=0.0):
    w, q = np.linalg.eigh((M + M.T) / 2)
    keep = w > cutoff_rel * max(w.max(), 0.0)
    f = np.where(keep, fn(np.where(keep, w, 1.0)), 0.0)
    return (q * f) @ q.T


def _inv(M, d):
    return np.linalg.inv(M + d * np.eye(M.shape[0]))


def _inv_sqrt(M, d):
    return _dense_eig_fn(M + d * np.eye(M.shape[0]), lambda w: 1.0 / np.sqrt(w))


def test_diagonal_operator():
    tol = tol_for(*STRUCT_OPS)
    rng = np.random.default_rng(2)
    d1, d2 = rng.uniform(0.5, 2.0, size=(2, 3)), rng.uniform(0.5, 2.0, size=(4,))
    d1[0, 1] = 0.0
    d2[2] = 0.0
    D = cv.Diagonal(tensors([d1, d2]))
    flat = np.concatenate([d1.ravel(), d2])
    assert D.shapes == [(2, 3), (4,)] and D.dim == 10
    dense = D.to_dense()
    np.testing.assert_array_equal(dense, np.diag(flat))
    V = rng.normal(size=(3, 10))
    assert rel(ref.flatten_rows(D.matmat(split_flat(V, D.shapes))), V * flat) < EXACT
    assert rel(ref.flatten(D.diagonal()), flat) < EXACT
    assert float(ops.convert_to_numpy(D.trace())) == pytest.approx(flat.sum(), rel=EXACT)
    # undamped pseudo-inverse: exact zeros are excluded, not inverted
    inv = D.inverse().to_dense()
    expected = np.diag(np.where(flat > 0, 1.0 / np.where(flat > 0, flat, 1.0), 0.0))
    assert np.all(np.isfinite(inv)) and rel(inv, expected) < EXACT
    assert inv[1, 1] == 0.0 and inv[8, 8] == 0.0
    # absolute and relative (per-tensor mean) damping
    assert rel(D.inverse(0.3).to_dense(), np.diag(1.0 / (flat + 0.3))) < EXACT
    lam = np.concatenate([np.full(6, 0.3 * d1.mean()), np.full(4, 0.3 * d2.mean())])
    assert rel(D.inverse(0.3, relative=True).to_dense(), np.diag(1.0 / (flat + lam))) < EXACT
    # teeth: one mean over all tensors is a different damping
    assert rel(np.diag(1.0 / (flat + 0.3 * flat.mean())), np.diag(1.0 / (flat + lam))) > 1e-3
    assert rel(D.inverse_sqrt(0.3, relative=True).to_dense(), np.diag(1.0 / np.sqrt(flat + lam))) < EXACT
    S = D.inverse_sqrt(0.3)
    assert rel((S @ S).to_dense(), D.inverse(0.3).to_dense()) < tol
    # rcond: entries at or below rcond * max are dropped
    cut = D.inverse(rcond=0.6).to_dense()
    assert rel(cut, np.diag(np.where(flat > 0.6 * flat.max(), 1.0 / np.where(flat > 0, flat, 1.0), 0.0))) < EXACT
    assert (np.diag(cut) == 0).sum() > 2


@pytest.mark.parametrize("shape,split,view", [((3, 4), None, (3, 4)), ((2, 3, 4), None, (6, 4)), ((2, 3, 2), 1, (2, 6))])
def test_kfac_operator_products(shape, split, view):
    tol = tol_for(*STRUCT_OPS)
    rng = np.random.default_rng(3)
    m, n = view
    A, B = rng.normal(size=(m, m)), rng.normal(size=(n, n))  # not symmetric
    op = cv.KFAC(*tensors([A, B]), shape, split)
    assert op.view == view and op.shapes == [shape]
    kron = np.kron(A, B)
    dense = op.to_dense()
    assert rel(dense, kron) < tol
    assert rel(np.kron(B, A), kron) > 1e-2  # teeth
    V = rng.normal(size=(3, m * n))
    out = op.matmat(split_flat(V, [shape]))
    assert tuple(out[0].shape) == (3,) + shape
    assert rel(ref.flatten_rows(out), V @ kron.T) < tol
    # (A kron B) vec_row(X) = vec_row(A X B^T)
    X = V[0].reshape(m, n)
    assert rel(ref.flatten(op.matvec(tensors([X.reshape(shape)]))), (A @ X @ B.T).ravel()) < tol
    assert rel(ref.flatten(op @ tensors([X.reshape(shape)])), (A @ X @ B.T).ravel()) < tol
    assert rel(ref.flatten(op.diagonal()), np.diag(kron)) < EXACT
    assert float(ops.convert_to_numpy(op.trace())) == pytest.approx(np.trace(kron), rel=EXACT)


def test_kfac_inverse_and_inverse_sqrt():
    tol = tol_for(*STRUCT_OPS)
    rng = np.random.default_rng(4)
    A, B = _sym_psd(rng, 3), _sym_psd(rng, 4)
    op = cv.KFAC(*tensors([A, B]), (3, 4))
    kron = np.kron(A, B)
    for d in (0.0, 0.05):
        inv = op.inverse(d)
        assert isinstance(inv, cv.EKFAC) and inv.orthogonal
        assert rel(inv.to_dense(), _inv(kron, d)) < tol
        assert rel(op.inverse_sqrt(d).to_dense(), _inv_sqrt(kron, d)) < tol
    # damping of the Kronecker product, not of the factors (teeth)
    assert rel(np.kron(A + 0.05 * np.eye(3), B + 0.05 * np.eye(4)), kron + 0.05 * np.eye(12)) > 1e-3
    # relative: times the mean eigenvalue tr(A) tr(B) / (m n)
    lam = 0.05 * np.trace(A) * np.trace(B) / 12
    assert rel(op.inverse(0.05, relative=True).to_dense(), _inv(kron, lam)) < tol
    assert rel(op.inverse_sqrt(0.05, relative=True).to_dense(), _inv_sqrt(kron, lam)) < tol
    S = op.inverse_sqrt(0.05, relative=True)
    assert rel((S @ S).to_dense(), op.inverse(0.05, relative=True).to_dense()) < tol
    assert rel(S.to_dense() @ S.to_dense() @ (kron + lam * np.eye(12)), np.eye(12)) < tol


def test_kfac_pseudo_inverse_of_a_singular_factor():
    tol = tol_for(*STRUCT_OPS)
    rng = np.random.default_rng(5)
    A = _sym_psd(rng, 3)
    A[-1, :] = A[:, -1] = 0.0  # exactly singular: a zero row and column
    B = _sym_psd(rng, 4)
    op = cv.KFAC(*tensors([A, B]), (3, 4))
    kron = np.kron(A, B)
    pinv = np.linalg.pinv(kron, rcond=4 * np.finfo(float).eps, hermitian=True)
    got = op.inverse().to_dense()
    assert np.all(np.isfinite(got))
    assert rel(got, pinv) < tol
    assert rel(got @ kron @ got, got) < tol  # Moore-Penrose
    assert np.abs(got[-4:, :]).max() < 1e-12 and np.abs(got[:, -4:]).max() < 1e-12
    assert rel(op.inverse_sqrt().to_dense(), _dense_eig_fn(kron, lambda w: 1.0 / np.sqrt(w), 4 * np.finfo(float).eps)) < tol
    # an explicit rcond drops the small eigenvalues too
    rcond = 0.05
    w = np.linalg.eigvalsh(kron)
    assert ((w > 1e-8 * w.max()) & (w <= rcond * w.max())).any()  # teeth: something is dropped
    assert rel(op.inverse(rcond=rcond).to_dense(), _dense_eig_fn(kron, lambda v: 1.0 / v, rcond)) < tol


def test_ekfac_operator():
    tol = tol_for(*STRUCT_OPS)
    rng = np.random.default_rng(6)
    QA, QG = _orthogonal(rng, 3), _orthogonal(rng, 4)
    s = rng.uniform(0.2, 2.0, size=(3, 4))
    shape = (3, 2, 2)  # split 1: view (3, 4)
    op = cv.EKFAC(*tensors([QA, QG, s]), shape, split=1, orthogonal=True)
    Q = np.kron(QA, QG)
    dense = Q @ np.diag(s.ravel()) @ Q.T
    assert rel(op.to_dense(), dense) < tol
    V = rng.normal(size=(3, 12))
    assert rel(ref.flatten_rows(op.matmat(split_flat(V, [shape]))), V @ dense.T) < tol
    X = V[0].reshape(3, 4)
    assert rel(ref.flatten(op.matvec(tensors([X.reshape(shape)]))), (QA @ (s * (QA.T @ X @ QG)) @ QG.T).ravel()) < tol
    assert rel(ref.flatten(op.diagonal()), np.diag(dense)) < tol
    assert float(ops.convert_to_numpy(op.trace())) == pytest.approx(np.trace(dense), rel=tol)
    assert rel(op.inverse(0.1).to_dense(), _inv(dense, 0.1)) < tol
    lam = 0.1 * s.mean()
    assert rel(op.inverse(0.1, relative=True).to_dense(), _inv(dense, lam)) < tol
    assert rel(op.inverse_sqrt(0.1, relative=True).to_dense(), _inv_sqrt(dense, lam)) < tol
    # learned (non-orthogonal) bases: products, diagonal, trace; no inverse
    PA, PG = rng.normal(size=(3, 3)), rng.normal(size=(4, 4))
    free = cv.EKFAC(*tensors([PA, PG, s]), shape, split=1)
    P = np.kron(PA, PG)
    fdense = P @ np.diag(s.ravel()) @ P.T
    assert rel(free.to_dense(), fdense) < tol
    assert rel(ref.flatten(free.diagonal()), np.diag(fdense)) < tol
    assert float(ops.convert_to_numpy(free.trace())) == pytest.approx(np.trace(fdense), rel=tol)
    assert abs(np.sum(s) - np.trace(fdense)) > 1e-2  # teeth: sum(s) is not the trace here
    with pytest.raises(NotImplementedError):
        free.inverse(0.1)


def test_dense_operator():
    tol = tol_for(*STRUCT_OPS)
    rng = np.random.default_rng(7)
    shapes = [(2, 2), (3,)]
    M = _sym_psd(rng, 7)
    op = cv.Dense(tensors([M])[0], shapes)
    assert rel(op.to_dense(), M) < tol
    V = rng.normal(size=(3, 7))
    out = op.matmat(split_flat(V, shapes))
    assert [tuple(o.shape) for o in out] == [(3, 2, 2), (3, 3)]
    assert rel(ref.flatten_rows(out), V @ M.T) < tol
    assert rel(ref.flatten(op.diagonal()), np.diag(M)) < EXACT
    assert float(ops.convert_to_numpy(op.trace())) == pytest.approx(np.trace(M), rel=EXACT)
    assert rel(op.inverse(0.2).to_dense(), _inv(M, 0.2)) < tol
    lam = 0.2 * np.trace(M) / 7
    assert rel(op.inverse(0.2, relative=True).to_dense(), _inv(M, lam)) < tol
    assert rel(op.inverse_sqrt(0.2, relative=True).to_dense(), _inv_sqrt(M, lam)) < tol
    with pytest.raises(ValueError):
        cv.Dense(tensors([np.eye(6)])[0], shapes)


def test_block_diagonal_operator_and_per_block_damping():
    tol = tol_for(*STRUCT_OPS)
    rng = np.random.default_rng(8)
    d = rng.uniform(0.5, 2.0, size=(2, 3))
    A, B = _sym_psd(rng, 3), _sym_psd(rng, 2)
    QA, QG, s = _orthogonal(rng, 2), _orthogonal(rng, 2), rng.uniform(0.2, 2.0, size=(2, 2))
    M = _sym_psd(rng, 5)
    blocks = [
        cv.Diagonal(tensors([d])),
        cv.KFAC(*tensors([A, B]), (3, 2)),
        cv.EKFAC(*tensors([QA, QG, s]), (2, 2), orthogonal=True),
        cv.Dense(tensors([M])[0], [(2,), (3,)]),
    ]
    op = cv.BlockDiagonal(blocks)
    assert op.shapes == [(2, 3), (3, 2), (2, 2), (2,), (3,)] and op.dim == 21
    Q = np.kron(QA, QG)
    parts = [np.diag(d.ravel()), np.kron(A, B), Q @ np.diag(s.ravel()) @ Q.T, M]
    dense = scipy.linalg.block_diag(*parts)
    assert rel(op.to_dense(), dense) < tol
    V = rng.normal(size=(3, 21))
    assert rel(ref.flatten_rows(op.matmat(split_flat(V, op.shapes))), V @ dense.T) < tol
    assert rel(ref.flatten(op.diagonal()), np.diag(dense)) < tol
    assert float(ops.convert_to_numpy(op.trace())) == pytest.approx(np.trace(dense), rel=tol)
    damp = [0.1, 0.2, 0.3, 0.4]
    expected = scipy.linalg.block_diag(*[_inv(p, x) for p, x in zip(parts, damp)])
    assert rel(op.inverse(damp).to_dense(), expected) < tol
    # teeth: a single damping gives another matrix
    assert rel(scipy.linalg.block_diag(*[_inv(p, 0.1) for p in parts]), expected) > 1e-3
    means = [d.mean(), np.trace(A) * np.trace(B) / 6, s.mean(), np.trace(M) / 5]
    expected_sqrt = scipy.linalg.block_diag(*[_inv_sqrt(p, x * mu) for p, x, mu in zip(parts, damp, means)])
    # the Diagonal block's relative damping is per tensor; it has one tensor here
    assert rel(op.inverse_sqrt(damp, relative=True).to_dense(), expected_sqrt) < tol
    with pytest.raises(ValueError):
        op.inverse([0.1, 0.2])
    with pytest.raises(ValueError):
        cv.BlockDiagonal([])


def test_blocks_far_below_the_largest_invert_to_zero_and_the_rest_as_alone():
    """Relative damping: a block whose largest eigenvalue is at most
    ``BLOCK_RCOND`` times the largest block's (rounding noise) inverts to
    zero, whatever its kind (diagonal, K-FAC, EK-FAC); every other block's
    inverse is its own, as alone. The blocks' top eigenvalues are read in
    one go, the diagonal ones in one call."""
    tol = tol_for(*STRUCT_OPS)
    rng = np.random.default_rng(11)
    A, B = _sym_psd(rng, 3), _sym_psd(rng, 2)
    QA, QG, s = _orthogonal(rng, 2), _orthogonal(rng, 2), rng.uniform(0.2, 2.0, size=(2, 2))

    def blocks(scale):
        return [cv.Diagonal(tensors([scale * rng.uniform(0.5, 2.0, size=(2, 3))])),
                cv.KFAC(*tensors([A, scale * B]), (3, 2)),
                cv.EKFAC(*tensors([QA, QG, scale * s]), (2, 2), orthogonal=True)]

    big, tiny = blocks(1.0), blocks(1e-13)
    mixed = [big[0], tiny[0], big[1], tiny[1], big[2], tiny[2]]
    op = cv.BlockDiagonal(mixed)
    tops = [float(np.max(np.linalg.eigvalsh(b.to_dense()))) for b in mixed]
    np.testing.assert_allclose(ref.to_numpy(op._top_eigenvalues()), tops, rtol=1e-12)
    for method in ("inverse", "inverse_sqrt"):
        out = getattr(op, method)(0.01, relative=True).blocks
        for b, o, kept in zip(mixed, out, (True, False) * 3):
            alone = getattr(b, method)(0.01, relative=True).to_dense()
            if kept:
                assert rel(o.to_dense(), alone) < tol, method
            else:
                assert not np.any(o.to_dense()) and np.any(alone), method  # teeth: alone it is not zero



def test_many_blocks_invert_in_a_few_calls_as_each_alone(solver_calls):
    """With one damping, ``BlockDiagonal`` inverts the blocks of one class
    together: every factor's eigendecomposition in one solver call, each
    block's inverse that of the dense matrix and the same as the per-block
    path (a damping per block) gives, whatever the blocks' order, sizes and
    kinds (several tensors of a diagonal, K-FAC of equal and unequal
    views, a Gram-built one, a diagonal input factor, EK-FAC, dense)."""
    tol = tol_for(*STRUCT_OPS)
    rng = np.random.default_rng(12)
    R = rng.normal(size=(2, 4))  # 2 rows < 4 columns: the Gram path
    A1, B1, A2, B2, A3, B3 = (_sym_psd(rng, n) for n in (3, 2, 3, 2, 2, 3))
    B4, B5, a6 = _sym_psd(rng, 3), _sym_psd(rng, 2), rng.uniform(0.5, 2.0, size=3)
    QA, QG, s = _orthogonal(rng, 2), _orthogonal(rng, 2), rng.uniform(0.2, 2.0, size=(2, 2))
    d1, d2 = rng.uniform(0.5, 2.0, size=(2, 3)), rng.uniform(0.5, 2.0, size=(4,))
    blocks = [
        cv.KFAC(*tensors([A1, B1]), (3, 2)),
        cv.Diagonal(tensors([d1, d2])),
        cv.KFAC.from_rows(*tensors([R, B4]), (4, 3)),
        cv.KFAC(*tensors([A2, B2]), (3, 2)),
        cv.EKFAC(*tensors([QA, QG, s]), (2, 2), orthogonal=True),
        cv.DiagonalInputKFAC(*tensors([a6, B5]), (3, 2)),
        cv.KFAC(*tensors([A3, B3]), (2, 3)),
    ]
    parts = [np.kron(A1, B1), np.diag(np.concatenate([d1.ravel(), d2])), np.kron(R.T @ R, B4), np.kron(A2, B2),
             np.kron(QA, QG) @ np.diag(s.ravel()) @ np.kron(QA, QG).T, np.kron(np.diag(a6), B5), np.kron(A3, B3)]
    op = cv.BlockDiagonal(blocks)
    # the trace, one call per class, is the dense one's
    trace = float(ops.convert_to_numpy(op.trace()))
    assert trace == pytest.approx(sum(np.trace(p) for p in parts), rel=tol)
    damping = 0.05
    for method, fn in (("inverse", _inv), ("inverse_sqrt", _inv_sqrt)):
        together = getattr(op, method)(damping)
        assert rel(together.to_dense(), scipy.linalg.block_diag(*[fn(p, damping) for p in parts])) < tol, method
        for relative in (False, True):
            together = getattr(op, method)(damping, relative=relative).to_dense()
            one_by_one = getattr(cv.BlockDiagonal(blocks), method)([damping] * len(blocks), relative=relative).to_dense()
            assert rel(together, one_by_one) < 1e-12 * max(1.0, np.abs(one_by_one).max()) or np.allclose(together, one_by_one, rtol=tol), method
    # Each factor decomposed once, cached on its block: the K-FAC blocks'
    # eight (three pairs, the Gram matrix and its output factor) in one
    # call, the diagonal-input class's output factor in another.
    assert solver_calls == [8, 1]

# ------------------------------------------------------ 5. composition ----
def test_composition_and_checks():
    tol = tol_for(*STRUCT_OPS)
    rng = np.random.default_rng(9)
    A_, B_ = rng.normal(size=(3, 3)), rng.normal(size=(4, 4))
    d = rng.uniform(0.5, 2.0, size=(3, 4))
    Kop = cv.KFAC(*tensors([A_, B_]), (3, 4))
    Dop = cv.Diagonal(tensors([d]))
    Kd, Dd = np.kron(A_, B_), np.diag(d.ravel())
    assert rel(Kd @ Dd, Dd @ Kd) > 1e-2  # teeth: the order of a product matters
    cases = [
        (Kop @ Dop, Kd @ Dd),
        (Dop @ Kop, Dd @ Kd),
        (Kop @ Dop @ Kop, Kd @ Dd @ Kd),
        (Kop + Dop, Kd + Dd),
        (Kop - Dop, Kd - Dd),
        (2.5 * Kop, 2.5 * Kd),
        (Kop * 2.5, 2.5 * Kd),
        (-Kop, -Kd),
        (Kop / 4.0, Kd / 4.0),
        (Kop + Dop - 0.5 * (Dop @ Kop), Kd + Dd - 0.5 * Dd @ Kd),
    ]
    for op, expected in cases:
        assert isinstance(op, cv.LinearOperator)
        assert rel(op.to_dense(), expected) < tol
    V = rng.normal(size=(3, 12))
    assert rel(ref.flatten_rows((Kop @ Dop).matmat(split_flat(V, [(3, 4)]))), V @ (Kd @ Dd).T) < tol
    assert rel(ref.flatten((Kop + Dop) @ tensors([V[0].reshape(3, 4)])), (Kd + Dd) @ V[0]) < tol
    assert rel(ref.flatten((Kop - Dop).diagonal()), np.diag(Kd - Dd)) < tol
    assert float(ops.convert_to_numpy((2.5 * Kop).trace())) == pytest.approx(2.5 * np.trace(Kd), rel=tol)
    # a positive multiple's inverse: (c K + d I)^-1
    P = cv.KFAC(*tensors([_sym_psd(rng, 3), _sym_psd(rng, 4)]), (3, 4))
    Pd = P.to_dense()
    assert rel((2.0 * P).inverse(0.1).to_dense(), _inv(2.0 * Pd, 0.1)) < tol
    with pytest.raises(ValueError):
        (-P).inverse(0.1)
    with pytest.raises(NotImplementedError):
        (Kop @ Dop).diagonal()
    # operators on different spaces do not combine
    other = cv.Diagonal(tensors([rng.uniform(size=(4, 3))]))
    for combine in (lambda: Kop @ other, lambda: Kop + other, lambda: Kop - other, lambda: cv.BlockDiagonal([Dop]) + Kop @ other):
        with pytest.raises(ValueError):
            combine()
    # badly shaped vectors
    with pytest.raises(ValueError):
        Kop.check(tensors([np.zeros((2, 4, 3))]))
    with pytest.raises(ValueError):
        Kop.check(tensors([np.zeros((3, 4))]))  # no leading axis
    Kop.check(tensors([np.zeros((3, 4))]), batched=False)
    with pytest.raises(ValueError):
        Kop.check(tensors([np.zeros((2, 3, 4)), np.zeros((2, 3, 4))]))
    with pytest.raises(ValueError):
        Kop.check(np.zeros((2, 3, 4)))
    two = cv.Diagonal(tensors([np.ones((2,)), np.ones((3,))]))
    with pytest.raises(ValueError, match="leading axis"):
        two.check(tensors([np.zeros((2, 2)), np.zeros((3, 3))]))
    with pytest.raises(ValueError):
        Kop.to_dense(max_dim=5)


def test_a_sandwich_s_quadratic_pair_lets_the_probes_go_when_handed_over():
    """``(S z, A S z)`` for ``S A S`` with a symmetric per-tensor S: the same
    inner products as ``z . (S A S z)``; handed over (`consume`), the
    probe list is emptied once S z exists (a copy of the weights less during
    A's product), and kept otherwise."""
    tol = tol_for(*STRUCT_OPS)
    rng = np.random.default_rng(13)
    S = cv.KFAC(*tensors([_sym_psd(rng, 3), _sym_psd(rng, 2)]), (3, 2)).inverse_sqrt(0.1)
    A = cv.Dense(tensors([_sym_psd(rng, 6)])[0], [(3, 2)])
    op = S @ A @ S
    Z = rng.choice([-1.0, 1.0], size=(4, 6))
    expected = np.einsum("kj,kj->k", Z, Z @ op.to_dense().T)
    for consume in (False, True):
        z = split_flat(Z, [(3, 2)])
        u, w = op.quadratic_pair(z, consume=consume)
        got = np.einsum("kj,kj->k", ref.flatten_rows(u), ref.flatten_rows(w))
        assert rel(got, expected) < tol
        assert len(z) == (0 if consume else 1)

def test_model_operator_checks_vectors():
    case = get_case("sigmoid_mlp")
    H = cv.Hessian(case.model, case.x, case.y, batch_size=case.batch_size)
    bad = split_flat(np.zeros((2, case.P)), case.shapes)
    with pytest.raises(ValueError):
        H.matmat(bad[:-1])
    with pytest.raises(ValueError):
        H.matmat(bad[:-1] + [ops.zeros((2, 7), dtype="float64")])
    with pytest.raises(ValueError):
        H + cv.Diagonal(tensors([np.ones(s) for s in case.shapes[:-1]]))
    # a model operator composes with structured ones on its space
    D = cv.Diagonal(tensors([np.full(s, 2.0) for s in case.shapes]))
    assert rel((D @ H - H).to_dense(), case.hessian) < case.tol


# -------------------------------------------------------- 6. trace_with ----
def _per_block_traces(case, W, G):
    WG = W @ G
    return [np.trace(case.block(WG, i)) for i in range(len(case.shapes))]


def _check_trace_with(case, G, W_ref, weight, tol):
    G_ref = case.ggn("exact")
    total, parts = G.trace_with(weight)
    assert isinstance(total, float) and len(parts) == len(case.shapes)
    assert total == pytest.approx(sum(parts), rel=1e-12)
    assert total == pytest.approx(np.trace(W_ref @ G_ref), rel=tol)
    expected = _per_block_traces(case, W_ref, G_ref)
    assert rel(parts, expected) < tol
    return total


@pytest.mark.parametrize("name", ["relu_mlp", "conv"])
def test_trace_with_none_and_diagonal_weights(name):
    case = get_case(name)
    G_ref = case.ggn("exact")
    G = cv.GGN(case.model, case.x, batch_size=case.batch_size)
    _check_trace_with(case, G, np.eye(case.P), None, case.tol)
    d_ref = np.diag(G_ref)
    o = offsets(case.shapes)
    means = np.concatenate([np.full(o[i + 1] - o[i], d_ref[o[i] : o[i + 1]].mean()) for i in range(len(case.shapes))])
    damped = cv.BlockDiagonal([cv.Diagonal([di]) for di in G.diagonal()]).inverse(1e-3, relative=True)
    W_ref = np.diag(1.0 / (d_ref + 1e-3 * means))
    assert rel(damped.to_dense(), W_ref) < case.tol
    _check_trace_with(case, G, W_ref, damped, case.tol)
    # undamped: exact zeros excluded; the trace counts the nonzero entries
    zero = d_ref == 0.0
    if name == "relu_mlp":
        assert zero.sum() >= 4  # teeth: the dead unit's weights
    undamped = cv.BlockDiagonal([cv.Diagonal([di]) for di in G.diagonal()]).inverse(0.0)
    W0 = np.diag(np.where(zero, 0.0, 1.0 / np.where(zero, 1.0, d_ref)))
    total = _check_trace_with(case, G, W0, undamped, case.tol)
    assert total == pytest.approx((~zero).sum(), rel=case.tol)
    # a plain Diagonal weight is taken too
    flat_w = cv.Diagonal(damped.diagonal())
    assert G.trace_with(flat_w)[0] == pytest.approx(np.trace(W_ref @ G_ref), rel=case.tol)


def _kfac_inverse_dense(case, A, B, M, damping, relative):
    kernel_of = dict(zip(case.kernels, range(len(case.kernels))))
    blocks = []
    for i in range(len(case.shapes)):
        if i in kernel_of:
            Kb = np.kron(A[kernel_of[i]], B[kernel_of[i]])
            lam = damping * (np.trace(Kb) / Kb.shape[0] if relative else 1.0)
            if damping > 0:
                blocks.append(_inv(Kb, lam))
            else:
                blocks.append(np.linalg.pinv(Kb, rcond=max(A[kernel_of[i]].shape[0], B[kernel_of[i]].shape[0]) * np.finfo(float).eps, hermitian=True))
        else:
            d = np.diag(case.block(M, i))
            lam = damping * (d.mean() if relative else 1.0)
            keep = d + lam > 0
            blocks.append(np.diag(np.where(keep, 1.0 / np.where(keep, d + lam, 1.0), 0.0)))
    return scipy.linalg.block_diag(*blocks)


@pytest.mark.parametrize("name", ["relu_mlp", "conv"])
def test_trace_with_kfac_inverse(name):
    case = get_case(name)
    G_ref = case.ggn("exact")
    A, B, _ = explicit_kfac(case, "exact")
    G = cv.GGN(case.model, case.x, batch_size=case.batch_size)
    kf = G.kfac()
    W = kf.inverse(1e-3, relative=True)
    W_ref = _kfac_inverse_dense(case, A, B, G_ref, 1e-3, True)
    assert rel(W.to_dense(), W_ref) < case.tol
    t = _check_trace_with(case, G, W_ref, W, case.tol)
    # teeth: damping the factors (Martens-Grosse pi-damping, A + pi sqrt(lam) I
    # and B + sqrt(lam) / pi I) instead of the Kronecker product gives another value
    factor_damped, o = W_ref.copy(), offsets(case.shapes)
    for i, l in zip(case.kernels, range(len(A))):
        m, n = len(A[l]), len(B[l])
        lam = 1e-3 * np.trace(A[l]) * np.trace(B[l]) / (m * n)
        pi = np.sqrt((np.trace(A[l]) / m) / (np.trace(B[l]) / n))
        factor_damped[o[i] : o[i + 1], o[i] : o[i + 1]] = np.kron(_inv(A[l], pi * np.sqrt(lam)), _inv(B[l], np.sqrt(lam) / pi))
    assert abs(np.trace(factor_damped @ G_ref) - t) > 1e-3 * abs(t)
    W0 = kf.inverse(0.0)
    W0_ref = _kfac_inverse_dense(case, A, B, G_ref, 0.0, False)
    assert rel(W0.to_dense(), W0_ref) < case.tol
    _check_trace_with(case, G, W0_ref, W0, case.tol)
    # wrong weights are refused
    with pytest.raises(ValueError):
        G.trace_with(cv.Dense(tensors([np.eye(case.P)])[0], case.shapes))
    free = cv.BlockDiagonal(
        [cv.EKFAC(b.QA, b.QG, b.s, b.shapes[0], b.split) if isinstance(b, cv.EKFAC) else b for b in W.blocks]
    )
    with pytest.raises(ValueError, match="orthogonal"):
        G.trace_with(free)


# ---------------------------------------- 7. layerwise-linear networks ----
@pytest.mark.parametrize("name,linear", [("relu_mlp", True), ("conv", True), ("conv_bn", True), ("sigmoid_mlp", False), ("einsum", False)])
def test_residual_vanishes_on_layer_blocks_of_layerwise_linear_networks(name, linear):
    from keras_geosam.sharpness import is_layerwise_linear

    case = get_case(name)
    R = cv.GGNResidual(case.model, case.x, case.y, batch_size=case.batch_size).to_dense()
    H = case.hessian
    scale = np.linalg.norm(H)
    assert np.linalg.norm(R - (H - case.ggn("exact"))) < case.tol * scale
    diag_blocks = [R[case.group_slice(g), case.group_slice(g)] for g in case.groups]
    largest = max(np.linalg.norm(b) for b in diag_blocks)
    if linear:
        assert largest < case.tol * scale
        # the residual lives off the diagonal blocks (teeth)
        assert np.linalg.norm(R) > 1e-3 * scale
    else:
        assert largest > 1e-3 * scale
    assert is_layerwise_linear(case.model) is linear


# ------------------------------------------------------ 8. validation ----
def test_validation():
    case = get_case("sigmoid_mlp")
    x, y = case.x, case.y
    mse = keras.Sequential([keras.Input((4,)), keras.layers.Dense(K)])
    mse.compile(loss="mse")
    # A squared error's GGN and Fisher are defined (test_likelihoods.py);
    # a hinge loss has no likelihood.
    for loss in ("hinge", keras.losses.MeanAbsoluteError()):
        with pytest.raises(ValueError, match="no likelihood"):
            cv.GGN(mse, x, kind="mc", loss=loss)
        with pytest.raises(ValueError, match="no likelihood"):
            cv.GGNResidual(mse, x, np.zeros((N, K)), loss=loss)
    hinge = keras.Sequential([keras.Input((4,)), keras.layers.Dense(K)])
    hinge.compile(loss="hinge")
    with pytest.raises(ValueError, match="squared error"):
        cv.GGN(hinge, x)
    with pytest.raises(ValueError, match="length"):
        cv.Hessian(case.model, x, y[:-1])
    with pytest.raises(ValueError, match="length"):
        cv.GGN(case.model, x, y[:-1], kind="empirical")
    x_nan = x.copy()
    x_nan[3, 1] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        cv.Hessian(case.model, x_nan, y)
    with pytest.raises(ValueError, match="NaN"):
        cv.GGN(case.model, x_nan)
    unbuilt = keras.Sequential([keras.layers.Dense(K)])
    unbuilt.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match="built"):
        cv.GGN(unbuilt, x)
    with pytest.raises(ValueError, match="kind"):
        cv.GGN(case.model, x, kind="bogus")
    with pytest.raises(ValueError, match="labels"):
        cv.GGN(case.model, x, kind="empirical")
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="num_samples"):
            cv.GGN(case.model, x, kind="mc", num_samples=bad)
    with pytest.raises(ValueError):
        cv.KFAC(*tensors([np.eye(3), np.eye(3)]), (3, 4))
    with pytest.raises(ValueError):
        cv.KFAC(*tensors([np.eye(3), np.eye(4)]), (12,))


def test_misuse_gets_clear_errors():
    """A weight that does not cover the variables, an un-inverted K-FAC
    weight, and badly shaped vectors for a structured operator are refused;
    a positive multiple has an inverse square root."""
    case = get_case("sigmoid_mlp")
    G = cv.GGN(case.model, case.x)
    with pytest.raises(ValueError, match="variables"):
        G.trace_with(cv.BlockDiagonal([cv.Diagonal([d]) for d in G.diagonal()[:2]]))
    with pytest.raises(ValueError, match="EKFAC"):
        G.trace_with(G.kfac())
    k = cv.KFAC(np.eye(3), np.eye(4), (3, 4))
    with pytest.raises(ValueError, match="shape"):
        k.matmat([ops.ones((2, 4, 3), dtype="float64")])
    with pytest.raises(ValueError, match="shape"):
        cv.Diagonal([ops.ones((3,), dtype="float64")]).matvec([ops.ones((4,), dtype="float64")])
    rng = np.random.default_rng(5)
    A, B = _sym_psd(rng, 3), _sym_psd(rng, 4)
    dense = np.kron(A, B)
    got = (2.0 * cv.KFAC(A, B, (3, 4))).inverse_sqrt(0.1).to_dense()
    assert rel(got, _inv_sqrt(2.0 * dense, 0.1)) < EXACT  # (2 A kron B + 0.1 I)^-1/2


def _diag_vs_dense(model, x, y, kind="exact"):
    G = cv.GGN(model, x, y, kind=kind, num_samples=2, seed=3)
    diag = np.concatenate([np.ravel(ops.convert_to_numpy(d)) for d in G.diagonal()])
    # to_dense builds G from per-example gradients by the backend's vectorised
    # map, independently of the layer rules behind diagonal().
    return diag, np.diag(G.to_dense())


@pytest.mark.parametrize("kind", ["exact", "empirical"])
def test_a_layer_called_twice_gets_the_summed_per_example_gradient(kind):
    rng = np.random.default_rng(30)
    d = keras.layers.Dense(4, activation="tanh")
    inp = keras.Input((4,))
    model = keras.Model(inp, keras.layers.Dense(K)(d(d(inp))))
    _compile(model)
    _assign(model.trainable_variables, rng, 0.7)
    x, y = _data(rng, (4,))
    diag, dense = _diag_vs_dense(model, x, y, kind)
    assert rel(diag, dense) < tol_for("matmul", "tanh")


def test_einsum_bias_axes_in_any_order():
    rng = np.random.default_rng(31)
    layer = keras.layers.EinsumDense("abc,cde->abde", output_shape=(3, 2, 4), bias_axes="ed", activation="tanh")
    model = keras.Sequential([keras.Input((3, 5)), layer, keras.layers.Flatten(), keras.layers.Dense(K)])
    _compile(model)
    _assign(model.trainable_variables, rng, 0.5)
    x = rng.normal(size=(N, 3, 5))
    y = rng.integers(0, K, size=N).astype("int32")
    diag, dense = _diag_vs_dense(model, x, y)
    assert rel(diag, dense) < tol_for("matmul", "tanh")


def test_lora_dense_falls_back_to_the_vectorised_map():
    # float32: Keras creates LoRA factors in float32 whatever the policy.
    with keras_dtype("float32"):
        rng = np.random.default_rng(32)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(K)])
        model.layers[0].enable_lora(2)
        _compile(model)
        _assign(model.trainable_variables, rng, 0.5)
        x, y = _data(rng, (4,))
        diag, dense = _diag_vs_dense(model, x.astype("float32"), y)
    assert rel(diag, dense) < 1e-5


def test_block_diagonal_matvec_of_diagonal_and_kfac_blocks():
    # matvec has its own path for diagonal blocks (no probe axis): checked
    # against NumPy products and against the operator's matmat.
    tol = tol_for(*STRUCT_OPS)
    rng = np.random.default_rng(11)
    d1, d2 = rng.normal(size=(4, 3)), rng.normal(size=(5,))
    A, B = rng.normal(size=(3, 3)), rng.normal(size=(2, 2))
    op = cv.BlockDiagonal([cv.Diagonal(tensors([d1, d2])), cv.KFAC(*tensors([A, B]), (3, 2), 1)])
    v = [rng.normal(size=(4, 3)), rng.normal(size=(5,)), rng.normal(size=(3, 2))]
    out = op.matvec(tensors(v))
    assert [tuple(o.shape) for o in out] == [(4, 3), (5,), (3, 2)]
    want = [d1 * v[0], d2 * v[1], A @ v[2] @ B.T]
    for got, w in zip(out, want):
        assert rel(ops.convert_to_numpy(got), w) < tol
    via_matmat = op.matmat([ops.expand_dims(t, 0) for t in tensors(v)])
    for got, w in zip(out, via_matmat):
        assert rel(ops.convert_to_numpy(got), ops.convert_to_numpy(w)[0]) < tol
    with pytest.raises(ValueError, match="shape"):
        op.matvec(tensors([v[0][None], v[1], v[2]]))


def test_matvec_into_equals_matvec_and_writes_only_where_safe():
    """``matvec_into`` (a descent product whose input is read no more) gives
    ``matvec``'s numbers on every operator. A diagonal writes into its
    input on eager torch, but never into a tensor listed twice or a
    strided view, whose other readers would see the product."""
    rng = np.random.default_rng(12)
    d1, d2 = rng.uniform(0.5, 2.0, size=(4, 3)), rng.uniform(0.5, 2.0, size=(4, 3))
    v = rng.normal(size=(4, 3))
    D = cv.Diagonal(tensors([d1, d2]))
    shared = ops.convert_to_tensor(v, dtype="float64")  # one tensor as both entries
    out = D.matvec_into([shared, shared])
    for got, w in zip(out, (d1 * v, d2 * v)):
        assert rel(ops.convert_to_numpy(got), w) < EXACT
    mixed = cv.BlockDiagonal([cv.Diagonal(tensors([d1])), cv.KFAC(*tensors([np.eye(4) * 2, np.eye(3)]), (4, 3), 1)])
    out = mixed.matvec_into(tensors([v, v]))
    for got, w in zip(out, (d1 * v, 2 * v)):
        assert rel(ops.convert_to_numpy(got), w) < EXACT
    blocks = cv.BlockDiagonal([cv.Diagonal(tensors([d1])), cv.Diagonal(tensors([d2]))])
    fresh = tensors([v, 2 * v])
    out = blocks.matvec_into(fresh)
    for got, w in zip(out, (d1 * v, 2 * d2 * v)):
        assert rel(ops.convert_to_numpy(got), w) < EXACT
    if keras.backend.backend() == "torch":
        import torch

        assert [o.data_ptr() for o in out] == [f.data_ptr() for f in fresh]  # written in place
        assert rel(fresh[0].numpy(), d1 * v) < EXACT
        base = torch.tensor(np.concatenate([v, v]))
        view = base[:4]  # a view: its base keeps the old numbers
        out = cv.Diagonal(tensors([d1])).matvec_into([view])
        assert out[0].data_ptr() != view.data_ptr() and rel(base[:4].numpy(), v) < EXACT
