"""A tiny token-level Transformer (a language model with padding) and its
float64 reference, for the curvature and sharpness tests.

The Keras model: Embedding (``mask_zero=True``: token 0 is padding, and the
mask Keras propagates reaches the output), causal MultiHeadAttention, a
residual Add, LayerNormalization, a Dense feed-forward block and a
per-token Dense head with ``C`` classes, so the outputs are ``(N, T,
C)`` logits and the labels ``(N, T)``.

The reference writes the same network in ``jax.numpy`` (x64), never through
Keras or keras_geosam, with padded keys masked out of every query's
attention; the loss is the weighted mean over tokens, ``sum w l / sum w``
with ``w = (id != 0) * sample_weight``. Every curvature matrix is built
explicitly over the flattened parameters from it.
"""

import jax
import jax.numpy as jnp
import keras
import numpy as np
from keras import ops

from reference import curvature as ref

V, T, D, H, KD, F = 7, 4, 8, 2, 4, 8


def build(classes=V, seed=0, mask_zero=True, dtype=None):
    """The Keras model (pre-LayerNorm blocks), weights drawn from a seeded
    generator."""
    L = keras.layers
    inputs = keras.Input((T,), dtype="int32")
    h = L.Embedding(V, D, mask_zero=mask_zero, name="embedding")(inputs)
    # MultiHeadAttention removes the mask from the tensor it is given (here
    # the normalised copy): the residual branch keeps it to the output.
    q = L.LayerNormalization(epsilon=1e-3, name="norm1")(h)
    a = L.MultiHeadAttention(H, KD, name="attention")(q, q, use_causal_mask=True)
    z = L.Add(name="add1")([h, a])
    # Dense layers propagate the mask (EinsumDense would drop it).
    f = L.Dense(F, activation="relu", name="ff1")(L.LayerNormalization(epsilon=1e-3, name="norm2")(z))
    f = L.Dense(D, name="ff2")(f)
    out = L.Dense(classes, name="head")(L.Add(name="add2")([z, f]))
    model = keras.Model(inputs, out)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(seed)
    for v in model.trainable_variables:
        gamma = v.path.endswith("gamma")
        value = (1.0 if gamma else 0.0) + (0.2 if gamma else 0.6) * rng.normal(size=v.shape)
        v.assign(value.astype(dtype or keras.config.floatx()))
    return model


def data(n=6, classes=V, seed=1, pad=True):
    """Token ids (padding 0 at the end of some rows, never a whole row) and
    per-token labels."""
    rng = np.random.default_rng(seed)
    x = rng.integers(1, V, size=(n, T)).astype("int32")
    if pad:
        lengths = rng.integers(1, T + 1, size=n)
        lengths[0] = T
        for i, length in enumerate(lengths):
            x[i, length:] = 0
    x[0, :3] = 2  # a repeated token: the embedding's rows add up
    y = rng.integers(0, classes, size=(n, T)).astype("int32")
    return x, y


def weights(model):
    return [ref.to_numpy(v.value) for v in model.trainable_variables]


def shapes(model):
    return [tuple(v.shape) for v in model.trainable_variables]


def _norm(z, gamma, beta):
    mu = z.mean(-1, keepdims=True)
    return gamma * (z - mu) / jnp.sqrt(((z - mu) ** 2).mean(-1, keepdims=True) + 1e-3) + beta


def forward(p, ids, mask_zero=True, head_input=False):
    """Logits ``(N, T, C)`` of the network, written by hand; `p` maps each
    variable path to its value. `head_input`: also the head's input rows."""
    h = p["embedding/embeddings"][ids]
    u = _norm(h, p["norm1/gamma"], p["norm1/beta"])
    att = lambda name: (jnp.einsum("btd,dhk->bthk", u, p[f"attention/{name}/kernel"]) + p[f"attention/{name}/bias"])
    q, k, v = att("query") / jnp.sqrt(float(KD)), att("key"), att("value")
    scores = jnp.einsum("bshk,bthk->bhts", k, q)
    allowed = jnp.tril(jnp.ones((T, T), bool))[None, None]
    if mask_zero:
        allowed = allowed & (ids != 0)[:, None, None, :]
    scores = jnp.where(allowed, scores, -jnp.inf)
    scores = scores - jnp.max(scores, axis=-1, keepdims=True)
    w = jnp.where(allowed, jnp.exp(scores), 0.0)
    w = w / w.sum(-1, keepdims=True)
    out = jnp.einsum("bhts,bshk->bthk", w, v)
    z = h + jnp.einsum("bthk,hkd->btd", out, p["attention/attention_output/kernel"]) + p["attention/attention_output/bias"]
    f = jnp.maximum(_norm(z, p["norm2/gamma"], p["norm2/beta"]) @ p["ff1/kernel"] + p["ff1/bias"], 0.0)
    f = f @ p["ff2/kernel"] + p["ff2/bias"]
    logits = (z + f) @ p["head/kernel"] + p["head/bias"]
    return (logits, z + f) if head_input else logits


def token_weights(x, sample_weight=None, mask_zero=True):
    w = np.ones(x.shape) if sample_weight is None else np.broadcast_to(
        np.asarray(sample_weight, "float64").reshape(x.shape[0], -1), x.shape)
    return w * (x != 0) if mask_zero else np.array(w, "float64")


class Reference:
    """Explicit float64 curvature of the weighted mean token loss.

    `logits_fn(params by path, x)` is the network written by hand (default:
    :func:`forward`); `weights` the loss terms' weights, shaped like the
    per-token losses (default: this module's padding mask).
    """

    def __init__(self, model, x, y, sample_weight=None, mask_zero=True, logits_fn=None, weights=None):
        self.shapes = shapes(model)
        self.paths = [v.path for v in model.trainable_variables]
        self.p = [jnp.asarray(a) for a in globals()["weights"](model)]
        self.theta = ref.flatten(self.p)
        self.x, self.y = jnp.asarray(x), jnp.asarray(y)
        self.forward = logits_fn or (lambda p, ids: forward(p, ids, mask_zero))
        w = token_weights(x, sample_weight, mask_zero) if weights is None else np.asarray(weights, "float64")
        self.w = jnp.asarray(w / w.sum())  # normalised: the loss is sum w l

    def unflat(self, theta):
        return ref.unflatten(theta, self.shapes)

    def logits(self, theta, x=None):
        return self.forward(dict(zip(self.paths, self.unflat(theta))), self.x if x is None else x)

    def token_losses(self, theta, x=None, y=None):
        logp = jax.nn.log_softmax(self.logits(theta, x), axis=-1)
        y = self.y if y is None else y
        return -jnp.take_along_axis(logp, y[..., None], axis=-1)[..., 0]

    def loss(self, theta=None):
        theta = self.theta if theta is None else theta
        return jnp.sum(self.w * self.token_losses(theta))

    def gradient(self):
        return np.asarray(jax.jit(jax.grad(self.loss))(self.theta))

    def hessian(self):
        return np.asarray(jax.jit(jax.hessian(self.loss))(self.theta))

    def jacobian(self):
        """``dz_ntc / dtheta``: (N, T, C, P)."""
        if not hasattr(self, "_jacobian"):
            self._jacobian = np.asarray(jax.jit(jax.jacfwd(self.logits))(self.theta))
        return self._jacobian

    def head_factors(self):
        """K-FAC factors of the head layer (rows: the head's inputs), as the
        package defines them with weights: ``A = sum w a a^T / sum w``, ``B
        = sum w (diag p - p p^T)`` (the head's outputs are the logits)."""
        _, a = forward(dict(zip(self.paths, self.unflat(self.theta))), self.x, head_input=True)
        a, p, w = np.asarray(a), self.probs(), np.asarray(self.w)
        A = np.einsum("nt,ntd,nte->de", w, a, a) / w.sum()
        B = np.einsum("nt,ntc,cd->cd", w, p, np.eye(p.shape[-1])) - np.einsum("nt,ntc,ntd->cd", w, p, p)
        return A, B

    def probs(self):
        return np.asarray(jax.nn.softmax(self.logits(self.theta), axis=-1))

    def _tokens(self):
        """Jacobian, probabilities and weights with one token axis: (N, T,
        C, P), (N, T, C), (N, T) (T = 1 for a classifier of whole examples)."""
        J, p, w = self.jacobian(), self.probs(), np.asarray(self.w)
        n, c = p.shape[0], p.shape[-1]
        return J.reshape(n, -1, c, J.shape[-1]), p.reshape(n, -1, c), w.reshape(n, -1)

    def ggn(self):
        J, p, w = self._tokens()
        # Square-root factors of diag p - p p^T: sqrt(p_c) (e_c - p).
        F = np.sqrt(p)[..., :, None] * (np.eye(p.shape[-1]) - p[..., None, :])
        g = np.einsum("ntcd,ntdq->ntcq", F, J) * np.sqrt(w)[..., None, None]
        g = g.reshape(-1, g.shape[-1])
        return g.T @ g

    def ggn_mc(self, labels, num_samples):
        """The Monte-Carlo GGN as the package defines it for sequences: one
        factor per draw spanning every token, ``c = sum_t sqrt(w_t) (e_s_t
        - p_t)`` (cross-token terms included), ``1/S sum c c^T`` per
        sequence. `labels`: (S, N, T)."""
        J, p, w = self._tokens()
        G = np.zeros((J.shape[-1],) * 2)
        for s in range(num_samples):
            c = (np.eye(p.shape[-1])[labels[s].reshape(w.shape)] - p) * np.sqrt(w)[..., None]
            g = np.einsum("ntc,ntcp->np", c, J)
            G += g.T @ g / num_samples
        return G

    def sequence_gradients(self):
        """Gradient of each sequence's own weighted mean loss: (N, P)."""
        w = jnp.asarray(self.w).reshape(self.x.shape[0], -1)
        totals = w.sum(axis=1)

        def one(theta, xi, yi, wi, total):
            losses = self.token_losses(theta, xi[None], yi[None])[0]
            return jnp.sum(jnp.reshape(losses, (-1,)) * wi) / jnp.where(total > 0, total, 1.0)

        grads = jax.jit(jax.vmap(jax.grad(one), in_axes=(None, 0, 0, 0, 0)))(self.theta, self.x, self.y, w, totals)
        return np.asarray(grads) * (np.asarray(totals) > 0)[:, None]

    def empirical(self):
        w = np.asarray(self.w).reshape(self.x.shape[0], -1)
        g = self.sequence_gradients()
        return np.einsum("n,np,nq->pq", w.sum(axis=1), g, g)


def mc_labels(probs, seed, num_samples):
    """The labels ``GGN(kind="mc", seed=seed)`` draws for these
    probabilities ``(N, ..., C)``: (S, N, ...), from the package's
    counter-based uniforms (token rows in order), inverted by NumPy."""
    from keras_geosam.curvature import probes

    c = probs.shape[-1]
    flat = probs.reshape(-1, c)
    u = np.asarray(ops.convert_to_numpy(probes.uniform(seed, np.arange(flat.shape[0]), np.arange(num_samples), "float64")))
    labels = np.minimum((u[:, :, None] > np.cumsum(flat, -1)[:, None, :]).sum(-1), c - 1)
    return labels.T.reshape((num_samples,) + probs.shape[:-1])
