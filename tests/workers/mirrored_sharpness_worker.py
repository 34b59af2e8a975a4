"""Subprocess worker: the estimators and SharpnessLogger under
tf.distribute.MirroredStrategy on two logical CPUs (configured before
TensorFlow initialises, hence a fresh process), against no strategy.
Writes JSON: the values both ways, and which replicas and devices computed
batch statistics."""

import json
import os
import sys

os.environ["KERAS_BACKEND"] = "tensorflow"
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)))
import keras_geosam as kg  # noqa: E402
from distributed_estimates import estimates  # noqa: E402
from keras_geosam import backend  # noqa: E402

rng = np.random.default_rng(0)
x = rng.normal(size=(30, 6)).astype("float32")
y = rng.integers(0, 3, size=30).astype("int32")
seen = set()
plain = backend.sum_over_replicas


def recording(model, fn, xb, yb, offset):
    def wrapped(xr, yr, off, share):
        ctx = tf.distribute.get_replica_context()
        seen.add((int(tf.get_static_value(ctx.replica_id_in_sync_group)), xr.device.split("/")[-1]))
        return fn(xr, yr, off, share)

    return plain(model, wrapped, xb, yb, offset)


backend.sum_over_replicas = recording


def build(strategy):
    with strategy.scope():
        model = kg.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
        w = np.random.default_rng(1)
        model.set_weights([0.5 * w.normal(size=v.shape).astype("float32") for v in model.weights])
        model.compile(optimizer=kg.optimizers.SAM(keras.optimizers.SGD(0.1), rho=0.2),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def logged(strategy):
    model = build(strategy)
    logger = kg.callbacks.SharpnessLogger(x, y, metrics=("hessian_trace", "riemannian_sharpness"), num_probes=6, rtol=None)
    history = model.fit(x[:24], y[:24], batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[logger])
    return {k: [float(v) for v in vals] for k, vals in history.history.items()}


one = tf.distribute.get_strategy()
two = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
result = {"single": estimates(build(one), x, y), "single_log": logged(one)}
seen.clear()
result["mirrored"] = estimates(build(two), x, y)
result["mirrored_seen"] = sorted(seen)
result["mirrored_log"] = logged(two)
with open(sys.argv[1], "w") as f:
    json.dump(result, f)
