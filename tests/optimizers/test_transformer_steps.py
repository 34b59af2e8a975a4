"""Every optimizer's step on a tiny Transformer (Embedding, MultiHeadAttention,
LayerNormalization, a feed-forward block) against a hand-written float64
reference, plus what attention models need of each backend.

The reference writes the Transformer again in ``jax.numpy`` (x64), takes its
gradients with ``jax.grad`` (never through Keras or keras_geosam), and
applies the spec's formulas (shared/spec/llqr-sam.md) and Keras' SGD / Adam
update rules in NumPy. LLQR's U is held at known, non-identity values
(``refresh_source="callback"`` without the callback) and applied from its
own block formulas, with the views written down here: the embedding
(vocabulary, d) with a diagonal input factor, query/key/value kernels
d_model x (heads*head_dim), the attention output (heads*head_dim) x d_model.

Tolerance: 1e-8 relative where Keras computes every op of the model in
float64 on this backend, 1e-6 where it computes one in float32 (probed).
"""


import jax.numpy as jnp
import keras
import numpy as np
import pytest
from keras import ops

import keras_geosam as kg
from reference import curvature as ref
from reference.dtypes import keras_dtype
from reference.transformer_classifier import (
    ADAM_EPSILON,
    ADAM_LR,
    BETA_1,
    BETA_2,
    LR,
    MOMENTUM,
    N,
    ORDER,
    _lossy,
    build,
    data,
    forward,
    random_u,
    reference_run,
    weights,
)
from locations import import_worker, start_on_other_backends

BACKEND = keras.backend.backend()
CASES = {
    # name: (kind, optimizer kwargs, base)
    "sam-sgd": ("sam", {"rho": 0.3}, "sgd"),
    "sam-adam": ("sam", {"rho": 0.3}, "adam"),
    "asam-sgd": ("asam", {"rho": 0.5, "eta": 0.01}, "sgd"),
    "fsam-sgd": ("fsam", {"rho": 0.3, "sigma": 1.0, "momentum": 0.6}, "sgd"),
    "fishersam-sgd": ("fisher", {"rho": 0.3, "eta": 0.1}, "sgd"),
    "llqr-kfac-sgd": ("llqr", {"structure": "kfac"}, "sgd"),
    "llqrsam-diagonal-sgd": ("llqrsam", {"rho": 0.3, "structure": "diagonal"}, "sgd"),
    "llqrsam-kfac-adam": ("llqrsam", {"rho": 0.3, "structure": "kfac"}, "adam"),
    "llqrsam-ekfac-sgd": ("llqrsam", {"rho": 0.3, "structure": "ekfac"}, "sgd"),
}


def make(kind, hp, base):
    if base == "sgd":
        base_opt = keras.optimizers.SGD(LR, momentum=MOMENTUM)
    else:
        base_opt = keras.optimizers.Adam(ADAM_LR, beta_1=BETA_1, beta_2=BETA_2, epsilon=ADAM_EPSILON)
    O = kg.optimizers
    if kind in ("sam", "asam"):
        return O.SAM(base_opt, rho=hp["rho"], adaptive=kind == "asam", **({"eta": hp["eta"]} if kind == "asam" else {}))
    if kind == "fsam":
        return O.FSAM(base_opt, rho=hp["rho"], sigma=hp["sigma"], momentum=hp["momentum"])
    if kind == "fisher":
        return O.FisherSAM(base_opt, rho=hp["rho"], eta=hp["eta"])
    if kind == "llqr":
        return O.LLQR(base_opt, structure=hp["structure"], refresh_source="callback")
    return O.LLQRSAM(base_opt, rho=hp["rho"], structure=hp["structure"], refresh_source="callback")


@pytest.mark.parametrize("case", sorted(CASES))
def test_step_on_a_tiny_transformer_matches_the_float64_reference(case):
    kind, hp, base = CASES[case]
    with keras_dtype("float64"):
        model = build()
        opt = make(kind, hp, base)
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        init = weights(model)
        u = random_u(opt, np.random.default_rng(5)) if kind.startswith("llqr") else None
        x, y = data()
        # The hand-written forward is the Keras model's.
        logits = np.asarray(forward([jnp.asarray(p) for p in init], jnp.asarray(x[:N])))
        assert ref.rel_err(ref.to_numpy(model(x[:N])), logits) < (1e-6 if _lossy() else 1e-10)
        model.fit(x, y, batch_size=N, epochs=1, shuffle=False, verbose=0)  # two steps
        got = weights(model)
    batches = [(x[:N], y[:N]), (x[N:], y[N:])]
    base_hp = {"name": base, "lr": LR if base == "sgd" else ADAM_LR, "momentum": MOMENTUM}
    expected = reference_run(kind, init, batches, hp, base_hp, u)
    tol = 1e-6 if _lossy() else 1e-8
    for name, a, b in zip(ORDER, got, expected):
        assert ref.rel_err(a, b) < tol, (case, name, ref.rel_err(a, b))
    # Teeth: the two-pass step is far from the base optimizer's own.
    plain = reference_run("llqr", init, batches, hp, base_hp, {n: {"d": np.ones_like(p)} for n, p in zip(ORDER, init)})
    assert ref.rel_err(expected, plain) > 1e-4
    if kind == "llqrsam":  # ... and so is U's
        assert ref.rel_err(expected, reference_run("sam", init, batches, hp, base_hp)) > 1e-4


def test_asam_leaves_two_axis_attention_biases_unscaled():
    """MultiHeadAttention's query/key/value biases have two axes (heads,
    head_dim): ASAM's T is 1 on them as on every bias (shared spec)."""
    opt = kg.optimizers.SAM(keras.optimizers.SGD(0.1), adaptive=True)
    model = build()
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    values = [v.value for v in model.trainable_variables]
    g = [ops.ones_like(v) for v in values]
    scale, direction = opt.scaled_perturbation(g, values)
    for v, d in zip(model.trainable_variables, direction):
        d = ref.to_numpy(d)
        if v.path.endswith("bias"):
            np.testing.assert_array_equal(d, np.ones_like(d))


# ------------------------------------------------- TensorFlow sparse ----
@pytest.mark.skipif(BACKEND != "tensorflow", reason="IndexedSlices are TensorFlow's")
def test_tensorflow_keeps_the_embedding_gradient_sparse_where_it_can(monkeypatch):
    """SAM and F-SAM on SGD hand the base optimizer the Embedding's
    IndexedSlices (no dense copy in the step); optimizers whose pieces need
    a dense gradient (ASAM's T g, U g), and bases that mishandle repeated
    rows (Keras' TensorFlow Adam squares them before summing), get one dense
    copy per pass, made by the gradient call itself."""
    seen = {}
    for kind, base in (("sam", "sgd"), ("fsam", "sgd"), ("asam", "sgd"), ("llqrsam", "sgd"), ("sam", "adam")):
        hp = {"rho": 0.3, "sigma": 1.0, "momentum": 0.6, "eta": 0.01, "structure": "kfac"}
        opt = make(kind, hp, base)
        kind = f"{kind}-{base}"
        model = build()
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        types = []
        stock = type(opt.base_optimizer).apply

        def spy(self, grads, variables=None, _types=types, _stock=stock):
            _types.append(type(grads[0]).__name__)  # the embedding's gradient
            return _stock(self, grads, variables)

        monkeypatch.setattr(type(opt.base_optimizer), "apply", spy)
        x, y = data()
        model.fit(x, y, batch_size=N, epochs=1, shuffle=False, verbose=0)
        monkeypatch.setattr(type(opt.base_optimizer), "apply", stock)
        seen[kind] = set(types)
    assert seen["sam-sgd"] == {"IndexedSlices"} and seen["fsam-sgd"] == {"IndexedSlices"}
    for kind in ("asam-sgd", "llqrsam-sgd", "sam-adam"):
        assert seen[kind] and "IndexedSlices" not in seen[kind], kind


# --------------------------------------------------- torch attention ----
@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's fused attention kernel")
def test_torch_second_order_paths_equal_the_math_kernel_everywhere():
    """The package picks the math SDPA kernel for second-order products
    itself; forbidding the fused kernel for the whole computation (first
    order too) gives the same values."""
    from torch.nn.attention import SDPBackend
    from torch.nn.attention import sdpa_kernel

    x, y = data()

    def run():
        keras.utils.set_random_seed(0)
        model = build()
        opt = kg.optimizers.LLQRSAM(keras.optimizers.SGD(0.1, momentum=0.9), rho=0.3, structure="kfac", refresh_every=1, refresh_steps=5)
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        v = [np.ones(tuple(w.shape), "float32") for w in model.trainable_variables]
        hv = kg.curvature.hvp(model, x, y, v)
        model.fit(x, y, batch_size=N, epochs=1, shuffle=False, verbose=0)
        return [ref.to_numpy(t) for t in hv], weights(model), [ref.to_numpy(p.value) for p in opt.preconditioner.variables]

    default = run()
    with sdpa_kernel([SDPBackend.MATH]):
        math = run()
    for a, b in zip(default, math):
        assert ref.rel_err(a, b) < 1e-5


# ------------------------------------------------------ across backends --
@pytest.mark.cross_backend
@pytest.mark.skipif(BACKEND != "jax", reason="runs once, from the JAX process")
def test_the_three_backends_agree_on_transformer_steps(tmp_path):
    """From identical float32 weights: two LLQR+SAM (K-FAC, refreshed in the
    step at step 0) and two SAM steps give the same weights and U on jax,
    tensorflow and torch (relative 1e-5)."""
    transformer_worker = import_worker("transformer_worker")

    collect = start_on_other_backends("transformer_worker.py", tmp_path, x64=False)
    mine = transformer_worker.compute()
    for b, theirs in collect(timeout=600).items():
        assert sorted(theirs) == sorted(mine)
        for key in sorted(mine):
            a, c = mine[key].astype(np.float64), theirs[key].astype(np.float64)
            assert np.linalg.norm(a - c) <= 1e-5 * max(np.linalg.norm(a), 1e-12), (b, key)


# ------------------------------------------ the trial model trains ----
TRIAL = [  # every optimizer, the bases rotating over SGD, Adam and AdamW
    ("sam", "sgd"), ("asam", "adam"), ("fsam", "adamw"), ("fisher", "sgd"), ("llqr-diagonal", "adam"),
    ("llqrsam-kfac", "adamw"), ("llqrsam-ekfac", "sgd"),
]


@pytest.mark.parametrize("kind,base", TRIAL, ids=[f"{k}-{b}" for k, b in TRIAL])
def test_every_optimizer_trains_an_attention_model_with_gelu_and_dropout(kind, base):
    """The trial model of the issue (Embedding, MultiHeadAttention with
    dropout, LayerNorm, a gelu feed-forward with dropout, pooling) on
    "is token 7 in the sequence": finite and decreasing loss, U refreshed in
    the step, nothing skipped."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,), dtype="int32")
    h = keras.layers.Embedding(50, 16)(inputs)
    a = keras.layers.MultiHeadAttention(2, 8, dropout=0.1)(h, h)
    h = keras.layers.LayerNormalization()(h + a)
    f = keras.layers.Dropout(0.1)(keras.layers.Dense(32, activation="gelu")(h))
    h = keras.layers.LayerNormalization()(h + keras.layers.Dense(16)(f))
    model = kg.Model(inputs, keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(h)))
    bases = {"sgd": lambda: keras.optimizers.SGD(0.05, momentum=0.9), "adam": lambda: keras.optimizers.Adam(3e-3),
             "adamw": lambda: keras.optimizers.AdamW(3e-3, weight_decay=1e-2)}
    name, _, structure = kind.partition("-")
    hp = {"rho": 0.05, "sigma": 1.0, "momentum": 0.9, "eta": 0.01 if name == "asam" else 0.1, "structure": structure}
    if name.startswith("llqr"):
        O = kg.optimizers.LLQRSAM if name == "llqrsam" else kg.optimizers.LLQR
        extra = {"rho": 0.05} if name == "llqrsam" else {}
        opt = O(bases[base](), structure=structure, refresh_every=4, refresh_steps=5, **extra)
    else:
        opt = make(name, hp, "sgd")
        opt = type(opt).from_config({**opt.get_config(), "base_optimizer": keras.saving.serialize_keras_object(bases[base]())})
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, size=(128, 16)).astype("int32")
    y = (x == 7).any(axis=1).astype("int32")
    h = model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    loss = h.history["loss"]
    assert all(np.isfinite(loss)) and loss[-1] < loss[0]
    assert h.history["skipped_steps"][-1] == 0
    if name.startswith("llqr"):
        assert h.history["refreshes"][-1] == 2.0  # steps 0 and 4 of 8
