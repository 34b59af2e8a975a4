#!/usr/bin/env python
"""LLQR+SAM at the sizes people train: GPT-2-small, ViT-B/16 and ResNet-50.

    python bench/scale.py                                  # GPT-2 with 2 blocks, 512 tokens, this backend
    python bench/scale.py --backends all --shapes gpt2_2,gpt2,vit_b16,resnet50 --work small,large
    python bench/scale.py --exponent                       # overhead ~ P^k over GPT-2 widths
    python bench/scale.py --toy                            # seconds: every code path on a tiny GPT-2
    python bench/scale.py --paired --shapes gpt2 --skip-refresh  # the methods' steps in turn, in one process
    python bench/scale.py --estimators --shapes gpt2       # tr H and S_R (K-FAC) per probe, in gradients

Shapes, built from their libraries' configurations with random weights (no
download): ``gpt2`` (keras-hub ``GPT2CausalLM``, 12 blocks of width 768, 12
heads, MLP 3072, vocabulary 50257, 124M parameters), ``gpt2_2`` (the same
with 2 blocks, 54M, for quick runs), ``gpt2_w<d>`` (2 blocks of width d,
d/64 heads, MLP 4d: the widths of ``--exponent``), ``vit_b16`` (keras-hub
``ViTImageClassifier``: 224x224 images, 16x16 patches, 12 blocks of width
768, 1000 classes, 86M) and ``resnet50`` (``keras.applications.ResNet50
(weights=None)``, 224x224, 1000 classes, 25.6M). Work per step
(``--work``): ``small`` is 512 tokens (4 sequences of 128) or 8 images,
``large`` 4096 tokens (32 x 128) or 64 images.

Every (backend, shape, work, method) runs in its own process, one after the
other (``--in-process`` runs them in one, for smoke runs). Methods: the
base optimizer alone (``AdamW(1e-4)``; ``SGD(0.1, momentum=0.9)`` for the
ResNet), SAM (rho 0.05) and LLQR+SAM (rho 0.05) with a diagonal, K-FAC and
EK-FAC U, each on that base, through ``kg.attach`` and ``fit`` on random
data. Per method:

- ``step_s``: the median time of ``--steps`` ``train_on_batch`` steps
  (each returns its loss to the host, so all its work is in it) after two
  that compile and warm up; ``step_min_s`` the fastest. LLQR+SAM's steps
  here never refresh (``refresh_source="callback"``), so the step is read
  apart from the refresh;
- ``compile_s``: the first step's time less a timed step (compilation and
  first-call work; the refresh is not in it);
- ``refresh_s``: one warm refresh (``refresh_now`` on one step's batch, 50
  inner steps unless ``--refresh-steps``), after a first one that compiles
  (``refresh_compile_s``; on JAX the same program ``fit`` runs between steps);
  ``refresh_compiles``: compilations during the warm refresh (JAX: XLA's
  compile events; 0 means compiled once);
- ``peak``: on a CPU the process's resident-set high-water mark over the
  timed steps (reset before them; ``VmHWM``) less its resident
  set before the model was built, in bytes and bytes per parameter; on a
  GPU the allocator's peak (JAX ``memory_stats``, torch
  ``max_memory_allocated``, TensorFlow ``get_memory_info``). The same for
  the warm refresh (``refresh_peak``). On JAX also XLA's own accounting
  of the compiled step and refresh programs (``xla_step_bytes``,
  ``xla_refresh_bytes``: arguments and temporaries, no allocator slack);
- FLOPs: the forward pass counted from its products (``_flops.py``), a
  gradient as 3 forwards; U's products from its layout.

The floors, read against SAM's measured step: a method's step floor is
``SAM step x FLOPs(method) / FLOPs(SAM)`` with FLOPs(SAM) two gradients and
FLOPs(LLQR+SAM) two gradients plus two U products (diagonal U: element-wise,
so its floor is SAM's step); a refresh's floor is ``SAM step x (F +
steps x (4 F + 3 U)) / (6 F)`` (F: a forward; per inner step a JVP and a
VJP of the logits, 2 F each, and U's product with its vector-Jacobian
product). ``amortised@500``: step + refresh / 500, over SAM's step.
``refresh_every for 10%``: the period at which refreshes cost 10% of SAM's
step time.

Goals (issue "LLQR+SAM at the sizes people train"), on JAX and torch at the
small work size and above: diagonal step <= 1.1x SAM; K-FAC and EK-FAC
<= max(1.3x SAM, 1.1x their floor); compile <= 60 s; a refresh <= 1.5x
its floor, compiled once; overhead exponent <= 1.1.

``--paired`` runs every method of a (backend, shape, work) in one process,
one step of each per round, every other round in reverse order (work
``small/paired`` in the table): each
ratio (``/SAM``, ``/base``) is the median over rounds of the step's time
over SAM's (the base's) in the same round, so a machine whose speed drifts
between processes (a shared host: SAM's step at GPT-2-small measured 6.4 s
and 9.4 s an hour apart) moves both sides of a ratio. Steps only: the
models share the process, so no peak memory and no refresh is read.

``--estimators`` measures the sharpness estimators at each shape instead
(issue goal: within 3 gradients per probe and 2x a training step's peak):
``hessian_trace`` and ``riemannian_sharpness(structure="kfac")`` on 8
sequences of 128 tokens (8 images), unsplit Hutchinson with 4 probes
(``rtol=None``), timed on a second call (the first compiles): the cost
per probe, everything in the call included, in gradients (a compiled
loss-and-gradient of the same batch, timed warm), and apart from it S_R's
metric (built once per call, timed warm on its own) and each further
probe (the rest of the call over the probes); the peak is the
resident set's high-water mark during the timed call over an ``AdamW``
training step's on the same batch (both less the resident set before the
model was built).

``--exponent`` runs the base and LLQR+SAM (diagonal) on ``gpt2_w256``,
``gpt2_w512``, ``gpt2_w768`` and ``gpt2_w1024`` at 512 tokens and fits the
amortised overhead (LLQR+SAM step + refresh / 1000 - base step) as P^k.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _flops import forward_flops  # noqa: E402
from _flops import u_flops  # noqa: E402

BACKENDS = ("jax", "tensorflow", "torch")
METHODS = ("base", "sam", "llqr_diag", "llqr_kfac", "llqr_ekfac")
STRUCTURE = {"llqr_diag": "diagonal", "llqr_kfac": "kfac", "llqr_ekfac": "ekfac"}
LABELS = {"base": "base", "sam": "SAM", "llqr_diag": "LLQR+SAM diag", "llqr_kfac": "LLQR+SAM K-FAC",
          "llqr_ekfac": "LLQR+SAM EK-FAC"}
SEQ = 128  # tokens per sequence
WORK = {"lm": {"small": 4, "large": 32}, "image": {"small": 8, "large": 64}}  # sequences or images per step
RHO = 0.05
REFRESH_STEPS = 50
AMORTISE = 500
EXPONENT_WIDTHS = (256, 512, 768, 1024)
# Goals
DIAG_GOAL, KFAC_SAM_GOAL, FLOOR_GOAL, REFRESH_FLOOR_GOAL, COMPILE_GOAL, EXPONENT_GOAL = 1.1, 1.3, 1.1, 1.5, 60.0, 1.1
PAPER_EXPONENT = 1.27


def shape_config(name):
    if name == "toy":
        # A vocabulary over the estimators' max_exact_classes (64): the
        # Fisher's labels are sampled, as at 50257.
        return dict(kind="lm", blocks=1, width=16, heads=2, mlp=32, vocab=96, seq=8)
    if name == "gpt2":
        return dict(kind="lm", blocks=12, width=768, heads=12, mlp=3072, vocab=50257, seq=SEQ)
    if name == "gpt2_2":
        return dict(kind="lm", blocks=2, width=768, heads=12, mlp=3072, vocab=50257, seq=SEQ)
    if name.startswith("gpt2_w"):
        d = int(name[len("gpt2_w"):])
        return dict(kind="lm", blocks=2, width=d, heads=max(1, d // 64), mlp=4 * d, vocab=50257, seq=SEQ)
    if name == "vit_b16":
        return dict(kind="vit", image=224, patch=16, blocks=12, width=768, heads=12, mlp=3072, classes=1000)
    if name == "resnet50":
        return dict(kind="resnet", image=224, classes=1000)
    raise SystemExit(f"unknown shape {name!r}")


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------ one process ---
def build(keras, name):
    """The model and a function ``data(n, seed) -> (x, y)`` of n examples."""
    import numpy as np

    cfg = shape_config(name)
    if cfg["kind"] == "lm":
        import keras_hub

        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=cfg["vocab"], num_layers=cfg["blocks"], num_heads=cfg["heads"], hidden_dim=cfg["width"],
            intermediate_dim=cfg["mlp"], dropout=0.0, max_sequence_length=max(1024, cfg["seq"]))
        model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)

        def data(n, seed):
            rng = np.random.default_rng(seed)
            tokens = rng.integers(0, cfg["vocab"], (n, cfg["seq"] + 1)).astype("int32")
            return {"token_ids": tokens[:, :-1], "padding_mask": np.ones((n, cfg["seq"]), "int32")}, tokens[:, 1:]

        return model, data, cfg["seq"]
    if cfg["kind"] == "vit":
        import keras_hub

        backbone = keras_hub.models.ViTBackbone(
            image_shape=(cfg["image"], cfg["image"], 3), patch_size=cfg["patch"], num_layers=cfg["blocks"],
            num_heads=cfg["heads"], hidden_dim=cfg["width"], mlp_dim=cfg["mlp"])
        model = keras_hub.models.ViTImageClassifier(backbone, num_classes=cfg["classes"], preprocessor=None)
    else:
        model = keras.applications.ResNet50(weights=None, input_shape=(cfg["image"], cfg["image"], 3),
                                            classes=cfg["classes"], classifier_activation=None)

    def data(n, seed):
        rng = np.random.default_rng(seed)
        return (rng.standard_normal((n, cfg["image"], cfg["image"], 3)).astype("float32"),
                rng.integers(0, cfg["classes"], n).astype("int32"))

    return model, data, 1


def optimizer(keras, kg, name, method, refresh_steps):
    base = (keras.optimizers.SGD(0.1, momentum=0.9) if shape_config(name)["kind"] == "resnet"
            else keras.optimizers.AdamW(1e-4))
    if method == "base":
        return base
    if method == "sam":
        return kg.optimizers.SAM(base, rho=RHO)
    return kg.optimizers.LLQRSAM(base, rho=RHO, structure=STRUCTURE[method], refresh_every=1000,
                                 refresh_source="callback", refresh_steps=refresh_steps)


class Memory:
    """Peak memory since the last ``reset``: the allocator's on a GPU, the
    resident set's high-water mark on a CPU."""

    def __init__(self, backend):
        self.backend = backend
        self.device = _accelerator(backend)

    def rss(self):
        return _status("VmRSS")

    def reset(self):
        if self.device is None:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # resets VmHWM to the current resident set
            except OSError:
                pass
        elif self.backend == "torch":
            import torch

            torch.cuda.reset_peak_memory_stats()
        elif self.backend == "tensorflow":
            import tensorflow as tf

            tf.config.experimental.reset_memory_stats("GPU:0")
        self._jax_floor = self.peak() if self.backend == "jax" and self.device is not None else 0

    def peak(self):
        if self.device is None:
            return _status("VmHWM")
        if self.backend == "torch":
            import torch

            return torch.cuda.max_memory_allocated()
        if self.backend == "tensorflow":
            import tensorflow as tf

            return tf.config.experimental.get_memory_info("GPU:0")["peak"]
        import jax

        return jax.devices()[0].memory_stats()["peak_bytes_in_use"]


def _status(key):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _accelerator(backend):
    """The accelerator's name, or None on a CPU."""
    if backend == "jax":
        import jax

        d = jax.devices()[0]
        return None if d.platform == "cpu" else str(d)
    if backend == "torch":
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    return gpus[0].name if gpus else None


def run_one(args, shape, work, method):
    """One method on one shape and work size, in this process."""
    import keras
    import numpy as np

    import keras_geosam as kg
    from keras_geosam import backend

    b = keras.backend.backend()
    memory = Memory(b)
    rss_before = memory.rss()
    keras.utils.set_random_seed(0)
    model, data, positions = build(keras, shape)
    per_step = WORK[("lm" if shape_config(shape)["kind"] == "lm" else "image")][work]
    opt = optimizer(keras, kg, shape, method, args.refresh_steps)
    if method != "base":
        model = kg.attach(model)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data(per_step * args.steps, 0)
    params = int(model.count_params())
    out = dict(backend=b, device=memory.device or "cpu", shape=shape, work=work, method=method, params=params,
               examples=per_step, units=per_step * positions, steps=args.steps)
    first = lambda a: keras.tree.map_structure(lambda t: t[:per_step], a)  # noqa: E731
    out["forward_flops"] = forward_flops(model, first(x))
    log(f"[{b}] {shape} {work} {method}: {params / 1e6:.1f}M parameters, {out['units']} "
        f"{'tokens' if positions > 1 else 'images'} per step, forward {out['forward_flops'] / 1e9:.1f} GFLOP")

    # train_on_batch, one batch at a time: keras-hub's fit feeds numpy data
    # through a grain / tf.data pipeline whose epoch end stalls for seconds
    # (seen on torch: epochs ending at 10.23 s whatever their steps took).
    batches = [keras.tree.map_structure(lambda t, i=i: t[i * per_step:(i + 1) * per_step], (x, y))
               for i in range(args.steps)]
    c0, t0 = backend.compile_seconds(), time.perf_counter()
    model.train_on_batch(*batches[0])
    first_s, out["compile_events_s"] = time.perf_counter() - t0, backend.compile_seconds() - c0
    model.train_on_batch(*batches[1 % args.steps])
    memory.reset()  # the timed steps' peak, not the compilation's
    c0, times = backend.compile_seconds(), []
    for i in range(args.steps):
        t0 = time.perf_counter()
        model.train_on_batch(*batches[i])  # returns the loss on the host: the step has run
        times.append(time.perf_counter() - t0)
    out["peak_bytes"] = memory.peak() - (rss_before if memory.device is None else 0)
    out["compile_after_first_step_s"] = backend.compile_seconds() - c0
    if b == "jax":  # compiles the step once more, for XLA's accounting only
        out["xla_step_bytes"] = _xla_step_bytes(model, batches[0])
    out["step_s"], out["step_min_s"], out["step_s_all"] = statistics.median(times), min(times), times
    out["compile_s"] = first_s - out["step_s"]
    log(f"[{b}] {shape} {work} {method}: step {out['step_s']:.3f} s (min {out['step_min_s']:.3f}), first step's "
        f"compilation {out['compile_s']:.1f} s, peak {out['peak_bytes'] / 1e9:.2f} GB")
    if method in STRUCTURE:
        pre = opt.preconditioner
        out["u_flops"] = u_flops(pre.layout)
        out["refresh_steps"] = args.refresh_steps
    if method in STRUCTURE and not args.skip_refresh:
        xb, yb = first(x), first(y)
        t0 = time.perf_counter()
        opt.refresh_now(model, xb, yb)
        out["refresh_compile_s"] = time.perf_counter() - t0
        memory.reset()
        c0, t0 = backend.compile_seconds(), time.perf_counter()
        opt.refresh_now(model, xb, yb)
        out["refresh_s"] = time.perf_counter() - t0
        out["refresh_compile_s"] -= out["refresh_s"]
        out["refresh_compiles_s"] = backend.compile_seconds() - c0
        out["refresh_peak_bytes"] = memory.peak() - (rss_before if memory.device is None else 0)
        if b == "jax":
            values = [v.value for v in model.trainable_variables]
            nt = [v.value for v in model.non_trainable_variables]
            compiled = pre.refresh_program(model).lower([p.value for p in pre.variables], values, nt, xb, yb).compile()
            analysis = compiled.memory_analysis()
            out["xla_refresh_bytes"] = {"arguments": analysis.argument_size_in_bytes, "temporaries": analysis.temp_size_in_bytes}
        log(f"[{b}] {shape} {work} {method}: refresh {out['refresh_s']:.1f} s (first call +{out['refresh_compile_s']:.1f} s)")
    return out


def run_paired(args, shape, work, methods):
    """Every method of `methods` on one shape and work size, in this
    process, their steps taken in turn (one step of each per round, every
    other round in reverse order): a ratio is read within a round, so a
    machine whose speed drifts (a shared host, a CPU's clock) moves both
    sides of it. One row per method, with ``paired_ratios``: the median
    over rounds of its step over SAM's and the base's."""
    import keras

    import keras_geosam as kg
    from keras_geosam import backend

    b = keras.backend.backend()
    per_step = WORK[("lm" if shape_config(shape)["kind"] == "lm" else "image")][work]
    runs, rows = {}, {}
    for method in methods:
        keras.utils.set_random_seed(0)
        model, data, positions = build(keras, shape)
        opt = optimizer(keras, kg, shape, method, args.refresh_steps)
        if method != "base":
            model = kg.attach(model)
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        x, y = data(per_step * args.steps, 0)
        batches = [keras.tree.map_structure(lambda t, i=i: t[i * per_step:(i + 1) * per_step], (x, y))
                   for i in range(args.steps)]
        row = dict(backend=b, device=_accelerator(b) or "cpu", shape=shape, work=f"{work}/paired", method=method,
                   params=int(model.count_params()), examples=per_step, units=per_step * positions, steps=args.steps,
                   forward_flops=forward_flops(model, batches[0][0]))
        if method in STRUCTURE:
            row["u_flops"] = u_flops(opt.preconditioner.layout)
        c0, t0 = backend.compile_seconds(), time.perf_counter()
        model.train_on_batch(*batches[0])
        row["first_step_s"] = time.perf_counter() - t0
        model.train_on_batch(*batches[1 % args.steps])
        runs[method], rows[method] = (model, batches), row
        log(f"[{b}] {shape} {work} paired: {method} built and compiled ({row['first_step_s']:.1f} s)")
    times = {m: [] for m in methods}
    for i in range(args.steps):
        # Every other round in reverse: a method's place in the round (what
        # ran just before it, what memory it finds) does not favour it.
        for m in (methods if i % 2 == 0 else methods[::-1]):
            model, batches = runs[m]
            t0 = time.perf_counter()
            model.train_on_batch(*batches[i])
            times[m].append(time.perf_counter() - t0)
    for m, row in rows.items():
        row["step_s"], row["step_min_s"], row["step_s_all"] = statistics.median(times[m]), min(times[m]), times[m]
        row["compile_s"] = row.pop("first_step_s") - row["step_s"]
        row["paired_ratios"] = {ref: statistics.median(t / r for t, r in zip(times[m], times[ref]))
                                for ref in ("sam", "base") if ref in times}
        log(f"[{b}] {shape} {work} paired: {m} step {row['step_s']:.3f} s, over SAM (paired) "
            f"{_f(row['paired_ratios'].get('sam'), '.3f')}")
    return list(rows.values())


def _xla_step_bytes(model, batch):
    """JAX: XLA's own accounting of the compiled train step (no allocator
    slack): its arguments (the state: weights, optimizer slots, U) and its
    temporaries (gradients, perturbed weights, activations), in bytes. The
    step is compiled once more here, as Keras' ``fit`` compiles it."""
    import jax

    state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True, optimizer_variables=True,
                                 metrics_variables=True)
    analysis = jax.jit(model.train_step, donate_argnums=0).lower(state, batch).compile().memory_analysis()
    return {"arguments": analysis.argument_size_in_bytes, "temporaries": analysis.temp_size_in_bytes}


ESTIMATOR_EXAMPLES = 8  # sequences of 128 tokens, or images
ESTIMATOR_PROBES = 4


def run_estimators(args, shape, probes=ESTIMATOR_PROBES):
    """``hessian_trace`` and K-FAC ``riemannian_sharpness`` on one batch of
    `shape`: seconds and gradients per probe (all the call's work), peak
    over a training step's (module doc)."""
    import warnings

    import keras

    from keras_geosam import sharpness
    from keras_geosam.curvature import model_functions

    b = keras.backend.backend()
    memory = Memory(b)
    rss_before = memory.rss()
    keras.utils.set_random_seed(0)
    model, data, positions = build(keras, shape)
    model.compile(optimizer=keras.optimizers.AdamW(1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data(ESTIMATOR_EXAMPLES, 0)
    out = dict(backend=b, device=memory.device or "cpu", shape=shape, work="estimators", method="estimators",
               examples=ESTIMATOR_EXAMPLES, units=ESTIMATOR_EXAMPLES * positions)
    model.train_on_batch(x, y)
    memory.reset()
    model.train_on_batch(x, y)
    out["params"] = int(model.count_params())
    out["step_peak_bytes"] = memory.peak() - (rss_before if memory.device is None else 0)
    fns = model_functions(model)
    grad = fns.kernel(fns.loss_and_grad_body)
    xs = keras.tree.map_structure(keras.ops.convert_to_tensor, x)
    ys = keras.ops.convert_to_tensor(y)
    times = []
    for _ in range(4):  # the first compiles
        t0 = time.perf_counter()
        keras.ops.convert_to_numpy(grad(fns.params(), fns.non_trainable(), xs, ys)[0])
        times.append(time.perf_counter() - t0)
    out["gradient_s"] = min(times[1:])
    # S_R's fixed cost: the K-FAC metric, built once per call whatever the
    # number of probes (its share of a probe falls as 1 / probes); timed
    # warm, after the calls (whose first call then compiles it).
    setup = {"riemannian_sharpness_kfac": lambda: sharpness.fisher_metric(model, x, y, "kfac",
                                                                           batch_size=ESTIMATOR_EXAMPLES)}
    calls = {"hessian_trace": lambda n: sharpness.hessian_trace(
                 model, x, y, num_probes=n, rtol=None, split=False, batch_size=ESTIMATOR_EXAMPLES),
             "riemannian_sharpness_kfac": lambda n: sharpness.riemannian_sharpness(
                 model, x, y, structure="kfac", num_probes=n, rtol=None, split=False,
                 batch_size=ESTIMATOR_EXAMPLES)}
    for name, call in calls.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # far from a minimum: the residual warnings are expected
            t0 = time.perf_counter()
            call(probes)  # compiles
            first = time.perf_counter() - t0
            memory.reset()
            t0 = time.perf_counter()
            estimate = call(probes)
            seconds = time.perf_counter() - t0
        per_probe = seconds / probes
        peak = memory.peak() - (rss_before if memory.device is None else 0)
        fixed = 0.0
        if name in setup:
            t0 = time.perf_counter()
            setup[name]()
            fixed = time.perf_counter() - t0
        marginal = max(seconds - fixed, 0.0) / probes
        # A process that already held the memory (a test's, after other
        # tests) may not grow for a small step: no ratio can be read then.
        over_step = peak / out["step_peak_bytes"] if out["step_peak_bytes"] > 0 else None
        out[name] = dict(probes=probes, per_probe_s=per_probe, per_probe_gradients=per_probe / out["gradient_s"],
                         setup_gradients=fixed / out["gradient_s"], marginal_gradients=marginal / out["gradient_s"],
                         compile_s=first - seconds, peak_bytes=peak, peak_over_step=over_step,
                         value=float(estimate.value), stderr=float(estimate.stderr))
        log(f"[{b}] {shape} {name}: {per_probe:.2f} s per probe = {per_probe / out['gradient_s']:.2f} gradients "
            f"({out[name]['setup_gradients']:.2f} once + {out[name]['marginal_gradients']:.2f} per probe) "
            f"({out['gradient_s']:.2f} s), first call +{first - seconds:.1f} s, peak {peak / 1e9:.2f} GB = "
            f"{_f(out[name]['peak_over_step'])} x the step's")
    return out


def estimator_table(rows):
    lines = ["| backend | shape | estimator | per probe s | gradients per probe | once per call (gradients) | each "
             "further probe (gradients) | first call + s | peak GB | peak / step's |",
             "|" + "---|" * 10]
    for r in rows:
        if r.get("method") != "estimators" or "error" in r:
            continue
        for name in ("hessian_trace", "riemannian_sharpness_kfac"):
            e = r[name]
            lines.append(f"| {r['backend']} | {r['shape']} | {name} | {e['per_probe_s']:.2f} | "
                         f"{e['per_probe_gradients']:.2f} | {e['setup_gradients']:.2f} | {e['marginal_gradients']:.2f} | "
                         f"{e['compile_s']:.1f} | {e['peak_bytes'] / 1e9:.2f} | "
                         f"{_f(e['peak_over_step'])} |")
    return "\n".join(lines) if len(lines) > 2 else ""


# ---------------------------------------------------------------- driver ---
def child(args, b, shape, work, method):
    """One run in a process of its own; its result (or error) as a dict."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [sys.executable, os.path.abspath(__file__), "--one", f"{shape}:{work}:{method}", "--json", path,
           "--steps", str(args.steps), "--refresh-steps", str(args.refresh_steps)]
    cmd += ["--skip-refresh"] if args.skip_refresh else []
    cmd += ["--methods", ",".join(args.methods)] if method == "paired" else []
    env = dict(os.environ, KERAS_BACKEND=b, TF_CPP_MIN_LOG_LEVEL="2")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=sys.stderr, timeout=args.timeout)
    try:
        if proc.returncode == 0:
            with open(path) as f:
                return json.load(f)
        return dict(backend=b, shape=shape, work=work, method=method,
                    error=f"exit {proc.returncode} after {time.perf_counter() - t0:.0f} s")
    finally:
        os.unlink(path)


def runs(args):
    if args.estimators:
        return [(s, "estimators", "estimators") for s in (["toy"] if args.toy else args.shapes)]
    if args.toy:
        return [("toy", "small", "paired")] if args.paired else [("toy", "small", m) for m in args.methods]
    if args.exponent:
        return [(f"gpt2_w{d}", "small", m) for d in EXPONENT_WIDTHS for m in ("base", "llqr_diag")]
    if args.paired:
        return [(s, w, "paired") for s in args.shapes for w in args.work]
    return [(s, w, m) for s in args.shapes for w in args.work for m in args.methods]


def _run(args, shape, work, method):
    if method == "estimators":
        return run_estimators(args, shape)
    if method == "paired":
        return run_paired(args, shape, work, args.methods)
    return run_one(args, shape, work, method)


def _as_rows(result):
    return result if isinstance(result, list) else [result]


def collect(args):
    results = []
    for b in args.backends:
        for shape, work, method in runs(args):
            if args.in_process:
                results += _as_rows(_run(args, shape, work, method))
            else:
                try:
                    results += _as_rows(child(args, b, shape, work, method))
                except subprocess.TimeoutExpired:
                    results.append(dict(backend=b, shape=shape, work=work, method=method,
                                        error=f"over --timeout {args.timeout} s"))
    return results


# ---------------------------------------------------------------- tables ---
def derive(rows):
    """Ratios and floors per (backend, shape, work), from its methods' rows."""
    cells = {}
    for r in rows:
        cells.setdefault((r["backend"], r["shape"], r["work"]), {})[r["method"]] = r
    for cell in cells.values():
        sam, base = cell.get("sam"), cell.get("base")
        for m, r in cell.items():
            if "error" in r:
                continue
            paired = r.get("paired_ratios", {})
            if base and "error" not in base:
                r["over_base"] = paired.get("base", r["step_s"] / base["step_s"])
            if not sam or "error" in sam:
                continue
            r["over_sam"] = paired.get("sam", r["step_s"] / sam["step_s"])
            grad = 3 * r["forward_flops"]
            if m in STRUCTURE:
                u = r["u_flops"]
                r["floor_over_sam"] = (2 * grad + 2 * u) / (2 * grad)
                r["floor_s"] = sam["step_s"] * r["floor_over_sam"]
                r["over_floor"] = r["over_sam"] / r["floor_over_sam"]
                if "refresh_s" not in r:
                    continue
                f = r["forward_flops"]
                r["refresh_floor_s"] = sam["step_s"] * (f + r["refresh_steps"] * (4 * f + 3 * u)) / (2 * grad)
                r["refresh_over_floor"] = r["refresh_s"] / r["refresh_floor_s"]
                r["amortised_over_sam"] = (r["step_s"] + r["refresh_s"] / AMORTISE) / sam["step_s"]
                r["refresh_every_10pct"] = r["refresh_s"] / (0.1 * sam["step_s"])
    return cells


def _f(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def table(rows):
    lines = ["| backend | shape | work | method | step s | /base | /SAM | floor/SAM | /floor | compile s | "
             "refresh s | refresh/floor | amort.@500 /SAM | refresh_every for 10% | peak GB (B/param) | refresh peak GB |",
             "|" + "---|" * 16]
    for r in rows:
        head = f"| {r['backend']} | {r['shape']} | {r['work']} | {LABELS.get(r['method'], r['method'])} |"
        if "error" in r:
            lines.append(head + f" ERR: {r['error']} |" + " |" * 11)
            continue
        peak = f"{r['peak_bytes'] / 1e9:.2f} ({r['peak_bytes'] / r['params']:.1f})" if "peak_bytes" in r else "-"
        refresh_peak = _f(r.get("refresh_peak_bytes") and r["refresh_peak_bytes"] / 1e9)
        lines.append(
            head + f" {r['step_s']:.3f} | {_f(r.get('over_base'))} | {_f(r.get('over_sam'))} | "
            f"{_f(r.get('floor_over_sam'))} | {_f(r.get('over_floor'))} | {r['compile_s']:.1f} | "
            f"{_f(r.get('refresh_s'), '.1f')} | {_f(r.get('refresh_over_floor'))} | {_f(r.get('amortised_over_sam'))} | "
            f"{_f(r.get('refresh_every_10pct'), '.0f')} | {peak} | {refresh_peak} |")
    return "\n".join(lines)


def memory_table(rows):
    """JAX rows: XLA's accounting of the step and refresh programs, in
    copies of the weights (4 bytes per parameter in float32)."""
    lines = ["| shape | work | method | step: state | step: temporaries | step total (B/param) | "
             "refresh: temporaries |", "|" + "---|" * 7]
    for r in rows:
        if "xla_step_bytes" not in r:
            continue
        w = 4 * r["params"]
        step = r["xla_step_bytes"]
        refresh = r.get("xla_refresh_bytes")
        total = step["arguments"] + step["temporaries"]
        lines.append(f"| {r['shape']} | {r['work']} | {LABELS[r['method']]} | {step['arguments'] / w:.2f} | "
                     f"{step['temporaries'] / w:.2f} | {total / w:.2f} ({total / r['params']:.1f}) | "
                     f"{_f(refresh and refresh['temporaries'] / w)} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def goals(cells):
    out = []

    def verdict(ok):
        return "met" if ok else "NOT met"

    for (b, shape, work), cell in sorted(cells.items()):
        where = f"{b} {shape} {work}"
        for m, r in sorted(cell.items()):
            if "error" in r:
                continue
            out.append(f"- {where} {LABELS[m]}: first step's compilation {r['compile_s']:.1f} s "
                       f"(<= {COMPILE_GOAL:g}): {verdict(r['compile_s'] <= COMPILE_GOAL)}")
            if "over_sam" not in r:
                continue
            if m == "llqr_diag":
                out.append(f"- {where} LLQR+SAM diag / SAM: {r['over_sam']:.2f} (<= {DIAG_GOAL}): "
                           f"{verdict(r['over_sam'] <= DIAG_GOAL)}")
            elif m in STRUCTURE:
                bound = max(KFAC_SAM_GOAL, FLOOR_GOAL * r["floor_over_sam"])
                out.append(f"- {where} {LABELS[m]} / SAM: {r['over_sam']:.2f} (<= max(1.3, 1.1 x floor) = "
                           f"{bound:.2f}): {verdict(r['over_sam'] <= bound)}")
            if "refresh_s" in r:
                out.append(f"- {where} {LABELS[m]} refresh / floor: {r['refresh_over_floor']:.2f} (<= "
                           f"{REFRESH_FLOOR_GOAL}), compilations in the warm refresh {r['refresh_compiles_s']:.1f} s: "
                           f"{verdict(r['refresh_over_floor'] <= REFRESH_FLOOR_GOAL and r['refresh_compiles_s'] == 0)}")
    return "\n".join(out)


def exponent(rows):
    from llqr import fit_power_law

    lines = []
    for b in sorted({r["backend"] for r in rows}):
        by_shape = {}
        for r in rows:
            # Only the GPT-2 widths: a fit across model families means nothing.
            if r["backend"] == b and "error" not in r and r["shape"].startswith("gpt2_w"):
                by_shape.setdefault(r["shape"], {})[r["method"]] = r
        points = [(c["base"]["params"], c["llqr_diag"]["step_s"] + c["llqr_diag"]["refresh_s"] / 1000 - c["base"]["step_s"])
                  for c in by_shape.values() if "base" in c and "refresh_s" in c.get("llqr_diag", {})]
        if len(points) < 2:
            continue
        fit = fit_power_law(*zip(*points))
        lines.append(f"- {b}: LLQR+SAM (diagonal, amortised at refresh_every=1000) overhead over the base ~ P^"
                     f"{fit['k']:.2f} [{fit['lo']:.2f}, {fit['hi']:.2f}] over {fit['n']} widths (paper: ~P^"
                     f"{PAPER_EXPONENT}; goal <= {EXPONENT_GOAL}: {'met' if fit['k'] <= EXPONENT_GOAL else 'NOT met'})")
    return "\n".join(lines)


def machine_line():
    load = os.getloadavg()
    return (f"{datetime.date.today()}; {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
            f"Python {platform.python_version()}; load {load[0]:.1f}")


def report(rows):
    estimators = estimator_table(rows)
    rows = [r for r in rows if r.get("method") != "estimators"]
    if estimators and not rows:
        return f"Machine: {machine_line()}\n\n{estimators}"
    cells = derive(rows)
    text = [f"Machine: {machine_line()}", "", table(rows), "", "Goals:", goals(cells)]
    memory = memory_table(rows)
    if memory:
        text += ["", "JAX: XLA's accounting of the compiled programs, in copies of the weights:", memory]
    exp = exponent(rows)
    if exp:
        text += ["", "Overhead exponent:", exp]
    return "\n".join(text)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backends", default=os.environ.get("KERAS_BACKEND", "jax"),
                   help="comma-separated, or 'all' (default: KERAS_BACKEND, else jax)")
    p.add_argument("--shapes", default="gpt2_2")
    p.add_argument("--work", default="small", help="small, large or both (comma-separated)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--steps", type=int, default=8, help="timed steps")
    p.add_argument("--refresh-steps", type=int, default=REFRESH_STEPS)
    p.add_argument("--skip-refresh", action="store_true", help="time the steps only (large work sizes on a CPU)")
    p.add_argument("--exponent", action="store_true", help="base and LLQR+SAM diag over GPT-2 widths")
    p.add_argument("--estimators", action="store_true", help="tr H and K-FAC S_R per probe at each shape")
    p.add_argument("--paired", action="store_true",
                   help="the methods in one process per shape, steps in turn: ratios immune to a drifting machine")
    p.add_argument("--toy", action="store_true", help="a tiny GPT-2, every method in this process (seconds)")
    p.add_argument("--in-process", action="store_true", help="every run in this process (smoke runs)")
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds per process")
    p.add_argument("--json", help="write every row here")
    p.add_argument("--one", help=argparse.SUPPRESS)  # shape:work:method, run in this process
    args = p.parse_args(argv)
    args.backends = list(BACKENDS) if args.backends == "all" else args.backends.split(",")
    args.shapes, args.work, args.methods = args.shapes.split(","), args.work.split(","), args.methods.split(",")
    if args.toy:
        args.in_process, args.steps, args.refresh_steps = True, 4, 2
        args.backends = [os.environ.get("KERAS_BACKEND", "jax")]
    if args.one:
        shape, work, method = args.one.split(":")
        row = _run(args, shape, work, method)
        with open(args.json, "w") as f:
            json.dump(row, f)
        return 0
    if args.in_process and len(args.backends) > 1:
        raise SystemExit("--in-process runs one backend: the one KERAS_BACKEND names")
    if args.in_process:
        os.environ["KERAS_BACKEND"] = args.backends[0]
    rows = collect(args)
    derive([r for r in rows if r.get("method") != "estimators"])  # the ratios go into the rows
    if args.json:  # before the report: a report that fails loses no measurement
        with open(args.json, "w") as f:
            json.dump({"machine": machine_line(), "rows": rows}, f, indent=1)
    print(report(rows))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
