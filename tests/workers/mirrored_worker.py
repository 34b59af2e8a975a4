"""Subprocess worker: SAM/F-SAM under tf.distribute.MirroredStrategy on two
logical CPUs (they must be configured before TensorFlow initialises, hence a
fresh process). Prints the max parameter difference to one device for
perturbation="global" and "per_replica"."""

import json
import os
import sys

os.environ["KERAS_BACKEND"] = "tensorflow"
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_geosam as kg  # noqa: E402

rng = np.random.default_rng(0)
x = rng.normal(size=(64, 6)).astype("float32")
y = rng.integers(0, 3, size=64).astype("int32")


def run(strategy, mode, cls):
    with strategy.scope():
        model = kg.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
        w = np.random.default_rng(1)
        model.set_weights([0.5 * w.normal(size=v.shape).astype("float32") for v in model.trainable_variables])
        opt = getattr(kg.optimizers, cls)(keras.optimizers.SGD(0.1), rho=0.5, perturbation=mode)
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    return model.get_weights()


out = {}
for cls in sys.argv[1:]:
    one = run(tf.distribute.get_strategy(), "global", cls)
    for mode in ("global", "per_replica"):
        two = run(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]), mode, cls)
        out[f"{cls}_{mode}"] = float(max(np.abs(a - b).max() for a, b in zip(one, two)))
print("RESULT " + json.dumps(out))
