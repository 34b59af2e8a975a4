#!/usr/bin/env python
"""Benchmark of the two-pass SAM-family train step against plain SGD.

One backend per process (Keras cannot switch backends inside a process):

    KERAS_BACKEND=jax python bench/sam_step.py [--quick] [--json out.json]
    python bench/sam_step.py --all [--quick] [--omp-passive] [--json out.json]

``--all`` runs this script once per backend (jax, tensorflow, torch) in a
subprocess and prints one combined Markdown table. ``--omp-passive`` sets
``OMP_WAIT_POLICY=PASSIVE``: on a CPU shared with other jobs, torch's
spinning OpenMP threads otherwise slow every torch op down by up to ~10x.

Measured on (a) an MLP 784-512-512-10 (ReLU, logits, sparse CE) and (b) a
small CNN (28x28x1, Conv 16 3x3 relu, MaxPool, Conv 32 3x3 relu, MaxPool,
Flatten, Dense 10), batch 256, random data, identical initial weights:

- per-step time of ``kg.Sequential.fit`` with ``keras.optimizers.SGD(0.05,
  momentum=0.9)`` and with ``kg.optimizers.SAM(SGD(0.05, momentum=0.9),
  rho=0.05)`` (MLP also: ASAM, FSAM, FisherSAM), all compiled with the
  default ``jit_compile``, side by side in the same process. Per-step time =
  epoch time / steps (the epoch ends on a host read of the loss, so all
  queued work is included), median over the timed epochs; one epoch per
  ``fit`` call, optimizers interleaved epoch by epoch after a warm-up epoch
  each (compilation). Both go through the same ``fit`` loop, data adapter and
  callbacks, so the framework overhead per step is the same for both. Wall
  time and process CPU time (all threads) are both reported: CPU time is far
  less sensitive to other jobs on the machine;
- JAX only: ``optax.contrib.sam`` (opaque mode, ``sync_period=2``,
  ``adv_optimizer = chain(normalize(), sgd(rho))``, outer ``sgd(0.05,
  momentum=0.9)``) on the same MLP written as a pure jax function (weights
  copied from the Keras model): per-step time of a jitted step (donated
  state) called in a Python loop over device-resident batches, against
  Keras' own ``train_step`` of our model jitted the same way (``fit`` minus
  data adapter and callbacks) and against ours through ``fit``; and the max
  absolute parameter difference after 20 steps (ours via ``fit``,
  ``shuffle=False``) from identical initial weights on identical batches, in
  float32 and (in a subprocess with ``JAX_ENABLE_X64=1``) in float64.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

BACKENDS = ("jax", "tensorflow", "torch")
BATCH = 256
LR, MOMENTUM, RHO = 0.05, 0.9, 0.05
ASAM_RHO = 0.5  # the reference's suggested ASAM radius (CIFAR-10)
EQ_STEPS = 20
# Goals stated by the project.
RATIO_GOAL = 2.1  # SAM step <= 2.1x the SGD step
OPTAX_GOAL = 1.2  # ours within 1.2x of optax.contrib.sam (JAX)
MLP_VARIANTS = ("sgd", "sam", "asam", "fsam", "fishersam")
CNN_VARIANTS = ("sgd", "sam")
LABELS = {"sgd": "SGD", "sam": "SAM", "asam": "ASAM", "fsam": "FSAM", "fishersam": "FisherSAM"}


def settings(quick):
    # batches: steps per epoch per model; rounds: timed epochs per
    # configuration (one epoch per fit call, configurations interleaved).
    if quick:
        return dict(batches={"mlp": 10, "cnn": 4}, rounds=3, eq_steps=EQ_STEPS)
    return dict(batches={"mlp": 40, "cnn": 10}, rounds=9, eq_steps=EQ_STEPS)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------- models ---
def layers_for(keras, name):
    if name == "mlp":
        return [
            keras.Input((784,)),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(10),
        ]
    return [
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(10),
    ]


def make_optimizer(keras, kg, variant):
    base = keras.optimizers.SGD(LR, momentum=MOMENTUM)
    if variant == "sgd":
        return base
    if variant == "sam":
        return kg.optimizers.SAM(base, rho=RHO)
    if variant == "asam":
        return kg.optimizers.SAM(base, rho=ASAM_RHO, adaptive=True)
    if variant == "fsam":
        return kg.optimizers.FSAM(base, rho=RHO)
    if variant == "fishersam":
        return kg.optimizers.FisherSAM(base, rho=RHO)
    raise ValueError(variant)


def build_model(keras, kg, name, variant, weights):
    model = kg.Sequential(layers_for(keras, name), name=f"{name}_{variant}")
    model.compile(
        optimizer=make_optimizer(keras, kg, variant),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.set_weights(weights)
    return model


def initial_weights(keras, name):
    keras.utils.set_random_seed(0)
    return keras.Sequential(layers_for(keras, name)).get_weights()


def make_data(np, model_name, batches):
    rng = np.random.default_rng(1 if model_name == "mlp" else 2)
    n = batches * BATCH
    shape = (n, 784) if model_name == "mlp" else (n, 28, 28, 1)
    x = rng.standard_normal(shape).astype("float32")
    y = rng.integers(0, 10, size=n).astype("int32")
    return x, y


# --------------------------------------------------------------- timing ---
def epoch_timer(keras):
    class EpochTimer(keras.callbacks.Callback):
        """Wall time of each epoch. Only epoch hooks: fit keeps dispatching
        steps asynchronously; CallbackList.on_epoch_end reads the epoch's
        logs on the host first, so the time includes all queued work."""

        async_safe = True

        def __init__(self):
            super().__init__()
            self.times, self.cpu, self.losses = [], [], []

        def on_epoch_begin(self, epoch, logs=None):
            self._t0, self._c0 = time.perf_counter(), time.process_time()

        def on_epoch_end(self, epoch, logs=None):
            loss = float(logs["loss"])  # host read (already synced by Keras)
            self.times.append(time.perf_counter() - self._t0)
            self.cpu.append(time.process_time() - self._c0)
            self.losses.append(loss)

    return EpochTimer


def fit_epochs(model, timer_cls, x, y, epochs):
    timer = timer_cls()
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=[timer])
    return timer.times, timer.cpu, timer.losses


# ---------------------------------------------------------- one backend ---
def run_backend(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.omp_passive:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # before torch loads libgomp
    import keras
    import numpy as np

    import keras_geosam as kg

    warnings.filterwarnings("ignore", message=".*piecewise linear.*")
    b = keras.backend.backend()
    cfg = settings(args.quick)
    timer_cls = epoch_timer(keras)
    result = {"backend": b, "quick": args.quick, "settings": cfg, "env": environment(b), "models": {}}
    result["env"]["loadavg_start"] = os.getloadavg()[0]

    for name, variants in (("mlp", MLP_VARIANTS), ("cnn", CNN_VARIANTS)):
        steps = cfg["batches"][name]
        x, y = make_data(np, name, steps)
        w0 = initial_weights(keras, name)
        models, losses, first = {}, {}, {}
        times, cpu = {v: [] for v in variants}, {v: [] for v in variants}
        for v in variants:
            log(f"[{b}] {name} {LABELS[v]}: build + warm-up epoch")
            models[v] = build_model(keras, kg, name, v, w0)
            t, _, _ = fit_epochs(models[v], timer_cls, x, y, 1)
            first[v] = t[0]
        log(f"[{b}] {name}: {cfg['rounds']} round(s) x {len(variants)} optimizers x 1 epoch of {steps} steps")
        for r in range(cfg["rounds"]):
            for v in variants:
                t, c, l = fit_epochs(models[v], timer_cls, x, y, 1)
                times[v] += t
                cpu[v] += c
                losses[v] = l[-1]
        rows = {}
        for v in variants:
            per_step = [t / steps for t in times[v]]
            rows[v] = {
                "step_s": statistics.median(per_step),
                "step_min_s": min(per_step),
                "step_max_s": max(per_step),
                "cpu_step_s": statistics.median([c / steps for c in cpu[v]]),
                "warmup_epoch_s": first[v],
                "final_loss": losses[v],
                "jit_compile": bool(models[v].jit_compile),
            }
        for v in variants:
            rows[v]["ratio_vs_sgd"] = rows[v]["step_s"] / rows["sgd"]["step_s"]
            rows[v]["ratio_vs_sgd_min"] = rows[v]["step_min_s"] / rows["sgd"]["step_min_s"]
            rows[v]["cpu_ratio_vs_sgd"] = rows[v]["cpu_step_s"] / rows["sgd"]["cpu_step_s"]
        result["models"][name] = {"num_params": int(models["sgd"].count_params()), "steps": steps, "variants": rows}
        if b == "jax" and name == "mlp":
            result["optax"] = optax_compare(keras, kg, np, models, x, y, w0, cfg, rows, args)
        del models
    result["env"]["loadavg_end"] = os.getloadavg()[0]
    return result


# --------------------------------------------------------------- optax ---
def jax_mlp_loss():
    import jax
    import jax.numpy as jnp

    def mlp_loss(params, xb, yb):
        h = xb
        for i, (w, bias) in enumerate(params):
            h = h @ w + bias
            if i < len(params) - 1:
                h = jax.nn.relu(h)
        logp = jax.nn.log_softmax(h, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, yb[:, None].astype(jnp.int32), axis=-1))

    return mlp_loss


def optax_optimizers():
    import optax

    # Opaque mode, sync_period=2: one adversarial step
    #   eps = -(sgd(rho) of normalize(g)) = +rho g/||g||,
    # the gradient at theta+eps (grad_fn), then the outer sgd(momentum)
    # applied at theta: exactly kg SAM(SGD(0.05, momentum=0.9), rho=0.05)
    # (whose eps = rho g / sqrt(||g||^2 + 1e-12)). optax.sgd's trace
    # t <- g + 0.9 t, theta -= lr t equals Keras SGD's m <- 0.9 m - lr g.
    sam_opt = optax.contrib.sam(
        optax.sgd(LR, momentum=MOMENTUM),
        optax.chain(optax.contrib.normalize(), optax.sgd(RHO)),
        sync_period=2,
        opaque_mode=True,
    )
    return sam_opt, optax.sgd(LR, momentum=MOMENTUM)


def optax_step(opt, two_pass, donate=True):
    import jax
    import optax

    mlp_loss = jax_mlp_loss()

    def step(params, state, xb, yb):
        loss, g = jax.value_and_grad(mlp_loss)(params, xb, yb)
        if two_pass:
            grad_fn = lambda p, _: jax.grad(mlp_loss)(p, xb, yb)  # noqa: E731
            updates, state = opt.update(g, state, params, grad_fn=grad_fn)
        else:
            updates, state = opt.update(g, state, params)
        return optax.apply_updates(params, updates), state, loss

    return jax.jit(step, donate_argnums=(0, 1) if donate else ())


def to_jax_params(weights):
    import jax.numpy as jnp

    return [(jnp.asarray(weights[i]), jnp.asarray(weights[i + 1])) for i in range(0, len(weights), 2)]


def equivalence(keras, kg, np, w0, n_steps):
    """Max |theta_ours - theta_optax| after n_steps (ours via fit, shuffle=False)."""
    import jax.numpy as jnp

    dtype = keras.config.floatx()
    w0 = [w.astype(dtype) for w in w0]
    xe, ye = make_data(np, "mlp", n_steps)
    xe = xe.astype(dtype)
    ours = build_model(keras, kg, "mlp", "sam", w0)
    ours.fit(xe, ye, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    ours_sgd = build_model(keras, kg, "mlp", "sgd", w0)
    ours_sgd.fit(xe, ye, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    sam_opt, _ = optax_optimizers()
    step = optax_step(sam_opt, True, donate=False)
    p = to_jax_params(w0)
    s = sam_opt.init(p)
    for i in range(n_steps):
        sl = slice(i * BATCH, (i + 1) * BATCH)
        p, s, _ = step(p, s, jnp.asarray(xe[sl]), jnp.asarray(ye[sl]))
    ref = [np.asarray(a) for pair in p for a in pair]
    assert all(a.dtype == np.dtype(dtype) for a in ref), [a.dtype for a in ref]

    def maxdiff(a_list, b_list):
        return max(float(np.max(np.abs(np.asarray(a, "float64") - np.asarray(b, "float64")))) for a, b in zip(a_list, b_list))

    return {
        "dtype": dtype,
        "max_abs_param_diff": maxdiff(ours.get_weights(), ref),
        "max_abs_param_change": maxdiff(ref, w0),
        "max_abs_diff_sgd_vs_sam": maxdiff(ours_sgd.get_weights(), ref),
    }


def equivalence_float64(args):
    """Child process (JAX_ENABLE_X64=1): the same comparison in float64."""
    import jax

    jax.config.update("jax_enable_x64", True)
    import keras
    import numpy as np

    import keras_geosam as kg

    keras.config.set_floatx("float64")
    res = equivalence(keras, kg, np, initial_weights(keras, "mlp"), EQ_STEPS)
    with open(args.json, "w") as f:
        json.dump(res, f)
    return 0


def optax_compare(keras, kg, np, models, x, y, w0, cfg, rows, args):
    import jax
    import jax.numpy as jnp
    import optax

    steps = cfg["batches"]["mlp"]
    sam_opt, sgd_opt = optax_optimizers()
    sam_step, sgd_step = optax_step(sam_opt, True), optax_step(sgd_opt, False)
    xs = [jnp.asarray(x[i * BATCH : (i + 1) * BATCH]) for i in range(steps)]
    ys = [jnp.asarray(y[i * BATCH : (i + 1) * BATCH]) for i in range(steps)]

    # -- equivalence: 20 steps from identical weights on identical batches.
    log(f"[jax] mlp: optax.contrib.sam vs kg SAM, {EQ_STEPS} steps, float32 and float64 (subprocess)")
    out = {"eq_steps": EQ_STEPS, "optax_version": optax.__version__}
    out["eq32"] = equivalence(keras, kg, np, w0, EQ_STEPS)
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_ENABLE_X64="1")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--eq64", "--json", path], env=env, stdout=sys.stderr)
    if proc.returncode == 0:
        with open(path) as f:
            out["eq64"] = json.load(f)
    os.unlink(path)

    # -- timing. Each runner does one loop over the batches per call; the
    # four runners are interleaved loop by loop, after a compiling call.
    def optax_runner(step, opt):
        params = to_jax_params(w0)
        box = [params, opt.init(params)]

        def run():
            params, state = box
            for i in range(steps):
                params, state, loss = step(params, state, xs[i], ys[i])
            jax.block_until_ready((params, loss))
            box[:] = [params, state]

        return run

    def keras_runner(model):
        # Keras' own train_step, jitted as fit jits it (donated state): fit
        # minus the data adapter, the epoch iterator and callbacks.
        box = [tuple(
            [jnp.array(v.value, copy=True) for v in vs]
            for vs in (model.trainable_variables, model.non_trainable_variables,
                       model.optimizer.variables, model.metrics_variables)
        )]
        step = jax.jit(model.train_step, donate_argnums=0)

        def run():
            state = box[0]
            for i in range(steps):
                logs, state = step(state, (xs[i], ys[i]))
            jax.block_until_ready((state, logs))
            box[0] = state

        return run

    runners = {
        "optax_sam": optax_runner(sam_step, sam_opt),
        "raw_sam": keras_runner(models["sam"]),
        "optax_sgd": optax_runner(sgd_step, sgd_opt),
        "raw_sgd": keras_runner(models["sgd"]),
    }
    for run in runners.values():
        run()  # compile + one loop
    R = cfg["rounds"]
    log(f"[jax] mlp: timing optax vs ours ({R} interleaved loops of {steps} steps each)")
    t, c = {k: [] for k in runners}, {k: [] for k in runners}
    for _ in range(R):
        for k, run in runners.items():
            t0, c0 = time.perf_counter(), time.process_time()
            run()
            t[k].append((time.perf_counter() - t0) / steps)
            c[k].append((time.process_time() - c0) / steps)
    for k, v in t.items():
        out[k + "_step_s"] = statistics.median(v)
        out[k + "_step_min_s"] = min(v)
        out[k + "_cpu_step_s"] = statistics.median(c[k])
    out["fit_sam_step_s"] = rows["sam"]["step_s"]
    out["fit_sgd_step_s"] = rows["sgd"]["step_s"]
    out["fit_sam_step_min_s"] = rows["sam"]["step_min_s"]
    out["ratio_fit_over_optax"] = out["fit_sam_step_s"] / out["optax_sam_step_s"]
    out["ratio_raw_over_optax"] = out["raw_sam_step_s"] / out["optax_sam_step_s"]
    out["cpu_ratio_raw_over_optax"] = out["raw_sam_cpu_step_s"] / out["optax_sam_cpu_step_s"]
    out["fit_sam_cpu_step_s"] = rows["sam"]["cpu_step_s"]
    out["fit_sgd_cpu_step_s"] = rows["sgd"]["cpu_step_s"]
    out["cpu_ratio_fit_over_optax"] = out["fit_sam_cpu_step_s"] / out["optax_sam_cpu_step_s"]
    out["ratio_raw_over_optax_min"] = out["raw_sam_step_min_s"] / out["optax_sam_step_min_s"]
    out["ratio_fit_over_optax_min"] = out["fit_sam_step_min_s"] / out["optax_sam_step_min_s"]
    out["optax_sam_over_sgd"] = out["optax_sam_step_s"] / out["optax_sgd_step_s"]
    out["raw_sam_over_sgd"] = out["raw_sam_step_s"] / out["raw_sgd_step_s"]
    out["raw_sam_over_sgd_min"] = out["raw_sam_step_min_s"] / out["raw_sgd_step_min_s"]
    return out


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
        env["OMP_WAIT_POLICY"] = os.environ.get("OMP_WAIT_POLICY", "")
        env["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    return env


# ------------------------------------------------------------- reports ---
def verdict(value, goal):
    return "met" if value <= goal else "NOT met"


def ratio_table(results, key_step, key_ratio, unit):
    lines = [
        f"| backend | model | jit | SGD {unit} | SAM {unit} | SAM/SGD | ASAM/SGD | FSAM/SGD | FisherSAM/SGD |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for res in results:
        for name, m in res["models"].items():
            r = m["variants"]
            cells = [f"{r[v][key_ratio]:.2f}" if v in r else "n/a" for v in ("sam", "asam", "fsam", "fishersam")]
            lines.append(
                f"| {res['backend']} | {name} | {'yes' if r['sam']['jit_compile'] else 'no'} | "
                f"{r['sgd'][key_step] * 1e3:.2f} | {r['sam'][key_step] * 1e3:.2f} | " + " | ".join(cells) + " |"
            )
    return lines


def markdown(results):
    cfg = results[0]["settings"]
    steps = ", ".join(f"{k} {v}" for k, v in cfg["batches"].items())
    lines = ["Wall time per step (`fit`):", ""]
    lines += ratio_table(results, "step_s", "ratio_vs_sgd", "ms/step")
    lines += ["", "Process CPU time per step (all threads; robust to other jobs on the machine, includes the same framework overhead):", ""]
    lines += ratio_table(results, "cpu_step_s", "cpu_ratio_vs_sgd", "CPU ms/step")
    lines.append("")
    lines.append(
        f"Batch {BATCH}; `fit` with the default `jit_compile` (jit: its effective value); steps per epoch: {steps}; "
        f"per-step time = epoch time / steps, median of {cfg['rounds']} epochs per optimizer, "
        f"optimizers interleaved epoch by epoch after a warm-up epoch each; ratios = ratios of medians. "
        f"SGD(lr={LR}, momentum={MOMENTUM}) alone and as the base of SAM, FSAM, FisherSAM (rho={RHO}) and ASAM (rho={ASAM_RHO})."
    )
    loads = ", ".join(
        f"{res['backend']} {res['env'].get('loadavg_start', float('nan')):.1f} -> {res['env'].get('loadavg_end', float('nan')):.1f}"
        for res in results
    )
    lines.append(f"1-minute load average at start -> end of each backend's run: {loads}.")
    lines.append("")
    lines.append("Spread (wall ms per step over the timed epochs: median, min, max; ratio of the fastest epochs; warm-up epoch = compilation + 1 epoch; final training loss):")
    lines.append("")
    lines.append("| backend | model | optimizer | median | min | max | CPU ms | min/min SGD | warm-up epoch s | final loss |")
    lines.append("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for res in results:
        for name, m in res["models"].items():
            for v, r in m["variants"].items():
                lines.append(
                    f"| {res['backend']} | {name} | {LABELS[v]} | {r['step_s'] * 1e3:.2f} | {r['step_min_s'] * 1e3:.2f} | "
                    f"{r['step_max_s'] * 1e3:.2f} | {r['cpu_step_s'] * 1e3:.2f} | {r['ratio_vs_sgd_min']:.2f} | "
                    f"{r['warmup_epoch_s']:.2f} | {r['final_loss']:.4g} |"
                )
    for res in results:
        o = res.get("optax")
        if not o:
            continue
        n = res["models"]["mlp"]["steps"]
        lines.append("")
        lines.append(
            f"optax.contrib.sam comparison (JAX, MLP, batch {BATCH}, optax {o['optax_version']}; wall ms per step: "
            f"median [min] over {res['settings']['rounds']} interleaved loops of {n} steps; CPU ms: median):"
        )
        lines.append("")
        lines.append("| step | SAM ms | SGD ms | SAM/SGD | SAM CPU ms | SGD CPU ms | SAM/SGD CPU |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|")
        for label, k in (
            ("optax: jitted step (donated), Python loop over device batches", "optax"),
            ("ours: Keras `train_step` jitted the same way, same loop", "raw"),
        ):
            lines.append(
                f"| {label} | {o[k + '_sam_step_s'] * 1e3:.2f} [{o[k + '_sam_step_min_s'] * 1e3:.2f}] | "
                f"{o[k + '_sgd_step_s'] * 1e3:.2f} [{o[k + '_sgd_step_min_s'] * 1e3:.2f}] | "
                f"{o[k + '_sam_step_s'] / o[k + '_sgd_step_s']:.2f} | {o[k + '_sam_cpu_step_s'] * 1e3:.2f} | "
                f"{o[k + '_sgd_cpu_step_s'] * 1e3:.2f} | {o[k + '_sam_cpu_step_s'] / o[k + '_sgd_cpu_step_s']:.2f} |"
            )
        lines.append(
            f"| ours: `fit` (tables above) | {o['fit_sam_step_s'] * 1e3:.2f} | {o['fit_sgd_step_s'] * 1e3:.2f} | "
            f"{o['fit_sam_step_s'] / o['fit_sgd_step_s']:.2f} | {o['fit_sam_cpu_step_s'] * 1e3:.2f} | "
            f"{o['fit_sgd_cpu_step_s'] * 1e3:.2f} | {o['fit_sam_cpu_step_s'] / o['fit_sgd_cpu_step_s']:.2f} |"
        )
        lines.append("")
        lines.append(
            f"- ours/optax per SAM step, wall (CPU): jitted `train_step` {o['ratio_raw_over_optax']:.2f} "
            f"({o['cpu_ratio_raw_over_optax']:.2f}); through `fit` {o['ratio_fit_over_optax']:.2f} "
            f"({o['cpu_ratio_fit_over_optax']:.2f}), which adds Keras' data adapter, epoch iterator and callbacks"
        )
        for key in ("eq32", "eq64"):
            e = o.get(key)
            if e is None:
                lines.append(f"- {key}: not run (subprocess failed)")
                continue
            lines.append(
                f"- {e['dtype']}, {o['eq_steps']} steps (ours via `fit`, shuffle=False) from identical weights on identical batches: "
                f"max |theta_ours - theta_optax| = {e['max_abs_param_diff']:.2e} "
                f"(scale: max |theta_{o['eq_steps']} - theta_0| = {e['max_abs_param_change']:.2e}; "
                f"ours with plain SGD vs optax SAM: {e['max_abs_diff_sgd_vs_sam']:.2e})"
            )
        lines.append(
            "- float32 gaps are rounding amplified by ReLU switching (a pre-activation within rounding of 0 takes the "
            "other branch in one run, and the trajectories separate); the float64 gap shows both compute the same update"
        )
    lines.append("")
    lines.append("Goals (wall-time verdict; CPU-time ratio and verdict in brackets):")
    lines.append("")
    for res in results:
        b = res["backend"]
        for name, m in res["models"].items():
            r = m["variants"]["sam"]
            lines.append(
                f"- {b} {name}: SAM/SGD = {r['ratio_vs_sgd']:.2f} (goal <= {RATIO_GOAL:g}): {verdict(r['ratio_vs_sgd'], RATIO_GOAL)} "
                f"[CPU {r['cpu_ratio_vs_sgd']:.2f}: {verdict(r['cpu_ratio_vs_sgd'], RATIO_GOAL)}]"
            )
        o = res.get("optax")
        if o:
            for label, k in (("jitted `train_step`, same loop", "raw"), ("through `fit`", "fit")):
                w, c = o[f"ratio_{k}_over_optax"], o[f"cpu_ratio_{k}_over_optax"]
                lines.append(
                    f"- {b} mlp: ours ({label}) / optax.contrib.sam = {w:.2f} (goal <= {OPTAX_GOAL:g}): "
                    f"{verdict(w, OPTAX_GOAL)} [CPU {c:.2f}: {verdict(c, OPTAX_GOAL)}]"
                )
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
    results, failed = [], []
    for b in BACKENDS:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            path = f.name
        cmd = [sys.executable, os.path.abspath(__file__), "--json", path]
        cmd += (["--quick"] if args.quick else []) + (["--omp-passive"] if args.omp_passive else [])
        env = dict(os.environ, KERAS_BACKEND=b, TF_CPP_MIN_LOG_LEVEL="2")
        log(f"=== {b} ===")
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, stdout=sys.stderr)
        log(f"=== {b}: {time.perf_counter() - t0:.0f} s, exit {proc.returncode} ===")
        if proc.returncode == 0:
            with open(path) as f:
                results.append(json.load(f))
        else:
            failed.append(b)
        os.unlink(path)
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
    ap.add_argument("--quick", action="store_true", help="fewer batches and epochs (CI smoke run)")
    ap.add_argument("--json", help="write raw results to this file")
    ap.add_argument("--all", action="store_true", help="run every backend in a subprocess, print one table")
    ap.add_argument(
        "--omp-passive", action="store_true",
        help="set OMP_WAIT_POLICY=PASSIVE (torch's OpenMP threads sleep instead of spinning; "
        "on a CPU shared with other jobs torch otherwise slows down by up to ~10x)",
    )
    ap.add_argument("--eq64", action="store_true", help=argparse.SUPPRESS)  # internal: float64 optax check
    args = ap.parse_args(argv)
    if args.eq64:
        return equivalence_float64(args)
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
