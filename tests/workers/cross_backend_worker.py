"""Worker for test_float32_results_agree_across_backends.

``KERAS_BACKEND=<b> python tests/workers/cross_backend_worker.py OUT.npz`` builds a
small float32 conv/BN classifier, sets every weight from a fixed NumPy seed,
and saves the loss, gradient, HVP, GGN-vector product and per-example
gradients on fixed NumPy data, and sharpness estimates (probe values,
exact parts, Monte-Carlo Fisher) for a fixed seed; the same on a tiny
Transformer with per-token weights and on a two-output model with
weights per output. ``compute()`` is also called in-process by the
test on the JAX backend.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the reference


def compute():
    import keras

    from keras_geosam import curvature as kc

    assert keras.config.floatx() == "float32"
    rng = np.random.default_rng(2024)
    inp = keras.Input((5, 5, 2))
    h = keras.layers.Conv2D(3, 3, activation="tanh")(inp)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(6)(h)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Activation("sigmoid")(h)
    out = keras.layers.Dense(3)(h)
    model = keras.Model(inp, out)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    for v in model.weights:  # same order and shapes on every backend
        if "moving_variance" in v.path:
            value = rng.uniform(0.5, 1.5, size=v.shape)
        elif "gamma" in v.path:
            value = 1.0 + 0.2 * rng.normal(size=v.shape)
        else:
            value = 0.5 * rng.normal(size=v.shape)
        v.assign(value.astype("float32"))

    x = rng.normal(size=(8, 5, 5, 2)).astype("float32")
    y = rng.integers(0, 3, size=8).astype("int32")
    vec = [rng.normal(size=v.shape).astype("float32") for v in model.trainable_variables]

    def flat(ts):
        return np.concatenate([np.ravel(keras.ops.convert_to_numpy(t)) for t in ts])

    def rows(ts):
        arrays = [np.asarray(keras.ops.convert_to_numpy(t)) for t in ts]
        return np.concatenate([a.reshape(a.shape[0], -1) for a in arrays], axis=1)

    from keras_geosam import sharpness as ks

    def estimate(e):
        return np.concatenate([[e.value, e.stderr], e.samples if e.samples is not None else []])

    out, errors = {"weights": flat(model.weights)}, []
    probed = dict(num_probes=4, rtol=None, seed=3)
    steps = {
        "trace_probes": lambda: estimate(ks.hessian_trace(model, x, y, split=False, **probed)),
        "trace_split": lambda: estimate(ks.hessian_trace(model, x, y, **probed)),
        "sr_diag": lambda: estimate(ks.riemannian_sharpness(model, x, y, structure="diagonal", **probed)),
        # K-FAC at damping 0.1: a damped inverse of condition ~1/damping
        # turns float32 rounding of the factors (1e-7) into 1/damping x
        # that; at the default 1e-3 backends agree to ~2e-4, not 1e-5.
        "sr_kfac": lambda: estimate(ks.riemannian_sharpness(model, x, y, structure="kfac", damping=0.1, **probed)),
        "fisher_mc": lambda: flat(ks.fisher_diagonal(model, x, kind="mc", num_samples=2, seed=5)),
        "loss_grad": lambda: kc.loss_and_gradient(model, x, y),
        "hvp": lambda: flat(kc.hvp(model, x, y, vec)),
        "ggnvp": lambda: flat(kc.ggnvp(model, x, y, vec)),
        "per_example": lambda: rows(kc.per_example_gradients(model, x, y)),
        "sampled": lambda: kc.sampled_label_gradients(model, x, num_samples=2, seed=5),
    }
    collect(out, errors, steps, flat, rows)
    transformer(out, errors, flat, rows, estimate)
    multi_output(out, errors, flat, rows, estimate)
    out["errors"] = np.array(errors, dtype=str)
    return out


def transformer(out, errors, flat, rows, estimate):
    """The same on the tiny token-level Transformer of ``tiny_transformer``
    (padding masked, per-token weights): keys ``lm_*``, in float64. In
    float32 the backends' GGN products on this model differ by 2-3e-4:
    rounding amplified by the attention softmax and the near-one-hot token
    softmaxes, not a difference of method (in float64 they agree to ~1e-6,
    the level of the ops Keras computes in float32 whatever the dtype)."""
    import keras
    from reference import tiny_transformer as tt

    from keras_geosam import curvature as kc
    from keras_geosam import sharpness as ks

    # The layers take their dtype from the global policy (fixed at its first
    # use, so set here along with floatx), and both go back afterwards.
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        model = tt.build()
    finally:
        keras.config.set_floatx(floatx)
        keras.config.set_dtype_policy(policy)
    x, y = tt.data()
    sw = np.random.default_rng(3).uniform(0.5, 2.0, x.shape)
    vec = [np.random.default_rng(4).normal(size=v.shape) for v in model.trainable_variables]
    kw = dict(sample_weight=sw)
    probed = dict(num_probes=4, rtol=None, seed=3, **kw)
    out["lm_weights"] = flat(model.weights)
    steps = {
        "lm_loss_grad": lambda: kc.loss_and_gradient(model, x, y, **kw),
        "lm_hvp": lambda: flat(kc.hvp(model, x, y, vec, **kw)),
        "lm_ggnvp": lambda: flat(kc.ggnvp(model, x, y, vec, **kw)),
        "lm_per_example": lambda: rows(kc.per_example_gradients(model, x, y, **kw)),
        "lm_trace_split": lambda: estimate(ks.hessian_trace(model, x, y, **probed)),
        "lm_sr_diag": lambda: estimate(ks.riemannian_sharpness(model, x, y, structure="diagonal", damping=0.1, **probed)),
        "lm_sr_kfac": lambda: estimate(ks.riemannian_sharpness(model, x, y, structure="kfac", damping=0.1, **probed)),
        "lm_fisher_mc": lambda: flat(ks.fisher_diagonal(model, x, kind="mc", num_samples=2, seed=5, **kw)),
    }
    collect(out, errors, steps, flat, rows, prefix="lm_")


def multi_output(out, errors, flat, rows, estimate):
    """A two-input, two-output model (3 classes with sparse cross-entropy,
    3 labels with binary cross-entropy, ``loss_weights``) with sample
    weights per output: keys ``mo_*``, in float32."""
    import keras

    from keras_geosam import curvature as kc
    from keras_geosam import sharpness as ks

    rng = np.random.default_rng(7)
    a, b = keras.Input((4,), name="a"), keras.Input((2,), name="b")
    h = keras.layers.Dense(5, activation="tanh")(keras.layers.Concatenate()([a, b]))
    model = keras.Model([a, b], [keras.layers.Dense(3, name="cls")(h), keras.layers.Dense(3, name="aux")(h)])
    model.compile(loss=[keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                        keras.losses.BinaryCrossentropy(from_logits=True)], loss_weights=[1.0, 0.3])
    for v in model.weights:
        v.assign((0.5 * rng.normal(size=v.shape)).astype("float32"))
    x = [rng.normal(size=(8, 4)).astype("float32"), rng.normal(size=(8, 2)).astype("float32")]
    y = [rng.integers(0, 3, size=8).astype("int32"), (rng.uniform(size=(8, 3)) < 0.5).astype("float32")]
    kw = dict(sample_weight={"cls": rng.uniform(0.2, 2.0, 8), "aux": rng.uniform(0.2, 2.0, 8)})
    vec = [rng.normal(size=v.shape).astype("float32") for v in model.trainable_variables]
    out["mo_weights"] = flat(model.weights)
    steps = {
        "mo_loss_grad": lambda: kc.loss_and_gradient(model, x, y, **kw),
        "mo_ggnvp": lambda: flat(kc.ggnvp(model, x, y, vec, **kw)),
        "mo_per_example": lambda: rows(kc.per_example_gradients(model, x, y, **kw)),
        "mo_sr_kfac": lambda: estimate(ks.riemannian_sharpness(model, x, y, structure="kfac", damping=0.1, num_probes=4,
                                                               rtol=None, seed=3, **kw)),
        "mo_fisher_mc": lambda: flat(ks.fisher_diagonal(model, x, kind="mc", num_samples=2, seed=5, **kw)),
    }
    collect(out, errors, steps, flat, rows, prefix="mo_")


def collect(out, errors, steps, flat, rows, prefix=""):
    """Runs each step on its own, so one failure does not hide the others:
    its value into `out` (``<prefix>loss_grad`` as ``loss`` and ``grad``,
    ``sampled`` as its rows and labels), its error into `errors`."""
    import keras

    for key, step in steps.items():
        try:
            value = step()
        except Exception as e:  # reported by the test
            errors.append(f"{key}: {type(e).__name__}: {str(e)[:300]}")
            continue
        if key == prefix + "loss_grad":
            out[prefix + "loss"] = np.asarray(keras.ops.convert_to_numpy(value[0])).reshape(1)
            out[prefix + "grad"] = flat(value[1])
        elif key == "sampled":
            out["sampled"] = rows(value[0])
            out["labels"] = np.asarray(value[1])
        else:
            out[key] = value


if __name__ == "__main__":
    np.savez(sys.argv[1], **compute())
