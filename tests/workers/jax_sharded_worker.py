"""Subprocess worker: JAX on four virtual CPU devices (the device count is
fixed when JAX starts, hence a fresh process).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/workers/jax_sharded_worker.py MODE OUT.json

Modes:
- ``estimators``: ``hessian_trace``, ``riemannian_sharpness`` (diagonal and
  K-FAC metrics, probed residual) and ``fisher_diagonal`` with no
  distribution and under ``DataParallel`` on four devices (batches of 12
  are split, the last batch of 6 is replicated), the sharding of a
  streamed batch, and ``SharpnessLogger`` inside a data-parallel ``fit``.
- ``model_parallel``: SAM and LLQR+SAM (diagonal, K-FAC) unsharded and under
  ``ModelParallel`` with the Dense kernels split over a 2 x 2 mesh's
  "model" axis; the sharding of the kernels and of U's parameters.
- ``errors``: the messages of the bad configurations (None: no error).
"""

import json
import os
import sys

os.environ["KERAS_BACKEND"] = "jax"

import numpy as np  # noqa: E402


def data(n=30, d=6, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)).astype("float32"), rng.integers(0, classes, size=n).astype("int32")


def build(optimizer=None, width=8, activation="tanh"):
    import keras

    import keras_geosam as kg

    model = kg.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(width, activation=activation, name="dense_a"),
        keras.layers.Dense(4, name="dense_b"),
    ])
    rng = np.random.default_rng(1)
    model.set_weights([0.5 * rng.normal(size=v.shape).astype("float32") for v in model.weights])
    model.compile(
        optimizer=optimizer or keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


from distributed_estimates import estimates  # noqa: E402
from distributed_estimates import flat  # noqa: E402


def logged(x, y):
    import keras

    import keras_geosam as kg

    model = build(kg.optimizers.SAM(keras.optimizers.SGD(0.1), rho=0.2))
    logger = kg.callbacks.SharpnessLogger(x, y, metrics=("hessian_trace", "riemannian_sharpness"), num_probes=6, rtol=None)
    history = model.fit(x[:24], y[:24], batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[logger])
    return {k: [float(v) for v in vals] for k, vals in history.history.items()}


def estimators_mode():
    import jax
    import keras

    from keras_geosam import backend

    x, y = data()
    single = estimates(build(), x, y)
    single_log = logged(x, y)
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
    split = backend.distribute_batch(x[:12])
    rest = backend.distribute_batch(x[:6])
    out = {
        "single": single,
        "parallel": estimates(build(), x, y),
        "split_devices": len(split.sharding.device_set),
        "split_replicated": bool(split.sharding.is_fully_replicated),
        "split_shard_rows": int(split.addressable_shards[0].data.shape[0]),
        "rest_replicated": bool(rest.sharding.is_fully_replicated),
        "single_log": single_log,
        "parallel_log": logged(x, y),
    }
    return out


def model_parallel_mode():
    import jax
    import keras

    import keras_geosam as kg

    x, y = data(n=32)
    cases = {
        "SAM": lambda: kg.optimizers.SAM(keras.optimizers.SGD(0.1, momentum=0.9), rho=0.3),
        "LLQRSAM_diagonal": lambda: kg.optimizers.LLQRSAM(keras.optimizers.SGD(0.1, momentum=0.9), rho=0.3, structure="diagonal", refresh_every=2, refresh_steps=5),
        "LLQRSAM_kfac": lambda: kg.optimizers.LLQRSAM(keras.optimizers.SGD(0.1, momentum=0.9), rho=0.3, structure="kfac", refresh_every=2, refresh_steps=5),
    }

    def train(make):
        model = build(make())
        history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        return model, history.history

    out = {"single": {}, "sharded": {}}
    for name, make in cases.items():
        model, hist = train(make)
        out["single"][name] = flat(model.weights + model.optimizer.variables)
        out["single"][name + "_grad_norm"] = hist["grad_norm"]
    mesh = keras.distribution.DeviceMesh((2, 2), ("batch", "model"), devices=jax.devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    # Keys are regular expressions matched against whole variable paths.
    layout_map[".*dense_a/kernel"] = (None, "model")
    layout_map[".*dense_b/kernel"] = ("model", None)
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
    for name, make in cases.items():
        model, hist = train(make)
        out["sharded"][name] = flat(model.weights + model.optimizer.variables)
        out["sharded"][name + "_grad_norm"] = hist["grad_norm"]
        spec = lambda v: [str(a) for a in v.value.sharding.spec] + [None] * (len(v.shape) - len(v.value.sharding.spec))
        out["sharded"][name + "_kernels"] = [spec(model.get_layer(n).kernel) for n in ("dense_a", "dense_b")]
        pre = getattr(model.optimizer, "preconditioner", None)
        if pre is not None:
            out["sharded"][name + "_U"] = {v.name: spec(v) for v in pre.variables}
    out["history_keys"] = sorted(hist)
    return out


def errors_mode():
    import jax
    import keras

    import keras_geosam as kg

    def message(fn):
        try:
            fn()
        except ValueError as e:
            return str(e)
        return None

    x, y = data(n=24)
    out = {}
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
    model = build(kg.optimizers.SAM(keras.optimizers.SGD(0.1)))
    out["batch"] = message(lambda: model.fit(x, y, batch_size=6, epochs=1, verbose=0))
    out["last_batch"] = message(lambda: model.fit(x[:22], y[:22], batch_size=8, epochs=1, verbose=0))
    out["per_replica"] = message(lambda: build(kg.optimizers.SAM(keras.optimizers.SGD(0.1), perturbation="per_replica")))
    mesh = keras.distribution.DeviceMesh((2, 2), ("batch", "model"), devices=jax.devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*dense_a/kernel"] = (None, "model")
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
    out["layout"] = message(lambda: build(width=5))
    return out


def main():
    mode, path = sys.argv[1], sys.argv[2]
    out = {"estimators": estimators_mode, "model_parallel": model_parallel_mode, "errors": errors_mode}[mode]()
    with open(path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)))
    main()
