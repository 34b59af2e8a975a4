"""Independent float64 reference for the curvature tests.

Nothing here goes through Keras or keras_geosam: the tiny models are written
by hand in ``jax.numpy`` (run with x64 enabled, whatever the active Keras
backend is) and fed the weights copied out of the Keras model, so both sides
compute the same function. Every curvature quantity is then built as an
explicit matrix over the flattened parameter vector:

- the full Hessian of the mean loss (``jax.hessian``), plus regularisers;
- the Gauss-Newton / Fisher matrix ``c * sum_n J_n^T (diag p_n - p_n p_n^T) J_n``
  with ``J_n`` the Jacobian of example n's pre-softmax logits;
- per-example gradients as the Jacobian of the vector of per-example losses.

Parameters are lists of arrays in the order of ``model.trainable_variables``;
``flatten`` / ``unflatten`` convert between lists and one vector.
"""

import os

os.environ.setdefault("JAX_ENABLE_X64", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)


# ------------------------------------------------------------ helpers ----
def to_numpy(a):
    """Any backend tensor (or array-like) as a float64 NumPy array."""
    try:
        import keras

        a = keras.ops.convert_to_numpy(a)
    except Exception:  # pragma: no cover - plain arrays
        pass
    return np.asarray(a, dtype=np.float64)


def flatten(arrays):
    """Concatenates a list of arrays into one float64 vector."""
    return np.concatenate([np.ravel(to_numpy(a)) for a in arrays])


def flatten_rows(arrays):
    """List of arrays with a common leading axis N -> (N, P) matrix."""
    mats = [to_numpy(a) for a in arrays]
    n = mats[0].shape[0]
    return np.concatenate([m.reshape(n, -1) for m in mats], axis=1)


def unflatten(vec, shapes):
    """Inverse of `flatten` (works on NumPy and jax arrays)."""
    out, start = [], 0
    for shape in shapes:
        size = int(np.prod(shape, dtype=np.int64))
        out.append(vec[start : start + size].reshape(shape))
        start += size
    if start != vec.shape[0]:
        raise ValueError(f"vector of length {vec.shape[0]} does not fit shapes {shapes}")
    return out


def rel_err(a, b):
    """||a - b|| / ||b|| over the flattened arrays (lists allowed)."""
    a = flatten(a) if isinstance(a, (list, tuple)) else np.ravel(to_numpy(a))
    b = flatten(b) if isinstance(b, (list, tuple)) else np.ravel(to_numpy(b))
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch {a.shape} vs {b.shape}")
    denom = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / (denom if denom > 0 else 1.0))


# ---------------------------------------------------- model building blocks
def dense(x, w, b=None):
    y = x @ w
    return y if b is None else y + b


def conv2d_valid(x, kernel, bias=None):
    """Channels-last 'valid' cross-correlation with stride 1, via explicit patches.

    x: (N, H, W, C); kernel: (kh, kw, C, F) as Keras stores it.
    """
    kh, kw = kernel.shape[0], kernel.shape[1]
    ho, wo = x.shape[1] - kh + 1, x.shape[2] - kw + 1
    out = 0.0
    for a in range(kh):
        for b in range(kw):
            out = out + jnp.einsum("nhwc,cf->nhwf", x[:, a : a + ho, b : b + wo, :], kernel[a, b])
    return out if bias is None else out + bias


def batchnorm_inference(x, gamma, beta, moving_mean, moving_var, epsilon=1e-3):
    return gamma * (x - moving_mean) / jnp.sqrt(moving_var + epsilon) + beta


ACTIVATIONS = {
    "linear": lambda z: z,
    "tanh": jnp.tanh,
    "relu": lambda z: jnp.maximum(z, 0.0),
    "sigmoid": lambda z: 1.0 / (1.0 + jnp.exp(-z)),
    "softplus": lambda z: jnp.logaddexp(z, 0.0),
}


def mlp(activations):
    """logits_fn(params, x) for Dense layers with biases; params [W1, b1, W2, b2, ...]."""

    def logits_fn(params, x):
        h = x
        for i, act in enumerate(activations):
            h = ACTIVATIONS[act](dense(h, params[2 * i], params[2 * i + 1]))
        return h

    return logits_fn


def log_softmax(z):
    z = z - jnp.max(z, axis=-1, keepdims=True)
    return z - jnp.log(jnp.sum(jnp.exp(z), axis=-1, keepdims=True))


# --------------------------------------------------------- the reference --
class Reference:
    """Explicit curvature matrices of softmax cross-entropy on a hand-written model.

    Args:
        logits_fn: ``f(params_list, x) -> (N, K)`` pre-softmax logits.
        params: list of arrays (the model's trainable weights, in order).
        x: inputs; y: integer labels (N,) or one-hot / soft labels (N, K).
        regularizer: optional ``r(params_list) -> scalar`` added to the loss
            (its Hessian enters the Hessian, never the GGN or per-example grads).
    """

    def __init__(self, logits_fn, params, x, y=None, regularizer=None):
        self.logits_fn = logits_fn
        self.params = [to_numpy(p) for p in params]
        self.shapes = [p.shape for p in self.params]
        self.theta = flatten(self.params)
        self.x = jnp.asarray(to_numpy(x)) if not isinstance(x, (list, tuple)) else x
        self.y = None if y is None else np.asarray(to_numpy(y))
        self.regularizer = regularizer

    @property
    def num_params(self):
        return self.theta.shape[0]

    def split(self, vec):
        return unflatten(np.asarray(vec), self.shapes)

    # ---- scalar / vector functions of the flat parameter vector ----
    def logits(self, theta=None, x=None):
        theta = self.theta if theta is None else theta
        return self.logits_fn(unflatten(theta, self.shapes), self.x if x is None else x)

    def per_example_losses(self, theta, x=None, y=None):
        """-sum_k y_nk log softmax(z_n)_k (y one-hot) or -log softmax(z_n)[y_n]."""
        y = self.y if y is None else y
        logp = log_softmax(self.logits(theta, x))
        if y.ndim == 1:
            return -jnp.take_along_axis(logp, jnp.asarray(y, dtype=jnp.int32)[:, None], axis=-1)[:, 0]
        return -jnp.sum(jnp.asarray(y) * logp, axis=-1)

    def reg(self, theta):
        if self.regularizer is None:
            return 0.0
        return self.regularizer(unflatten(theta, self.shapes))

    def loss(self, theta=None):
        theta = self.theta if theta is None else theta
        return jnp.mean(self.per_example_losses(theta)) + self.reg(theta)

    # ---- explicit matrices ----
    def probs(self):
        return np.asarray(jnp.exp(log_softmax(self.logits())))

    def gradient(self):
        return np.asarray(jax.jit(jax.grad(self.loss))(jnp.asarray(self.theta)))

    def hessian(self):
        """Full (P, P) Hessian of the mean loss plus regulariser."""
        return np.asarray(jax.jit(jax.hessian(self.loss))(jnp.asarray(self.theta)))

    def logits_jacobian(self, x=None):
        """(N, K, P) Jacobian of every example's logits."""
        return np.asarray(jax.jit(jax.jacfwd(lambda t: self.logits(t, x)))(jnp.asarray(self.theta)))

    def ggn(self, reduction="mean"):
        """c * sum_n J_n^T (diag p_n - p_n p_n^T) J_n, c = 1/N or 1."""
        jac = self.logits_jacobian()
        p = self.probs()
        h_out = np.einsum("nk,kl->nkl", p, np.eye(p.shape[1])) - np.einsum("nk,nl->nkl", p, p)
        g = np.einsum("nkp,nkl,nlq->pq", jac, h_out, jac)
        if reduction == "mean":
            g = g / p.shape[0]
        elif reduction != "sum":
            raise ValueError(reduction)
        return g

    def per_example_gradients(self, x=None, y=None):
        """(N, P) gradients of each example's loss (no regulariser)."""
        return np.asarray(
            jax.jit(jax.jacrev(lambda t: self.per_example_losses(t, x, y)))(jnp.asarray(self.theta))
        )

    def nll_gradients(self, x, labels):
        """(M, P) gradients of -log p(labels_m | x_m) for integer labels."""
        return self.per_example_gradients(x=jnp.asarray(to_numpy(x)), y=np.asarray(labels))


class LikelihoodReference(Reference):
    """Explicit matrices of Keras' mean squared error (``"gaussian"``) or
    binary cross-entropy on logits (``"bernoulli"``), each the mean over the
    d outputs and then over examples, on a hand-written model whose
    ``logits_fn`` returns ``(N, d)`` natural outputs (a sigmoid's input for
    a model that ends in one).

    GGN = exact Fisher: ``1/N sum_n J_n^T Q_n J_n`` with ``Q = 2/d I``
    (Gaussian of variance d/2) or ``diag(p (1 - p)) / d`` (Bernoulli).
    ``mc_ggn`` rebuilds the Monte-Carlo Fisher from the "labels" hash
    stream: per (example, output) row ``n d + k``, Box-Muller on draws
    ``2s, 2s + 1`` (Gaussian) or a target ``u < p`` (Bernoulli).
    """

    def __init__(self, family, logits_fn, params, x, y=None, regularizer=None):
        super().__init__(logits_fn, params, x, y, regularizer)
        if family not in ("gaussian", "bernoulli"):
            raise ValueError(family)
        self.family = family

    def per_example_losses(self, theta, x=None, y=None):
        y = jnp.asarray(self.y if y is None else y)
        z = self.logits(theta, x)
        y = y.reshape(z.shape)
        if self.family == "gaussian":
            return jnp.mean((z - y) ** 2, axis=-1)
        # -y log sigmoid(z) - (1 - y) log sigmoid(-z), written without Keras.
        return jnp.mean(y * jnp.logaddexp(0.0, -z) + (1.0 - y) * jnp.logaddexp(0.0, z), axis=-1)

    def probs(self):
        return np.asarray(jax.nn.sigmoid(self.logits()))

    def output_hessians(self):
        """(N, d, d): each example's Q."""
        z = np.asarray(self.logits())
        d = z.shape[-1]
        if self.family == "gaussian":
            return np.broadcast_to(2.0 / d * np.eye(d), (z.shape[0], d, d))
        p = self.probs()
        return np.einsum("nk,kl->nkl", p * (1 - p) / d, np.eye(d))

    def ggn(self, reduction="mean"):
        jac = self.logits_jacobian()
        g = np.einsum("nkp,nkl,nlq->pq", jac, self.output_hessians(), jac)
        return g / jac.shape[0] if reduction == "mean" else g

    def mc_factors(self, num_samples, seed):
        """(S, N, d) factors c with E[c c^T] = Q, from the hash."""
        z = np.asarray(self.logits())
        n, d = z.shape
        rows = np.arange(n * d)
        draws = np.arange(num_samples)
        if self.family == "gaussian":
            u = hash_uniform(seed, rows, np.concatenate([2 * draws, 2 * draws + 1]))
            u = u.reshape(n, d, 2, num_samples)
            eps = np.sqrt(-2.0 * np.log(1.0 - u[:, :, 0])) * np.cos(2.0 * np.pi * u[:, :, 1])
            return np.sqrt(2.0 / d) * eps.transpose(2, 0, 1)
        u = hash_uniform(seed, rows, draws).reshape(n, d, num_samples)
        p = self.probs()
        target = (u < p[:, :, None]).astype(np.float64)
        return (target.transpose(2, 0, 1) - p[None]) / np.sqrt(d)

    def mc_ggn(self, num_samples, seed):
        jac = self.logits_jacobian()
        c = self.mc_factors(num_samples, seed)
        v = np.einsum("nkp,snk->snp", jac, c)
        return np.einsum("snp,snq->pq", v, v) / (jac.shape[0] * num_samples)


# ------------------------------------------------ counter-based probes ----
# An independent NumPy (uint32) implementation of the probe hash of
# keras_geosam/curvature/probes.py: murmur3's 32-bit finaliser applied to
# (seed, stream) -> key, (key, row) -> r, (r, column) -> bits.
STREAMS = {"hutchinson": 1, "lanczos": 2, "sketch": 3, "labels": 4}


def fmix32(h):
    h = np.asarray(h, dtype=np.uint32).copy()
    with np.errstate(over="ignore"):
        h ^= h >> np.uint32(16)
        h *= np.uint32(0x85EBCA6B)
        h ^= h >> np.uint32(13)
        h *= np.uint32(0xC2B2AE35)
        h ^= h >> np.uint32(16)
    return h


def hash_bits(seed, stream, rows, cols):
    """(len(rows), len(cols)) int32 words."""
    golden = np.uint32(0x9E3779B1)
    with np.errstate(over="ignore"):
        key = fmix32(fmix32(np.uint32(int(seed) % (1 << 32))) ^ np.uint32(STREAMS[stream] * 0x27D4EB2F % (1 << 32)))
        r = fmix32(key + np.asarray(rows, np.uint32) * golden)
        a = fmix32((np.asarray(cols, np.uint32)[None, :] * golden) ^ r[:, None])
        return fmix32(a + r[:, None]).view(np.int32)


def hash_rademacher(seed, start, count, shapes, stream="hutchinson"):
    """Probes start..start+count-1 as a list of (count,) + shape float64
    arrays: coordinate j (numbered across the list) is -1 where bit j % 32
    of word j // 32 is set."""
    rows = np.arange(start, start + count)
    out, offset = [], 0
    for shape in shapes:
        size = int(np.prod(shape, dtype=np.int64))
        j = np.arange(offset, offset + size)
        words = hash_bits(seed, stream, rows, j // 32).view(np.uint32)
        bit = (words >> (j % 32).astype(np.uint32)[None, :]) & np.uint32(1)
        out.append(np.where(bit == 1, -1.0, 1.0).reshape((count,) + tuple(shape)))
        offset += size
    return out


def hash_probes(seed, shapes, num, stream="hutchinson"):
    """The same probes as a list (one per probe) of lists of arrays."""
    block = hash_rademacher(seed, 0, num, shapes, stream)
    return [[b[i] for b in block] for i in range(num)]


def hash_uniform(seed, rows, cols, stream="labels"):
    h = hash_bits(seed, stream, rows, cols).view(np.uint32)
    return (h >> np.uint32(8)).astype(np.float64) * 2.0**-24


def hash_labels(probs, num_samples, seed):
    """(num_samples, N) labels drawn from `probs` (N, K) by inverse CDF of
    the "labels" stream: u(example n, draw s) > cdf counts."""
    u = hash_uniform(seed, np.arange(probs.shape[0]), np.arange(num_samples))
    cdf = np.cumsum(probs, axis=-1)
    labels = (u[:, :, None] > cdf[:, None, :]).sum(-1)
    return np.minimum(labels, probs.shape[-1] - 1).T
