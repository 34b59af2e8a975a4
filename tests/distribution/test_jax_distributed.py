"""JAX beyond one device: multi-process data parallelism (two processes
over gloo), model parallelism on virtual CPU devices, data-parallel
estimators. Each configuration runs in fresh processes (device counts and
``jax.distributed`` are fixed at start-up) and is compared with one process
on one device from identical weights and global batches."""

import json
import os
import socket
import subprocess
import sys

import keras
import numpy as np
import pytest
from locations import worker_script

pytestmark = pytest.mark.skipif(keras.backend.backend() != "jax", reason="keras.distribution with jax.distributed is JAX's")

TOL = 1e-5


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env(**extra):
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    env.pop("XLA_FLAGS", None)
    env.update(extra)
    return env


def _run(args, env, timeout=600):
    proc = subprocess.run([sys.executable] + args, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_two_processes_equal_one_process(tmp_path):
    """SAM, ASAM, LLQR+SAM (diagonal, K-FAC, refreshes included) over two
    processes equal one process; a checkpoint saved by process 0 and loaded
    by both resumes exactly; the estimators return the one-process values."""
    worker = worker_script("jax_multiprocess_worker.py")
    single = tmp_path / "single.npz"
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, worker, "worker", str(i), port, str(tmp_path)],
            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(2)
    ]
    try:
        _run([worker, "single", str(single)], _env())
        errors = []
        for p in procs:
            _, err = p.communicate(timeout=600)
            if p.returncode != 0:
                errors.append(err[-4000:])
        assert not errors, "\n---\n".join(errors)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    one, two = np.load(single), np.load(tmp_path / "multi.npz")
    for case in ("SAM", "ASAM", "LLQRSAM_diagonal", "LLQRSAM_kfac", "checkpoint"):
        # Weights and every optimizer variable (slots, U, refresh count).
        np.testing.assert_allclose(two[case], one[case], rtol=TOL, atol=TOL, err_msg=case)
    # Resuming from the checkpoint loses nothing: equal to never stopping.
    np.testing.assert_allclose(two["checkpoint"], two["uninterrupted"], rtol=TOL, atol=TOL)
    est_one, est_two = json.loads(str(one["sharpness"])), json.loads(str(two["sharpness"]))
    for name in ("hessian_trace", "riemannian_sharpness"):
        np.testing.assert_allclose(est_two[name], est_one[name], rtol=TOL, err_msg=name)
    np.testing.assert_allclose(est_two["fisher_diagonal"], est_one["fisher_diagonal"], rtol=TOL, atol=1e-7)


def _sharded(mode, tmp_path):
    out = tmp_path / f"{mode}.json"
    worker = worker_script("jax_sharded_worker.py")
    _run([worker, mode, str(out)], _env(XLA_FLAGS="--xla_force_host_platform_device_count=4"))
    with open(out) as f:
        return json.load(f)


def test_estimators_split_batches_over_devices_and_match_one_device(tmp_path):
    r = _sharded("estimators", tmp_path)
    # A batch of 12 is split 3 per device; the last batch of 6 cannot split
    # over 4 devices and is replicated instead.
    assert r["split_devices"] == 4 and not r["split_replicated"] and r["split_shard_rows"] == 3
    assert r["rest_replicated"]
    for name, value in r["single"].items():
        np.testing.assert_allclose(r["parallel"][name], value, rtol=TOL, atol=1e-7, err_msg=name)
    # SharpnessLogger inside a data-parallel fit logs what one device logs.
    assert set(r["parallel_log"]) == set(r["single_log"])
    assert "riemannian_sharpness_stderr" in r["parallel_log"]
    for key, values in r["single_log"].items():
        np.testing.assert_allclose(r["parallel_log"][key], values, rtol=TOL, atol=1e-6, err_msg=key)


def test_model_parallel_equals_unsharded_and_lays_out_U(tmp_path):
    r = _sharded("model_parallel", tmp_path)
    for name in ("SAM", "LLQRSAM_diagonal", "LLQRSAM_kfac"):
        # Weights, slots and U after 4 steps (2 refreshes); equal gradient
        # norms mean the perturbation is normalised by the global norm.
        np.testing.assert_allclose(r["sharded"][name], r["single"][name], rtol=TOL, atol=TOL, err_msg=name)
        np.testing.assert_allclose(r["sharded"][name + "_grad_norm"], r["single"][name + "_grad_norm"], rtol=TOL)
        assert r["sharded"][name + "_kernels"] == [["None", "model"], ["model", "None"]], r["sharded"][name + "_kernels"]
    # A diagonal block follows its weight's layout; K-FAC factors and the
    # bias blocks are replicated.
    assert r["sharded"]["LLQRSAM_diagonal_U"] == {
        "U0_d": ["None", "model"], "U1_d": ["None"], "U2_d": ["model", "None"], "U3_d": ["None"],
    }
    assert all(all(a == "None" for a in spec) for spec in r["sharded"]["LLQRSAM_kfac_U"].values())


def test_bad_configurations_name_the_fix(tmp_path):
    r = _sharded("errors", tmp_path)
    assert "batch_size=6" in r["batch"] and "divisible by 4" in r["batch"], r["batch"]
    assert "22 % 8" in r["last_batch"] and "drop_remainder" in r["last_batch"], r["last_batch"]
    assert 'perturbation="global"' in r["per_replica"], r["per_replica"]
    assert "'.*dense_a/kernel'" in r["layout"] and "(6, 5)" in r["layout"] and "LayoutMap" in r["layout"], r["layout"]
