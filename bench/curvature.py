#!/usr/bin/env python
#!/usr/bin/env python
"""Benchmark of keras_geosam's curvature operators and sharpness estimators.

One backend per process (Keras cannot switch backends inside a process):

    KERAS_BACKEND=jax python bench/curvature.py [--quick] [--json out.json] [--threads N]
    python bench/curvature.py --all [--quick] [--json out.json] [--threads N]

``--all`` runs this script once per backend (jax, tensorflow, torch) in a
subprocess and prints one combined Markdown table (progress and each
backend's own table go to stderr). ``--quick`` (fewer repeats and probes, one
compute thread unless ``--threads`` says otherwise) is a smoke run.

Measured on (a) an MLP 784-512-512-10 (ReLU, logits, sparse CE) and (b) a
small CNN (28x28x1, Conv 16 3x3 relu, MaxPool, Conv 32 3x3 relu, MaxPool,
Flatten, Dense 10), both on 256 random examples, and (c) the bench
Transformer of ``sam_step.py`` (4 post-LN blocks, d=128, 4 heads, gelu,
sequence 64, vocabulary 512, one label per sequence) on 32 random
sequences, every time warm (after a call that compiles), as ratios to one
batch gradient or HVP measured in the same process, interleaved:

- kernels: one gradient, one Hessian-vector product and one GGN-vector
  product (the operators' batched kernels with k = 1);
- exact ``fisher_diagonal`` / gradient (goal <= 25);
- one Hutchinson probe / one HVP: ``hessian_trace(split=False,
  num_probes=20, rtol=None)`` / 20 (goal <= 1.5);
- default ``riemannian_sharpness`` (diagonal and K-FAC) and default
  ``hessian_trace`` / gradient (goal for K-FAC S_R <= 40);
- peak resident memory during ``fisher_diagonal`` on the MLP, over the
  parameters' bytes and over 4 x parameters + one batch of activations
  (goal <= 1);
- torch only: our ``hessian_trace`` with 20 probes / PyHessian's (goal
  <= 0.8), same model, batch and probe count, with an exact reference trace.
"""

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings

from _backends import run_each_backend  # noqa: E402  (bench/ is the script's own folder)
BATCH = 256
TRANSFORMER_BATCH = 32  # sequences of 64 tokens: 2048 tokens, as sam_step.py's attention rows
# Goals (issue "trustworthy sharpness"): ratio -> bound, per model.
GOALS = {
    "fisher_diag_over_grad": {"mlp": 25.0, "cnn": 25.0},
    "probe_over_hvp": {"mlp": 1.5, "cnn": 1.5},
    "sr_kfac_over_grad": {"mlp": 40.0, "cnn": 40.0},
    "hvp_over_grad": {"mlp": 2.0, "cnn": 3.0},
    "fisher_memory_over_budget": {"mlp": 1.0},
}


def settings(quick):
    if quick:
        return dict(repeats=3, probes=20, pyh_pairs=1, estimator_repeats=1)
    return dict(repeats=15, probes=20, pyh_pairs=5, estimator_repeats=3)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------- models ---
def build_models(keras):
    keras.utils.set_random_seed(0)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    mlp = keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(10),
        ],
        name="mlp",
    )
    cnn = keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(10),
        ],
        name="cnn",
    )
    import sam_step  # the same Transformer as the step bench

    transformer = keras.Model(*sam_step.attention_graph(keras, "transformer"), name="transformer")
    for m in (mlp, cnn, transformer):
        m.compile(loss=loss)
    return {"mlp": mlp, "cnn": cnn, "transformer": transformer}


def batch_of(model_name):
    return TRANSFORMER_BATCH if model_name == "transformer" else BATCH


def make_data(np, model_name):
    if model_name == "transformer":
        import sam_step

        return sam_step.make_data(np, "transformer", TRANSFORMER_BATCH)
    rng = np.random.default_rng(1 if model_name == "mlp" else 2)
    shape = (BATCH, 784) if model_name == "mlp" else (BATCH, 28, 28, 1)
    x = rng.standard_normal(shape).astype("float32")
    y = rng.integers(0, 10, size=BATCH).astype("int32")
    return x, y


# --------------------------------------------------------------- timing ---
def make_sync(backend_name):
    if backend_name == "jax":
        import jax

        return jax.block_until_ready
    if backend_name == "tensorflow":
        import tensorflow as tf

        def sync(out):
            # tf.function returns concrete tensors; reading the smallest one
            # on the host guarantees the call has finished on any device.
            flat = tf.nest.flatten(out)
            min(flat, key=lambda t: int(tf.size(t))).numpy()
            return out

        return sync
    import torch

    def sync(out):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return out

    return sync


def time_kernels(r, calls, sync, repeats):
    """Times each of `calls` (name -> fn): first call (compilation) alone, then
    `repeats` rounds calling every kernel once in turn, so that load from
    other processes hits all kernels alike. Records in `r`: <name>_first_s,
    <name>_s (median wall), <name>_min_s, <name>_cpu_s (median process CPU
    time, all threads)."""
    live = {}
    for key, fn in calls.items():
        t0 = time.perf_counter()
        try:
            sync(fn())
        except Exception as e:
            r.setdefault("errors", {})[key] = " ".join(f"{type(e).__name__}: {e}".split())[:300]
            log(f"    {key} FAILED: {r['errors'][key]}")
            continue
        r[key + "_first_s"] = time.perf_counter() - t0
        sync(fn())  # second warm-up
        live[key] = fn
    wall = {k: [] for k in live}
    cpu = {k: [] for k in live}
    for _ in range(repeats):
        for key, fn in live.items():
            c0, t0 = time.process_time(), time.perf_counter()
            sync(fn())
            wall[key].append(time.perf_counter() - t0)
            cpu[key].append(time.process_time() - c0)
    for key in live:
        r[key + "_s"] = statistics.median(wall[key])
        r[key + "_min_s"] = min(wall[key])
        r[key + "_cpu_s"] = statistics.median(cpu[key])


def attempt(r, key, fn):
    """Runs fn(); on failure records the error under r["errors"][key]."""
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as e:  # a failing estimator must not hide the others
        msg = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        r.setdefault("errors", {})[key] = msg
        log(f"    FAILED after {time.perf_counter() - t0:.1f} s: {msg}")
    else:
        log(f"    {time.perf_counter() - t0:.1f} s")


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


# ---------------------------------------------------------- one backend ---
def limit_threads(n):
    """Before any backend import: at most `n` compute threads per process.

    Torch's OpenMP pool and TF's / XLA's thread pools spin at barriers; on a
    machine loaded by other processes a 2-thread pool on 2 cores can run 10x
    slower than 1 thread (seen here for torch). JAX only knows on/off: n == 1
    turns XLA's multi-threaded Eigen off, n > 1 leaves it alone.
    """
    os.environ["OMP_NUM_THREADS"] = str(n)
    os.environ["MKL_NUM_THREADS"] = str(n)
    if n == 1:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = (flags + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1").strip()


def apply_threads(b, n):
    if b == "torch":
        import torch

        torch.set_num_threads(n)
        torch.set_num_interop_threads(1)
    elif b == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(n)
        tf.config.threading.set_inter_op_parallelism_threads(1)


def peak_rss_during(fn):
    """``(fn(), peak resident bytes above the level just before)``, sampled
    every millisecond from /proc/self/statm by a background thread."""
    import threading

    page = os.sysconf("SC_PAGE_SIZE")

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    base, peak, done = rss(), [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.001)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        out = fn()
    finally:
        done.set()
        t.join()
    return out, max(peak[0], rss()) - base


# glibc keeps freed heap memory for reuse, which hides a warm call's peak;
# with these settings every block of 64 KiB or more is an mmap, returned to
# the system on free, so the resident size follows the live buffers.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0", "MALLOC_TOP_PAD_": "0"}


def memory_child(b, threads):
    """Peak resident bytes of a warm exact fisher_diagonal on the MLP, in a
    fresh process (so nothing else's buffers are counted)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--memory-child"] + (["--threads", str(threads)] if threads else [])
    env = dict(os.environ, KERAS_BACKEND=b, TF_CPP_MIN_LOG_LEVEL="2", **MALLOC_ENV)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-500:])
    return int(out.stdout.strip().splitlines()[-1])


def run_memory_child(args):
    if args.threads:
        limit_threads(args.threads)
    import keras
    import numpy as np

    import keras_geosam as kg

    model = build_models(keras)["mlp"]
    x, y = make_data(np, "mlp")
    fn = lambda: kg.sharpness.fisher_diagonal(model, x, y, kind="exact", batch_size=BATCH)
    fn(), fn()
    _, peak = peak_rss_during(fn)
    print(peak)
    return 0


def median_time(fn, repeats, sync=lambda out: out):
    times = []
    out = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = sync(fn())
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times)


def run_backend(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.threads:
        limit_threads(args.threads)
    import keras
    import numpy as np
    from keras import ops

    import keras_geosam as kg
    from keras_geosam.curvature import model_functions

    warnings.filterwarnings("ignore", message=".*piecewise linear.*")
    S = kg.sharpness
    b = keras.backend.backend()
    if args.threads:
        apply_threads(b, args.threads)
    cfg = settings(args.quick)
    cfg["threads"] = args.threads or "default"
    sync = make_sync(b)
    models = build_models(keras)
    result = {"backend": b, "quick": args.quick, "settings": cfg, "env": environment(b), "models": {}}
    result["loadavg_start"] = os.getloadavg()
    t_start = time.perf_counter()
    R = cfg["estimator_repeats"]

    for name, model in models.items():
        if args.models and name not in args.models.split(","):
            continue
        x_np, y_np = make_data(np, name)
        x, y = ops.convert_to_tensor(x_np), ops.convert_to_tensor(y_np)
        fns = model_functions(model)
        params, nt = fns.params(), fns.non_trainable()
        vrng = np.random.default_rng(3)
        vectors = [ops.convert_to_tensor(vrng.standard_normal((1,) + tuple(v.shape)).astype("float32")) for v in fns.variables]
        key, offset = kg.curvature.probes.key(0, "labels"), ops.convert_to_tensor(0, "int32")
        k_grad, k_hvp = fns.kernel(fns.loss_and_grad_body), fns.kernel(fns.hvp_batched_body)
        k_ggn = fns.kernel(fns.ggn_batched_body, kind="exact", num_samples=1)
        r = {"num_params": int(sum(math.prod(v.shape) for v in fns.variables))}
        calls = {
            "grad": lambda: k_grad(params, nt, x, y),
            "hvp": lambda: k_hvp(params, nt, vectors, x, y),
            "ggnvp": lambda: k_ggn(params, nt, vectors, x, None, key, offset),
        }
        log(f"[{b}] {name}: grad / hvp / ggnvp kernels")
        attempt(r, "kernels", lambda: time_kernels(r, calls, sync, cfg["repeats"]))
        if "grad_s" in r:
            for k, ratio in (("hvp", "hvp_over_grad"), ("ggnvp", "ggn_over_grad")):
                if k + "_s" in r:
                    r[ratio] = r[k + "_s"] / r["grad_s"]
        P = cfg["probes"]

        def estimators():
            def fisher():
                return S.fisher_diagonal(model, x_np, y_np, kind="exact", batch_size=batch_of(name))

            fisher()  # compiles
            D, r["fisher_diag_s"] = median_time(fisher, R)
            r["trace_ggn_exact"] = float(sum(float(d.sum()) for d in D))
            unsplit = lambda: S.hessian_trace(model, x_np, y_np, num_probes=P, rtol=None, split=False, batch_size=batch_of(name))
            unsplit()
            est, dt = median_time(unsplit, R)
            r["probe_s"], r["trace_unsplit"], r["trace_unsplit_stderr"] = dt / P, est.value, est.stderr
            for metric in ("diagonal", "kfac"):
                fn = lambda structure=metric: S.riemannian_sharpness(model, x_np, y_np, structure=metric, batch_size=batch_of(name))
                fn()
                est, r[f"sr_{metric}_s"] = median_time(fn, R)
                r[f"sr_{metric}"], r[f"sr_{metric}_stderr"], r[f"sr_{metric}_probes"] = est.value, est.stderr, est.num_samples
            fn = lambda: S.hessian_trace(model, x_np, y_np, batch_size=batch_of(name))
            fn()
            est, r["trace_default_s"] = median_time(fn, R)
            r["trace_default"], r["trace_default_stderr"] = est.value, est.stderr
            # the gradient again, interleaved with the estimators, for the ratios
            _, r["grad_again_s"] = median_time(calls["grad"], cfg["repeats"], sync)
            grad_s = min(r.get("grad_s", math.inf), r["grad_again_s"])
            r["fisher_diag_over_grad"] = r["fisher_diag_s"] / grad_s
            r["sr_diagonal_over_grad"] = r["sr_diagonal_s"] / grad_s
            r["sr_kfac_over_grad"] = r["sr_kfac_s"] / grad_s
            r["trace_default_over_grad"] = r["trace_default_s"] / grad_s
            if "hvp_s" in r:
                r["probe_over_hvp"] = r["probe_s"] / r["hvp_s"]

        log(f"[{b}] {name}: fisher_diagonal, Hutchinson, default S_R and tr H")
        attempt(r, "estimators", estimators)

        if name == "mlp":
            def memory():
                peak = memory_child(b, args.threads)
                param_bytes = 4 * r["num_params"]
                act_bytes = 4 * BATCH * (784 + 512 + 512 + 10)
                r["fisher_peak_bytes"] = peak
                r["fisher_memory_over_params"] = peak / param_bytes
                r["fisher_memory_over_budget"] = peak / (4 * param_bytes + act_bytes)

            log(f"[{b}] {name}: fisher_diagonal peak memory")
            attempt(r, "memory", memory)

        if b == "torch" and name == "mlp":

            def pyh():
                r["pyhessian"] = pyhessian_compare(model, x_np, y_np, cfg)

            attempt(r, "pyhessian", pyh)
        result["models"][name] = r
    result["loadavg_end"] = os.getloadavg()
    result["wall_s"] = time.perf_counter() - t_start
    return result


def environment(b):
    import keras
    import numpy as np

    env = {"keras": keras.__version__, "numpy": np.__version__, "python": platform.python_version()}
    if b == "jax":
        import jax

        env["jax"] = jax.__version__
        env["device"] = str(jax.devices()[0].platform)
    elif b == "tensorflow":
        import tensorflow as tf

        env["tensorflow"] = tf.__version__
        env["device"] = "gpu" if tf.config.list_logical_devices("GPU") else "cpu"
    else:
        import torch

        env["torch"] = torch.__version__
        env["torch_threads"] = torch.get_num_threads()
        env["device"] = "cpu"  # the Keras torch backend here places tensors on CPU
    return env


# ------------------------------------------------------------ PyHessian ---
def torch_mlp_from_keras(model):
    import torch

    from keras import ops

    dense = [l for l in model.layers if l.__class__.__name__ == "Dense"]
    mods = []
    for i, layer in enumerate(dense):
        k = ops.convert_to_numpy(layer.kernel)
        lin = torch.nn.Linear(k.shape[0], k.shape[1])
        with torch.no_grad():
            lin.weight.copy_(torch.as_tensor(k.T))  # Keras kernel is (in, out)
            lin.bias.copy_(torch.as_tensor(ops.convert_to_numpy(layer.bias)))
        mods.append(lin)
        if i < len(dense) - 1:
            mods.append(torch.nn.ReLU())
    return torch.nn.Sequential(*mods)


def exact_trace_torch(tm, x, y):
    """tr H of the mean CE loss, exactly (float64), for a ReLU MLP.

    Each logit is linear in every single parameter (ReLU), so the output
    Hessians have a zero diagonal and diag H = diag GGN = diag F_exact:
    tr H = 1/N sum_n sum_k p_nk ||grad_theta log p_nk(x_n)||^2.
    A Linear layer's per-example gradient is delta_n a_n^T (bias: delta_n),
    so its squared norm is (||a_n||^2 + 1) ||delta_n||^2, with delta_n the
    gradient with respect to the layer's output: C = 10 batched backward
    passes, independent of keras_geosam and of PyHessian. `y` is unused
    (the Fisher does not depend on the labels).
    """
    import copy

    import torch

    m = copy.deepcopy(tm).double()
    acts, outs = [], []
    with torch.enable_grad():
        h = x.double()
        for mod in m:
            if isinstance(mod, torch.nn.Linear):
                acts.append(h.detach())
                h = mod(h)
                outs.append(h)
            else:
                h = mod(h)
        logp = torch.log_softmax(h, -1)
        p = logp.exp().detach()
        total = torch.zeros((), dtype=torch.float64)
        for k in range(logp.shape[-1]):
            deltas = torch.autograd.grad(logp[:, k].sum(), outs, retain_graph=True)
            sq = sum((a.pow(2).sum(1) + 1.0) * d.pow(2).sum(1) for a, d in zip(acts, deltas))
            total = total + (p[:, k] * sq).sum()
    return float(total / x.shape[0])


def pyhessian_compare(model, x_np, y_np, cfg):
    import numpy as np
    import torch
    from pyhessian import hessian

    import keras_geosam as kg
    import keras_geosam.sharpness  # noqa: F401

    P = cfg["probes"]
    log(f"[torch] mlp: PyHessian vs hessian_trace ({P} probes, {cfg['pyh_pairs']} pairs)")
    tm = torch_mlp_from_keras(model)
    x, y = torch.as_tensor(x_np), torch.as_tensor(y_np).long()
    with torch.no_grad():
        diff = float((tm(x) - torch.as_tensor(np.asarray(model(x_np)))).abs().max())
    crit = torch.nn.CrossEntropyLoss()
    # PyHessian's constructor uses backward(create_graph=True); torch warns
    # about the parameter <-> .grad reference cycle (we reset .grad below).
    warnings.filterwarnings("ignore", message="Using backward\\(\\) with create_graph=True")

    def run_pyh(n):
        # PyHessian's constructor calls loss.backward(create_graph=True),
        # which ACCUMULATES into .grad: clear it, or a second construction
        # differentiates old+new gradients (2x the Hessian).
        for p in tm.parameters():
            p.grad = None
        t0 = time.perf_counter()
        h = hessian(tm, crit, data=(x, y), cuda=False)
        t1 = time.perf_counter()
        # tol=-inf: its stopping test `|mean - prev| / (prev + 1e-6) < tol`
        # never fires, so exactly maxIter probes run (tol=0 would stop early
        # once the running mean is negative).
        vals = h.trace(maxIter=n, tol=float("-inf"))
        t2 = time.perf_counter()
        assert len(vals) == n, (len(vals), n)
        return np.array(vals), t2 - t0, t1 - t0

    torch.manual_seed(0)
    run_pyh(2)  # warm-up
    ours = lambda: kg.sharpness.hessian_trace(model, x_np, y_np, num_probes=P, rtol=None, split=False, batch_size=BATCH)
    default = lambda: kg.sharpness.hessian_trace(model, x_np, y_np, batch_size=BATCH)
    ours(), default()
    ours_t, pyh_t, pyh_setup, default_t = [], [], [], []
    for _ in range(cfg["pyh_pairs"]):
        est, dt = timed(ours)
        ours_t.append(dt)
        default_t.append(timed(default)[1])
        vals, total, setup = run_pyh(P)
        pyh_t.append(total)
        pyh_setup.append(setup)
    pyh_val = float(vals.mean())
    pyh_se = float(vals.std(ddof=1) / math.sqrt(P))
    out = {
        "probes": P,
        "torch_vs_keras_max_abs_logit_diff": diff,
        "ours_s": statistics.median(ours_t),
        "pyhessian_s": statistics.median(pyh_t),
        "pyhessian_setup_s": statistics.median(pyh_setup),
        "ours_trace": est.value,
        "ours_stderr": est.stderr,
        "pyhessian_trace": pyh_val,
        "pyhessian_stderr": pyh_se,
    }
    out["ratio_ours_over_pyhessian"] = out["ours_s"] / out["pyhessian_s"]
    out["default_s"] = statistics.median(default_t)
    out["ratio_default_over_pyhessian"] = out["default_s"] / out["pyhessian_s"]
    log("[torch] mlp: exact reference trace")
    (ref, out["exact_s"]) = timed(lambda: exact_trace_torch(tm, x, y))
    out["exact_trace"] = ref
    out["z_ours_vs_pyhessian"] = (est.value - pyh_val) / math.hypot(est.stderr, pyh_se)
    out["z_ours_vs_exact"] = (est.value - ref) / est.stderr
    out["z_pyhessian_vs_exact"] = (pyh_val - ref) / pyh_se
    return out


# ------------------------------------------------------------- reports ---
def fmt(r, key, spec, scale=1.0):
    v = r.get(key)
    return "ERR" if v is None else format(v * scale, spec)


def pm(r, key, skey):
    return "ERR" if r.get(key) is None else f"{r[key]:.4g} ± {r[skey]:.2g}"


def markdown(results):
    lines = [
        "| backend | model | grad ms | HVP/grad | GGN/grad | probe/HVP | fisher_diag/grad | S_R diag/grad | S_R K-FAC/grad | tr H/grad | fisher_diag peak / budget |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for res in results:
        for name, r in res["models"].items():
            lines.append(
                f"| {res['backend']} | {name} | {fmt(r, 'grad_s', '.2f', 1e3)} | {fmt(r, 'hvp_over_grad', '.2f')} | "
                f"{fmt(r, 'ggn_over_grad', '.2f')} | {fmt(r, 'probe_over_hvp', '.2f')} | {fmt(r, 'fisher_diag_over_grad', '.1f')} | "
                f"{fmt(r, 'sr_diagonal_over_grad', '.1f')} | {fmt(r, 'sr_kfac_over_grad', '.1f')} | {fmt(r, 'trace_default_over_grad', '.1f')} | "
                f"{fmt(r, 'fisher_memory_over_budget', '.2f') if name == 'mlp' else '-'} |"
            )
    cfg = results[0]["settings"]
    lines.append("")
    lines.append(
        f"Batch {BATCH} (transformer: {TRANSFORMER_BATCH} sequences of 64 tokens), warm calls. Kernels: median of {cfg['repeats']} interleaved calls. Estimators: median of "
        f"{cfg['estimator_repeats']} (defaults: rtol 0.05, relative damping 1e-3). probe/HVP: hessian_trace(split=False, "
        f"{cfg['probes']} probes) per probe over one HVP. Memory budget: 4 x parameter bytes + one batch of activations. "
        f"Compute threads: {cfg.get('threads', 'default')}. ERR: failed (see Errors)."
    )
    loads = ", ".join(
        f"{res['backend']} {res['loadavg_start'][0]:.1f} -> {res['loadavg_end'][0]:.1f} ({res['wall_s']:.0f} s)" for res in results if "loadavg_start" in res
    )
    lines.append(f"1-min load average during each backend's run (2 cores = load 2.0 saturates): {loads}.")
    lines.append("")
    lines.append("Values (every estimate with its standard error; exact parts have none):")
    lines.append("")
    lines.append("| backend | model | params | tr H (20 probes, unsplit) | tr H default | tr GGN exact | S_R diag | S_R K-FAC (probes) | fisher_diag peak MB |")
    lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for res in results:
        for name, r in res["models"].items():
            mem = r.get("fisher_peak_bytes")
            lines.append(
                f"| {res['backend']} | {name} | {r['num_params']} | {pm(r, 'trace_unsplit', 'trace_unsplit_stderr')} | "
                f"{pm(r, 'trace_default', 'trace_default_stderr')} | {fmt(r, 'trace_ggn_exact', '.4g')} | "
                f"{pm(r, 'sr_diagonal', 'sr_diagonal_stderr')} | {pm(r, 'sr_kfac', 'sr_kfac_stderr')} ({r.get('sr_kfac_probes', '?')}) | "
                f"{'-' if mem is None else format(mem / 2**20, '.1f')} |"
            )
    errors = [(res["backend"], name, k, e) for res in results for name, r in res["models"].items() for k, e in r.get("errors", {}).items()]
    if errors:
        lines.append("")
        lines.append("Errors:")
        lines.append("")
        for b, name, k, e in errors:
            lines.append(f"- {b} {name} {k}: {e}")
    for res in results:
        p = res["models"].get("mlp", {}).get("pyhessian")
        if p:
            lines.append("")
            lines.append(f"PyHessian comparison (torch, MLP, batch {BATCH}, {p['probes']} Rademacher probes each, median of {res['settings']['pyh_pairs']}):")
            lines.append("")
            lines.append(
                f"- time: keras_geosam hessian_trace(split=False) {p['ours_s']:.3f} s, PyHessian {p['pyhessian_s']:.3f} s "
                f"(of which constructor {p['pyhessian_setup_s']:.3f} s) -> ours/PyHessian = {p['ratio_ours_over_pyhessian']:.2f}; "
                f"default hessian_trace (exact here) {p['default_s']:.3f} s -> {p['ratio_default_over_pyhessian']:.2f}"
            )
            lines.append(
                f"- trace: ours {p['ours_trace']:.4f} ± {p['ours_stderr']:.4f}, PyHessian {p['pyhessian_trace']:.4f} ± {p['pyhessian_stderr']:.4f} "
                f"(z = {p['z_ours_vs_pyhessian']:.2f}); exact {p['exact_trace']:.4f} "
                f"(z ours = {p['z_ours_vs_exact']:.2f}, z PyHessian = {p['z_pyhessian_vs_exact']:.2f}; computed in {p['exact_s']:.1f} s)"
            )
            lines.append(f"- torch MLP vs Keras MLP: max |logit difference| = {p['torch_vs_keras_max_abs_logit_diff']:.2e}")
    lines.append("")
    lines.append("Goals:")
    lines.append("")
    for res in results:
        b = res["backend"]
        for name, r in res["models"].items():
            for key, bounds in GOALS.items():
                if name not in bounds:
                    continue
                v = r.get(key)
                status = "not measured (error)" if v is None else f"{v:.2f} (goal <= {bounds[name]:g}): {'met' if v <= bounds[name] else 'NOT met'}"
                lines.append(f"- {b} {name} {key}: {status}")
        p = res["models"].get("mlp", {}).get("pyhessian")
        if p:
            ok = p["ratio_ours_over_pyhessian"] <= 0.8
            lines.append(f"- {b} mlp hessian_trace(20 probes) / PyHessian = {p['ratio_ours_over_pyhessian']:.2f} (goal <= 0.8): {'met' if ok else 'NOT met'}")
    return "\n".join(lines)


def machine_line(results=None):
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    parts = [f"{datetime.date.today().isoformat()}", f"{cpu}, {os.cpu_count()} cores", f"Python {platform.python_version()}"]
    for res in results or []:
        env = res["env"]
        b = res["backend"]
        parts.append(f"{b} {env.get(b, '?')} ({env.get('device', '?')})")
    if results:
        parts.append(f"keras {results[0]['env']['keras']}")
    return "; ".join(parts)


# ----------------------------------------------------------------- main ---
def run_all(args):
    extra = (["--quick"] if args.quick else []) + (["--threads", str(args.threads)] if args.threads else [])
    extra += ["--models", args.models] if args.models else []
    results, failed = run_each_backend(__file__, extra)
    if results:
        print(f"Machine: {machine_line(results)}\n")
        print(markdown(results))
    if failed:
        print(f"\nFAILED backends: {', '.join(failed)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failed else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats and probes (CI smoke run)")
    ap.add_argument("--json", help="write raw results to this file")
    ap.add_argument("--all", action="store_true", help="run every backend in a subprocess, print one table")
    ap.add_argument(
        "--threads", type=int, default=None,
        help="compute threads per process (default: each library's own; --quick: 1, robust on a shared machine)",
    )
    ap.add_argument("--models", help="comma-separated subset of mlp,cnn,transformer (default: all)")
    ap.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.memory_child:
        return run_memory_child(args)
    if args.threads is None and args.quick:
        args.threads = 1
    if args.all:
        return run_all(args)
    res = run_backend(args)
    print(f"Machine: {machine_line([res])}\n")
    print(markdown([res]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
