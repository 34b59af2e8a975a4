"""Independent NumPy reference for the two-pass training tests.

Nothing here goes through Keras or keras_geosam: small models (Dense layers,
tanh/sigmoid activations, training-mode BatchNormalization) are written by
hand in float64 NumPy, with hand-written backward passes for the mean
softmax cross-entropy, squared error or binary cross-entropy (optionally
sample-weighted, Keras' ``sum_over_batch_size`` reduction: ``sum_n w_n l_n
/ N``). The SAM-family
perturbations follow the spec formulas (shared/spec/llqr-sam.md, section 3).
``workers/training_worker.py`` runs the same models on other backends.
"""

import numpy as np


# ================================================================ reference ==
# A model is a list of layers; parameters are a flat list of arrays in the
# order of ``model.trainable_variables``:
#   ("dense", units)    params W (d_in, units), b (units,)
#   ("act", name)       tanh | sigmoid | linear, no params
#   ("bn", epsilon)     params gamma, beta; training-mode batch statistics
def n_params(layer):
    return {"dense": 2, "act": 0, "bn": 2}[layer[0]]


def _act(name, z):
    if name == "tanh":
        return np.tanh(z)
    if name == "sigmoid":
        return 1.0 / (1.0 + np.exp(-z))
    assert name == "linear", name
    return z


def _act_grad(name, a, da):
    if name == "tanh":
        return da * (1.0 - a * a)
    if name == "sigmoid":
        return da * a * (1.0 - a)
    return da


def forward(layers, params, x):
    """Returns (logits, caches, bn_batch_stats) with caches for backward."""
    h = np.asarray(x, np.float64)
    caches, stats, i = [], [], 0
    for layer in layers:
        kind = layer[0]
        if kind == "dense":
            W, b = params[i], params[i + 1]
            caches.append(h)
            h = h @ W + b
        elif kind == "act":
            h = _act(layer[1], h)
            caches.append(h)
        elif kind == "bn":
            gamma, beta = params[i], params[i + 1]
            mean, var = h.mean(0), h.var(0)  # biased, as ops.moments
            stats.append((mean, var))
            inv = 1.0 / np.sqrt(var + layer[1])
            xhat = (h - mean) * inv
            caches.append((xhat, inv))
            h = gamma * xhat + beta
        i += n_params(layer)
    return h, caches, stats


def softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def loss_and_grad(layers, params, x, y, sample_weight=None, loss="sce"):
    """Mean (sum_n w_n l_n / N) loss and its gradient: sparse softmax
    cross-entropy (``"sce"``), or Keras' mean over the k outputs of the
    squared error (``"mse"``) or of the binary cross-entropy on logits
    (``"bce"``), y then ``(N, k)`` targets."""
    params = [np.asarray(p, np.float64) for p in params]
    z, caches, stats = forward(layers, params, x)
    n, k = z.shape
    w = np.ones(n) if sample_weight is None else np.asarray(sample_weight, np.float64)
    if loss == "sce":
        p = softmax(z)
        onehot = np.eye(k)[np.asarray(y).astype(int).ravel()]
        per_example = -np.sum(onehot * np.log(p), axis=1)
        dz = p - onehot
    elif loss == "mse":
        t = np.asarray(y, np.float64).reshape(n, k)
        per_example = np.mean((z - t) ** 2, axis=1)
        dz = 2.0 * (z - t) / k
    else:
        assert loss == "bce", loss
        t = np.asarray(y, np.float64).reshape(n, k)
        per_example = np.mean(np.logaddexp(0.0, z) - t * z, axis=1)
        dz = (1.0 / (1.0 + np.exp(-z)) - t) / k
    value = np.sum(w * per_example) / n
    dh = dz * w[:, None] / n
    grads = [None] * len(params)
    i = len(params)
    for layer, cache in zip(reversed(layers), reversed(caches)):
        kind = layer[0]
        i -= n_params(layer)
        if kind == "dense":
            W = params[i]
            grads[i] = cache.T @ dh
            grads[i + 1] = dh.sum(0)
            dh = dh @ W.T
        elif kind == "act":
            dh = _act_grad(layer[1], cache, dh)
        elif kind == "bn":
            xhat, inv = cache
            gamma = params[i]
            grads[i] = np.sum(dh * xhat, axis=0)
            grads[i + 1] = dh.sum(0)
            dxhat = dh * gamma
            m = dxhat.shape[0]
            dh = inv / m * (m * dxhat - dxhat.sum(0) - xhat * np.sum(dxhat * xhat, axis=0))
    return value, grads, stats


def norm(ts):
    return np.sqrt(sum(np.sum(t * t) for t in ts))


def perturbation(kind, g, params, hp, state):
    """eps of the spec's SAM-family formulas; `state` holds F-SAM's average."""
    rho = hp["rho"]
    if kind == "sam":
        return [rho * t / np.sqrt(norm(g) ** 2 + 1e-12) for t in g]
    if kind == "asam":
        T = [np.abs(p) + hp.get("eta", 0.01) if p.ndim > 1 else np.ones_like(p) for p in params]
        tg = [t * gi for t, gi in zip(T, g)]
        den = np.sqrt(norm(tg) ** 2 + 1e-12)
        return [rho * t * t * gi / den for t, gi in zip(T, g)]
    if kind == "fsam":
        sigma = hp.get("sigma", 1.0)
        d = [gi - sigma * m for gi, m in zip(g, state["m"])]
        return [rho * t / np.sqrt(norm(d) ** 2 + 1e-12) for t in d]
    if kind == "fisher":
        w = [gi / (gi * gi + hp.get("eta", 0.1)) for gi in g]
        den = np.sqrt(sum(np.sum(gi * wi) for gi, wi in zip(g, w)) + 1e-12)
        return [rho * wi / den for wi in w]
    raise ValueError(kind)


def two_pass_reference(layers, kind, params, x, y, hp, state, sample_weight=None):
    """Centre gradient, perturbation, perturbed gradient (float64)."""
    loss_c, g_c, stats_c = loss_and_grad(layers, params, x, y, sample_weight)
    eps = perturbation(kind, g_c, params, hp, state)
    p_pert = [p + e for p, e in zip(params, eps)]
    loss_p, g_p, stats_p = loss_and_grad(layers, p_pert, x, y, sample_weight)
    if kind == "fsam":
        b = hp.get("momentum", 0.9)
        state["m"] = [b * m + (1.0 - b) * g for m, g in zip(state["m"], g_c)]
    return dict(loss_c=loss_c, loss_p=loss_p, g_c=g_c, g_p=g_p, eps=eps,
                stats_c=stats_c, stats_p=stats_p)


def sgd_train(layers, kind, params, batches, lr, momentum=0.0, hp=None, steps_per_batch=1):
    """Runs the two-pass step with Keras' SGD (v <- mu v - lr g; p <- p + v)
    on each (x, y[, sw]) batch in order. kind=None: plain SGD on the centre
    gradient. Returns the final parameters (float64)."""
    params = [np.asarray(p, np.float64).copy() for p in params]
    vel = [np.zeros_like(p) for p in params]
    state = {"m": [np.zeros_like(p) for p in params]}
    for batch in batches:
        x, y = batch[0], batch[1]
        sw = batch[2] if len(batch) > 2 else None
        if kind is None:
            g = loss_and_grad(layers, params, x, y, sw)[1]
        else:
            g = two_pass_reference(layers, kind, params, x, y, hp, state, sw)["g_p"]
        if momentum:
            vel = [momentum * v - lr * gi for v, gi in zip(vel, g)]
            params = [p + v for p, v in zip(params, vel)]
        else:
            params = [p - lr * gi for p, gi in zip(params, g)]
    return params


# ===================================================== Keras-side helpers ==
def build_keras(layers, d_in, kg_cls=None, bn_momentum=0.9):
    """The Keras model computing `layers` (logits out); kg_cls defaults to
    kg.Sequential."""
    import keras

    if kg_cls is None:
        import keras_geosam as kg

        kg_cls = kg.Sequential
    kl = [keras.Input((d_in,))]
    for layer in layers:
        if layer[0] == "dense":
            kl.append(keras.layers.Dense(layer[1]))
        elif layer[0] == "act":
            kl.append(keras.layers.Activation(layer[1]))
        elif layer[0] == "bn":
            kl.append(keras.layers.BatchNormalization(momentum=bn_momentum, epsilon=layer[1]))
    return kg_cls(kl)


def set_weights(model, seed, scale=0.5):
    """Sets every trainable weight from a fixed NumPy seed; returns them
    (float32, in model.trainable_variables order)."""
    rng = np.random.default_rng(seed)
    values = []
    for v in model.trainable_variables:
        if "gamma" in v.path:
            val = 1.0 + 0.2 * rng.normal(size=v.shape)
        else:
            val = scale * rng.normal(size=v.shape)
        val = val.astype("float32")
        v.assign(val)
        values.append(val)
    return values


def weights_of(model):
    import keras

    return [np.asarray(keras.ops.convert_to_numpy(v.value), np.float64) for v in model.trainable_variables]


def make_data(seed, n, d_in, k):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d_in)).astype("float32")
    y = rng.integers(0, k, size=n).astype("int32")
    return x, y


# ---- helpers shared by the optimizer and training tests ----------------
RTOL = 1e-5  # float32 training vs float64 reference
ATOL = 1e-6

MLP = [("dense", 5), ("act", "tanh"), ("dense", 3)]
BN_NET = [("dense", 5), ("bn", 1e-3), ("act", "sigmoid"), ("dense", 3)]


def sce():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def assert_weights_close(actual, expected, rtol=RTOL, atol=ATOL):
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=f"weight {i}")


def max_abs_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b))
