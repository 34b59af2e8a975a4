#!/usr/bin/env python
"""Device check: step and estimator cost on an accelerator, per dtype policy.

Meant for a machine with a CUDA GPU or a TPU; on a CPU it still runs (with a
warning), which is what ``--quick`` is for: a smoke run of every code path.
One backend per process (Keras cannot switch backends inside a process):

    KERAS_BACKEND=jax python bench/device_check.py [--quick] [--json out.json]
    python bench/device_check.py --all [--quick] [--json out.json]
    python bench/device_check.py --all --policies float32,mixed_bfloat16
    python bench/device_check.py --scale [--quick] [--json out.json]   # bench/scale.py's table

``--scale`` runs ``bench/scale.py`` instead: GPT-2-small (124M), ViT-B/16
and ResNet-50 at both work sizes on every backend, one process per
optimizer, peak memory from the device's allocator (``--quick``: GPT-2
with 2 blocks at 512 tokens).

``--all`` runs this script once per backend (jax, tensorflow, torch) in a
subprocess with ``KERAS_BACKEND`` set; each backend's tables go to stderr,
the combined tables to stdout.

Per backend:

- which device Keras and the backend use (``jax.devices()``,
  ``tf.config.list_logical_devices``, ``torch.cuda``, and where a new
  ``keras.Variable`` lands), with a warning when there is no accelerator;
- per dtype policy (``keras.mixed_precision.set_dtype_policy``: float32,
  mixed_bfloat16, mixed_float16; a policy the backend or device cannot run
  is skipped with its error as the reason), on an MLP 784-512-512-10 (batch
  256) and a small BatchNorm ResNet on 32x32x3 (batch 64): the warm step time
  of ``train_on_batch`` with ``keras.optimizers.SGD(0.01, momentum=0.9)`` and
  with SAM, ASAM, FSAM, FisherSAM and LLQRSAM (diagonal, K-FAC) wrapping the
  same SGD, default ``jit_compile``, optimizers interleaved round by round,
  median over the rounds; absolute ms and ratio to the SGD step of the same
  model, policy and backend. LLQRSAM uses ``refresh_every=1000`` and
  refreshes U inside its first (warm-up) step, so every timed step is a
  non-refresh step; one refresh (``refresh_now``) is timed on its own;
- per policy, on a CIFAR ResNet-18 layout (BatchNorm, 4 stages of 2 basic
  blocks, 64-512 filters, ~11M parameters; batch 64): seconds per warm call
  of ``kg.sharpness.hessian_trace``, ``riemannian_sharpness`` (metric
  "diagonal" and "kfac") and ``fisher_diagonal`` (all at their defaults,
  one pass over the batch) and the ratio to one SGD step of that model.

Every failure is caught and recorded per entry (or per policy and model when
even the SGD baseline cannot run); nothing stops the run. ``--quick`` shrinks
everything (MLP 784-64-64-10 at batch 32, ResNets with 4-16 filters at batch
8, few repeats, 2 inner refresh steps instead of 50) to check that every path
runs; its timings say little.
"""

import argparse
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings

from _backends import run_each_backend  # noqa: E402  (bench/ is the script's own folder)
POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
LR, MOMENTUM, RHO = 0.01, 0.9, 0.05
ASAM_RHO = 0.5  # the ASAM paper's CIFAR radius, as bench/sam_step.py
REFRESH_EVERY = 1000
OPTIMIZERS = ("sgd", "sam", "asam", "fsam", "fishersam", "llqrsam_diagonal", "llqrsam_kfac")
LABELS = {
    "sgd": "SGD", "sam": "SAM", "asam": "ASAM", "fsam": "FSAM", "fishersam": "FisherSAM",
    "llqrsam_diagonal": "LLQRSAM diag", "llqrsam_kfac": "LLQRSAM K-FAC",
}
ESTIMATORS = ("hessian_trace", "sr_diagonal", "sr_kfac", "fisher_diagonal")
ESTIMATOR_LABELS = {
    "hessian_trace": "hessian_trace", "sr_diagonal": "S_R diag", "sr_kfac": "S_R K-FAC",
    "fisher_diagonal": "fisher_diagonal",
}


def settings(quick, batch=None):
    """Model sizes, batches and repeat counts. `batch` overrides every batch."""
    if quick:
        cfg = dict(
            mlp_width=64, mlp_batch=32,
            # one strided stage: compilation, not compute, dominates here
            resnet=dict(stem=4, stages=(8,), strides=(2,), blocks=1), resnet_batch=8,
            # identity and strided projection shortcuts both, as in ResNet-18
            big=dict(stem=8, stages=(8, 16), strides=(1, 2), blocks=1), big_name="resnet_tiny", big_batch=8,
            warmup=2, rounds=3, steps_per_round=2, refresh_repeats=1, estimator_repeats=1,
            refresh_steps=2,  # 50 unrolled inner steps take minutes to compile on XLA:CPU
        )
    else:
        cfg = dict(
            mlp_width=512, mlp_batch=256,
            # bench/llqr.py's small ResNet, so the two scripts' figures compare
            resnet=dict(stem=16, stages=(32, 64), strides=(2, 2), blocks=1), resnet_batch=64,
            big=dict(stem=64, stages=(64, 128, 256, 512), strides=(1, 2, 2, 2), blocks=2),
            big_name="resnet18", big_batch=64,
            warmup=3, rounds=9, steps_per_round=10, refresh_repeats=3, estimator_repeats=3,
            refresh_steps=50,
        )
    if batch:
        cfg["mlp_batch"] = cfg["resnet_batch"] = cfg["big_batch"] = batch
    # Every timed LLQRSAM step must come before the next due refresh.
    assert cfg["warmup"] + cfg["rounds"] * cfg["steps_per_round"] < REFRESH_EVERY
    return cfg


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def short_error(e):
    return " ".join(f"{type(e).__name__}: {e}".split())[:300]


# --------------------------------------------------------------- device ---
def describe_device(keras):
    """What the backend sees and where Keras puts a new variable."""
    import numpy as np

    b = keras.backend.backend()
    info = {}
    if b == "jax":
        import jax

        devices = jax.devices()
        info["devices"] = [f"{d.platform}:{d.id} {getattr(d, 'device_kind', '')}".strip() for d in devices]
        info["default_backend"] = jax.default_backend()
        info["accelerator"] = jax.default_backend() in ("gpu", "cuda", "rocm", "tpu")
    elif b == "tensorflow":
        import tensorflow as tf

        gpus = tf.config.list_logical_devices("GPU")
        tpus = tf.config.list_logical_devices("TPU")
        info["devices"] = [d.name for d in tf.config.list_logical_devices()]
        info["built_with_cuda"] = bool(tf.test.is_built_with_cuda())
        names = []
        for d in tf.config.list_physical_devices("GPU"):
            try:
                names.append(tf.config.experimental.get_device_details(d).get("device_name", d.name))
            except Exception:  # details are optional; the name is enough
                names.append(d.name)
        info["gpu_names"] = names
        # A TPU needs a TPUStrategy, which this script does not set up: TF
        # on a TPU host would still run these steps on its CPU.
        info["accelerator"] = bool(gpus)
        info["tpus_unused"] = [d.name for d in tpus]
    else:
        import torch

        cuda = torch.cuda.is_available()
        info["cuda_available"] = cuda
        info["torch_cuda"] = torch.version.cuda
        info["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else ["cpu"]
        info["accelerator"] = cuda
    v = keras.Variable(np.zeros((1,), "float32"))
    value = v.value
    if b == "jax":
        info["variable_device"] = ", ".join(str(d) for d in value.devices())
    else:
        info["variable_device"] = str(value.device)
    info["summary"] = f"{b}: {', '.join(info['devices'])}; keras variables on {info['variable_device']}"
    return info


def environment(keras):
    import numpy as np

    b = keras.backend.backend()
    env = {"keras": keras.__version__, "numpy": np.__version__, "python": platform.python_version()}
    if b == "jax":
        import jax

        env["jax"] = jax.__version__
    elif b == "tensorflow":
        import tensorflow as tf

        env["tensorflow"] = tf.__version__
    else:
        import torch

        env["torch"] = torch.__version__
    return env


# --------------------------------------------------------------- models ---
def mlp(keras, kg, width):
    return kg.Sequential([
        keras.Input((784,)),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.Dense(10),
    ], name=f"mlp{width}")


def resnet(keras, kg, stem, stages, strides, blocks):
    """BatchNorm ResNet on 32x32x3: a 3x3 conv stem, then per stage `blocks`
    basic blocks (two 3x3 convs); a stage's first block has that stage's
    stride, and a 1x1 projection on its shortcut where the shape changes.
    stem=64, stages=(64, 128, 256, 512), strides=(1, 2, 2, 2), blocks=2 is
    the CIFAR ResNet-18 layout; stem=16, stages=(32, 64), strides=(2, 2),
    blocks=1 is bench/llqr.py's small ResNet."""
    L = keras.layers

    def conv_bn(h, filters, strides=1, relu=True):
        h = L.BatchNormalization()(L.Conv2D(filters, 3, strides=strides, padding="same", use_bias=False)(h))
        return L.ReLU()(h) if relu else h

    inputs = keras.Input((32, 32, 3))
    h = conv_bn(inputs, stem)
    width = stem
    for filters, stage_stride in zip(stages, strides):
        for j in range(blocks):
            stride = stage_stride if j == 0 else 1
            shortcut = h
            if stride != 1 or filters != width:
                shortcut = L.Conv2D(filters, 1, strides=stride, use_bias=False)(h)
            r = conv_bn(conv_bn(h, filters, stride), filters, relu=False)
            h = L.ReLU()(L.Add()([r, shortcut]))
            width = filters
    outputs = L.Dense(10)(L.GlobalAveragePooling2D()(h))
    return kg.Model(inputs, outputs, name=f"resnet{stem}_{'-'.join(map(str, stages))}x{blocks}")


def make_optimizer(keras, kg, name, refresh_steps):
    base = keras.optimizers.SGD(LR, momentum=MOMENTUM)
    if name == "sgd":
        return base
    if name == "sam":
        return kg.optimizers.SAM(base, rho=RHO)
    if name == "asam":
        return kg.optimizers.SAM(base, rho=ASAM_RHO, adaptive=True)
    if name == "fsam":
        return kg.optimizers.FSAM(base, rho=RHO)
    if name == "fishersam":
        return kg.optimizers.FisherSAM(base, rho=RHO)
    if name.startswith("llqrsam_"):
        return kg.optimizers.LLQRSAM(
            base, structure=name.split("_", 1)[1], refresh_every=REFRESH_EVERY, refresh_steps=refresh_steps,
        )
    raise ValueError(name)


def data(np, kind, batch, seed):
    rng = np.random.default_rng(seed)
    shape = (batch, 784) if kind == "mlp" else (batch, 32, 32, 3)
    return rng.standard_normal(shape).astype("float32"), rng.integers(0, 10, size=batch).astype("int32")


# --------------------------------------------------------------- timing ---
def sync(keras, model):
    # A host read of the smallest weight waits for every queued update.
    v = min(model.trainable_variables, key=lambda v: math.prod(v.shape))
    keras.ops.convert_to_numpy(v.value)


def compiled(keras, build, optimizer):
    keras.utils.set_random_seed(0)  # same initial weights for every optimizer
    model = build()
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def step_rows(keras, kg, np, b, policy, kind, build, x, y, cfg):
    """Step times of every optimizer on one model under one policy."""
    base = {"backend": b, "policy": policy, "model": kind, "batch": int(x.shape[0])}
    log(f"[{b}] {policy} {kind}: SGD build + warm-up")
    try:
        t0 = time.perf_counter()
        sgd = compiled(keras, build, make_optimizer(keras, kg, "sgd", cfg["refresh_steps"]))
        for _ in range(cfg["warmup"]):
            sgd.train_on_batch(x, y)
        sync(keras, sgd)
        log(f"    {time.perf_counter() - t0:.1f} s")
    except Exception as e:  # the policy cannot run on this backend/device
        reason = short_error(e)
        log(f"[{b}] {policy} {kind}: SKIPPED: {reason}")
        return [dict(base, kind="skip", name="all", reason=reason)]
    base["params"] = int(sgd.count_params())
    live = {"sgd": sgd}
    opts = {}
    rows = {}
    for name in OPTIMIZERS[1:]:
        log(f"[{b}] {policy} {kind}: {LABELS[name]} build + warm-up")
        try:
            opts[name] = make_optimizer(keras, kg, name, cfg["refresh_steps"])
            model = compiled(keras, build, opts[name])
            t0 = time.perf_counter()
            for _ in range(cfg["warmup"]):  # LLQRSAM: the first refreshes U
                model.train_on_batch(x, y)
            sync(keras, model)
            log(f"    {time.perf_counter() - t0:.1f} s")
            live[name] = model
        except Exception as e:  # one optimizer failing must not hide the others
            rows[name] = dict(base, kind="step", name=name, error=short_error(e))
            log(f"    FAILED: {rows[name]['error']}")
    times = {name: [] for name in live}
    log(f"[{b}] {policy} {kind}: {cfg['rounds']} rounds x {len(live)} optimizers x {cfg['steps_per_round']} steps")
    for _ in range(cfg["rounds"]):
        for name in list(live):
            model = live[name]
            try:
                t0 = time.perf_counter()
                for _ in range(cfg["steps_per_round"]):
                    logs = model.train_on_batch(x, y, return_dict=True)
                sync(keras, model)
                times[name].append((time.perf_counter() - t0) / cfg["steps_per_round"])
            except Exception as e:
                rows[name] = dict(base, kind="step", name=name, error=short_error(e))
                log(f"    {LABELS[name]} FAILED: {rows[name]['error']}")
                del live[name]
                continue
            rows[name] = dict(
                base, kind="step", name=name, jit_compile=bool(model.jit_compile),
                final_loss=float(logs["loss"]), skipped_steps=float(logs.get("skipped_steps", 0.0)),
            )
    sgd_ms = 1e3 * statistics.median(times["sgd"]) if "sgd" in live else None
    for name in live:
        ms = 1e3 * statistics.median(times[name])
        rows[name].update(ms=ms, min_ms=1e3 * min(times[name]), baseline_ms=sgd_ms, ratio=ms / sgd_ms if sgd_ms else None)
    out = [rows[n] for n in OPTIMIZERS if n in rows]
    # One refresh of U, eagerly, as a callback would run it.
    for name in ("llqrsam_diagonal", "llqrsam_kfac"):
        if name not in live:
            continue
        opt, model = opts[name], live[name]
        row = dict(base, kind="refresh", name=name, refresh_steps=cfg["refresh_steps"])
        log(f"[{b}] {policy} {kind}: {LABELS[name]} refresh_now (compile + {cfg['refresh_repeats']})")
        try:
            t0 = time.perf_counter()
            opt.refresh_now(model, x, y)  # compiles
            keras.ops.convert_to_numpy(opt.preconditioner.variables[0])
            row["first_s"] = time.perf_counter() - t0
            ts = []
            for _ in range(cfg["refresh_repeats"]):
                t0 = time.perf_counter()
                opt.refresh_now(model, x, y)
                keras.ops.convert_to_numpy(opt.preconditioner.variables[0])  # synchronise
                ts.append(time.perf_counter() - t0)
            ms = 1e3 * statistics.median(ts)
            row.update(ms=ms, baseline_ms=sgd_ms, ratio=ms / sgd_ms if sgd_ms else None)
            log(f"    first {row['first_s']:.1f} s, warm {ms / 1e3:.3f} s")
        except Exception as e:
            row["error"] = short_error(e)
            log(f"    FAILED: {row['error']}")
        out.append(row)
    return out


def estimator_rows(keras, kg, np, b, policy, build, x, y, cfg):
    """Warm seconds per call of each sharpness estimator, over one SGD step."""
    S = kg.sharpness
    base = {"backend": b, "policy": policy, "model": cfg["big_name"], "batch": int(x.shape[0])}
    log(f"[{b}] {policy} {base['model']}: SGD step (estimator baseline)")
    try:
        start = time.perf_counter()
        model = compiled(keras, build, make_optimizer(keras, kg, "sgd", cfg["refresh_steps"]))
        for _ in range(cfg["warmup"]):
            model.train_on_batch(x, y)
        sync(keras, model)
        ts = []
        for _ in range(cfg["rounds"]):
            t0 = time.perf_counter()
            for _ in range(cfg["steps_per_round"]):
                model.train_on_batch(x, y)
            sync(keras, model)
            ts.append((time.perf_counter() - t0) / cfg["steps_per_round"])
        sgd_ms = 1e3 * statistics.median(ts)
        log(f"    {time.perf_counter() - start:.1f} s, {sgd_ms:.2f} ms/step")
    except Exception as e:
        reason = short_error(e)
        log(f"[{b}] {policy} {base['model']}: SKIPPED: {reason}")
        return [dict(base, kind="skip", name="estimators", reason=reason)]
    base["params"] = int(model.count_params())
    n = int(x.shape[0])
    calls = {  # one pass over the batch each (batch_size = batch)
        "hessian_trace": lambda: S.hessian_trace(model, x, y, batch_size=n),
        "sr_diagonal": lambda: S.riemannian_sharpness(model, x, y, structure="diagonal", batch_size=n),
        "sr_kfac": lambda: S.riemannian_sharpness(model, x, y, structure="kfac", batch_size=n),
        "fisher_diagonal": lambda: S.fisher_diagonal(model, x, batch_size=n),
    }
    rows = [dict(base, kind="baseline", name="sgd", ms=sgd_ms, baseline_ms=sgd_ms, ratio=1.0)]
    for name, fn in calls.items():
        row = dict(base, kind="estimator", name=name)
        log(f"[{b}] {policy} {base['model']}: {name} (warm-up + {cfg['estimator_repeats']})")
        try:
            t0 = time.perf_counter()
            out = fn()  # compiles; results are host values (synchronised)
            row["first_s"] = time.perf_counter() - t0
            ts = []
            for _ in range(cfg["estimator_repeats"]):
                t0 = time.perf_counter()
                out = fn()
                ts.append(time.perf_counter() - t0)
            ms = 1e3 * statistics.median(ts)
            row.update(ms=ms, baseline_ms=sgd_ms, ratio=ms / sgd_ms)
            if isinstance(out, list):  # fisher_diagonal: float64 arrays
                row["value"] = float(sum(float(np.sum(a)) for a in out))
            else:
                row.update(value=float(out.value), stderr=float(out.stderr), num_samples=int(out.num_samples))
            log(f"    first {row['first_s']:.1f} s, warm {ms / 1e3:.3f} s, value {row['value']:.4g}")
        except Exception as e:
            row["error"] = short_error(e)
            log(f"    FAILED: {row['error']}")
        rows.append(row)
    return rows


# ---------------------------------------------------------- one backend ---
def run_backend(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np

    import keras_geosam as kg

    warnings.filterwarnings("ignore", message=".*piecewise linear.*")
    b = keras.backend.backend()
    cfg = settings(args.quick, args.batch)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    device = describe_device(keras)
    log(f"[{b}] device: {device['summary']}")
    if not device["accelerator"]:
        log(f"[{b}] WARNING: no accelerator found: every timing below is a CPU timing.")
    result = {"backend": b, "quick": args.quick, "settings": cfg, "policies": policies,
              "env": environment(keras), "device": device, "rows": []}
    result["env"]["loadavg_start"] = os.getloadavg()[0]
    t_start = time.perf_counter()

    mx, my = data(np, "mlp", cfg["mlp_batch"], 1)
    rx, ry = data(np, "resnet", cfg["resnet_batch"], 2)
    bx, by = data(np, "resnet", cfg["big_batch"], 3)
    cases = (
        ("mlp", lambda: mlp(keras, kg, cfg["mlp_width"]), mx, my),
        ("resnet", lambda: resnet(keras, kg, **cfg["resnet"]), rx, ry),
    )
    for policy in policies:
        try:
            keras.mixed_precision.set_dtype_policy(policy)
        except Exception as e:  # an unknown policy name
            result["rows"].append({"backend": b, "policy": policy, "model": "all", "kind": "skip",
                                   "name": "all", "reason": short_error(e)})
            log(f"[{b}] {policy}: SKIPPED: {short_error(e)}")
            continue
        try:
            for kind, build, x, y in cases:
                result["rows"] += step_rows(keras, kg, np, b, policy, kind, build, x, y, cfg)
                gc.collect()
            result["rows"] += estimator_rows(keras, kg, np, b, policy, lambda: resnet(keras, kg, **cfg["big"]), bx, by, cfg)
            gc.collect()
        finally:
            keras.mixed_precision.set_dtype_policy("float32")
    for row in result["rows"]:
        row["device"] = device["summary"]
        row["accelerator"] = device["accelerator"]
    result["env"]["loadavg_end"] = os.getloadavg()[0]
    result["env"]["wall_s"] = time.perf_counter() - t_start
    return result


# ------------------------------------------------------------- reports ---
def ratio(v):
    return f"{v:.2f}" if v < 10 else f"{v:.0f}"


def cell(row):
    if row is None:
        return "-"
    if row.get("error"):
        return "ERR"
    return f"{row['ms']:.2f} ({row['ratio']:.2f}x)" if row.get("ratio") is not None else f"{row['ms']:.2f}"


def markdown(results):
    lines = ["Devices:", ""]
    for res in results:
        d = res["device"]
        warn = "" if d["accelerator"] else " **(no accelerator: CPU timings)**"
        lines.append(f"- {d['summary']}{warn}")
    lines += ["", "Train step, ms per warm `train_on_batch` (ratio to the SGD step of the same backend, policy and model):", ""]
    lines.append("| backend | policy | model | params | batch | jit | " + " | ".join(LABELS[n] for n in OPTIMIZERS) + " |")
    lines.append("|---|---|---|---:|---:|---|" + "---:|" * len(OPTIMIZERS))
    skips, errors = [], []
    for res in results:
        groups = {}
        for r in res["rows"]:
            if r["kind"] in ("estimator", "baseline") or (r["kind"] == "skip" and r["name"] == "estimators"):
                continue
            groups.setdefault((r["policy"], r["model"]), []).append(r)
        for (policy, model), rows in groups.items():
            skip = [r for r in rows if r["kind"] == "skip"]
            if skip:
                skips.append(f"- {res['backend']} {policy} {model}: {skip[0]['reason']}")
                continue
            steps = {r["name"]: r for r in rows if r["kind"] == "step"}
            if not steps:
                continue
            first = next(iter(steps.values()))
            jit = steps.get("sgd", {}).get("jit_compile")
            lines.append(
                f"| {res['backend']} | {policy} | {model} | {first.get('params', '-')} | {first['batch']} | "
                f"{'-' if jit is None else ('yes' if jit else 'no')} | " + " | ".join(cell(steps.get(n)) for n in OPTIMIZERS) + " |"
            )
    lines += ["", "One refresh of U (`refresh_now`, warm), seconds and in SGD steps of the same model:", ""]
    lines.append("| backend | policy | model | U | inner steps | refresh s | refresh / SGD step |")
    lines.append("|---|---|---|---|---:|---:|---:|")
    for res in results:
        for r in res["rows"]:
            if r["kind"] != "refresh":
                continue
            s = "ERR" if r.get("error") else f"{r['ms'] / 1e3:.3f}"
            q = "ERR" if r.get("error") else (ratio(r["ratio"]) if r.get("ratio") else "-")
            lines.append(f"| {res['backend']} | {r['policy']} | {r['model']} | {r['name'].split('_', 1)[1]} | {r['refresh_steps']} | {s} | {q} |")
    lines += ["", "Sharpness estimators, seconds per warm call (ratio to one SGD step of the same model):", ""]
    lines.append("| backend | policy | model | params | batch | SGD step ms | " + " | ".join(ESTIMATOR_LABELS[n] for n in ESTIMATORS) + " |")
    lines.append("|---|---|---|---:|---:|---:|" + "---:|" * len(ESTIMATORS))
    values = []
    for res in results:
        groups = {}
        for r in res["rows"]:
            if r["kind"] in ("estimator", "baseline") or (r["kind"] == "skip" and r["name"] == "estimators"):
                groups.setdefault((r["policy"], r["model"]), []).append(r)
        for (policy, model), rows in groups.items():
            skip = [r for r in rows if r["kind"] == "skip"]
            if skip:
                skips.append(f"- {res['backend']} {policy} {model} (estimators): {skip[0]['reason']}")
                continue
            by = {r["name"]: r for r in rows}
            sgd = by["sgd"]
            cells = []
            for n in ESTIMATORS:
                r = by.get(n)
                cells.append("-" if r is None else ("ERR" if r.get("error") else f"{r['ms'] / 1e3:.3f} ({ratio(r['ratio'])}x)"))
            lines.append(f"| {res['backend']} | {policy} | {model} | {sgd['params']} | {sgd['batch']} | {sgd['ms']:.2f} | " + " | ".join(cells) + " |")
            vals = []
            for n in ESTIMATORS:
                r = by.get(n)
                if r is None or r.get("error"):
                    vals.append("ERR" if r else "-")
                elif "stderr" in r:
                    vals.append(f"{r['value']:.4g} ± {r['stderr']:.2g} ({r['num_samples']})")
                else:
                    vals.append(f"{r['value']:.4g}")
            values.append(f"| {res['backend']} | {policy} | {model} | " + " | ".join(vals) + " |")
    if values:
        lines += ["", "Estimator values (value ± stderr (probes or samples); fisher_diagonal: sum of the diagonal):", ""]
        lines.append("| backend | policy | model | " + " | ".join(ESTIMATOR_LABELS[n] for n in ESTIMATORS) + " |")
        lines.append("|---|---|---|" + "---|" * len(ESTIMATORS))
        lines += values
    for res in results:
        for r in res["rows"]:
            if r.get("error"):
                errors.append(f"- {res['backend']} {r['policy']} {r['model']} {r['kind']} {r['name']}: {r['error']}")
            elif r["kind"] == "step" and r.get("skipped_steps"):
                errors.append(f"- {res['backend']} {r['policy']} {r['model']} {r['name']}: {r['skipped_steps']:.0f} "
                              f"non-finite steps skipped (loss scale settling or overflow); timing includes them")
    if skips:
        lines += ["", "Skipped (the policy could not be set, or the SGD baseline could not run under it):", ""] + skips
    if errors:
        lines += ["", "Errors and notes (ERR above):", ""] + errors
    cfg = results[0]["settings"]
    lines += [
        "",
        f"{'QUICK smoke run (tiny models; timings say little). ' if results[0]['quick'] else ''}"
        f"Steps: median over {cfg['rounds']} rounds of {cfg['steps_per_round']} steps, optimizers interleaved round by round, "
        f"after {cfg['warmup']} warm-up steps each; SGD(lr={LR}, momentum={MOMENTUM}) alone and as the base of SAM, FSAM, "
        f"FisherSAM (rho={RHO}), ASAM (rho={ASAM_RHO}) and LLQRSAM (rho=0.1, refresh_every={REFRESH_EVERY}, "
        f"{cfg['refresh_steps']} inner refresh steps; U refreshed in the first warm-up step, timed steps do not refresh). "
        f"Refresh: median of {cfg['refresh_repeats']} after a compiling call. Estimators: defaults, median of "
        f"{cfg['estimator_repeats']} warm calls, batch_size = batch.",
    ]
    loads = ", ".join(
        f"{res['backend']} {res['env']['loadavg_start']:.1f} -> {res['env']['loadavg_end']:.1f} ({res['env']['wall_s']:.0f} s)"
        for res in results
    )
    lines.append(f"1-minute load average at start -> end of each backend's run: {loads}.")
    return "\n".join(lines)


def machine_line(results):
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    parts = [datetime.date.today().isoformat(), f"{cpu}, {os.cpu_count()} cores", f"Python {platform.python_version()}"]
    for res in results:
        b = res["backend"]
        parts.append(f"{b} {res['env'].get(b, '?')}")
    if results:
        parts.append(f"keras {results[0]['env']['keras']}")
    return "; ".join(parts)


# ----------------------------------------------------------------- main ---
def run_all(args):
    extra = ["--policies", args.policies] + (["--quick"] if args.quick else [])
    extra += ["--batch", str(args.batch)] if args.batch else []
    results, failed = run_each_backend(__file__, extra)
    if results:
        print(f"Machine: {machine_line(results)}\n")
        print(markdown(results))
    if failed:
        print(f"\nFAILED backends (crashed; see stderr): {', '.join(failed)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failed else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--all", action="store_true", help="run every backend in a subprocess, print combined tables")
    ap.add_argument("--quick", action="store_true", help="tiny models, few repeats (smoke run, also on a CPU)")
    ap.add_argument("--json", help="write every row (device, backend, policy, model, optimizer, ms, ratio, errors) here")
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated dtype policies (default: %(default)s)")
    ap.add_argument("--batch", type=int, help="one batch size for every model (default: MLP 256, ResNets 64; --quick: 32 and 8)")
    ap.add_argument("--scale", action="store_true",
                    help="instead: bench/scale.py's table (GPT-2-small, ViT-B/16, ResNet-50; every backend, both work "
                         "sizes, one process per optimizer, the allocator's peak) in one command")
    args = ap.parse_args(argv)
    if args.scale:
        import scale

        extra = ["--json", args.json] if args.json else []
        shapes = "gpt2_2" if args.quick else "gpt2,vit_b16,resnet50"
        work = "small" if args.quick else "small,large"
        backends = "all" if args.all or not os.environ.get("KERAS_BACKEND") else os.environ["KERAS_BACKEND"]
        return scale.main(["--backends", backends, "--shapes", shapes, "--work", work] + extra)
    if args.batch is not None and args.batch < 1:
        ap.error("--batch must be >= 1")
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
