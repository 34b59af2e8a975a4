"""Subprocess worker of the two-pass training tests (models and reference:
``reference/two_pass.py``).

Modes:

- ``KERAS_BACKEND=<b> python tests/workers/training_worker.py cross OUT.npz``:
  a few steps of every two-pass optimizer on a fixed float32 model with
  BatchNormalization, from fixed NumPy weights and data; saves every weight.
  ``cross_backend_results()`` is also called in-process on JAX.
- ``KERAS_BACKEND=jax XLA_FLAGS=--xla_force_host_platform_device_count=2
  python tests/workers/training_worker.py dp OUT.npz``: the same SAM steps on
  one device and under ``keras.distribution.DataParallel`` on two.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the reference

from reference.two_pass import build_keras, make_data, set_weights  # noqa: E402


# ========================================================== worker modes ==
CROSS_LAYERS = [("dense", 5), ("bn", 1e-3), ("act", "tanh"), ("dense", 3)]


def _cross_optimizers():
    import keras

    import keras_geosam as kg

    def sgd():
        return keras.optimizers.SGD(0.1, momentum=0.9)

    return {
        # SAM keeps the perturbed pass's BatchNorm statistics here, F-SAM the centre's.
        "sam": lambda: kg.optimizers.SAM(sgd(), rho=0.3, bn_stats="perturbed"),
        "asam": lambda: kg.optimizers.SAM(sgd(), rho=0.5, adaptive=True),
        "fsam": lambda: kg.optimizers.FSAM(sgd(), rho=0.3, sigma=1.0),
        "fisher": lambda: kg.optimizers.FisherSAM(sgd(), rho=0.3, eta=0.1),
    }


def cross_backend_results():
    """Four steps (2 epochs x 2 batches) of each optimizer; every weight."""
    import keras

    assert keras.config.floatx() == "float32"
    x, y = make_data(7, 16, 4, 3)
    out = {}
    for name, make in _cross_optimizers().items():
        model = build_keras(CROSS_LAYERS, 4)
        set_weights(model, 11)
        model.compile(
            optimizer=make(),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        out[name] = np.concatenate(
            [np.ravel(keras.ops.convert_to_numpy(v.value)) for v in model.weights]
        ).astype("float32")
    return out


def data_parallel_results():
    """SAM steps with a BN model on one device, then on two (DataParallel)."""
    import jax
    import keras

    import keras_geosam as kg

    assert len(jax.devices()) == 2, jax.devices()
    x, y = make_data(3, 16, 4, 3)

    def run():
        model = build_keras(CROSS_LAYERS, 4)
        set_weights(model, 5)
        model.compile(
            optimizer=kg.optimizers.SAM(keras.optimizers.SGD(0.1, momentum=0.9), rho=0.3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return np.concatenate(
            [np.ravel(keras.ops.convert_to_numpy(v.value)) for v in model.weights]
        )

    single = run()
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
    try:
        multi = run()
    finally:
        keras.distribution.set_distribution(None)
    return {"single": single, "multi": multi}


if __name__ == "__main__":
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "cross":
        np.savez(path, **cross_backend_results())
    elif mode == "dp":
        np.savez(path, **data_parallel_results())
    else:
        raise SystemExit(f"unknown mode {mode!r}")
