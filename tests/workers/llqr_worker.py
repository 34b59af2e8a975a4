"""Worker for test_llqr.test_refresh_gives_the_same_U_on_all_backends.

``KERAS_BACKEND=<b> python tests/workers/llqr_worker.py OUT.npz`` builds a small
float32 classifier with BatchNormalization (non-trivial moving statistics),
sets every weight from a fixed NumPy seed, refreshes LLQR+SAM's U twice
(``opt.refresh_now``, the path ``kg.callbacks.PreconditionerRefresh`` uses)
on a fixed batch for several structures and divergences, and saves every U
factor (and its value before). ``compute()`` is also called in-process by the test on JAX.
"""

import sys

import numpy as np

CASES = (("diagonal", "ngd"), ("kfac", "newton"), ("ekfac", "ngd"))


def compute():
    import keras
    from keras import ops

    import keras_geosam as kg

    assert keras.config.floatx() == "float32"
    rng = np.random.default_rng(31)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = rng.integers(0, 3, size=16).astype("int32")
    weights = np.random.default_rng(32)
    init = None
    out = {}
    for structure, divergence in CASES:
        z = {"kernel_initializer": "zeros"}
        model = kg.Sequential([
            keras.Input((4,)), keras.layers.Dense(5, **z), keras.layers.BatchNormalization(),
            keras.layers.Activation("sigmoid"), keras.layers.Dense(3, **z),
        ])
        if init is None:  # same architecture every time: one set of weights
            init = []
            for v in model.weights:
                if "gamma" in v.path or "variance" in v.path:
                    init.append(weights.uniform(0.5, 1.5, size=v.shape).astype("float32"))
                else:
                    init.append((0.7 * weights.normal(size=v.shape)).astype("float32"))
        for v, value in zip(model.weights, init):
            v.assign(value)
        opt = kg.optimizers.LLQRSAM(
            keras.optimizers.SGD(0.1), rho=0.1, structure=structure, divergence=divergence,
            refresh_source="callback", beta=0.5, inner_learning_rate=2e-2, refresh_steps=25,
        )
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        for i, u in enumerate(opt.preconditioner.variables):
            out[f"init_{structure}_{divergence}_{i}"] = np.asarray(ops.convert_to_numpy(u.value))
        opt.refresh_now(model, x, y)
        opt.refresh_now(model, x, y)
        assert int(ops.convert_to_numpy(opt.refreshes)) == 2
        for i, u in enumerate(opt.preconditioner.variables):
            out[f"{structure}_{divergence}_{i}"] = np.asarray(ops.convert_to_numpy(u.value))
    return out


if __name__ == "__main__":
    np.savez(sys.argv[1], **compute())
