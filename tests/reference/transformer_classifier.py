"""The tiny Transformer classifier of the optimizer tests and its float64
reference (``tests/optimizers/test_transformer_steps.py`` says how they are
compared): Embedding, MultiHeadAttention, LayerNormalization and a
feed-forward block, written again in ``jax.numpy`` (x64) with gradients from
``jax.grad``, never through Keras or keras_geosam; the spec's perturbations
and Keras' SGD / Adam update rules in NumPy; U applied from its own block
formulas with the views written down here.
"""

import jax
import jax.numpy as jnp
import keras
import numpy as np
from keras import ops

import keras_geosam as kg
from reference import curvature as ref

N, T, V, D, H, KD, F, K = 6, 4, 7, 8, 2, 4, 8, 3
# Adam divides by sqrt(v) + epsilon: a gradient that is zero in exact
# arithmetic (attention's key bias shifts all of a query's scores alike, which
# softmax ignores) would turn rounding noise into steps of lr; this epsilon
# keeps such noise from deciding the comparison.
ADAM_EPSILON = 2.0**-10
# Hyperparameters exact in float32: Keras' TensorFlow optimizers round their
# learning rate, momentum and betas to float32 under a float64 policy.
LR, MOMENTUM, ADAM_LR, BETA_1, BETA_2 = 0.125, 0.875, 2.0**-7, 0.875, 1.0 - 2.0**-10


def _lossy():
    """Whether Keras computes an op of this model in float32 for float64 inputs."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, 4))
    checks = [
        (lambda: ops.layer_normalization(x, None, None, -1, 1e-3),
         (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-3)),
        (lambda: ops.softmax(x, axis=-1), np.exp(x) / np.exp(x).sum(-1, keepdims=True)),
        (lambda: ops.einsum("abc,dc->abd", x, x[0]), np.einsum("abc,dc->abd", x, x[0])),
    ]
    return any(ref.rel_err(fn(), exact) > 1e-13 for fn, exact in checks)


# ---------------------------------------------------------- the model ----
def build(seed=0, model_cls=None):
    """A 1-layer Transformer classifier with weights from a seeded generator."""
    inputs = keras.Input((T,), dtype="int32")
    h = keras.layers.Embedding(V, D, name="embedding")(inputs)
    a = keras.layers.MultiHeadAttention(H, KD, name="attention")(h, h)
    h = keras.layers.LayerNormalization(epsilon=1e-3, name="norm")(h + a)
    f = keras.layers.EinsumDense("btd,df->btf", (T, F), bias_axes="f", activation="relu", name="ff1")(h)
    f = keras.layers.EinsumDense("btf,fd->btd", (T, D), bias_axes="d", name="ff2")(f)
    h = keras.layers.Lambda(lambda t: ops.sum(t, axis=1), output_shape=(D,), name="pool")(h + f)
    out = keras.layers.EinsumDense("bd,dc->bc", (K,), bias_axes="c", name="head")(h)
    model = (model_cls or kg.Model)(inputs, out)
    rng = np.random.default_rng(seed)
    for v in model.trainable_variables:
        scale = 0.5 if not v.path.endswith("gamma") else 0.2
        v.assign((1.0 if v.path.endswith("gamma") else 0.0) + scale * rng.normal(size=v.shape))
    return model


def data(seed=1):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, V, size=(2 * N, T)).astype("int32")
    x[0, :3] = 2  # a repeated token (summed rows in the embedding's gradient)
    return x, rng.integers(0, K, size=2 * N).astype("int32")


ORDER = [
    "embedding/embeddings",
    "attention/query/kernel", "attention/query/bias", "attention/key/kernel", "attention/key/bias",
    "attention/value/kernel", "attention/value/bias", "attention/attention_output/kernel", "attention/attention_output/bias",
    "norm/gamma", "norm/beta", "ff1/kernel", "ff1/bias", "ff2/kernel", "ff2/bias", "head/kernel", "head/bias",
]
# The K-FAC view (rows, cols) of every kernel; None: a diagonal block.
VIEWS = {
    "embedding/embeddings": ("diagonal_rows", V, D),
    "attention/query/kernel": ("kfac", D, H * KD), "attention/key/kernel": ("kfac", D, H * KD),
    "attention/value/kernel": ("kfac", D, H * KD), "attention/attention_output/kernel": ("kfac", H * KD, D),
    "ff1/kernel": ("kfac", D, F), "ff2/kernel": ("kfac", F, D), "head/kernel": ("kfac", D, K),
}


def forward(p, ids):
    """The same network by hand: p in ORDER, ids (n, T)."""
    E, Wq, bq, Wk, bk, Wv, bv, Wo, bo, gamma, beta, W1, b1, W2, b2, W3, b3 = p
    h = E[ids]
    q = (jnp.einsum("btd,dhk->bthk", h, Wq) + bq) / jnp.sqrt(float(KD))
    k = jnp.einsum("btd,dhk->bthk", h, Wk) + bk
    v = jnp.einsum("btd,dhk->bthk", h, Wv) + bv
    scores = jnp.einsum("bshk,bthk->bhts", k, q)
    w = jnp.exp(scores - scores.max(-1, keepdims=True))
    w = w / w.sum(-1, keepdims=True)
    a = jnp.einsum("bthk,hkd->btd", jnp.einsum("bhts,bshk->bthk", w, v), Wo) + bo
    z = h + a
    mu = z.mean(-1, keepdims=True)
    z = gamma * (z - mu) / jnp.sqrt(((z - mu) ** 2).mean(-1, keepdims=True) + 1e-3) + beta
    f = jnp.maximum(jnp.einsum("btd,df->btf", z, W1) + b1, 0.0)
    z = z + jnp.einsum("btf,fd->btd", f, W2) + b2
    return jnp.sum(z, axis=1) @ W3 + b3


def loss_fn(p, ids, y):
    logp = jax.nn.log_softmax(forward(p, ids))
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=-1))


_grad = jax.jit(jax.grad(loss_fn))


def grad(params, x, y):
    return [np.asarray(g) for g in _grad([jnp.asarray(p) for p in params], jnp.asarray(x), jnp.asarray(y))]


def weights(model):
    by_path = {v.path: v for v in model.trainable_variables}
    return [np.asarray(ref.to_numpy(by_path[name].value)) for name in ORDER]


# --------------------------------------------------- reference steps ----
def dot(a, b):
    return sum(float(np.sum(x * y)) for x, y in zip(a, b))


def apply_u(u, vecs):
    """U v from U's parameters by their names, per variable (ORDER)."""
    out = []
    for name, g in zip(ORDER, vecs):
        block = u[name]
        view = VIEWS.get(name)
        if "d" in block:
            out.append(block["d"] * g)
            continue
        _, m, n = view
        X = g.reshape(m, n)
        if "a" in block:
            Y = block["a"][:, None] * (X @ block["B"].T)
        elif "A" in block:
            Y = block["A"] @ X @ block["B"].T
        elif "QA" in block:
            Y = block["QA"] @ (block["s"] * (block["QA"].T @ X @ block["QG"])) @ block["QG"].T
        else:
            Y = (block["s"] * (X @ block["QG"])) @ block["QG"].T
        out.append(Y.reshape(g.shape))
    return out


def perturbation(kind, g, params, hp, state, u=None):
    rho = hp.get("rho", 0.0)
    if kind == "sam":
        return [rho * t / np.sqrt(dot(g, g) + 1e-12) for t in g]
    if kind == "asam":  # T = |theta| + eta on weight tensors, 1 on biases
        Ts = [np.ones_like(p) if name.endswith("bias") or p.ndim < 2 else np.abs(p) + hp["eta"] for name, p in zip(ORDER, params)]
        tg = [t * gi for t, gi in zip(Ts, g)]
        return [rho * t * x / np.sqrt(dot(tg, tg) + 1e-12) for t, x in zip(Ts, tg)]
    if kind == "fsam":
        d = [gi - hp["sigma"] * m for gi, m in zip(g, state["m"])]
        return [rho * t / np.sqrt(dot(d, d) + 1e-12) for t in d]
    if kind == "fisher":
        w = [gi / (gi * gi + hp["eta"]) for gi in g]
        return [rho * t / np.sqrt(dot(g, w) + 1e-12) for t in w]
    if kind == "llqrsam":
        w = apply_u(u, g)
        return [rho * t / np.sqrt(dot(w, w) + 1e-12) for t in w]
    if kind == "llqr":
        return [np.zeros_like(t) for t in g]
    raise ValueError(kind)


def reference_run(kind, params, batches, hp, base, u=None):
    """Two-pass steps (centre gradient, eps, perturbed gradient) with Keras'
    SGD (v <- mu v - lr g; theta <- theta + v) or Adam as the base."""
    params = [p.copy() for p in params]
    slots = [[np.zeros_like(p) for p in params] for _ in range(2)]
    state = {"m": [np.zeros_like(p) for p in params]}
    for step, (x, y) in enumerate(batches, start=1):
        g_c = grad(params, x, y)
        eps = perturbation(kind, g_c, params, hp, state, u)
        g = g_c if kind == "llqr" else grad([p + e for p, e in zip(params, eps)], x, y)
        if kind == "fsam":
            state["m"] = [hp["momentum"] * m + (1 - hp["momentum"]) * gc for m, gc in zip(state["m"], g_c)]
        if kind in ("llqr", "llqrsam"):
            g = apply_u(u, g)
        if base["name"] == "sgd":
            slots[0] = [base["momentum"] * s - base["lr"] * gi for s, gi in zip(slots[0], g)]
            params = [p + s for p, s in zip(params, slots[0])]
        else:  # Keras' Adam
            b1, b2, lr, e = BETA_1, BETA_2, base["lr"], ADAM_EPSILON
            slots[0] = [s + (gi - s) * (1 - b1) for s, gi in zip(slots[0], g)]
            slots[1] = [s + (gi * gi - s) * (1 - b2) for s, gi in zip(slots[1], g)]
            alpha = lr * np.sqrt(1 - b2**step) / (1 - b1**step)
            params = [p - alpha * m / (np.sqrt(v) + e) for p, m, v in zip(params, slots[0], slots[1])]
    return params


def random_u(opt, rng):
    """Known non-identity values for every U factor; returns them by variable path."""
    pre = opt.preconditioner
    u = {}
    for (i, name, shape, _, _), var in zip(kg.preconditioner.param_specs(pre.layout), pre.variables):
        if name in ("d", "s", "a"):
            value = rng.uniform(0.3, 2.5, size=shape)
        elif name in ("QA", "QG"):
            value = np.linalg.qr(rng.normal(size=shape))[0]
        else:
            value = np.eye(shape[0]) + 0.3 * rng.normal(size=shape)
        var.assign(value)
        u.setdefault(pre.paths[i], {})[name] = value
    return {name: u[name] for name in ORDER}
