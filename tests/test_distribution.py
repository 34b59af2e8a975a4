"""tf.distribute: the global perturbation equals one device; per-replica
perturbation ("m-sharpness") is a different algorithm and must differ."""

import json
import os
import subprocess
import sys

import keras
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="MirroredStrategy is TensorFlow's"
)


def test_mirrored_strategy_global_equals_one_device_and_per_replica_differs():
    worker = os.path.join(os.path.dirname(__file__), "mirrored_worker.py")
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
