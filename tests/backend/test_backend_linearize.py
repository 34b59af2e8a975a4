"""backend.linearize and backend.value_and_vjp against hand-written Jacobian
products of a two-layer tanh map (float64), called repeatedly, eagerly and
inside a compiled loop (the LLQR refresh's use). Tolerances are float32-level:
Keras computes float64 matmul (torch) and tanh (JAX) in float32."""

import numpy as np
import pytest
from keras import ops

from keras_geosam import backend

RNG = np.random.default_rng(0)
X = RNG.normal(size=(5, 3))
W1, W2 = RNG.normal(size=(3, 4)), RNG.normal(size=(4, 2))


def f(params, x):
    return ops.matmul(ops.tanh(ops.matmul(x, params[0])), params[1])


def jvp_ref(t1, t2):
    h = np.tanh(X @ W1)
    return ((1 - h**2) * (X @ t1)) @ W2 + h @ t2


def vjp_ref(c):
    h = np.tanh(X @ W1)
    return [X.T @ ((c @ W2.T) * (1 - h**2)), h.T @ c]


def tensors(*arrays):
    return [ops.convert_to_tensor(a, dtype="float64") for a in arrays]


def test_linearize_matches_hand_written_products_on_reuse(float64):
    out, jvp_fn, vjp_fn = backend.linearize(f, tensors(W1, W2), ops.convert_to_tensor(X, dtype="float64"))
    np.testing.assert_allclose(ops.convert_to_numpy(out), np.tanh(X @ W1) @ W2, rtol=1e-5)
    for seed in (1, 2):  # the same linearisation serves every call
        r = np.random.default_rng(seed)
        t1, t2, c = r.normal(size=W1.shape), r.normal(size=W2.shape), r.normal(size=(5, 2))
        np.testing.assert_allclose(ops.convert_to_numpy(jvp_fn(tensors(t1, t2))), jvp_ref(t1, t2), rtol=1e-5)
        for got, want in zip(vjp_fn(ops.convert_to_tensor(c, dtype="float64")), vjp_ref(c)):
            np.testing.assert_allclose(ops.convert_to_numpy(got), want, rtol=1e-5)


def test_linearize_inside_a_compiled_loop(float64):
    """G t = J^T J t applied k times in a fori_loop of a compiled function
    (tf.while_loop, jax.lax.fori_loop, a Python loop on torch)."""
    k = 3

    def power(params, x, t):
        _, jvp_fn, vjp_fn = backend.linearize(f, params, x)
        return ops.fori_loop(0, k, lambda i, v: vjp_fn(jvp_fn(v)), t)

    r = np.random.default_rng(3)
    t = [r.normal(size=W1.shape), r.normal(size=W2.shape)]
    got = backend.compile(power)(tensors(W1, W2), ops.convert_to_tensor(X, dtype="float64"), tensors(*t))
    want = t
    for _ in range(k):
        want = vjp_ref(jvp_ref(*want))
    for g, w in zip(got, want):
        np.testing.assert_allclose(ops.convert_to_numpy(g), w, rtol=1e-5)


def test_value_and_vjp_of_a_list_valued_map(float64):
    def g(params):
        a, b = params
        return [a * b[0, 0], ops.sum(b * b, axis=0)]

    value, pull = backend.value_and_vjp(g, tensors(W1, W2))
    np.testing.assert_allclose(ops.convert_to_numpy(value[0]), W1 * W2[0, 0])
    np.testing.assert_allclose(ops.convert_to_numpy(value[1]), (W2**2).sum(0))
    c0, c1 = RNG.normal(size=W1.shape), RNG.normal(size=(2,))
    da, db = pull(tensors(c0, c1))
    want_db = 2 * W2 * c1[None, :]
    want_db[0, 0] += np.sum(c0 * W1)
    np.testing.assert_allclose(ops.convert_to_numpy(da), c0 * W2[0, 0], rtol=1e-5)
    np.testing.assert_allclose(ops.convert_to_numpy(db), want_db, rtol=1e-5)


@pytest.mark.parametrize("structure", ["diagonal", "kfac"])
def test_refresh_products_reuse_equals_fresh_hvp(structure):
    """The refresh's linearised G-product equals the GGN surrogate's
    forward-over-reverse HVP on a real model (float32, rtol 1e-4)."""
    import keras

    from keras_geosam.curvature.functional import model_functions
    from keras_geosam.preconditioner import LearnedPreconditioner

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = RNG.normal(size=(8, 6)).astype("float32")
    y = RNG.integers(0, 3, size=8).astype("int32")
    pre = LearnedPreconditioner(structure=structure)
    values = [v.value for v in model.trainable_variables]
    nt = [v.value for v in model.non_trainable_variables]
    gbar, gprod = pre._problem(model, values, nt, ops.convert_to_tensor(x), ops.convert_to_tensor(y))
    fns = model_functions(model, None, training=False, include_regularization=False)
    _, want_g = backend.value_and_grad(fns.loss, values, nt, x, y)
    u = [ops.convert_to_tensor(RNG.normal(size=v.shape).astype("float32")) for v in values]
    summed = lambda p, n_, xb: 8.0 * fns.ggn_surrogate_of(p, n_, xb, None, None, None, kind="exact")
    want_gu = backend.hvp(summed, values, u, nt, ops.convert_to_tensor(x))
    for a, b in zip(gbar, want_g):
        np.testing.assert_allclose(ops.convert_to_numpy(a), ops.convert_to_numpy(b), rtol=1e-4, atol=1e-6)
    for _ in range(2):
        for a, b in zip(gprod(u), want_gu):
            np.testing.assert_allclose(ops.convert_to_numpy(a), ops.convert_to_numpy(b), rtol=1e-4, atol=1e-5)


def test_unrolled_refresh_equals_the_loop():
    """objective.refresh(unroll=True), used for convolutional nets where
    compiled loops are slow (XLA:CPU), computes the same U as the loop."""
    import importlib

    import keras

    from keras_geosam import backend as kb
    from keras_geosam.preconditioner import LearnedPreconditioner

    objective = importlib.import_module("keras_geosam.preconditioner.objective")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6, 6, 2)), keras.layers.Conv2D(3, 3, activation="tanh"),
                              keras.layers.Flatten(), keras.layers.Dense(3)])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = ops.convert_to_tensor(RNG.normal(size=(8, 6, 6, 2)).astype("float32"))
    y = ops.convert_to_tensor(RNG.integers(0, 3, size=8).astype("int32"))
    from keras_geosam.preconditioner import structures

    pre = LearnedPreconditioner(structure="kfac")
    pre.layout = structures.layout(model.trainable_variables, "kfac")
    assert pre._unroll(model) == kb.slow_convolutions_in_loops
    # Attention kernels have three axes but no convolution: the loop stays.
    inputs = keras.Input((4, 6))
    attention = keras.Model(inputs, keras.layers.MultiHeadAttention(2, 3)(inputs, inputs))
    assert pre._unroll(attention) is False
    # A ViT: one patch convolution, attention kernels hold the most entries.
    images = keras.Input((8, 8, 3))
    patches = keras.layers.Reshape((4, 8))(keras.layers.Conv2D(8, 4, strides=4)(images))
    vit = keras.Model(images, keras.layers.MultiHeadAttention(2, 8)(patches, patches))
    assert pre._unroll(vit) is False
    values = [v.value for v in model.trainable_variables]
    nt = [v.value for v in model.non_trainable_variables]
    gbar, gprod = pre._problem(model, values, nt, x, y)
    groups = structures.clip_groups(pre.layout, model.trainable_variables, "kfac")
    params = [ops.convert_to_tensor(np.eye(s[0], dtype="float32") if init == "identity" else np.ones(s, "float32"))
              for _, _, s, init, _ in structures.param_specs(pre.layout)]
    looped = objective.refresh(pre.layout, params, gbar, gprod, groups, steps=4, learning_rate=0.1)
    unrolled = objective.refresh(pre.layout, params, gbar, gprod, groups, steps=4, learning_rate=0.1, unroll=True)
    moved = False
    for a, b, p in zip(looped, unrolled, params):
        np.testing.assert_allclose(ops.convert_to_numpy(a), ops.convert_to_numpy(b), rtol=1e-5, atol=1e-7)
        moved = moved or not np.allclose(ops.convert_to_numpy(a), ops.convert_to_numpy(p))
    assert moved


def test_vdot_sums_products_over_a_list_of_tensors():
    # The gradient norms and dot products of every step: checked against
    # NumPy float64 in the tensors' dtype, in float32 on request (the step's
    # statistics), from half precision, and for a single tensor. The last
    # pair is larger than torch's serial-product limit (backend/torch.py),
    # so both of its dot paths are checked; correlated, so its sum is large.
    shapes = [(7, 5), (5,), (2, 3, 4), (200, 200)]
    a = [RNG.normal(size=s) for s in shapes]
    b = [RNG.normal(size=s) for s in shapes]
    b[-1] = a[-1] + 0.5 * b[-1]
    for dtype, tol in (("float32", 1e-5), ("float64", 1e-12)):
        # The reference in float64 from the values the tensors hold.
        ra = [x.astype(dtype).astype("float64") for x in a]
        rb = [y.astype(dtype).astype("float64") for y in b]
        ta = [ops.convert_to_tensor(x.astype(dtype)) for x in a]
        tb = [ops.convert_to_tensor(y.astype(dtype)) for y in b]
        got = backend.vdot(ta, tb)
        assert ops.convert_to_numpy(got).dtype == np.dtype(dtype)
        np.testing.assert_allclose(float(got), sum(float(np.sum(x * y)) for x, y in zip(ra, rb)), rtol=tol)
        np.testing.assert_allclose(float(backend.vdot(ta, ta)), sum(float(np.sum(x * x)) for x in ra), rtol=tol)
        np.testing.assert_allclose(float(backend.vdot(ta, ta, dtype)), sum(float(np.sum(x * x)) for x in ra), rtol=tol)
        # A squared norm stays non-finite when an entry is (the step's skip
        # check relies on it).
        for bad in (np.nan, np.inf):
            spoilt = [ta[0], ops.convert_to_tensor(np.where(np.arange(5) == 2, bad, a[1]).astype(dtype)), *ta[2:]]
            assert not np.isfinite(float(backend.vdot(spoilt, spoilt, "float32")))
        np.testing.assert_allclose(float(backend.vdot(ta[:1], tb[:1])), float(np.sum(ra[0] * rb[0])), rtol=tol)
    # Mixed dtypes promote; an empty list sums to zero.
    mixed = backend.vdot([ops.convert_to_tensor(a[0].astype("float32"))], [ops.convert_to_tensor(b[0])])
    np.testing.assert_allclose(float(mixed), float(np.sum(a[0].astype("float32").astype("float64") * b[0])), rtol=1e-6)
    assert float(backend.vdot([], [])) == 0.0
    half = [ops.convert_to_tensor(x, "bfloat16") for x in a]
    got = backend.vdot(half, half, "float32")
    assert ops.convert_to_numpy(got).dtype == np.float32
    rounded = [ops.convert_to_numpy(ops.cast(h, "float32")).astype("float64") for h in half]
    # A float32 sum of 40,000 products: rounding grows like sqrt(n) * 6e-8
    # ~ 1.2e-5, and the order depends on the CPU's vector width (torch on an
    # AVX2-only CPU: 2.4e-6). A bfloat16 accumulation would be off by ~1e-2.
    np.testing.assert_allclose(float(got), sum(float(np.sum(r * r)) for r in rounded), rtol=2e-5)


def test_add_scaled_is_y_plus_alpha_x():
    # LLQR's inner heavy-ball update (a Python number) and the perturbed
    # weights of a SAM step (a scalar tensor); one fused op on torch.
    x, y = RNG.normal(size=(4, 3)), RNG.normal(size=(4, 3))
    for dtype, tol in (("float32", 1e-6), ("float64", 1e-15)):
        for alpha in (-0.3, ops.convert_to_tensor(np.asarray(-0.3, dtype))):
            got = backend.add_scaled(ops.convert_to_tensor(y.astype(dtype)), ops.convert_to_tensor(x.astype(dtype)), alpha)
            assert ops.convert_to_numpy(got).dtype == np.dtype(dtype)
            np.testing.assert_allclose(ops.convert_to_numpy(got), y - 0.3 * x, rtol=tol, atol=tol)


def test_a_block_kernel_traces_once_per_signature(caplog):
    """``backend.block_kernel``: where it compiles (JAX, TensorFlow) the body
    runs once per argument signature (shapes, dtypes, static values), never
    again for a signature seen before, and TensorFlow logs no retracing;
    everywhere the value is the body's."""
    import keras

    traces = []

    def body(a, b, *, power):
        traces.append((tuple(a.shape), power))
        return ops.matmul(a, b) * power

    kernel = backend.block_kernel(body, static_argnames=("power",))
    rng = np.random.default_rng(0)
    calls = [(3, 2.0), (3, 2.0), (4, 2.0), (3, 0.5), (4, 2.0), (3, 2.0)]
    for n, power in calls:
        a, b = rng.normal(size=(n, n)).astype("float32"), rng.normal(size=(n, n)).astype("float32")
        out = ops.convert_to_numpy(kernel(ops.convert_to_tensor(a), ops.convert_to_tensor(b), power=power))
        np.testing.assert_allclose(out, a @ b * power, rtol=1e-5)
    if keras.backend.backend() == "torch":
        assert len(traces) == len(calls)  # eager: the body runs every call
    else:
        assert traces == [((3, 3), 2.0), ((4, 4), 2.0), ((3, 3), 0.5)]
    # Many shapes in a row (a network's blocks): TensorFlow warns when one
    # function retraces 5 times; here none does.
    with caplog.at_level("WARNING"):
        for n in range(5, 13):
            kernel(ops.ones((n, n)), ops.ones((n, n)), power=1.0)
    assert not [r for r in caplog.records if "retracing" in r.getMessage()]
