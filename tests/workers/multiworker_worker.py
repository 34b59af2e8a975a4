"""Subprocess worker: SAM-family training under
tf.distribute.MultiWorkerMirroredStrategy (two local worker processes, one
CPU replica each) or, for the reference, in one process without a strategy.

    python multiworker_worker.py worker INDEX PORT0,PORT1 OUT.json
    python multiworker_worker.py single OUT.json

TF_CONFIG is built here from the ports: it must be set before TensorFlow
initialises, and the strategy created once, at the start of the program.
Both modes run the same code on the same data (global batch 32, no
shuffling, identical initial weights from a fixed NumPy RNG) and write to
OUT.json, per case, the final weights and the history, and per input path
the example indices of every batch this process fed its replica. The test
compares worker 0 (the chief) with the single-process run.

Input paths (each one `fit` under the strategy accepts):
- "arrays": NumPy arrays with batch_size=32; Keras batches them globally
  (AutoShardPolicy.DATA) and distributes the dataset, which splits each
  global batch into per-replica halves (rebatch, then shard).
- "dataset": a tf.data.Dataset of global batches, auto-sharded by the
  strategy (AUTO falls back to DATA for in-memory data).
- "fn": `distribute_datasets_from_function`, each worker reading its own
  shard (examples i, i+2, ...) in batches of the per-replica size 16.
"""

import json
import os
import sys

mode = sys.argv[1]
if mode == "worker":
    index, ports, out_path = int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4]
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"localhost:{p}" for p in ports]},
        "task": {"type": "worker", "index": index},
    })
elif mode == "single":
    index, out_path = 0, sys.argv[2]
    os.environ.pop("TF_CONFIG", None)
else:
    raise SystemExit(f"unknown mode {mode!r}")
os.environ["KERAS_BACKEND"] = "tensorflow"
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import tensorflow as tf  # noqa: E402

if mode == "worker":
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING
        )
    )
else:
    strategy = tf.distribute.get_strategy()

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter  # noqa: E402

import keras_geosam as kg  # noqa: E402

# Full tracebacks in the stderr tail the test shows on failure.
keras.config.disable_traceback_filtering()

N, BATCH, EPOCHS = 64, 32, 2
STEPS = N // BATCH
rng = np.random.default_rng(0)
x = rng.normal(size=(N, 6)).astype("float32")
y = rng.integers(0, 3, size=N).astype("int32")


def sam(p):
    return kg.optimizers.SAM(keras.optimizers.SGD(0.1), rho=0.5, perturbation=p)


def asam(p):
    return kg.optimizers.SAM(keras.optimizers.SGD(0.1), rho=0.5, adaptive=True, perturbation=p)


def fsam(p):
    return kg.optimizers.FSAM(keras.optimizers.SGD(0.1), rho=0.5, perturbation=p)


CASES = {
    # name: (optimizer factory, perturbation, input path)
    "SAM_global": (sam, "global", "arrays"),
    "SAM_per_replica": (sam, "per_replica", "arrays"),
    "FSAM_global": (fsam, "global", "arrays"),
    "ASAM_global": (asam, "global", "arrays"),
    "SAM_global_dataset": (sam, "global", "dataset"),
    "SAM_global_fn": (sam, "global", "fn"),
    "SAM_global_attached": (sam, "global", "attached"),
}


def global_batches(arrays):
    return tf.data.Dataset.from_tensor_slices(arrays).batch(BATCH)


def per_worker_batches(arrays):
    def fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices(arrays)
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        # Repeated: `fit` with steps_per_epoch keeps one iterator across epochs.
        return ds.repeat().batch(ctx.get_per_replica_batch_size(BATCH))

    return strategy.distribute_datasets_from_function(fn)


def run(make_opt, perturbation, source):
    with strategy.scope():
        # "attached": a plain keras.Sequential given the step by kg.attach.
        cls = keras.Sequential if source == "attached" else kg.Sequential
        model = cls([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
        if source == "attached":
            kg.attach(model)
        w = np.random.default_rng(1)
        model.set_weights([0.5 * w.normal(size=v.shape).astype("float32") for v in model.trainable_variables])
        model.compile(
            optimizer=make_opt(perturbation), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
    if source in ("arrays", "attached"):
        # Validation runs Keras' test step (evaluate) under the strategy too.
        history = model.fit(
            x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, validation_data=(x[:BATCH], y[:BATCH])
        )
    elif source == "dataset":
        history = model.fit(global_batches((x, y)), epochs=EPOCHS, verbose=0)
    else:
        history = model.fit(per_worker_batches((x, y)), epochs=EPOCHS, steps_per_epoch=STEPS, verbose=0)
    return {
        "weights": [v.tolist() for v in model.get_weights()],
        "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
    }


def batches_seen(source):
    """The example indices of each batch of one epoch this process feeds its
    replica, through the path `fit` takes for `source`."""
    ids = np.arange(N, dtype="int64")
    if source == "arrays":
        dataset = strategy.experimental_distribute_dataset(
            ArrayDataAdapter(ids, batch_size=BATCH, shuffle=False).get_tf_dataset()
        )
    elif source == "dataset":
        dataset = strategy.experimental_distribute_dataset(global_batches(ids))
    else:
        dataset = per_worker_batches(ids)
    seen, it = [], iter(dataset)
    for _ in range(STEPS):
        local = strategy.experimental_local_results(next(it))
        seen.append(sorted(int(i) for part in local for i in part.numpy()))
    return seen


out = {
    "mode": mode,
    "index": index,
    "replicas": int(strategy.num_replicas_in_sync),
    "batches": {source: batches_seen(source) for source in ("arrays", "dataset", "fn")},
    "cases": {name: run(*case) for name, case in CASES.items()},
}
with open(out_path, "w") as f:
    json.dump(out, f)
