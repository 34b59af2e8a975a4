#!/usr/bin/env python
"""One table: SAM-family train steps against SGD and against the peers.

One backend per process (Keras cannot switch backends inside a process):

    KERAS_BACKEND=jax python bench/sam_step.py [--quick] [--batches 64,256,1024] [--json out.json]
    python bench/sam_step.py --all [--quick] [--omp-passive] [--json out.json]

``--all`` runs this script once per backend (jax, tensorflow, torch) in a
subprocess and prints one combined table. ``--omp-passive`` sets
``OMP_WAIT_POLICY=PASSIVE``: on a CPU shared with other jobs, torch's
spinning OpenMP threads otherwise slow every torch op down by up to ~10x.

Per backend, for each model (an MLP 784-512-512-10: ReLU, logits, sparse CE;
a small CNN: 28x28x1, Conv 16 3x3 relu, MaxPool, Conv 32 3x3 relu, MaxPool,
Flatten, Dense 10) and each batch size (``--batches``, default 64,256,1024),
random data, identical initial weights, everything interleaved epoch by
epoch in one process (a "runner" = one epoch over the same batches):

- attention models, only when named (``--models transformer,vit``; default
  batch 32), functional ``kg.Model``\s: ``transformer``: 4 blocks, d=128, 4
  heads (key_dim 32), 64 random tokens of a 512-word vocabulary, token
  Embedding + a learned position Embedding; per block MultiHeadAttention +
  residual + LayerNormalization + feed-forward (Dense 4d gelu, Dense d) +
  residual + LayerNormalization; GlobalAveragePooling1D, Dense 10 (one label
  per sequence). ``vit``: the same blocks (d=64) on 32x32x3 images cut into
  64 patches by Conv2D(d, 4, strides=4) and a Reshape, with a learned
  position Embedding. No peers for them. ``--vit-widths 32,64,128,256``
  runs the ViT at those widths (``vit_d<d>``) and fits LLQR+SAM's amortised
  overhead over SGD (step - SGD step) as ~ P^k (``llqr.fit_power_law``);
- the first step's compilation per runner: the warm-up epoch less the
  median timed epoch;

- ours through ``kg.Sequential.fit``: ``keras.optimizers.SGD(0.05,
  momentum=0.9)`` (the baseline of every ratio) and SAM (rho 0.05), ASAM
  (rho 0.5), F-SAM, Fisher-SAM (rho 0.05) and LLQR+SAM (rho 0.05; diagonal
  and K-FAC U) over that SGD, default ``jit_compile`` (``--torch-compile``: True, i.e. torch.compile on torch). Per-step time = epoch
  time / steps (the epoch ends on a host read of the loss, so all queued
  work is included), median over the timed epochs, after one warm-up epoch
  each (compilation). Wall time and process CPU time (all threads; far less
  sensitive to other jobs) are both kept;
- LLQR+SAM: the timed steps never refresh U (``refresh_source="callback"``:
  the step has no refresh branch; ``--llqr-source step`` keeps the in-step
  refresh branch with ``refresh_every`` beyond the run instead: only step 0,
  in the warm-up epoch, refreshes). One refresh (``opt.refresh_now(model, x,
  y)`` on one batch, 50 inner steps) is timed after a warm-up refresh, and
  the amortised step at ``refresh_every=1000`` is step + refresh / 1000;
- peers on the same model, data, weights and hyperparameters:
  JAX: ``optax.contrib.sam`` (opaque mode, ``sync_period=2``,
  ``adv_optimizer = chain(normalize(), sgd(rho))``, outer ``sgd(0.05,
  momentum=0.9)``) and ``optax.sgd(0.05, momentum=0.9)`` on the model
  written as a pure jax function, one jitted step (donated state) called in
  a Python loop over device-resident batches; torch: a
  ``torch.nn.Sequential`` copy of the model (Keras weights; NCHW for the
  CNN) with ``torch.optim.SGD(0.05, momentum=0.9)`` and with ``TorchSAM``
  below (the first_step / second_step SAM of the widely used PyTorch
  implementation: closure, two backward passes, e_w = rho g / ||g||,
  restore, base SGD step), in a Python loop over tensors already on the
  device. TensorFlow: no peer;
- ours without ``fit`` (JAX and torch): Keras' own ``train_step`` of our
  SGD and SAM models in the peers' loop (JAX: jitted as ``fit`` jits it,
  donated state), so ours/peer can be read with and without ``fit``'s
  per-step overhead (data adapter, epoch iterator, callbacks);
- equivalence: the parameters of our SAM (via ``fit``, shuffle=False) and of
  the peer's SAM after 20 steps from identical weights on identical batches
  (batch 256); JAX: float32 and float64 (in a subprocess with
  ``JAX_ENABLE_X64=1``); torch: float32 (Keras 3.15 computes a float64
  model's matmuls in float32 on torch) and the initial logits of the copy.
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

from _backends import run_each_backend  # noqa: E402  (bench/ is the script's own folder)
from _flops import u_flops  # noqa: E402
MODELS = ("mlp", "cnn")  # the default --models
# Attention models: run only when named in --models (or --vit-widths); peers skipped.
ATTENTION_MODELS = ("transformer", "vit")
SEQ_LEN, VOCAB, CLASSES = 64, 512, 10  # transformer: tokens per sequence, vocabulary
IMAGE, PATCH = 32, 4  # vit: 32x32x3 images, 4x4 patches (64 of them)
DEPTH, HEADS = 4, 4  # both: blocks, attention heads (key_dim = d / heads)
WIDTH = {"transformer": 128, "vit": 64}  # d; "vit_d<d>" names another width (--vit-widths)
DEFAULT_BATCHES = "64,256,1024"
QUICK_BATCHES = "64"
ATTENTION_BATCHES = "32"  # the attention models' default batch (with or without --quick)
LR, MOMENTUM, RHO = 0.05, 0.9, 0.05
ASAM_RHO = 0.5  # the reference's suggested ASAM radius (CIFAR-10)
REFRESH_EVERY = 1000  # for the amortised LLQR+SAM step
EQ_STEPS, EQ_BATCH = 20, 256
# Goals (issue "Optimizer steps at their floor on every backend, measured
# side by side with the peers").
SAM_GOAL = 1.95  # SAM step <= 1.95x the Keras SGD step (same model, batch, backend)
OPTAX_GOAL = 1.05  # JAX: our SAM step <= 1.05x optax.contrib.sam's
LLQR_DIAG_GOAL = 2.05  # LLQR+SAM diagonal, amortised at refresh_every=1000, <= 2.05x SGD
KFAC_FLOOR_GOAL = 1.1  # LLQR+SAM K-FAC step <= 1.1x its FLOP floor (SAM step + U products at the gradient's rate)
# Goals for the attention models (issue "Bench rows"): SAM and LLQR+SAM
# diagonal against SGD, the first step's compilation, the growth exponent of
# LLQR+SAM's overhead over SGD in the parameter count (ViT widths).
ATTENTION_SAM_GOAL, ATTENTION_LLQR_DIAG_GOAL = 2.1, 2.2
COMPILE_GOAL_S = 60.0  # first fit epoch - median epoch, per method, CPU
EXPONENT_GOAL = 1.1  # overhead ~ P^k, k <= 1.1 (the paper: ~1.27)
METHODS = ("sam", "asam", "fsam", "fishersam", "llqr_diag", "llqr_kfac")
LABELS = {
    "sgd": "SGD", "sam": "SAM", "asam": "ASAM", "fsam": "F-SAM", "fishersam": "Fisher-SAM",
    "llqr_diag": "LLQR+SAM diag", "llqr_kfac": "LLQR+SAM K-FAC",
    "raw_sgd": "SGD train_step", "raw_sam": "SAM train_step", "peer_sgd": "peer SGD", "peer_sam": "peer SAM",
}
LLQR_STRUCTURE = {"llqr_diag": "diagonal", "llqr_kfac": "kfac"}


def settings(args):
    """Steps per epoch per (model, batch): an epoch of about `examples`
    examples, at least `min_steps` steps; `rounds` timed epochs per runner."""
    batches = [int(b) for b in (args.batches or (QUICK_BATCHES if args.quick else DEFAULT_BATCHES)).split(",")]
    models = [m for m in (args.models or ("" if args.vit_widths else ",".join(MODELS))).split(",") if m]
    models += [f"vit_d{int(w)}" for w in (args.vit_widths or "").split(",") if w]
    for m in models:
        try:
            model_kind(m)
        except ValueError:
            raise SystemExit(f"unknown model {m!r}; choose from {MODELS + ATTENTION_MODELS} or vit_d<width>") from None
    methods = [m for m in (args.methods or ",".join(METHODS)).split(",")]
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"unknown method {m!r}; choose from {METHODS}")
    if args.quick:
        cfg = dict(examples={"mlp": 0, "cnn": 0, "transformer": 0, "vit": 0},
                   min_steps={"mlp": 10, "cnn": 4, "transformer": 3, "vit": 3}, rounds=3,
                   refresh_steps=2, refresh_repeats=1, eq_models=["mlp"])
    else:
        cfg = dict(examples={"mlp": 10240, "cnn": 2560, "transformer": 256, "vit": 256},
                   min_steps={"mlp": 10, "cnn": 4, "transformer": 4, "vit": 4}, rounds=9,
                   refresh_steps=50, refresh_repeats=3, eq_models=list(MODELS))
    for key in ("rounds", "refresh_steps", "refresh_repeats"):
        if getattr(args, key):
            cfg[key] = getattr(args, key)
    attention_batches = [int(b) for b in (args.batches or ATTENTION_BATCHES).split(",")]
    cfg.update(batches=batches, models=models, methods=methods, llqr_source=args.llqr_source,
               torch_compile=args.torch_compile,
               batches_for={m: attention_batches if model_kind(m)[0] in ATTENTION_MODELS else batches for m in models},
               eq_models=[m for m in cfg["eq_models"] if m in models])
    return cfg


def model_kind(name):
    """``(kind, width)``: "mlp"/"cnn" -> (name, None); "transformer"/"vit"
    -> their default d; "vit_d<d>" -> ("vit", d)."""
    if name in MODELS:
        return name, None
    if name in ATTENTION_MODELS:
        return name, WIDTH[name]
    if name.startswith("vit_d") and name[5:].isdigit() and int(name[5:]) % HEADS == 0:
        return "vit", int(name[5:])
    raise ValueError(name)


def steps_for(cfg, name, batch):
    kind = model_kind(name)[0]
    return max(cfg["min_steps"][kind], cfg["examples"][kind] // batch)


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


def attention_graph(keras, name):
    """``(inputs, outputs)`` of the Transformer or ViT classifier (module doc):
    tokens (or patches) + a learned position embedding (an Embedding over
    the positions), DEPTH post-norm blocks of MultiHeadAttention + residual
    + LayerNormalization + feed-forward (Dense 4d gelu, Dense d) + residual
    + LayerNormalization, then GlobalAveragePooling1D and Dense(CLASSES)."""
    L = keras.layers
    kind, d = model_kind(name)
    if kind == "transformer":
        inputs = keras.Input((SEQ_LEN,), dtype="int32")
        h = L.Embedding(VOCAB, d, name="tokens")(inputs)
        positions = SEQ_LEN
    else:
        inputs = keras.Input((IMAGE, IMAGE, 3))
        h = L.Conv2D(d, PATCH, strides=PATCH, name="patches")(inputs)
        positions = (IMAGE // PATCH) ** 2
        h = L.Reshape((positions, d))(h)
    # Position ids 0..T-1 per example, as a tensor of the graph, so the
    # position Embedding is a layer of the model (trained, with its own rule).
    ids = L.Lambda(lambda t: keras.ops.zeros((keras.ops.shape(t)[0], positions), "int32")
                   + keras.ops.arange(positions, dtype="int32"), output_shape=(positions,), name="position_ids")(h)
    h = L.Add()([h, L.Embedding(positions, d, name="position_embedding")(ids)])
    for i in range(DEPTH):
        a = L.MultiHeadAttention(HEADS, d // HEADS, name=f"attention_{i}")(h, h)
        h = L.LayerNormalization(name=f"norm_{i}a")(L.Add()([h, a]))
        f = L.Dense(4 * d, activation="gelu", name=f"ff_{i}a")(h)
        f = L.Dense(d, name=f"ff_{i}b")(f)
        h = L.LayerNormalization(name=f"norm_{i}b")(L.Add()([h, f]))
    outputs = L.Dense(CLASSES, name="head")(L.GlobalAveragePooling1D()(h))
    return inputs, outputs


def make_optimizer(keras, kg, variant, cfg):
    base = keras.optimizers.SGD(LR, momentum=MOMENTUM)
    if variant in ("sgd", "raw_sgd"):
        return base
    if variant in ("sam", "raw_sam"):
        return kg.optimizers.SAM(base, rho=RHO)
    if variant == "asam":
        return kg.optimizers.SAM(base, rho=ASAM_RHO, adaptive=True)
    if variant == "fsam":
        return kg.optimizers.FSAM(base, rho=RHO)
    if variant == "fishersam":
        return kg.optimizers.FisherSAM(base, rho=RHO)
    if variant in LLQR_STRUCTURE:
        if cfg["llqr_source"] == "step":
            # The in-step refresh branch stays in the compiled step; only
            # step 0 (in the warm-up epoch) is due.
            source = dict(refresh_source="step", refresh_every=10**9)
        else:
            source = dict(refresh_source="callback", refresh_every=REFRESH_EVERY)
        return kg.optimizers.LLQRSAM(
            base, rho=RHO, structure=LLQR_STRUCTURE[variant], refresh_steps=cfg["refresh_steps"], **source
        )
    raise ValueError(variant)


def keras_model(keras, name, model_cls, label=None):
    """The model `name`: ``model_cls.Sequential(layers)`` for mlp/cnn,
    ``model_cls.Model(inputs, outputs)`` (functional) for transformer/vit;
    `model_cls` is ``keras`` or ``keras_geosam``."""
    kw = {} if label is None else {"name": label}
    if model_kind(name)[0] in MODELS:
        return model_cls.Sequential(layers_for(keras, name), **kw)
    return model_cls.Model(*attention_graph(keras, name), **kw)


def build_model(keras, kg, name, variant, weights, cfg):
    model = keras_model(keras, name, kg, label=f"{name}_{variant}")
    model.compile(
        optimizer=make_optimizer(keras, kg, variant, cfg),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True if cfg.get("torch_compile") and keras.backend.backend() == "torch" else "auto",
    )
    model.set_weights(weights)
    return model


def initial_weights(keras, name):
    keras.utils.set_random_seed(0)
    return keras_model(keras, name, keras).get_weights()


def make_data(np, name, n):
    """Random inputs and labels (10 classes; the transformer: random tokens,
    one label per sequence)."""
    kind = model_kind(name)[0]
    rng = np.random.default_rng({"mlp": 1, "cnn": 2, "transformer": 3, "vit": 4}[kind])
    if kind == "transformer":
        x = rng.integers(0, VOCAB, size=(n, SEQ_LEN)).astype("int32")
    else:
        shape = {"mlp": (n, 784), "cnn": (n, 28, 28, 1), "vit": (n, IMAGE, IMAGE, 3)}[kind]
        x = rng.standard_normal(shape).astype("float32")
    y = rng.integers(0, CLASSES, size=n).astype("int32")
    return x, y


# --------------------------------------------------------------- timing ---
def epoch_timer(keras):
    class EpochTimer(keras.callbacks.Callback):
        """Wall and CPU time of each epoch. Only epoch hooks: fit keeps
        dispatching steps asynchronously; CallbackList.on_epoch_end reads
        the epoch's logs on the host first, so the time includes all queued
        work."""

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


def fit_runner(model, timer_cls, x, y, batch):
    def run():
        timer = timer_cls()
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
        return timer.times[0], timer.cpu[0], timer.losses[0]

    return run


def timed(loop):
    """A runner from a loop that returns its last loss (already synced)."""

    def run():
        t0, c0 = time.perf_counter(), time.process_time()
        loss = loop()
        return time.perf_counter() - t0, time.process_time() - c0, loss

    return run


def time_refresh(keras, model, x, y, repeats):
    """(first call s, median warm call s) of one ``refresh_now``."""
    opt = model.optimizer

    def once():
        t0 = time.perf_counter()
        opt.refresh_now(model, x, y)
        keras.ops.convert_to_numpy(opt.preconditioner.variables[0])  # synchronise
        return time.perf_counter() - t0

    first = once()
    return first, statistics.median(once() for _ in range(repeats))


def kernel_positions(np, model, layout_by_path):
    """``{kernel path: positions}``: how many positions per example a
    kernel's matmul runs at, from its top-level layer's output shape. A
    layer's own kernel with view (m, n): output elements per example / n
    (Conv: the output pixels; Dense or EinsumDense on a sequence: its length;
    1 on a vector); a kernel of a nested layer: the output's positions
    (MultiHeadAttention, self-attention: every projection at the query's
    positions)."""
    out = {}
    for layer in model.layers:
        try:
            shape = [int(s) for s in layer.output.shape[1:]]
        except (AttributeError, ValueError, TypeError):
            continue
        for v in layer.trainable_variables:
            cls, vshape, split = layout_by_path.get(v.path, (None, None, None))
            if split is None:
                continue
            if v is getattr(layer, "kernel", None):
                out[v.path] = int(np.prod(shape)) // int(np.prod(vshape[split:]))
            else:
                out[v.path] = int(np.prod(shape[:-1]))
    return out


def kfac_flops(np, model, batch):
    """``(U FLOPs per step, gradient FLOPs per batch)`` of a model trained
    with a K-FAC LLQR+SAM: an estimate.

    U: :func:`u_flops` of the optimizer's layout, applied twice per step
    (perturbation and descent). A gradient: per kernel with a K-FAC view
    (m, n) applied at P positions per example (:func:`kernel_positions`),
    the forward, kernel-gradient and input-gradient matmuls, 2 B P m n
    each, except the input gradient of a kernel that is the model's first
    trainable tensor (its input is the data); an Embedding is a gather (no
    matmul). Per MultiHeadAttention layer, the score and value matmuls,
    QK^T and AV, each 2 B H T^2 d_head forward and two such products
    backward (both operands are activations): 6 B H T^2 (d_key + d_value).
    Softmax, normalisation, activations and biases are not counted.
    """
    import keras

    P = model.optimizer.preconditioner
    by_path = dict(zip(P.paths, P.layout))
    u = 2 * u_flops(P.layout)
    positions = kernel_positions(np, model, by_path)
    first_path = model.trainable_variables[0].path
    grad = 0
    for path, (cls, shape, split) in by_path.items():
        if split is None or cls.__name__.startswith("DiagonalInput"):
            continue
        m, n = int(np.prod(shape[:split])), int(np.prod(shape[split:]))
        grad += (2 if path == first_path else 3) * 2 * batch * positions[path] * m * n
    for layer in model.layers:
        if isinstance(layer, keras.layers.MultiHeadAttention):
            t = int(np.prod(layer.output.shape[1:-1]))
            grad += 6 * batch * layer._num_heads * t * t * (layer._key_dim + layer._value_dim)
    return u, grad


def time_kfac_floor(keras, np, model, x, y, repeats=15):
    """One U application and one batch gradient, each through
    ``backend.compile`` (jit on JAX, tf.function on TensorFlow, eager on
    torch), warm; medians in seconds."""
    from keras_geosam import backend
    from keras_geosam.curvature.functional import model_functions
    from keras_geosam.preconditioner import structures

    sync = lambda out: keras.ops.convert_to_numpy(out[0] if isinstance(out, (list, tuple)) else out)  # noqa: E731
    fns = model_functions(model)
    grad = fns.kernel(fns.loss_and_grad_body)
    params, nt = fns.params(), fns.non_trainable()
    xb, yb = keras.ops.convert_to_tensor(x), keras.ops.convert_to_tensor(y)
    P = model.optimizer.preconditioner
    u = backend.compile(lambda ps, vs: structures.operator(P.layout, ps).matvec(vs))
    us = [p.value for p in P.variables]
    rng = np.random.default_rng(0)
    vs = [keras.ops.convert_to_tensor(rng.standard_normal(tuple(v.shape)).astype("float32")) for v in model.trainable_variables]

    def med(call):
        sync(call())
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            sync(call())
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return med(lambda: u(us, vs)), med(lambda: grad(params, nt, xb, yb))


# ---------------------------------------------------------- one backend ---
def run_backend(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.omp_passive:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # before torch loads libgomp
    load_start = os.getloadavg()
    t_start = time.perf_counter()
    import keras
    import numpy as np

    import keras_geosam as kg

    warnings.filterwarnings("ignore", message=".*piecewise linear.*")
    b = keras.backend.backend()
    cfg = settings(args)
    timer_cls = epoch_timer(keras)
    result = {"backend": b, "quick": args.quick, "settings": cfg, "env": environment(b), "cells": [], "equivalence": {}}
    result["env"]["loadavg_start"] = load_start

    for name in cfg["models"]:
        w0 = initial_weights(keras, name)
        for batch in cfg["batches_for"][name]:
            result["cells"].append(measure_cell(keras, kg, np, b, name, batch, w0, cfg, timer_cls))
        if name in cfg["eq_models"]:
            if b == "jax":
                result["equivalence"][name] = optax_equivalence_both(keras, kg, np, name, w0)
            elif b == "torch":
                # float32 only: Keras 3.15 computes torch matmuls of float64
                # tensors in float32 (its result_type maps float64 to float32
                # on torch), so a "float64" Keras model is not one there.
                result["equivalence"][name] = {"float32": torch_equivalence(keras, kg, np, name)}
    result["env"]["loadavg_end"] = os.getloadavg()
    result["env"]["wall_s"] = time.perf_counter() - t_start
    return result


def measure_cell(keras, kg, np, b, name, batch, w0, cfg, timer_cls):
    steps = steps_for(cfg, name, batch)
    x, y = make_data(np, name, steps * batch)
    variants = ["sgd"] + cfg["methods"]
    models, runners, first = {}, {}, {}
    for v in variants:
        log(f"[{b}] {name} b={batch} {LABELS[v]}: build + warm-up epoch")
        models[v] = build_model(keras, kg, name, v, w0, cfg)
        runners[v] = fit_runner(models[v], timer_cls, x, y, batch)
        t0 = time.perf_counter()
        runners[v]()
        first[v] = time.perf_counter() - t0
    peer = None
    if name not in MODELS:
        pass  # attention models: no peer (not written as pure JAX / torch.nn)
    elif b == "jax":
        peer = jax_runners(keras, kg, np, name, w0, x, y, batch, steps, models, cfg)
    elif b == "torch":
        peer = torch_runners(keras, kg, np, name, w0, x, y, batch, steps, cfg)
    if peer:
        for k, run in peer["runners"].items():
            log(f"[{b}] {name} b={batch} {LABELS[k]}: warm-up loop")
            t0 = time.perf_counter()
            run()
            first[k] = time.perf_counter() - t0
            runners[k] = run
    R = cfg["rounds"]
    log(f"[{b}] {name} b={batch}: {R} round(s) x {len(runners)} runners x 1 epoch of {steps} steps")
    wall, cpu, losses = ({k: [] for k in runners} for _ in range(3))
    for _ in range(R):
        for k, run in runners.items():
            t, c, loss = run()
            wall[k].append(t / steps)
            cpu[k].append(c / steps)
            losses[k] = loss
    rows = {}
    for k in runners:
        rows[k] = {
            "step_s": statistics.median(wall[k]),
            "step_min_s": min(wall[k]),
            "step_max_s": max(wall[k]),
            "cpu_step_s": statistics.median(cpu[k]),
            "warmup_s": first[k],
            # The first step's compilation (and the first epoch's one-off
            # work): the warm-up epoch less the median timed epoch.
            "compile_s": first[k] - statistics.median(wall[k]) * steps,
            "final_loss": losses[k],
            # Per timed epoch, in the interleaved order: paired ratios (derive).
            "rounds_s": wall[k],
            "cpu_rounds_s": cpu[k],
        }
        if k in models:
            rows[k]["jit_compile"] = bool(models[k].jit_compile)
    cell = {"model": name, "width": model_kind(name)[1], "batch": batch, "steps": steps,
            "num_params": int(models["sgd"].count_params()),
            "runners": rows, "refresh": {}}
    if peer:
        cell["peer"] = peer["label"]
    # LLQR+SAM: one refresh on one batch, after the timed steps.
    for v in variants:
        if v not in LLQR_STRUCTURE:
            continue
        log(f"[{b}] {name} b={batch} {LABELS[v]}: refresh_now ({cfg['refresh_steps']} inner steps)")
        refreshes_before = int(keras.ops.convert_to_numpy(models[v].optimizer.refreshes))
        first_s, refresh_s = time_refresh(keras, models[v], x[:batch], y[:batch], cfg["refresh_repeats"])
        cell["refresh"][v] = {"first_s": first_s, "refresh_s": refresh_s, "inner_steps": cfg["refresh_steps"],
                              "refreshes_in_timed_steps": refreshes_before - (1 if cfg["llqr_source"] == "step" else 0)}
    if "llqr_kfac" in models and "sam" in models:
        log(f"[{b}] {name} b={batch} LLQR+SAM K-FAC: FLOP floor (one U product, one gradient)")
        u_step_flops, grad_flops = kfac_flops(np, models["llqr_kfac"], batch)
        u_s, grad_s = time_kfac_floor(keras, np, models["llqr_kfac"], x[:batch], y[:batch])
        cell["kfac_floor"] = {"u_flops_per_step": u_step_flops, "grad_flops": grad_flops, "u_product_s": u_s, "grad_s": grad_s}
    derive(cell)
    del models
    return cell


def paired_ratio_interval(num, den, level=0.95):
    """``(lo, hi)``: the `level` t interval of the geometric mean of the
    paired ratios num_i / den_i (epoch i of two runners, run back to back),
    from their logs; NaNs with fewer than 2 pairs. A load change on the
    machine moves both members of a pair, so the interval is the ratio's
    own run-to-run uncertainty."""
    import math

    from scipy import stats

    logs = [math.log(a / b) for a, b in zip(num, den)]
    n = len(logs)
    if n < 2:
        return float("nan"), float("nan")
    mean, sem = statistics.fmean(logs), statistics.stdev(logs) / math.sqrt(n)
    half = stats.t.ppf(0.5 + level / 2, n - 1) * sem
    return math.exp(mean - half), math.exp(mean + half)


def derive(cell):
    """Ratios of medians (wall) and of CPU medians; for each method's step
    over SGD's, also the 95% interval of the paired per-epoch ratios."""
    r = cell["runners"]
    out = {}
    for key, suffix in (("step_s", ""), ("cpu_step_s", "_cpu")):
        sgd = r["sgd"][key]
        rounds = key.replace("step_s", "rounds_s")
        for v in METHODS:
            if v in r:
                out[v + suffix] = r[v][key] / sgd
                out[v + suffix + "_ci"] = paired_ratio_interval(r[v][rounds], r["sgd"][rounds])
        for v, ref in cell["refresh"].items():
            amort = r[v][key] + ref["refresh_s"] / REFRESH_EVERY
            out[v + "_amortised" + suffix] = amort / sgd
            # The refresh's share taken as exact (timed separately, warm).
            lo, hi = out[v + suffix + "_ci"]
            share = ref["refresh_s"] / REFRESH_EVERY / sgd
            out[v + "_amortised" + suffix + "_ci"] = (lo + share, hi + share)
            if not suffix:
                ref["amortised_step_s"] = amort
        if "peer_sam" in r:
            out["peer_sam_over_sgd" + suffix] = r["peer_sam"][key] / r["peer_sgd"][key]
            out["sam_over_peer_sam" + suffix] = r["sam"][key] / r["peer_sam"][key] if "sam" in r else float("nan")
            out["raw_sam_over_peer_sam" + suffix] = r["raw_sam"][key] / r["peer_sam"][key]
            out["sgd_over_peer_sgd" + suffix] = sgd / r["peer_sgd"][key]
            out["raw_sgd_over_peer_sgd" + suffix] = r["raw_sgd"][key] / r["peer_sgd"][key]
            out["raw_sam_over_raw_sgd" + suffix] = r["raw_sam"][key] / r["raw_sgd"][key]
    f = cell.get("kfac_floor")
    if f and "sam" in r and "llqr_kfac" in r and f["grad_flops"] > 0:
        # Floor: the SAM step plus both U products run at the gradient's
        # FLOP rate; `rate` = the U products' achieved rate over the gradient's.
        grad_rate = f["grad_flops"] / f["grad_s"]
        f["rate_u_over_grad"] = (f["u_flops_per_step"] / 2 / f["u_product_s"]) / grad_rate
        f["floor_s"] = r["sam"]["step_s"] + f["u_flops_per_step"] / grad_rate
        out["llqr_kfac_over_floor"] = r["llqr_kfac"]["step_s"] / f["floor_s"]
        if "llqr_kfac" in cell["refresh"]:
            out["llqr_kfac_amortised_over_floor"] = cell["refresh"]["llqr_kfac"]["amortised_step_s"] / f["floor_s"]
    cell["ratios"] = out


# --------------------------------------------------------- JAX / optax ---
def jax_forward(name):
    import jax
    import jax.numpy as jnp

    if name == "mlp":
        def forward(params, xb):
            h = xb
            for i, (w, bias) in enumerate(params):
                h = h @ w + bias
                if i < len(params) - 1:
                    h = jax.nn.relu(h)
            return h

        return forward

    dn = ("NHWC", "HWIO", "NHWC")  # Keras' layouts: channels last, kernel HWIO

    def pool(h):
        return jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")

    def forward(params, xb):
        (k1, b1), (k2, b2), (k3, b3) = params
        h = pool(jax.nn.relu(jax.lax.conv_general_dilated(xb, k1, (1, 1), "VALID", dimension_numbers=dn) + b1))
        h = pool(jax.nn.relu(jax.lax.conv_general_dilated(h, k2, (1, 1), "VALID", dimension_numbers=dn) + b2))
        return h.reshape(h.shape[0], -1) @ k3 + b3  # NHWC flatten, as Keras' Flatten

    return forward


def jax_loss(name):
    import jax
    import jax.numpy as jnp

    forward = jax_forward(name)

    def loss(params, xb, yb):
        logp = jax.nn.log_softmax(forward(params, xb), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, yb[:, None].astype(jnp.int32), axis=-1))

    return loss


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


def optax_step(loss_fn, opt, two_pass, donate=True):
    import jax
    import optax

    def step(params, state, xb, yb):
        loss, g = jax.value_and_grad(loss_fn)(params, xb, yb)
        if two_pass:
            grad_fn = lambda p, _: jax.grad(loss_fn)(p, xb, yb)  # noqa: E731
            updates, state = opt.update(g, state, params, grad_fn=grad_fn)
        else:
            updates, state = opt.update(g, state, params)
        return optax.apply_updates(params, updates), state, loss

    return jax.jit(step, donate_argnums=(0, 1) if donate else ())


def to_jax_params(weights):
    import jax.numpy as jnp

    return [(jnp.asarray(weights[i]), jnp.asarray(weights[i + 1])) for i in range(0, len(weights), 2)]


def jax_runners(keras, kg, np, name, w0, x, y, batch, steps, models, cfg):
    import jax
    import jax.numpy as jnp
    import optax

    loss_fn = jax_loss(name)
    sam_opt, sgd_opt = optax_optimizers()
    xs = [jnp.asarray(x[i * batch:(i + 1) * batch]) for i in range(steps)]
    ys = [jnp.asarray(y[i * batch:(i + 1) * batch]) for i in range(steps)]

    def optax_loop(opt, two_pass):
        step = optax_step(loss_fn, opt, two_pass)
        params = to_jax_params(w0)
        box = [params, opt.init(params)]

        def loop():
            params, state = box
            for i in range(steps):
                params, state, loss = step(params, state, xs[i], ys[i])
            jax.block_until_ready((params, loss))
            box[:] = [params, state]
            return float(loss)

        return timed(loop)

    def keras_loop(variant):
        # Keras' own train_step, jitted as fit jits it (donated state): fit
        # minus the data adapter, the epoch iterator and callbacks. Its own
        # model, so fit's model is not touched.
        model = models[variant[4:]] if variant[4:] in models else build_model(keras, kg, name, variant[4:], w0, cfg)
        box = [tuple(
            [jnp.array(v.value, copy=True) for v in vs]
            for vs in (model.trainable_variables, model.non_trainable_variables,
                       model.optimizer.variables, model.metrics_variables)
        )]
        step = jax.jit(model.train_step, donate_argnums=0)

        def loop():
            # Metrics restart each loop, as fit resets them each epoch.
            tv, ntv, ov, mv = box[0]
            state = (tv, ntv, ov, [jnp.zeros_like(m) for m in mv])
            for i in range(steps):
                logs, state = step(state, (xs[i], ys[i]))
            jax.block_until_ready((state, logs))
            box[0] = state
            return float(logs["loss"])

        return timed(loop)

    runners = {
        "raw_sgd": keras_loop("raw_sgd"),
        "raw_sam": keras_loop("raw_sam"),
        "peer_sgd": optax_loop(sgd_opt, False),
        "peer_sam": optax_loop(sam_opt, True),
    }
    return {"label": f"optax {optax.__version__}", "runners": runners}


def optax_equivalence(keras, kg, np, name, w0, n_steps=EQ_STEPS):
    """Max |theta_ours - theta_optax| after n_steps (ours via fit, shuffle=False)."""
    import jax.numpy as jnp

    dtype = keras.config.floatx()
    w0 = [w.astype(dtype) for w in w0]
    xe, ye = make_data(np, name, n_steps * EQ_BATCH)
    xe = xe.astype(dtype)
    cfg = {"llqr_source": "callback", "refresh_steps": 50}
    ours = build_model(keras, kg, name, "sam", w0, cfg)
    ours.fit(xe, ye, batch_size=EQ_BATCH, epochs=1, shuffle=False, verbose=0)
    ours_sgd = build_model(keras, kg, name, "sgd", w0, cfg)
    ours_sgd.fit(xe, ye, batch_size=EQ_BATCH, epochs=1, shuffle=False, verbose=0)
    sam_opt, _ = optax_optimizers()
    step = optax_step(jax_loss(name), sam_opt, True, donate=False)
    p = to_jax_params(w0)
    s = sam_opt.init(p)
    for i in range(n_steps):
        sl = slice(i * EQ_BATCH, (i + 1) * EQ_BATCH)
        p, s, _ = step(p, s, jnp.asarray(xe[sl]), jnp.asarray(ye[sl]))
    ref = [np.asarray(a) for pair in p for a in pair]
    assert all(a.dtype == np.dtype(dtype) for a in ref), [a.dtype for a in ref]
    return {
        "dtype": dtype,
        "steps": n_steps,
        "max_abs_param_diff": maxdiff(np, ours.get_weights(), ref),
        "max_abs_param_change": maxdiff(np, ref, w0),
        "max_abs_diff_sgd_vs_sam": maxdiff(np, ours_sgd.get_weights(), ref),
    }


def maxdiff(np, a_list, b_list):
    return max(float(np.max(np.abs(np.asarray(a, "float64") - np.asarray(b, "float64")))) for a, b in zip(a_list, b_list))


def optax_equivalence_both(keras, kg, np, name, w0):
    log(f"[jax] {name}: optax.contrib.sam vs kg SAM, {EQ_STEPS} steps, float32 and float64 (subprocess)")
    out = {"float32": optax_equivalence(keras, kg, np, name, w0)}
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_ENABLE_X64="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--eq64", "--models", name, "--json", path]
    proc = subprocess.run(cmd, env=env, stdout=sys.stderr)
    if proc.returncode == 0:
        with open(path) as f:
            out["float64"] = json.load(f)
    os.unlink(path)
    return out


def equivalence_float64(args):
    """Child process (JAX_ENABLE_X64=1): the optax comparison in float64."""
    import jax

    jax.config.update("jax_enable_x64", True)
    import keras
    import numpy as np

    import keras_geosam as kg

    keras.config.set_floatx("float64")
    name = args.models
    res = optax_equivalence(keras, kg, np, name, initial_weights(keras, name))
    with open(args.json, "w") as f:
        json.dump(res, f)
    return 0


# --------------------------------------------------------------- torch ---
def torch_sam_class():
    import torch

    class TorchSAM(torch.optim.Optimizer):
        """SAM the way PyTorch code usually writes it (the first_step /
        second_step interface of the widely used implementation; written
        here from the algorithm):

            g     = grad L_B(w)                       (first backward pass)
            e_w   = rho * g / (||g|| + 1e-12)         first_step: w <- w + e_w
            g_p   = grad L_B(w + e_w)                 (closure: second backward pass)
            w     <- the saved w                      second_step: restore,
            w     <- base_optimizer(w, g_p)           then the base step
        """

        def __init__(self, params, base_optimizer_cls, rho=0.05, **kwargs):
            super().__init__(params, dict(rho=rho, **kwargs))
            self.base_optimizer = base_optimizer_cls(self.param_groups, **kwargs)
            self.param_groups = self.base_optimizer.param_groups

        @torch.no_grad()
        def first_step(self, zero_grad=False):
            grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            for group in self.param_groups:
                scale = group["rho"] / (norm + 1e-12)
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    self.state[p]["old_p"] = p.detach().clone()
                    p.add_(p.grad * scale.to(p))
            if zero_grad:
                self.zero_grad()

        @torch.no_grad()
        def second_step(self, zero_grad=False):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    p.copy_(self.state[p]["old_p"])  # back to w
            self.base_optimizer.step()  # the update with the perturbed gradient
            if zero_grad:
                self.zero_grad()

        @torch.no_grad()
        def step(self, closure=None):
            if closure is None:
                raise ValueError("SAM needs a closure that recomputes the loss and its gradient.")
            closure = torch.enable_grad()(closure)
            self.first_step(zero_grad=True)
            closure()
            self.second_step()

    return TorchSAM


def torch_module(name, weights, device, dtype):
    """A torch.nn.Sequential with the Keras model's weights (NCHW for the CNN)."""
    import numpy as np
    import torch

    nn = torch.nn
    if name == "mlp":
        net = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    else:
        net = nn.Sequential(
            nn.Conv2d(1, 16, 3), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(800, 10),
        )
    net = net.to(device=device, dtype=dtype)
    params = [p for p in net.parameters()]  # weight, bias per layer, in order
    with torch.no_grad():
        for p, w in zip(params, keras_to_torch(np, name, weights)):
            p.copy_(torch.from_numpy(w).to(device=device, dtype=dtype))
    return net


def keras_to_torch(np, name, weights):
    """Keras weights in torch's layouts (a permutation of each array)."""
    out = []
    for i in range(0, len(weights), 2):
        k, bias = np.asarray(weights[i]), np.asarray(weights[i + 1])
        if k.ndim == 4:  # Conv2D kernel HWIO -> OIHW
            k = k.transpose(3, 2, 0, 1)
        elif name == "cnn":  # Dense after an NHWC Flatten: rows (h, w, c) -> (c, h, w)
            k = k.reshape(5, 5, 32, -1).transpose(2, 0, 1, 3).reshape(800, -1).T
        else:
            k = k.T
        out += [np.ascontiguousarray(k), bias]
    return out


def torch_batches(keras, np, name, x, y, batch, steps):
    """Keras' device tensors (NHWC) and the peer's (NCHW for the CNN)."""
    ks, ts = [], []
    for i in range(steps):
        xb, yb = x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]
        kx, ky = keras.ops.convert_to_tensor(xb), keras.ops.convert_to_tensor(yb)
        ks.append((kx, ky))
        tx = kx.permute(0, 3, 1, 2).contiguous() if name == "cnn" else kx
        ts.append((tx, ky.long()))
    return ks, ts, ks[0][0].device


def torch_sam_loop(net, opt, crit, batches):
    def closure():
        loss = crit(net(xb), yb)
        loss.backward()
        return loss

    def loop():
        nonlocal xb, yb
        for xb, yb in batches:
            opt.zero_grad()
            loss = closure()  # first forward-backward pass
            opt.step(closure)  # first_step, second pass, second_step
        return float(loss.detach())

    xb = yb = None
    return loop


def torch_sgd_loop(net, opt, crit, batches):
    def loop():
        for xb, yb in batches:
            opt.zero_grad()
            loss = crit(net(xb), yb)
            loss.backward()
            opt.step()
        return float(loss.detach())

    return loop


def torch_runners(keras, kg, np, name, w0, x, y, batch, steps, cfg):
    import torch

    TorchSAM = torch_sam_class()
    ks, ts, device = torch_batches(keras, np, name, x, y, batch, steps)
    crit = torch.nn.CrossEntropyLoss()

    def keras_loop(variant):
        # Keras' own train_step called directly (what fit calls on torch),
        # on its own model: fit minus the data adapter, iterator, callbacks.
        model = build_model(keras, kg, name, variant[4:], w0, cfg)
        # One fit step builds the optimizer and metrics; then train_step as
        # fit calls it, in torch's train mode as fit sets it.
        model.fit(x[:batch], y[:batch], batch_size=batch, epochs=1, shuffle=False, verbose=0)
        model.train()

        def loop():
            model.reset_metrics()  # as fit does each epoch
            for data in ks:
                logs = model.train_step(data)
            return float(keras.ops.convert_to_numpy(logs["loss"]))

        return timed(loop)

    sgd_net = torch_module(name, w0, device, torch.float32)
    sam_net = torch_module(name, w0, device, torch.float32)
    sgd_opt = torch.optim.SGD(sgd_net.parameters(), lr=LR, momentum=MOMENTUM)
    sam_opt = TorchSAM(sam_net.parameters(), torch.optim.SGD, rho=RHO, lr=LR, momentum=MOMENTUM)
    runners = {
        "raw_sgd": keras_loop("raw_sgd"),
        "raw_sam": keras_loop("raw_sam"),
        "peer_sgd": timed(torch_sgd_loop(sgd_net, sgd_opt, crit, ts)),
        "peer_sam": timed(torch_sam_loop(sam_net, sam_opt, crit, ts)),
    }
    return {"label": f"torch {torch.__version__.split('+')[0]}", "runners": runners}


def torch_equivalence(keras, kg, np, name, n_steps=EQ_STEPS):
    """Initial logits of the torch copy and max |theta_ours - theta_torchSAM|
    after n_steps (ours via fit, shuffle=False), float32."""
    import torch

    log(f"[torch] {name}: TorchSAM vs kg SAM, {n_steps} steps, float32")
    w0 = initial_weights(keras, name)
    xe, ye = make_data(np, name, n_steps * EQ_BATCH)
    cfg = {"llqr_source": "callback", "refresh_steps": 50}
    ours = build_model(keras, kg, name, "sam", w0, cfg)
    ks, ts, device = torch_batches(keras, np, name, xe, ye, EQ_BATCH, n_steps)
    net = torch_module(name, w0, device, torch.float32)
    with torch.no_grad():
        logits_diff = float((net(ts[0][0]) - ours(ks[0][0], training=False)).abs().max())
    ours.fit(xe, ye, batch_size=EQ_BATCH, epochs=1, shuffle=False, verbose=0)
    ours_sgd = build_model(keras, kg, name, "sgd", w0, cfg)
    ours_sgd.fit(xe, ye, batch_size=EQ_BATCH, epochs=1, shuffle=False, verbose=0)
    opt = torch_sam_class()(net.parameters(), torch.optim.SGD, rho=RHO, lr=LR, momentum=MOMENTUM)
    torch_sam_loop(net, opt, torch.nn.CrossEntropyLoss(), ts)()
    ref = [p.detach().cpu().numpy() for p in net.parameters()]
    return {
        "dtype": "float32",
        "steps": n_steps,
        "max_abs_logit_diff": logits_diff,
        "max_abs_param_diff": maxdiff(np, keras_to_torch(np, name, ours.get_weights()), ref),
        "max_abs_param_change": maxdiff(np, ref, keras_to_torch(np, name, w0)),
        "max_abs_diff_sgd_vs_sam": maxdiff(np, keras_to_torch(np, name, ours_sgd.get_weights()), ref),
    }


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


def fmt(x, spec=".2f"):
    return "-" if x is None or x != x else format(x, spec)


def main_table(results, cpu=False):
    s = "_cpu" if cpu else ""
    key = "cpu_step_s" if cpu else "step_s"
    unit = "CPU ms" if cpu else "ms"
    head = ["backend", "model", "batch", "jit", f"SGD {unit}", "SAM", "ASAM", "F-SAM", "Fisher-SAM",
            "LLQR diag", "LLQR diag amort.", "LLQR K-FAC", "LLQR K-FAC amort.",
            "peer", f"peer SGD {unit}", "peer SAM/SGD", "SAM/peer SAM (fit)", "SAM/peer SAM (train_step)",
            "SGD/peer SGD (fit)", "SGD/peer SGD (train_step)"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---:|---|" + "---:|" * (len(head) - 4)]
    for res in results:
        for c in res["cells"]:
            r, q = c["runners"], c["ratios"]
            cells = [res["backend"], c["model"], str(c["batch"]), "yes" if r["sgd"]["jit_compile"] else "no",
                     fmt(r["sgd"][key] * 1e3)]
            cells += [fmt(q.get(v + s)) for v in ("sam", "asam", "fsam", "fishersam")]
            for v in ("llqr_diag", "llqr_kfac"):
                cells += [fmt(q.get(v + s)), fmt(q.get(v + "_amortised" + s))]
            if "peer_sgd" in r:
                cells += [c["peer"], fmt(r["peer_sgd"][key] * 1e3)]
                cells += [fmt(q[k + s]) for k in ("peer_sam_over_sgd", "sam_over_peer_sam", "raw_sam_over_peer_sam",
                                                  "sgd_over_peer_sgd", "raw_sgd_over_peer_sgd")]
            else:
                cells += ["none" if c["model"] in MODELS else "skipped"] + ["-"] * 6
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown(results):
    cfg = results[0]["settings"]
    lines = ["Wall time per step; every method as a ratio over Keras SGD(momentum) through `fit` (same backend, model, batch):", ""]
    lines += main_table(results)
    lines += ["", "The same in process CPU time (all threads; robust to other jobs on the machine):", ""]
    lines += main_table(results, cpu=True)
    lines.append("")
    steps = "; ".join(
        f"{m} " + ", ".join(f"b{b}: {steps_for(cfg, m, b)}" for b in cfg["batches_for"][m]) for m in cfg["models"]
    )
    src = ("`refresh_source=\"callback\"` (no refresh branch in the step)" if cfg["llqr_source"] == "callback"
           else "`refresh_source=\"step\"`, `refresh_every` beyond the run (the refresh branch stays in the step; only step 0, in the warm-up epoch, refreshes)")
    lines.append(
        f"Per-step time = epoch time / steps, median of {cfg['rounds']} epochs per runner, all runners of a row "
        f"interleaved epoch by epoch after one warm-up epoch each; ratios = ratios of medians; in the goal table a step ratio "
        f"carries (in brackets) the 95% t interval of the geometric mean of its per-epoch paired ratios. Steps per epoch: {steps}. "
        f"jit: `fit`'s effective `jit_compile`. SGD(lr={LR}, momentum={MOMENTUM}) alone and as the base of every method; "
        f"rho {RHO} (ASAM {ASAM_RHO}). LLQR+SAM: timed steps never refresh U ({src}); amort. = (step + one refresh "
        f"({cfg['refresh_steps']} inner steps, one batch, warm) / {REFRESH_EVERY}) / SGD step."
        + (" **--quick: 2 inner refresh steps instead of 50, so amort. is not the default's.**" if cfg["refresh_steps"] != 50 else "")
    )
    lines.append(
        "Peers (same model, data, weights, hyperparameters): JAX: optax.sgd and optax.contrib.sam (opaque, sync_period=2) as "
        "one jitted step (donated state) in a Python loop over device batches; torch: a torch.nn.Sequential copy with "
        "torch.optim.SGD and a first_step/second_step SAM (closure, two backward passes). SAM/peer SAM (fit): ours through "
        "`fit` over the peer; (train_step): Keras' `train_step` of our model in the peer's loop (JAX: jitted like `fit`, "
        "donated state), i.e. without `fit`'s per-step data adapter, iterator and callbacks. TensorFlow: no peer."
    )
    lines.append("")
    lines.append("LLQR+SAM refresh (one `refresh_now` on one batch; first call compiles; warm: median):")
    lines.append("")
    lines.append("| backend | model | batch | U | inner steps | first call s | warm refresh s | refresh / SGD step | step ms | amortised step ms | refreshes in timed steps |")
    lines.append("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for res in results:
        for c in res["cells"]:
            sgd = c["runners"]["sgd"]["step_s"]
            for v, ref in c["refresh"].items():
                lines.append(
                    f"| {res['backend']} | {c['model']} | {c['batch']} | {LLQR_STRUCTURE[v]} | {ref['inner_steps']} | "
                    f"{ref['first_s']:.2f} | {ref['refresh_s']:.3f} | {ref['refresh_s'] / sgd:.0f} | "
                    f"{c['runners'][v]['step_s'] * 1e3:.2f} | {ref['amortised_step_s'] * 1e3:.2f} | {ref['refreshes_in_timed_steps']} |"
                )
    lines.append("")
    lines.append("Spread (wall ms per step over the timed epochs: median, min, max; CPU ms: median; warm-up = compilation + 1 epoch; "
                 "compile = warm-up less the median timed epoch; final training loss):")
    lines.append("")
    lines.append("| backend | model | batch | runner | median | min | max | CPU ms | warm-up s | compile s | final loss |")
    lines.append("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for res in results:
        for c in res["cells"]:
            for k, r in c["runners"].items():
                label = LABELS[k].replace("peer", c.get("peer", "peer"))
                lines.append(
                    f"| {res['backend']} | {c['model']} | {c['batch']} | {label} | {r['step_s'] * 1e3:.2f} | "
                    f"{r['step_min_s'] * 1e3:.2f} | {r['step_max_s'] * 1e3:.2f} | {r['cpu_step_s'] * 1e3:.2f} | "
                    f"{r['warmup_s']:.2f} | {r['compile_s']:.2f} | {r['final_loss']:.4g} |"
                )
    eq_lines = []
    for res in results:
        for name, by_dtype in res.get("equivalence", {}).items():
            peer = "optax.contrib.sam" if res["backend"] == "jax" else "TorchSAM"
            for dt in ("float32", "float64") if res["backend"] == "jax" else ("float32",):
                e = by_dtype.get(dt)
                if e is None:
                    eq_lines.append(f"- {res['backend']} {name} {dt}: not run (subprocess failed)")
                    continue
                logit = f"initial max |logit diff| {e['max_abs_logit_diff']:.1e}; " if "max_abs_logit_diff" in e else ""
                eq_lines.append(
                    f"- {res['backend']} {name} {dt}, ours vs {peer}: {logit}after {e['steps']} steps max |theta_ours - theta_peer| = "
                    f"{e['max_abs_param_diff']:.2e} (scale: max |theta_{e['steps']} - theta_0| = {e['max_abs_param_change']:.2e}; "
                    f"our plain SGD vs the peer's SAM: {e['max_abs_diff_sgd_vs_sam']:.2e})"
                )
    if eq_lines:
        lines += ["", f"Same update as the peer (ours via `fit`, shuffle=False; identical weights and batches of {EQ_BATCH}):", ""]
        lines += eq_lines
        lines.append(
            "- float32 gaps beyond rounding are rounding amplified by ReLU switching (a pre-activation within rounding of 0 "
            "takes the other branch in one run, and the trajectories separate); the JAX float64 gap shows both compute the "
            "same update. torch: float32 only (Keras 3.15 computes a float64 model's matmuls in float32 on torch)"
        )
    lines += ["", f"Goals (wall; CPU time in brackets): SAM/SGD <= {SAM_GOAL:g} (transformer, vit: {ATTENTION_SAM_GOAL:g}); "
              f"LLQR+SAM diagonal amortised at refresh_every={REFRESH_EVERY} <= {LLQR_DIAG_GOAL:g} (transformer, vit: "
              f"{ATTENTION_LLQR_DIAG_GOAL:g}); JAX SAM/optax.contrib.sam <= {OPTAX_GOAL:g}; "
              f"LLQR+SAM K-FAC step / its FLOP floor <= {KFAC_FLOOR_GOAL:g} (floor: the SAM step plus both U products "
              "at the gradient's FLOP rate, both measured here; U FLOPs from U's layout: 2 x 2(m^2 n + m n^2) per K-FAC "
              "block, 2 x 2 m n^2 per Embedding block (diag(a) X B^T); gradient 2 B P m n per kernel matmul at its P "
              "positions: forward, kernel and input gradients, without the first layer's input gradient, plus attention's "
              "score and value matmuls, 6 B H T^2 (d_key + d_value) per layer; an estimate; "
              "rate: the U product's achieved FLOP rate over the gradient's, each timed alone through backend.compile). "
              "The floor is a reference, not a lower bound: the U GEMMs can run faster than the batch's matmuls. "
              f"First-step compile (the slowest method's; transformer, vit) < {COMPILE_GOAL_S:g} s.", ""]
    lines.append("| backend | model | batch | SAM/SGD | LLQR diag amort./SGD | SAM/optax SAM (fit) | SAM/optax SAM (train_step) "
                 "| LLQR K-FAC amort./SGD | U GFLOP/step | grad GFLOP | U rate/grad rate | K-FAC/floor | K-FAC amort./floor "
                 "| compile s: SGD, SAM, diag, K-FAC |")
    lines.append("|---|---|---:|---|---|---|---|---|---:|---:|---:|---|---|---|")

    def goal_cell(q, k, goal):
        if k not in q:
            return "-"

        def one(k):
            lo, hi = q.get(k + "_ci", (float("nan"),) * 2)
            interval = f" ({lo:.2f}-{hi:.2f})" if lo == lo else ""
            return f"{q[k]:.2f}{interval} {verdict(q[k], goal)}"

        return f"{one(k)} [{one(k + '_cpu')}]"

    for res in results:
        for c in res["cells"]:
            q = c["ratios"]
            jax_peer = res["backend"] == "jax"
            attention = c["model"] not in MODELS
            cells = [res["backend"], c["model"], str(c["batch"]),
                     goal_cell(q, "sam", ATTENTION_SAM_GOAL if attention else SAM_GOAL),
                     goal_cell(q, "llqr_diag_amortised", ATTENTION_LLQR_DIAG_GOAL if attention else LLQR_DIAG_GOAL),
                     goal_cell(q, "sam_over_peer_sam", OPTAX_GOAL) if jax_peer else "-",
                     goal_cell(q, "raw_sam_over_peer_sam", OPTAX_GOAL) if jax_peer else "-",
                     f"{q['llqr_kfac_amortised']:.2f} [{q['llqr_kfac_amortised_cpu']:.2f}]" if "llqr_kfac_amortised" in q else "-"]
            f = c.get("kfac_floor")
            if f and "rate_u_over_grad" in f:
                cells += [f"{f['u_flops_per_step'] / 1e9:.2f}", f"{f['grad_flops'] / 1e9:.2f}", f"{f['rate_u_over_grad']:.2f}",
                          f"{q['llqr_kfac_over_floor']:.2f} {verdict(q['llqr_kfac_over_floor'], KFAC_FLOOR_GOAL)}",
                          f"{q['llqr_kfac_amortised_over_floor']:.2f} {verdict(q['llqr_kfac_amortised_over_floor'], KFAC_FLOOR_GOAL)}"
                          if "llqr_kfac_amortised_over_floor" in q else "-"]
            else:
                cells += ["-"] * 5
            compile_s = [c["runners"][v]["compile_s"] for v in ("sgd", "sam", "llqr_diag", "llqr_kfac") if v in c["runners"]]
            cells.append(", ".join(f"{t:.1f}" for t in compile_s)
                         + (f" ({verdict(max(compile_s), COMPILE_GOAL_S)})" if attention else ""))
            lines.append("| " + " | ".join(cells) + " |")
    lines += exponent_lines(results)
    return "\n".join(lines)


def overhead_fits(res):
    """Per structure and clock, the power law of LLQR+SAM's amortised
    overhead over SGD in the parameter count across the ViT widths of one
    backend (cells of kind "vit" at one batch, >= 3 widths): overhead =
    amortised LLQR+SAM step - SGD step (bench/llqr.py's definition), fitted by
    ``llqr.fit_power_law`` (least squares in log-log, t interval)."""
    from llqr import fit_power_law

    cells = [c for c in res["cells"] if model_kind(c["model"])[0] == "vit" and c["refresh"]]
    out = []
    for batch in sorted({c["batch"] for c in cells}):
        row = sorted((c for c in cells if c["batch"] == batch), key=lambda c: c["num_params"])
        if len({c["num_params"] for c in row}) < 3:
            continue
        for v in ("llqr_diag", "llqr_kfac"):
            for key in ("step_s", "cpu_step_s"):
                pts = [c for c in row if v in c["refresh"]]
                P = [c["num_params"] for c in pts]
                over = [c["runners"][v][key] + c["refresh"][v]["refresh_s"] / REFRESH_EVERY - c["runners"]["sgd"][key] for c in pts]
                fit = fit_power_law(P, over)
                out.append(dict(fit, batch=batch, method=v, clock="wall" if key == "step_s" else "cpu",
                                points=[{"model": c["model"], "params": p, "overhead_ms": o * 1e3,
                                         "ratio": (o + c["runners"]["sgd"][key]) / c["runners"]["sgd"][key]}
                                        for c, p, o in zip(pts, P, over)]))
    return out


def exponent_lines(results):
    rows = [(res["backend"], f) for res in results for f in overhead_fits(res)]
    if not rows:
        return []
    lines = ["", f"Overhead of LLQR+SAM over SGD against the parameter count P (ViT, depth {DEPTH}, {HEADS} heads, "
             f"patch {PATCH} on {IMAGE}x{IMAGE}x3, widths d): overhead = amortised LLQR+SAM step (refresh_every={REFRESH_EVERY}) "
             "- SGD step, fitted as overhead ~ P^k by least squares on log-log (positive overheads), 95% interval = "
             f"k +- t(0.975, n-2) x stderr (scipy.stats.linregress). Goal k <= {EXPONENT_GOAL:g} (the paper: ~1.27). "
             "Per point: P, overhead ms (amortised / SGD).", ""]
    lines.append("| backend | batch | U | clock | k | 95% interval | n | r^2 | points: P, overhead ms (ratio) |")
    lines.append("|---|---:|---|---|---:|---|---:|---:|---|")
    for b, f in rows:
        pts = "; ".join(f"{p['params']}: {p['overhead_ms']:.1f} ({p['ratio']:.2f})" for p in f["points"])
        lines.append(f"| {b} | {f['batch']} | {LLQR_STRUCTURE[f['method']]} | {f['clock']} | {fmt(f['k'])} "
                     f"{verdict(f['k'], EXPONENT_GOAL) if f['k'] == f['k'] else ''} | [{fmt(f['lo'])}, {fmt(f['hi'])}] | "
                     f"{f['n']} | {fmt(f['r2'], '.3f')} | {pts} |")
    return lines


def machine_line(results=None, load=None):
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    parts = [f"{datetime.datetime.now().isoformat(timespec='minutes')}", f"{cpu}, {os.cpu_count()} cores",
             f"Python {platform.python_version()}"]
    for res in results or []:
        env = res["env"]
        b = res["backend"]
        parts.append(f"{b} {env.get(b, '?')} ({env.get('device', '?')})")
    if results:
        parts.append(f"keras {results[0]['env']['keras']}")
    lines = ["Machine: " + "; ".join(parts)]
    fmt_load = lambda l: "/".join(f"{v:.2f}" for v in l)  # noqa: E731
    if load:
        lines.append(f"Load average (1/5/15 min) at start -> end of the whole run: {fmt_load(load[0])} -> {fmt_load(load[1])}")
    per = [
        f"{res['backend']} {fmt_load(res['env']['loadavg_start'])} -> {fmt_load(res['env']['loadavg_end'])} ({res['env']['wall_s']:.0f} s)"
        for res in results or [] if "loadavg_end" in res["env"]
    ]
    if per:
        lines.append(f"Load average (1/5/15 min) at start -> end of each backend's run ({os.cpu_count()} cores = {os.cpu_count()}.0 saturates): " + "; ".join(per))
    return "\n".join(lines)


# ----------------------------------------------------------------- main ---
def child_args(args):
    out = []
    for flag in ("quick", "omp_passive", "torch_compile"):
        if getattr(args, flag):
            out.append("--" + flag.replace("_", "-"))
    for opt in ("batches", "models", "methods", "rounds", "llqr_source", "vit_widths", "refresh_steps", "refresh_repeats"):
        value = getattr(args, opt)
        if value is not None:
            out += ["--" + opt.replace("_", "-"), str(value)]
    return out


def run_all(args):
    load_start = os.getloadavg()
    results, failed = run_each_backend(__file__, child_args(args))
    load_end = os.getloadavg()
    if results:
        print(machine_line(results, (load_start, load_end)) + "\n")
        print(markdown(results))
    if failed:
        print(f"\nFAILED backends: {', '.join(failed)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"loadavg_start": load_start, "loadavg_end": load_end, "results": results}, f, indent=1)
    return 1 if failed else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: batch 64 only (unless --batches), short epochs, 3 rounds, 2 inner refresh steps")
    ap.add_argument("--batches", help=f"comma-separated batch sizes (default {DEFAULT_BATCHES}; --quick: {QUICK_BATCHES})")
    ap.add_argument("--models", help=f"comma-separated subset of {','.join(MODELS + ATTENTION_MODELS)} or vit_d<width> "
                                     f"(default: {','.join(MODELS)}; the attention models run only when named, "
                                     f"at batch {ATTENTION_BATCHES} unless --batches)")
    ap.add_argument("--vit-widths", help="comma-separated ViT widths d (e.g. 32,64,128,256): adds vit_d<d> to the models "
                                         "(--models defaults to none then) and fits LLQR+SAM's overhead ~ P^k")
    ap.add_argument("--refresh-steps", type=int, help="inner steps of the timed refresh (default 50; --quick 2)")
    ap.add_argument("--refresh-repeats", type=int, help="warm refreshes timed, median (default 3; --quick 1)")
    ap.add_argument("--methods", help=f"comma-separated subset of {','.join(METHODS)} (default: all; SGD always runs)")
    ap.add_argument("--rounds", type=int, help="timed epochs per runner (default 9; --quick 3)")
    ap.add_argument("--llqr-source", choices=("callback", "step"), default="callback",
                    help="LLQR+SAM's refresh_source for the timed steps (default callback: no refresh branch in the step)")
    ap.add_argument("--torch-compile", action="store_true",
                    help="torch only: jit_compile=True for every Keras model (torch.compile of the train step); "
                         "the other backends keep Keras' default")
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
    print(machine_line([res]) + "\n")
    print(markdown([res]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
