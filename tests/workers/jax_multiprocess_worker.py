"""Subprocess worker: two-pass training under JAX multi-process data
parallelism (``jax.distributed`` over gloo, one CPU device per process) and
the same steps in one process, from identical weights and global batches.

    python tests/workers/jax_multiprocess_worker.py single OUT.npz
    python tests/workers/jax_multiprocess_worker.py worker PROCESS_ID PORT OUT_DIR

Each case trains 4 steps of global batch 16 on 64 fixed examples; in the
two-process run process p feeds the p-th half of every global batch (Keras
assembles the global batch with ``jax.make_array_from_process_local_data``).
The checkpoint case trains 2 steps, process 0 alone saves the whole model
(optimizer state and U included), every process loads it and trains 2 more.
A worker writes its weights (and the sharpness estimates) only from process 0.
"""

import json
import os
import sys

os.environ["KERAS_BACKEND"] = "jax"

import numpy as np  # noqa: E402

GLOBAL_BATCH = 16
PROCESSES = 2
CASES = {
    "SAM": ("SAM", {"rho": 0.3}),
    "ASAM": ("SAM", {"rho": 0.5, "adaptive": True}),
    "LLQRSAM_diagonal": ("LLQRSAM", {"rho": 0.3, "structure": "diagonal", "refresh_every": 2, "refresh_steps": 5}),
    "LLQRSAM_kfac": ("LLQRSAM", {"rho": 0.3, "structure": "kfac", "refresh_every": 2, "refresh_steps": 5}),
}


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = rng.integers(0, 3, size=64).astype("int32")
    return x, y


def local_part(a, process, processes):
    """Process `process`'s share of every global batch, in step order."""
    per = GLOBAL_BATCH // processes
    batches = a.reshape((-1, GLOBAL_BATCH) + a.shape[1:])
    return batches[:, process * per:(process + 1) * per].reshape((-1,) + a.shape[1:])


def build(case):
    import keras

    import keras_geosam as kg

    model = kg.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
    rng = np.random.default_rng(1)
    model.set_weights([0.5 * rng.normal(size=v.shape).astype("float32") for v in model.weights])
    cls, kwargs = CASES[case]
    opt = getattr(kg.optimizers, cls)(keras.optimizers.SGD(0.1, momentum=0.9), **kwargs)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def flat(model):
    import keras

    values = [v.value for v in model.weights + model.optimizer.variables]
    return np.concatenate([np.ravel(keras.ops.convert_to_numpy(v)).astype("float64") for v in values])


def sharpness(model, x, y):
    import keras_geosam as kg

    out = {}
    est = kg.sharpness.hessian_trace(model, x, y, num_probes=4, rtol=None, seed=3)
    out["hessian_trace"] = [est.value, est.stderr]
    est = kg.sharpness.riemannian_sharpness(model, x, y, structure="kfac", num_probes=4, rtol=None, seed=3)
    out["riemannian_sharpness"] = [est.value, est.stderr]
    diag = kg.sharpness.fisher_diagonal(model, x, y)
    out["fisher_diagonal"] = np.concatenate([np.ravel(np.asarray(d, "float64")) for d in diag]).tolist()
    return out


def run_all(x_feed, y_feed, batch, save_dir):
    """Every case's final state; the checkpoint case saves after 2 steps."""
    import keras

    import keras_geosam as kg

    results = {}
    for case in CASES:
        model = build(case)
        model.fit(x_feed, y_feed, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        results[case] = flat(model)
    # Checkpoint: 2 steps, save from one process, everyone reloads, 2 more.
    half = len(x_feed) // 2
    model = build("LLQRSAM_kfac")
    model.fit(x_feed[:half], y_feed[:half], batch_size=batch, epochs=1, shuffle=False, verbose=0)
    path = os.path.join(save_dir, "checkpoint.keras")
    kg.distribution.save_model(model, path)
    model = keras.saving.load_model(path)
    model.fit(x_feed[half:], y_feed[half:], batch_size=batch, epochs=1, shuffle=False, verbose=0)
    results["checkpoint"] = flat(model)
    results["uninterrupted"] = results["LLQRSAM_kfac"]
    return results, model


def main():
    mode = sys.argv[1]
    x, y = data()
    if mode == "single":
        out = sys.argv[2]
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            results, model = run_all(x, y, GLOBAL_BATCH, d)
        est = sharpness(model, x, y)
        np.savez(out, sharpness=json.dumps(est), **results)
        return
    process, port, out_dir = int(sys.argv[2]), sys.argv[3], sys.argv[4]
    import jax

    # CPU collectives across processes; jax's default on CPU is none.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    import keras
    from jax.experimental import multihost_utils

    keras.distribution.initialize(f"localhost:{port}", num_processes=PROCESSES, process_id=process)
    devices = keras.distribution.list_devices()
    assert len(devices) == PROCESSES and jax.local_device_count() == 1, devices
    distribution = keras.distribution.DataParallel(devices=devices)
    distribution.auto_shard_dataset = False  # each process feeds its own half
    keras.distribution.set_distribution(distribution)
    results, model = run_all(local_part(x, process, PROCESSES), local_part(y, process, PROCESSES), GLOBAL_BATCH // PROCESSES, out_dir)
    # The estimators take the same global data on every process and split
    # each streamed batch over all devices.
    est = sharpness(model, x, y)
    if process == 0:
        np.savez(os.path.join(out_dir, "multi.npz"), sharpness=json.dumps(est), **results)
    multihost_utils.sync_global_devices("done")


if __name__ == "__main__":
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)))
    main()
