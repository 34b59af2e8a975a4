"""tf.distribute.MultiWorkerMirroredStrategy: two local worker processes
(one CPU replica each, TF_CONFIG on localhost) train exactly what one
process trains on the same global batches with perturbation="global";
perturbation="per_replica" is a different algorithm and must differ.

The workers and the single-process reference are subprocesses of
``multiworker_worker.py`` (the strategy must be created at the start of a
fresh program), started together once for the module.
"""

import json
import os
import socket
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
from locations import worker_script

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="MultiWorkerMirroredStrategy is TensorFlow's"
)

WORKER = worker_script("multiworker_worker.py")
TIMEOUT = 300  # seconds for all three processes together (15-70 s on 2 shared cores)
GLOBAL = ("SAM_global", "FSAM_global", "ASAM_global", "SAM_global_dataset", "SAM_global_fn", "SAM_global_attached")


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("localhost", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _tail(path, n=4000):
    try:
        with open(path) as f:
            return f.read()[-n:]
    except OSError:
        return ""


def _launch(tmp):
    env = dict(os.environ, KERAS_BACKEND="tensorflow", CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    ports = ",".join(str(p) for p in _free_ports(2))
    jobs = {
        "worker0": ["worker", "0", ports],
        "worker1": ["worker", "1", ports],
        "single": ["single"],
    }
    procs, logs = {}, {}
    try:
        for name, args in jobs.items():
            logs[name] = tmp / f"{name}.stderr"
            with open(logs[name], "w") as err:
                procs[name] = subprocess.Popen(
                    [sys.executable, WORKER, *args, str(tmp / f"{name}.json")],
                    stdout=subprocess.DEVNULL, stderr=err, env=env,
                )
        # Until all exit, one fails (its peer would wait for it in a
        # collective) or the time is up; then the rest are killed.
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs.values()]
            if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.2)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    failed = {n: p.returncode for n, p in procs.items() if p.returncode != 0 or not (tmp / f"{n}.json").exists()}
    return failed, logs


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    # A port taken between choosing and binding it fails a worker's server
    # start: choose again once.
    for attempt in range(2):
        tmp = tmp_path_factory.mktemp(f"multiworker{attempt}")
        failed, logs = _launch(tmp)
        if not failed:
            break
        text = "".join(_tail(p) for p in logs.values())
        if "already in use" not in text.lower():
            break
    if failed:
        # The process that failed first, not those killed after it, on top.
        order = sorted(failed.items(), key=lambda item: item[1] == -9)
        report = "\n".join(f"--- {n} (exit {rc}; -9: killed by the test):\n{_tail(logs[n])}" for n, rc in order)
        pytest.fail(f"multi-worker processes failed:\n{report}")
    return {n: json.loads((tmp / f"{n}.json").read_text()) for n in ("worker0", "worker1", "single")}


def _max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(p) - np.asarray(q)))) for p, q in zip(a, b))


def test_each_global_batch_is_split_between_the_workers(results):
    w0, w1, one = results["worker0"], results["worker1"], results["single"]
    assert (w0["replicas"], w1["replicas"], one["replicas"]) == (2, 2, 1)
    for source in ("arrays", "dataset", "fn"):
        for k, full in enumerate(one["batches"][source]):
            a, b = w0["batches"][source][k], w1["batches"][source][k]
            # Per-replica halves of 16, disjoint, together the global batch.
            assert len(a) == len(b) == 16, (source, k, a, b)
            assert sorted(a + b) == full, (source, k, a, b, full)


def test_global_perturbation_equals_one_process(results):
    w0, w1, one = results["worker0"], results["worker1"], results["single"]
    diffs = {c: _max_diff(w0["cases"][c]["weights"], one["cases"][c]["weights"]) for c in GLOBAL}
    # The same 32 examples per step; only summation order differs.
    assert all(d < 1e-5 for d in diffs.values()), diffs
    for c in GLOBAL:
        # Mirrored variables: both workers hold identical weights.
        assert _max_diff(w0["cases"][c]["weights"], w1["cases"][c]["weights"]) == 0.0, c
        # Logs are averaged over the replicas: the global loss, gap and norm
        # (and validation loss, where the case validates). Not grad_cosine:
        # each replica computes it with its own, unreduced perturbed gradient.
        history = w0["cases"][c]["history"]
        for metric in ("loss", "sharpness_gap", "grad_norm", "val_loss"):
            if metric not in history and metric.startswith("val_"):
                continue
            got, want = history[metric], one["cases"][c]["history"][metric]
            np.testing.assert_allclose(got, want, atol=1e-5, err_msg=f"{c} {metric}")


def test_per_replica_perturbation_differs(results):
    w0, one = results["worker0"], results["single"]
    # Each replica perturbs with its own half-batch gradient ("m-sharpness").
    diff = _max_diff(w0["cases"]["SAM_per_replica"]["weights"], one["cases"]["SAM_per_replica"]["weights"])
    assert diff > 1e-3, diff
