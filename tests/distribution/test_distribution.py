"""tf.distribute: the global perturbation equals one device; per-replica
perturbation ("m-sharpness") is a different algorithm and must differ."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
from locations import worker_script

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="MirroredStrategy is TensorFlow's"
)


def test_mirrored_strategy_global_equals_one_device_and_per_replica_differs():
    worker = worker_script("mirrored_worker.py")
    env = dict(os.environ, KERAS_BACKEND="tensorflow")
    proc = subprocess.run([sys.executable, worker, "SAM", "FSAM"], capture_output=True, text=True, env=env, timeout=600)
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    diffs = json.loads(line[0][len("RESULT "):])
    for cls in ("SAM", "FSAM"):
        # Two replicas of 16 examples vs one of 32: only summation order differs.
        assert diffs[f"{cls}_global"] < 1e-6, diffs
        # Each replica perturbs with its own half-batch gradient.
        assert diffs[f"{cls}_per_replica"] > 1e-3, diffs


_UNEVEN = """
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, numpy as np, keras_geosam as kg
x = np.random.default_rng(0).normal(size=(66, 6)).astype("float32")
y = np.zeros(66, "int32")
with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
    model = kg.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer=kg.optimizers.SAM(keras.optimizers.SGD(0.1)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
before = [w.copy() for w in model.get_weights()]
for batch_size, n in ((33, 66), (32, 65)):
    try:
        model.fit(x[:n], y[:n], batch_size=batch_size, epochs=1, verbose=0)
        print("NO ERROR", batch_size, n)
    except ValueError as e:
        print("ERROR", e)
assert all((a == b).all() for a, b in zip(before, model.get_weights()))
model.fit(x[:64], y[:64], batch_size=32, epochs=1, verbose=0)
print("EVEN OK")
"""


def test_uneven_replica_batches_are_refused_before_a_step():
    """Replicas would get unequal shares (17/16) and the step's gradient
    would no longer be the batch mean: refused, naming the fix."""
    env = dict(os.environ, KERAS_BACKEND="tensorflow")
    proc = subprocess.run([sys.executable, "-c", _UNEVEN], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [l for l in proc.stdout.splitlines() if l.startswith(("ERROR", "NO ERROR", "EVEN"))]
    assert "batch_size=33" in lines[0] and "divisible by 2" in lines[0], lines
    assert "(65 % 32)" in lines[1] and "drop_remainder" in lines[1], lines
    assert lines[2] == "EVEN OK", lines


def test_estimators_and_sharpness_logger_use_every_replica(tmp_path):
    """Under MirroredStrategy each batch's curvature statistics are computed
    by both replicas on their own devices and summed: the estimators and
    SharpnessLogger inside a distributed fit equal one device."""
    worker = worker_script("mirrored_sharpness_worker.py")
    out = tmp_path / "result.json"
    env = dict(os.environ, KERAS_BACKEND="tensorflow")
    proc = subprocess.run([sys.executable, worker, str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["mirrored_seen"] == [[0, "device:CPU:0"], [1, "device:CPU:1"]]
    for name, value in r["single"].items():
        np.testing.assert_allclose(r["mirrored"][name], value, rtol=1e-5, atol=1e-7, err_msg=name)
    for key in ("hessian_trace", "hessian_trace_stderr", "riemannian_sharpness", "riemannian_sharpness_stderr", "loss", "sharpness_gap"):
        np.testing.assert_allclose(r["mirrored_log"][key], r["single_log"][key], rtol=1e-5, atol=1e-6, err_msg=key)
