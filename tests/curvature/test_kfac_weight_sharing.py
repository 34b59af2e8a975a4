"""K-FAC for layers shared over positions (Embedding, EinsumDense with
sequence axes, as in attention), and the per-example rules of Embedding and
LayerNormalization, against explicit float64 references.

Each tiny model is written a second time by hand in ``jax.numpy`` (x64) and
fed the Keras model's weights. The references are built from explicit
per-position quantities: every K-FAC layer's input rows ``a_nt`` (one-hot
rows for an Embedding) and the gradients ``b_ntj`` of the output factors'
projections with respect to its output at each position (jax, by additive
perturbations), so

- expand: ``A = 1/(NT) sum_nt a a^T``, ``B = 1/N sum_ntj b b^T``;
- reduce: ``A = 1/N sum_n abar abar^T`` (``abar`` the mean row over t),
  ``B = 1/N sum_nj (sum_t b)(sum_t b)^T``;
- an Embedding keeps ``diag(A)``;

and the exact GGN from explicit Jacobians ``1/N sum_n J_n^T Lambda_n J_n``
(Lambda_n the Hessian of example n's loss in its outputs). Exact cases (as
curvlinops tests them): deep linear networks with a squared-error loss per
position (expand) or after pooling the positions (reduce, for any number of
examples) and, for cross-entropy, one example (reduce).

Tolerances: relative Frobenius error 1e-8, or 1e-6 where Keras computes an
op of the model in float32 for float64 inputs on this backend (probed).
"""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
from keras import ops

from reference import curvature as ref
from reference.dtypes import keras_dtype
from keras_geosam import curvature as cv
from keras_geosam.curvature.capture import Capture
from keras_geosam.curvature.functional import model_functions

EXACT, KERAS_F32 = 1e-8, 1e-6
N, T, V, D, K = 5, 4, 7, 3, 3


@pytest.fixture(scope="module", autouse=True)
def _module_float64():
    with keras_dtype("float64"):
        yield


def _lossy(name):
    """Whether Keras evaluates this op of float64 inputs in float32 here."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, 4))
    probes = {
        "einsum": (lambda: ops.einsum("abc,cd->abd", x, x[0].T), np.einsum("abc,cd->abd", x, x[0].T)),
        "layernorm": (lambda: ops.layer_normalization(x, None, None, -1, 1e-3),
                      (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-3)),
        "take": (lambda: ops.take(x[0], np.array([2, 0, 2]), axis=0), x[0][[2, 0, 2]]),
    }
    fn, exact = probes[name]
    return ref.rel_err(fn(), exact) > 1e-13


def tol_for(*names):
    return KERAS_F32 if any(_lossy(n) for n in names) else EXACT


def rel(a, b):
    return ref.rel_err(a, b)


# ------------------------------------------------------ hand-written ----
class Tape:
    """Records each K-FAC layer's input rows (N, T, m) and adds `perts[l]`
    to its output l (the gradient there is the layer's output gradient)."""

    def __init__(self, perts=None):
        self.perts, self.rows, self.shapes, self.out_axes = perts, [], [], []

    def layer(self, rows, z, out_axes=1):
        """`out_axes`: trailing axes of `z` that form the kernel's columns."""
        i = len(self.rows)
        self.rows.append(rows)
        self.shapes.append(tuple(z.shape))
        self.out_axes.append(out_axes)
        return z if self.perts is None else z + self.perts[i]


def _assign(model, rng, scale=0.7):
    for v in model.trainable_variables:
        v.assign(scale * rng.normal(size=v.shape))


def _tokens(rng):
    ids = rng.integers(0, V, size=(N, T)).astype("int32")
    ids[0, :2] = 3  # a token repeated inside one example
    ids[1, :] = [1, 1, 5, 1]
    return ids


class Case:
    """A Keras model and its hand-written forward ``fwd(params, x, tape)``."""

    def __init__(self, model, fwd, x, y, loss, ops_used, kernels):
        self.model, self.fwd, self.x, self.y, self.loss = model, fwd, x, y, loss
        self.tol = tol_for(*ops_used)
        self.variables = list(model.trainable_variables)
        self.shapes = [tuple(v.shape) for v in self.variables]
        self.kernels = kernels  # variable indices of the K-FAC kernels, in tape order
        self.p = [jnp.asarray(ref.to_numpy(v.value)) for v in self.variables]
        self.n = int(x.shape[0])

    def outputs(self, p, x=None):
        return self.fwd(p, jnp.asarray(self.x if x is None else x), Tape())

    def out_hessians(self):
        """Per-example Hessians of the loss in the flattened outputs, (N, O, O)."""
        z = np.asarray(self.outputs(self.p))
        per_example = z.reshape(self.n, -1)
        if self.loss == "mse":
            positions = int(np.prod(z.shape[1:-1]))
            c = z.shape[-1]
            return np.stack([np.eye(per_example.shape[1]) * 2.0 / (c * positions)] * self.n)
        p = np.exp(np.asarray(ref.log_softmax(jnp.asarray(z))))
        return np.einsum("nk,kl->nkl", p, np.eye(p.shape[1])) - np.einsum("nk,nl->nkl", p, p)

    def ggn(self):
        """Exact 1/N sum_n J_n^T Lambda_n J_n over the flattened parameters."""
        theta = ref.flatten(self.p)

        def flat_out(t):
            return self.outputs(ref.unflatten(t, self.shapes)).reshape(self.n, -1)

        jac = np.asarray(jax.jacfwd(flat_out)(jnp.asarray(theta)))  # (N, O, P)
        return np.einsum("nop,noq,nqr->pr", jac, self.out_hessians(), jac) / self.n

    def block(self, M, i):
        o = np.cumsum([0] + [int(np.prod(s)) for s in self.shapes])
        return M[o[i] : o[i + 1], o[i] : o[i + 1]]

    def factors(self, approximation):
        """(A, B) of every tape layer from explicit rows and per-position
        output gradients of the exact output factors."""
        tape = Tape()
        self.fwd(self.p, jnp.asarray(self.x), tape)
        lam = self.out_hessians()
        w, q = np.linalg.eigh(lam)
        roots = q * np.sqrt(np.clip(w, 0.0, None))[:, None, :]  # (N, O, O): columns c with sum c c^T = Lambda
        x = jnp.asarray(self.x)
        out_shape = tuple(np.asarray(self.outputs(self.p)).shape[1:])

        def projection(perts, c):
            z = self.fwd(self.p, x, Tape(perts))
            return jnp.sum(c * z)

        grad = jax.jit(jax.grad(projection))
        zeros = [jnp.zeros(s) for s in tape.shapes]
        deltas = [grad(zeros, jnp.asarray(roots[:, :, j].reshape((self.n,) + out_shape))) for j in range(roots.shape[2])]
        A, B = [], []
        for l, rows in enumerate(tape.rows):
            a = np.asarray(rows)
            a = a.reshape(a.shape[0], -1, a.shape[-1])
            d = np.stack([np.asarray(dj[l]) for dj in deltas])
            cols = int(np.prod(d.shape[d.ndim - tape.out_axes[l]:]))
            d = d.reshape(d.shape[0], d.shape[1], -1, cols)
            if approximation == "expand":
                A.append(np.einsum("ntm,ntl->ml", a, a) / (a.shape[0] * a.shape[1]))
                B.append(np.einsum("kntj,kntl->jl", d, d) / self.n)
            else:
                abar = a.mean(axis=1)
                dsum = d.sum(axis=2)
                A.append(abar.T @ abar / self.n)
                B.append(np.einsum("knj,knl->jl", dsum, dsum) / self.n)
        return A, B


def onehot(ids):
    return jax.nn.one_hot(ids, V, dtype=jnp.float64)


def _compile(model, loss):
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True) if loss == "sce" else "mse")
    return model


def build_attention_like(linear=False, n=N):
    """Embedding -> EinsumDense d -> (heads, head_dim) like a query kernel ->
    EinsumDense (heads, head_dim) -> f like an attention output kernel ->
    sum over positions -> EinsumDense head; cross-entropy."""
    rng = np.random.default_rng(31)
    act = None if linear else "relu"
    inputs = keras.Input((T,), dtype="int32")
    h = keras.layers.Embedding(V, D)(inputs)
    h = keras.layers.EinsumDense("btd,dhe->bthe", (T, 2, 2), bias_axes="he", activation=act)(h)
    h = keras.layers.EinsumDense("bthe,hef->btf", (T, 4), bias_axes="f", activation=act)(h)
    h = keras.layers.Lambda(lambda t: ops.sum(t, axis=1), output_shape=(4,))(h)
    out = keras.layers.EinsumDense("bd,dc->bc", (K,), bias_axes="c")(h)
    model = _compile(keras.Model(inputs, out), "sce")
    _assign(model, rng)
    ids = _tokens(rng)[:n]
    y = rng.integers(0, K, size=n).astype("int32")
    f = (lambda z: z) if linear else (lambda z: jnp.maximum(z, 0.0))

    def fwd(p, x, tape):
        E, W1, b1, W2, b2, W3, b3 = p
        ids = x.astype(jnp.int32)
        h = tape.layer(onehot(ids), E[ids])
        h = f(tape.layer(h, jnp.einsum("btd,dhe->bthe", h, W1) + b1, out_axes=2))
        z = f(tape.layer(h.reshape(h.shape[0], T, 4), jnp.einsum("bthe,hef->btf", h, W2) + b2))
        pooled = jnp.sum(z, axis=1)
        return tape.layer(pooled[:, None, :], pooled @ W3 + b3)

    return Case(model, fwd, ids, y, "sce", ("einsum", "take"), kernels=[0, 1, 3, 5])


def build_per_position_regression():
    """Embedding -> EinsumDense -> EinsumDense to per-position outputs
    (N, T, K), linear, mean squared error: the expand setting."""
    rng = np.random.default_rng(32)
    inputs = keras.Input((T,), dtype="int32")
    h = keras.layers.Embedding(V, D)(inputs)
    h = keras.layers.EinsumDense("btd,de->bte", (T, 4), bias_axes="e")(h)
    out = keras.layers.EinsumDense("btd,dc->btc", (T, K), bias_axes="c")(h)
    model = _compile(keras.Model(inputs, out), "mse")
    _assign(model, rng)
    ids = _tokens(rng)
    y = rng.normal(size=(N, T, K))

    def fwd(p, x, tape):
        E, W1, b1, W2, b2 = p
        ids = x.astype(jnp.int32)
        h = tape.layer(onehot(ids), E[ids])
        h = tape.layer(h, jnp.einsum("btd,de->bte", h, W1) + b1)
        return tape.layer(h, jnp.einsum("btd,dc->btc", h, W2) + b2)

    return Case(model, fwd, ids, y, "mse", ("einsum", "take"), kernels=[0, 1, 3])


def build_pooled_regression():
    """Deep linear EinsumDense layers on T positions, summed, then a head;
    mean squared error: the reduce setting."""
    rng = np.random.default_rng(33)
    inputs = keras.Input((T, D))
    h = keras.layers.EinsumDense("btd,de->bte", (T, 4), bias_axes="e")(inputs)
    h = keras.layers.EinsumDense("btd,de->bte", (T, 4), bias_axes="e")(h)
    h = keras.layers.Lambda(lambda t: ops.sum(t, axis=1), output_shape=(4,))(h)
    out = keras.layers.EinsumDense("bd,dc->bc", (K,), bias_axes="c")(h)
    model = _compile(keras.Model(inputs, out), "mse")
    _assign(model, rng)
    x = rng.normal(size=(N, T, D))
    y = rng.normal(size=(N, K))

    def fwd(p, x, tape):
        W1, b1, W2, b2, W3, b3 = p
        h = tape.layer(x, jnp.einsum("btd,de->bte", x, W1) + b1)
        h = tape.layer(h, jnp.einsum("btd,de->bte", h, W2) + b2)
        pooled = jnp.sum(h, axis=1)
        return tape.layer(pooled[:, None, :], pooled @ W3 + b3)

    return Case(model, fwd, x, y, "mse", ("einsum",), kernels=[0, 2, 4])


def _check_forward(case):
    keras_out = ref.to_numpy(case.model(case.x))
    assert rel(keras_out, np.asarray(case.outputs(case.p))) < case.tol


def _kfac_blocks(case, approximation):
    op = cv.GGN(case.model, case.x, case.y).kfac(approximation)
    return op, [op.blocks[i] for i in case.kernels]


# ---------------------------------------------- 1. dense definitions ----
@pytest.mark.parametrize("approximation", ["expand", "reduce"])
@pytest.mark.parametrize("builder", [build_attention_like, build_per_position_regression], ids=["attention", "per_position"])
def test_kfac_factors_equal_their_definitions(builder, approximation):
    case = builder()
    _check_forward(case)
    A_ref, B_ref = case.factors(approximation)
    op, blocks = _kfac_blocks(case, approximation)
    for l, blk in enumerate(blocks):
        assert isinstance(blk, cv.KFAC)
        if l == 0:  # the Embedding: a diagonal input factor, the vocabulary x vocabulary one never formed
            assert isinstance(blk, cv.DiagonalInputKFAC) and tuple(blk.A.shape) == (V,)
            if approximation == "expand":  # one-hot rows: A is diagonal
                assert np.count_nonzero(A_ref[0] - np.diag(np.diag(A_ref[0]))) == 0
            assert rel(blk.A, np.diag(A_ref[0])) < case.tol, (approximation, "A", l)
        else:
            assert rel(blk.A, A_ref[l]) < case.tol, (approximation, "A", l)
        assert rel(blk.B, B_ref[l]) < case.tol, (approximation, "B", l)
    if builder is build_attention_like:
        # Views: d_model x (heads*head_dim) and (heads*head_dim) x f, as for
        # MultiHeadAttention's query and output kernels.
        assert [b.view for b in blocks] == [(V, D), (D, 4), (4, 4), (4, K)]
        # Teeth: with four positions the two approximations differ.
        other = _kfac_blocks(case, "reduce" if approximation == "expand" else "expand")[1]
        assert rel(other[1].B, blocks[1].B) > 1e-2 and rel(other[1].A, blocks[1].A) > 1e-2


# -------------------------------------------------- 2. exact cases ----
def _assert_exact_blocks(case, approximation, kernels):
    G = case.ggn()
    op, _ = _kfac_blocks(case, approximation)
    for i in kernels:
        blk = op.blocks[i]
        dense = ref.to_numpy(blk.to_dense())
        exact = case.block(G, i)
        assert rel(dense, exact) < case.tol * 10, (approximation, i)
    return op, G


def test_expand_is_exact_for_a_deep_linear_network_with_a_loss_per_position():
    case = build_per_position_regression()
    _check_forward(case)
    _assert_exact_blocks(case, "expand", case.kernels)  # the Embedding included
    # Teeth: reduce is not exact here.
    G = case.ggn()
    reduce = cv.GGN(case.model, case.x, case.y).kfac("reduce")
    i = case.kernels[1]
    assert rel(ref.to_numpy(reduce.blocks[i].to_dense()), case.block(G, i)) > 1e-2


def test_reduce_is_exact_for_a_deep_linear_network_that_pools_positions():
    case = build_pooled_regression()
    _check_forward(case)
    _assert_exact_blocks(case, "reduce", case.kernels)
    G = case.ggn()
    expand = cv.GGN(case.model, case.x, case.y).kfac("expand")
    i = case.kernels[0]
    assert rel(ref.to_numpy(expand.blocks[i].to_dense()), case.block(G, i)) > 1e-2


def test_reduce_is_exact_for_one_cross_entropy_example_of_a_deep_linear_network():
    case = build_attention_like(linear=True, n=1)
    _check_forward(case)
    # The EinsumDense kernels before the pooling and the head (the
    # Embedding's input factor is kept diagonal, so it is not exact).
    _assert_exact_blocks(case, "reduce", case.kernels[1:])


def test_exact_ggn_of_a_squared_error_with_positions():
    """GGN(kind="exact") of a per-position squared error: 1/N sum_n J_n^T
    (2/(C T) I) J_n (Keras averages over positions and outputs)."""
    case = build_per_position_regression()
    G = case.ggn()
    assert rel(cv.GGN(case.model, case.x).to_dense(), G) < case.tol
    # The network is linear in each layer's weights: every per-layer block
    # of the Hessian of the squared error is the GGN's (cross-layer ones not).
    theta = jnp.asarray(ref.flatten(case.p))
    hess = np.asarray(jax.hessian(lambda t: jnp.mean((case.outputs(ref.unflatten(t, case.shapes)) - case.y) ** 2))(theta))
    for i in range(len(case.shapes)):
        assert rel(case.block(G, i), case.block(hess, i)) < 1e-10
    assert rel(G, hess) > 1e-2


# ------------------------------------ 3. per-example rules, no vmap ----
def build_layernorm_net():
    rng = np.random.default_rng(34)
    inputs = keras.Input((T,), dtype="int32")
    h = keras.layers.Embedding(V, D)(inputs)
    h = keras.layers.EinsumDense("btd,de->bte", (T, 4), bias_axes="e")(h)
    h = keras.layers.LayerNormalization(epsilon=1e-3)(h)
    h = keras.layers.Lambda(lambda t: ops.sum(t, axis=1), output_shape=(4,))(h)
    out = keras.layers.EinsumDense("bd,dc->bc", (K,), bias_axes="c")(h)
    model = _compile(keras.Model(inputs, out), "sce")
    _assign(model, rng)
    ln = model.layers[3]
    ln.gamma.assign(1.0 + 0.3 * rng.normal(size=ln.gamma.shape))
    ids = _tokens(rng)
    y = rng.integers(0, K, size=N).astype("int32")

    def fwd(p, x, tape):
        E, W1, b1, gamma, beta, W3, b3 = p
        ids = x.astype(jnp.int32)
        h = E[ids]
        h = jnp.einsum("btd,de->bte", h, W1) + b1
        mu = h.mean(-1, keepdims=True)
        h = gamma * (h - mu) / jnp.sqrt(((h - mu) ** 2).mean(-1, keepdims=True) + 1e-3) + beta
        pooled = jnp.sum(h, axis=1)
        return pooled @ W3 + b3

    return Case(model, fwd, ids, y, "sce", ("einsum", "take", "layernorm"), kernels=[0, 1, 5])


def test_embedding_and_layernorm_have_rules_and_exact_per_example_gradients():
    case = build_layernorm_net()
    _check_forward(case)
    capture = Capture(model_functions(case.model))
    assert capture.uncovered == []  # nothing falls back to the vectorised map
    reference = ref.Reference(lambda p, x: case.outputs(p, x), case.p, case.x, case.y)
    per_example = reference.per_example_gradients()
    got = cv.per_example_gradients(case.model, case.x, case.y)
    assert rel(ref.flatten_rows(got), per_example) < case.tol
    diag = cv.GGN(case.model, case.x).diagonal()
    assert rel(ref.flatten(diag), np.diag(reference.ggn())) < case.tol
    # Teeth: the repeated token's rows are summed before squaring.
    E_grad = per_example[:, : V * D].reshape(N, V, D)
    assert np.abs(E_grad[0, 3]).sum() > 0 and np.abs(E_grad[1, 1]).sum() > 0


def test_exact_trace_under_the_embeddings_kfac_inverse():
    """tr(M^-1 GGN) with M the damped K-FAC of an Embedding (an EK-FAC
    inverse whose input basis is the identity) equals its dense formula."""
    case = build_attention_like()
    G = case.ggn()
    M = cv.GGN(case.model, case.x).kfac()
    Minv = M.inverse(1e-2, relative=True)
    assert Minv.blocks[0].QA is None
    total, parts = cv.GGN(case.model, case.x).trace_with(Minv)
    dense = ref.to_numpy(Minv.to_dense())
    assert abs(total - np.trace(dense @ G)) < case.tol * 10 * abs(np.trace(dense @ G))
    assert abs(parts[0] - np.trace(case.block(dense, 0) @ case.block(G, 0))) < case.tol * 10 * abs(parts[0])


# --------------------------------------- 4. one view for U and the metric
def test_llqr_u_and_the_metric_share_the_attention_views():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((T,), dtype="int32")
    h = keras.layers.Embedding(V, 8)(inputs)
    h = keras.layers.MultiHeadAttention(2, 4)(h, h)
    h = keras.layers.LayerNormalization()(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    out = keras.layers.Dense(K)(h)
    import keras_geosam as kg

    model = kg.Model(inputs, out)
    emb, mha, ln = model.layers[1], model.layers[2], model.layers[3]
    path = {"embedding": emb.embeddings.path, "query": mha._query_dense.kernel.path, "query_bias": mha._query_dense.bias.path,
            "key": mha._key_dense.kernel.path, "output": mha._output_dense.kernel.path, "gamma": ln.gamma.path}
    for structure, emb_cls in (("kfac", cv.DiagonalInputKFAC), ("ekfac", cv.DiagonalInputEKFAC)):
        opt = kg.optimizers.LLQRSAM(keras.optimizers.SGD(0.1), structure=structure)
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        U = opt.preconditioner.operator()
        rows = {d["path"]: d for d in U.describe()}
        assert rows[path["embedding"]]["block"] == emb_cls.__name__
        assert rows[path["query"]]["view"] == (8, 8)  # d_model x heads*head_dim
        assert rows[path["query"]]["shape"] == (8, 2, 4)
        assert rows[path["output"]]["view"] == (8, 8)  # heads*head_dim x d_model
        assert rows[path["query_bias"]]["block"] == "Diagonal"
        assert rows[path["gamma"]]["block"] == "Diagonal"
        lines = []
        opt.preconditioner.summary(print_fn=lines.append)
        assert any(path["key"] in line and "8 x 8" in line for line in lines)
    x = np.random.default_rng(0).integers(0, V, size=(6, T))
    metric = cv.GGN(model, x).kfac()
    views = {d["path"]: (d["block"], d["view"]) for d in metric.describe()}
    for d in U.describe():
        if d["block"] != "Diagonal":
            assert views[d["path"]] == ("DiagonalInputKFAC" if d["block"].startswith("DiagonalInput") else "KFAC", d["view"])


def test_a_kernel_without_a_rule_warns_once_and_gets_a_diagonal_block():
    import keras_geosam as kg

    class Scale(keras.layers.Layer):
        def build(self, shape):
            self.w = self.add_weight(shape=(shape[-1], shape[-1]), name="mixing")

        def call(self, x):
            return ops.einsum("bd,de->be", x, self.w)

    inputs = keras.Input((4,))
    out = keras.layers.Dense(K)(Scale(name="mixer")(inputs))
    model = kg.Model(inputs, out)
    opt = kg.optimizers.LLQRSAM(keras.optimizers.SGD(0.1), structure="kfac")
    with pytest.warns(UserWarning, match="mixer/mixing"):
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert [d["block"] for d in opt.preconditioner.operator().describe()] == ["Diagonal", "KFAC", "Diagonal"]
    x = np.random.default_rng(0).normal(size=(6, 4))
    with pytest.warns(UserWarning, match="mixer/mixing"):
        cv.GGN(model, x).kfac()
