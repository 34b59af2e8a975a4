"""
Title: LLQR+SAM on a Transformer
Author: keras_geosam authors
Date created: 2026/12/02
Last modified: 2026/12/02
Description: A character-level language model trained on Python's own
    source code, and a tiny ViT, each trained with AdamW, SAM, LLQR and
    LLQR+SAM over several seeds, compared with 95% intervals.
Accelerator: GPU (for --full; the small default mode runs on a CPU)

Run it with any Keras backend (the default small mode takes a few minutes on
2 CPU cores; torch is the fastest backend there, JAX and TensorFlow spend
much of the time compiling):

    KERAS_BACKEND=torch python guides/llqr_sam_transformer.py

Part 1 trains a small causal Transformer, written below in plain
`keras.layers`, to predict the next character of the source code of a fixed
list of Python standard-library modules: real text with real structure,
shipped with every Python, so nothing is downloaded. Part 2 trains a tiny
Vision Transformer on images generated here (oriented stripes whose class is
their orientation and tint). Each part trains the same model with four
optimizers, all built on `keras.optimizers.AdamW`, over several seeds, and
reports the mean validation loss and perplexity (accuracy for the images)
with a 95% t-interval per optimizer, the difference from AdamW paired by
seed, and a sentence saying what those intervals do and do not show.

It writes `facts.json` (every number it prints) under `--output` (default
`geosam_output/llqr_sam_transformer/`). Options:

- `--full`: more text (30 modules, whole files), a bigger model, 5 seeds,
  longer training; and CIFAR-10 for the ViT when Keras has it cached (use a
  GPU).
- `--dataset cifar10`: CIFAR-10 for part 2, through
  `keras_geosam.datasets.load("cifar10")` (Keras' cache, or the machine
  must be online); `--data file.npz`: your own images (keys `x_train,
  y_train, x_test, y_test`).
- `--structure diagonal`: a diagonal U instead of K-FAC; `--seeds N`,
  `--rho`, `--lr` to change the comparison.
- `--smoke`: the smallest run (one seed, a few steps), for CI; its numbers
  mean nothing.

The text differs a little between Python versions (it is their standard
library), so the numbers do too.
"""

"""
## Setup

Any Keras 3 backend works; pick it with `KERAS_BACKEND` before Keras is
imported.
"""

import argparse
import importlib
import inspect
import json
import math
import os
import string
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up chatter

import keras
import numpy as np
import scipy.stats
from keras import ops

import keras_geosam as kg

"""
## Sizes

Per mode, for the language model: how many modules and characters of each,
the context length T, the model (width, heads, blocks, feed-forward width),
batch size, epochs and seeds; for the ViT: image count, patch size, model,
epochs and seeds. `refresh_every` / `refresh_steps` set LLQR's slow
timescale (section "Four optimizers" below).

The small mode is sized so that the language model learns a good part of
what it can from its text in a few minutes on a CPU (its validation
perplexity falls from about 100, a uniform guess over the vocabulary, to
below 10): enough for the comparison to say something about this scale and
no more.
"""

# Standard-library modules that are plain Python files (or packages with a
# large __init__.py) on every Python from 3.9 on, in a fixed order.
MODULES = (
    "argparse", "textwrap", "heapq", "fractions", "functools", "calendar", "difflib", "pprint",
    "dataclasses", "enum", "statistics", "random", "configparser", "tokenize", "ast", "inspect",
    "typing", "doctest", "pydoc", "tarfile", "zipfile", "subprocess", "threading", "logging",
    "optparse", "pickle", "shutil", "tempfile", "traceback", "ipaddress",
)

SIZES = {
    "smoke": dict(
        lm=dict(modules=4, chars_per_module=2000, T=16, d=16, heads=2, blocks=1, ff=32,
                batch=32, epochs=1, seeds=1, refresh_every=2, refresh_steps=3, lr=3e-3),
        vit=dict(n_train=128, n_test=64, image=8, patch=4, d=16, heads=2, blocks=1, ff=32,
                 batch=32, epochs=1, seeds=1, refresh_every=2, refresh_steps=3, lr=3e-3),
    ),
    "small": dict(
        lm=dict(modules=16, chars_per_module=12000, T=64, d=64, heads=4, blocks=2, ff=128,
                batch=32, epochs=2, seeds=3, refresh_every=40, refresh_steps=20, lr=3e-3),
        vit=dict(n_train=2048, n_test=512, image=16, patch=4, d=32, heads=2, blocks=1, ff=64,
                 batch=64, epochs=6, seeds=2, refresh_every=32, refresh_steps=20, lr=3e-3),
    ),
    "full": dict(
        lm=dict(modules=len(MODULES), chars_per_module=None, T=128, d=256, heads=8, blocks=4,
                ff=1024, batch=64, epochs=4, seeds=5, refresh_every=500, refresh_steps=50, lr=1e-3),
        vit=dict(n_train=None, n_test=None, image=32, patch=4, d=192, heads=6, blocks=6, ff=384,
                 batch=256, epochs=30, seeds=5, refresh_every=500, refresh_steps=50, lr=1e-3),
    ),
}


"""
## Part 1 data: Python's standard library, one character at a time

The text is the source of the modules above (`inspect.getsource`), the
first `chars_per_module` characters of each. The vocabulary is Python's
`string.printable` (letters, digits, punctuation and whitespace: 100
characters) plus one unknown token for anything else (a few accented
letters in docstrings).

The split is by position, not at random: the first 90% of each module's
excerpt is training text and the last 10% validation text. Random windows
would put overlapping neighbours of a training window in the validation
set; contiguous blocks do not, and every module is seen on both sides.

Each side is cut into non-overlapping windows of T + 1 characters: the
first T are the inputs, the last T (the same window shifted by one) the
labels, so every position predicts the next character.
"""

VOCAB = string.printable
UNKNOWN = len(VOCAB)
CHAR_INDEX = {c: i for i, c in enumerate(VOCAB)}


def stdlib_text(num_modules, chars_per_module):
    """[(module, its excerpt)] in MODULES order."""
    out = []
    for name in MODULES[:num_modules]:
        src = inspect.getsource(importlib.import_module(name))
        out.append((name, src if chars_per_module is None else src[:chars_per_module]))
    return out


def encode(text):
    return np.array([CHAR_INDEX.get(c, UNKNOWN) for c in text], dtype="int32")


def windows(ids, T, multiple):
    """(inputs, labels), each (n, T), n a multiple of `multiple` (whole
    batches: no partial batch, so JAX and TensorFlow compile one step)."""
    n = (len(ids) - 1) // T
    n -= n % multiple
    if n == 0:
        raise SystemExit(f"{len(ids)} characters are too few for one batch of {multiple} windows of {T}.")
    x = ids[: n * T].reshape(n, T)
    y = ids[1 : n * T + 1].reshape(n, T)
    return x, y


def text_data(size, val_fraction=0.1):
    parts = stdlib_text(size["modules"], size["chars_per_module"])
    train, val = [], []
    for _, text in parts:
        cut = int(len(text) * (1 - val_fraction))
        train.append(text[:cut])
        val.append(text[cut:])
    train_ids, val_ids = encode("\n".join(train)), encode("\n".join(val))
    info = dict(
        modules=[name for name, _ in parts], characters=sum(len(t) for _, t in parts),
        train_characters=int(len(train_ids)), val_characters=int(len(val_ids)),
        unknown_fraction=float(np.mean(np.concatenate([train_ids, val_ids]) == UNKNOWN)),
        vocab_size=len(VOCAB) + 1,
    )
    return windows(train_ids, size["T"], size["batch"]), windows(val_ids, size["T"], size["batch"]), info


"""
## A small causal Transformer in plain Keras layers

Token embedding plus a learned position embedding (a second `Embedding`,
over the positions 0..T-1), then `blocks` post-norm Transformer blocks
(causal self-attention, residual, `LayerNormalization`; a GELU feed-forward
layer, residual, `LayerNormalization`) and a `Dense` layer to the
vocabulary. It outputs logits shaped (batch, T, vocabulary): one next-
character distribution per position, with the labels shaped (batch, T).
`use_causal_mask=True` keeps each position from seeing the characters it is
asked to predict.

The only keras_geosam line is the last: `kg.Model` instead of
`keras.Model`, which gives the model the two-pass train step that SAM and
LLQR need (`kg.attach(model)` does the same to a model you already have).
"""


def transformer_block(h, heads, ff, causal, name):
    d = h.shape[-1]
    a = keras.layers.MultiHeadAttention(heads, d // heads, name=f"{name}_attention")(h, h, use_causal_mask=causal)
    h = keras.layers.LayerNormalization(epsilon=1e-5, name=f"{name}_norm1")(keras.layers.Add()([h, a]))
    f = keras.layers.Dense(ff, activation="gelu", name=f"{name}_ff1")(h)
    f = keras.layers.Dense(d, name=f"{name}_ff2")(f)
    return keras.layers.LayerNormalization(epsilon=1e-5, name=f"{name}_norm2")(keras.layers.Add()([h, f]))


def positions_like(t, n):
    """Integer positions 0..n-1, shaped (batch, n), for `t` shaped
    (batch, n) or (batch, n, features)."""

    def positions(t):
        first = t if len(t.shape) == 2 else t[..., 0]
        return ops.cast(ops.zeros_like(first), "int32") + ops.arange(n, dtype="int32")

    return keras.layers.Lambda(positions, output_shape=(n,), name="positions")(t)


def char_transformer(vocab_size, T, d, heads, blocks, ff):
    tokens = keras.Input((T,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(vocab_size, d, name="token_embedding")(tokens)
    p = keras.layers.Embedding(T, d, name="position_embedding")(positions_like(tokens, T))
    h = keras.layers.Add()([h, p])
    for i in range(blocks):
        h = transformer_block(h, heads, ff, causal=True, name=f"block{i}")
    logits = keras.layers.Dense(vocab_size, name="logits")(h)
    return kg.Model(tokens, logits, name="char_transformer")


"""
## Four optimizers, one base

Every optimizer below is AdamW with the same learning-rate schedule (a
linear warm-up over the first 10% of the steps, then cosine decay) and
weight decay; keras_geosam's optimizers wrap it, so Adam's moments, the
schedule and the decoupled decay all come from the base:

- **AdamW**: the base alone.
- **SAM** (`kg.optimizers.SAM(AdamW, rho)`): the gradient is taken at
  `theta + rho g / ||g||`, on the same batch (two passes per step).
- **LLQR** (`kg.optimizers.LLQR(AdamW, structure="kfac", refresh_every=...)`):
  Adam receives `U g`, where U is a learned, structured preconditioner
  refreshed every `refresh_every` steps (step 0 included) by
  `refresh_steps` inner heavy-ball steps that fit U to the local Fisher on
  the current batch, and frozen in between. `structure="kfac"` gives every
  kernel a Kronecker-factored block `A X B^T`; LayerNorm scales and biases
  get diagonal blocks.
- **LLQR+SAM** (`kg.optimizers.LLQRSAM(...)`): the perturbation direction is
  `U g` (scaled to length rho), and Adam receives `U g_perturbed`.

For a language model the loss terms are tokens: the Fisher that U is fitted
to sums over every (example, position) pair of the preconditioner batch.

A refresh costs many ordinary steps (it differentiates a Fisher product),
so real runs refresh rarely (the reference uses 1000 steps); the short
modes refresh more often so that U has a chance to matter, and cut the
inner steps for CPU speed.
"""


def schedule(lr, total_steps):
    warmup = max(1, total_steps // 10)
    return keras.optimizers.schedules.CosineDecay(
        0.0, decay_steps=max(1, total_steps - warmup), warmup_target=lr, warmup_steps=warmup, alpha=0.1,
    )


def make_optimizers(size, total_steps, args):
    """{name: a function returning a fresh optimizer}: one instance per
    model, since a two-pass optimizer serves exactly one model."""
    lr = args.lr or size["lr"]

    def adamw():
        return keras.optimizers.AdamW(schedule(lr, total_steps), weight_decay=args.weight_decay)

    llqr = dict(structure=args.structure, refresh_every=size["refresh_every"], refresh_steps=size["refresh_steps"])
    return {
        "AdamW": adamw,
        "SAM": lambda: kg.optimizers.SAM(adamw(), rho=args.rho),
        "LLQR": lambda: kg.optimizers.LLQR(adamw(), **llqr),
        "LLQR+SAM": lambda: kg.optimizers.LLQRSAM(adamw(), rho=args.rho, **llqr),
    }


"""
## Estimates with their uncertainty

One training run is one sample: a different seed gives different initial
weights and a different batch order, and a different validation loss. So
every optimizer runs `seeds` times, and we report the mean over seeds with
a 95% t-interval, `mean +- t_{0.975, n-1} s / sqrt(n)` (Student's t, since
n is small). With one seed there is no interval: `n/a`.

Seed s gives the same initial weights and the same shuffling seed to every
optimizer, so runs are also compared *paired*: the per-seed difference from
AdamW, with its own t-interval, which removes the share of the variation
that comes from the initialisation.

The validation set is fixed, so these intervals describe the variation
between training runs, not the finite size of the validation text.
"""


def t_interval(values, confidence=0.95):
    """mean, sample standard deviation and the two-sided t-interval of
    `values` (no interval, None, below two values)."""
    v = np.asarray(values, dtype="float64")
    n, mean = len(v), float(np.mean(v))
    if n < 2:
        return dict(n=n, mean=mean, std=None, half_width=None, interval=None)
    std = float(np.std(v, ddof=1))
    half = float(scipy.stats.t.ppf(0.5 + confidence / 2, n - 1) * std / math.sqrt(n))
    return dict(n=n, mean=mean, std=std, half_width=half, interval=[mean - half, mean + half])


def fmt(stat, digits=3):
    if stat["half_width"] is None:
        return f"{stat['mean']:.{digits}f} ± n/a"
    return f"{stat['mean']:.{digits}f} ± {stat['half_width']:.{digits}f}"


def train_and_evaluate(build, make_optimizer, train, val, size, seed):
    """One run: a fresh model and optimizer, `fit`, then the validation loss
    and accuracy. Returns (record, model, optimizer)."""
    keras.utils.set_random_seed(seed)
    model = build()
    optimizer = make_optimizer()
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    t0 = time.perf_counter()
    history = model.fit(*train, batch_size=size["batch"], epochs=size["epochs"], shuffle=True, verbose=0).history
    fit_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    val_loss, val_accuracy = model.evaluate(*val, batch_size=size["batch"], verbose=0)
    eval_seconds = time.perf_counter() - t0
    record = dict(
        seed=seed, val_loss=float(val_loss), val_perplexity=float(math.exp(val_loss)),
        val_accuracy=float(val_accuracy), train_loss=float(history["loss"][-1]),
        steps=int(ops.convert_to_numpy(optimizer.iterations)), fit_seconds=fit_seconds,
        eval_seconds=eval_seconds,
    )
    # `refreshes` and `refresh_seconds` are written into the logs by
    # kg.callbacks.RefreshMonitor, which `fit` adds by itself for optimizers
    # that learn a U: the refreshes so far and the wall time they took (timed
    # directly on torch; on JAX and TensorFlow from the step times, less an
    # ordinary step's and without compilation).
    if "refreshes" in history:
        record.update(refreshes=int(history["refreshes"][-1]), refresh_seconds=float(history["refresh_seconds"][-1]))
    return record, model, optimizer


def compare(build, optimizers, train, val, size, seeds, metric, label, on_first=None):
    """Every optimizer x seed; per optimizer the per-seed records and the
    intervals of the validation loss and of `metric`, and the paired
    difference of `metric` from AdamW."""
    results = {}
    for name, make in optimizers.items():
        runs = []
        for seed in seeds:
            record, model, optimizer = train_and_evaluate(build, make, train, val, size, seed)
            runs.append(record)
            extra = (f", {record['refreshes']} U refreshes ({record['refresh_seconds']:.1f}s)"
                     if "refreshes" in record else "")
            print(f"  {name:9s} seed {seed}: val loss {record['val_loss']:.4f}, {label} "
                  f"{record[metric]:.4f}, {record['steps']} steps in {record['fit_seconds']:.1f}s{extra}")
            if on_first is not None and name == "LLQR+SAM" and seed == seeds[0]:
                on_first(optimizer)
        entry = dict(runs=runs, val_loss=t_interval([r["val_loss"] for r in runs]),
                     metric=metric, **{metric: t_interval([r[metric] for r in runs])},
                     fit_seconds=t_interval([r["fit_seconds"] for r in runs]))
        if "refreshes" in runs[0]:
            entry.update(refreshes=[r["refreshes"] for r in runs],
                         refresh_seconds=t_interval([r["refresh_seconds"] for r in runs]))
        results[name] = entry
    base = [r[metric] for r in results["AdamW"]["runs"]]
    for name, entry in results.items():
        if name != "AdamW":
            entry["minus_adamw"] = t_interval([r[metric] - b for r, b in zip(entry["runs"], base)])
    return results


def print_table(results, metric, label):
    print(f"\n{'optimizer':10s} {'seeds':>5s}  {'val loss':>17s}  {label:>17s}  {'minus AdamW (paired)':>21s}"
          f"  {'refreshes':>9s}  {'fit s':>6s}")
    for name, e in results.items():
        diff = fmt(e["minus_adamw"]) if "minus_adamw" in e else "-"
        refreshes = str(e["refreshes"][0]) if "refreshes" in e else "-"
        print(f"{name:10s} {e[metric]['n']:5d}  {fmt(e['val_loss']):>17s}  {fmt(e[metric]):>17s}  {diff:>21s}"
              f"  {refreshes:>9s}  {e['fit_seconds']['mean']:6.1f}")
    print("(mean ± half-width of the 95% t-interval over seeds)")


"""
## Saying what the numbers say

The conclusion is computed, not written in advance: which optimizer has the
best mean, whether its interval overlaps the others', and which paired
differences from AdamW exclude zero. Overlapping intervals mean that these
runs do not tell the optimizers apart at this scale; they do not mean the
optimizers are equal.
"""


def conclude(results, metric, label, lower_is_better):
    means = {k: e[metric]["mean"] for k, e in results.items()}
    best = (min if lower_is_better else max)(means, key=means.get)
    n = results[best][metric]["n"]
    head = f"{best} has the {'lowest' if lower_is_better else 'highest'} mean validation {label} ({fmt(results[best][metric])})"
    if n < 2:
        return head + ", but with one seed per optimizer there are no intervals: these runs cannot tell the optimizers apart."
    lo, hi = results[best][metric]["interval"]
    count = {2: "two", 3: "three", 4: "four"}.get(len(results), str(len(results)))
    overlap, apart = [], []
    for k, e in results.items():
        if k != best:
            klo, khi = e[metric]["interval"]
            (overlap if klo <= hi and lo <= khi else apart).append(k)
    if not apart:
        text = (f"{head}, but its 95% interval overlaps those of {', '.join(overlap)}: "
                f"no difference between the {count} optimizers at this scale ({n} seeds).")
    elif not overlap:
        text = f"{head}, and its 95% interval is clear of all the others': the best of the {count} at this scale ({n} seeds)."
    else:
        text = (f"{head}; its 95% interval is clear of {', '.join(apart)} (better than them at this scale) and "
                f"overlaps {', '.join(overlap)} (no difference from them at this scale; {n} seeds).")
    paired = []
    for k, e in results.items():
        d = e.get("minus_adamw")
        if d is not None and d["interval"] is not None and (d["interval"][0] > 0 or d["interval"][1] < 0):
            better = (d["mean"] < 0) == lower_is_better
            paired.append(f"{k} {'better' if better else 'worse'} by {abs(d['mean']):.3g} ± {d['half_width']:.2g}")
    text += (" Paired by seed, the differences from AdamW that exclude zero: " + "; ".join(paired) + "."
             if paired else " Paired by seed, no difference from AdamW excludes zero.")
    return text


"""
## Part 2 data: images for a tiny ViT

By default, images generated here: stripes (a sine grating with a random
phase and a slightly random frequency) in one of four orientations, tinted
warm or cold, plus pixel noise; the class is (orientation, tint), 8 classes.
The random phase means no single pixel predicts the class: the network has
to see the direction of the stripes across a patch. Also CIFAR-10 via
`keras_geosam.datasets.load("cifar10")` (when cached), or an `.npz` file of
your own, checked by `keras_geosam.datasets.load_npz`.
"""


def stripe_images(n_train, n_test, size=16, seed=0, noise=0.25):
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size].astype("float64") / size
    tints = np.array([[1.0, 0.55, 0.3], [0.3, 0.6, 1.0]])

    def draw(n):
        y = rng.integers(0, 8, size=n)
        angle = np.pi * (y % 4) / 4 + rng.normal(0, 0.08, n)
        freq = rng.uniform(2.5, 3.5, n)
        phase = rng.uniform(0, 2 * np.pi, n)
        wave = np.sin(2 * np.pi * freq[:, None, None] * (np.cos(angle)[:, None, None] * xx
                                                         + np.sin(angle)[:, None, None] * yy) + phase[:, None, None])
        x = 0.5 + 0.35 * wave[..., None] * tints[y // 4][:, None, None, :] + noise * rng.normal(size=(n, size, size, 3))
        return np.clip(x, 0, 1).astype("float32"), y.astype("int32")

    return draw(n_train), draw(n_test), 8


def image_data(args, size):
    from keras_geosam import datasets

    if args.data:
        (x, y), (xt, yt), k = datasets.load_npz(args.data)
        source = args.data
    elif args.dataset in ("cifar10", "auto"):
        try:
            (x, y), (xt, yt), k = datasets.load("cifar10")
            source = "cifar10"
        except RuntimeError as e:  # not cached and offline
            if args.dataset == "cifar10":
                raise SystemExit(f"{e}\nPart 2 also runs on generated images (the default) or on --data file.npz.") from e
            print("CIFAR-10 is not in Keras' cache and cannot be downloaded: part 2 uses generated stripes.")
            (x, y), (xt, yt), k = stripe_images(size["n_train"] or 50000, size["n_test"] or 10000, size["image"])
            source = "stripes"
    else:
        (x, y), (xt, yt), k = stripe_images(size["n_train"], size["n_test"], size["image"])
        source = "stripes"
    if x.ndim != 4:
        raise SystemExit(f"Part 2 trains on images shaped (N, height, width, channels); got x_train {x.shape}.")
    if x.max() > 1.5:  # 0-255 pixels
        x, xt = x / 255.0, xt / 255.0
    # A subset outside --full keeps CPU runs short; whole batches only.
    n_train = min(len(x), size["n_train"] or len(x))
    n_test = min(len(xt), size["n_test"] or len(xt))
    n_train -= n_train % size["batch"]
    n_test -= n_test % size["batch"]
    if n_train == 0 or n_test == 0:
        raise SystemExit(f"Part 2 needs at least {size['batch']} training and test images.")
    return (x[:n_train], y[:n_train]), (xt[:n_test], yt[:n_test]), k, source


"""
## A tiny ViT in plain Keras layers

Non-overlapping patches through a `Conv2D` with `strides=patch` (the same
as cutting patches and applying one `Dense` to each), a learned position
embedding per patch, `blocks` Transformer blocks as above but without the
causal mask, average pooling over the patches and a `Dense` head.
"""


def tiny_vit(input_shape, num_classes, patch, d, heads, blocks, ff):
    images = keras.Input(input_shape, name="images")
    h = keras.layers.Conv2D(d, patch, strides=patch, name="patches")(images)
    n = (input_shape[0] // patch) * (input_shape[1] // patch)
    h = keras.layers.Reshape((n, d), name="tokens")(h)
    p = keras.layers.Embedding(n, d, name="position_embedding")(positions_like(h, n))
    h = keras.layers.Add()([h, p])
    for i in range(blocks):
        h = transformer_block(h, heads, ff, causal=False, name=f"block{i}")
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    logits = keras.layers.Dense(num_classes, name="logits")(h)
    return kg.Model(images, logits, name="tiny_vit")


def main(argv=None):
    p = argparse.ArgumentParser(description="LLQR+SAM on a Transformer: AdamW, SAM, LLQR and LLQR+SAM over seeds.")
    p.add_argument("--full", action="store_true", help="more text, bigger models, 5 seeds (use a GPU)")
    p.add_argument("--smoke", action="store_true", help="the smallest run, for tests")
    p.add_argument("--dataset", choices=("stripes", "cifar10"), default=None,
                   help="part 2's images (default: cifar10 with --full, else generated stripes)")
    p.add_argument("--data", default=None, help="an .npz with x_train, y_train, x_test, y_test for part 2")
    p.add_argument("--structure", choices=("kfac", "diagonal", "ekfac"), default="kfac", help="U's structure (default kfac)")
    p.add_argument("--seeds", type=int, default=None, help="seeds per optimizer (default by mode)")
    p.add_argument("--rho", type=float, default=0.05, help="SAM radius for SAM and LLQR+SAM (default 0.05)")
    p.add_argument("--lr", type=float, default=None, help="AdamW's peak learning rate (default by mode)")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW's decoupled weight decay (default 0.01)")
    p.add_argument("--output", default=os.path.join("geosam_output", "llqr_sam_transformer"),
                   help="folder for facts.json")
    args = p.parse_args(argv)
    mode = "full" if args.full else "smoke" if args.smoke else "small"
    sizes = {part: dict(s) for part, s in SIZES[mode].items()}
    if args.seeds:
        for s in sizes.values():
            s["seeds"] = args.seeds
    if args.dataset is None:  # --full: CIFAR-10 if it can be had, else stripes
        args.dataset = "auto" if args.full else "stripes"
    os.makedirs(args.output, exist_ok=True)
    start = time.perf_counter()
    facts = {"backend": keras.backend.backend(), "mode": mode, "structure": args.structure, "rho": args.rho,
             "weight_decay": args.weight_decay}

    """
    ## Part 1: the language model
    """
    size = sizes["lm"]
    train, val, info = text_data(size)
    steps = len(train[0]) // size["batch"] * size["epochs"]
    print(f"text: {len(info['modules'])} modules ({', '.join(info['modules'])}), {info['characters']} characters; "
          f"train {train[0].shape} windows, validation {val[0].shape}; vocabulary {info['vocab_size']} "
          f"({100 * info['unknown_fraction']:.3f}% unknown); {steps} steps per run")

    def build_lm():
        return char_transformer(info["vocab_size"], size["T"], size["d"], size["heads"], size["blocks"], size["ff"])

    facts["lm"] = dict(data=info, sizes=size, steps=steps, num_params=int(build_lm().count_params()))
    print(f"model: {facts['lm']['num_params']} parameters; a uniform guess has perplexity {info['vocab_size']}")

    """
    `opt.preconditioner.summary()` lists the block U uses for every
    trainable tensor and the 2-D view it acts on. MultiHeadAttention's
    kernels are 3-D (query/key/value: `d x heads x head_dim`, the output
    projection `heads x head_dim x d`); K-FAC sees each as the matrix of
    the linear map it is, `d x (heads * head_dim)` and `(heads * head_dim) x
    d`. Embeddings get a K-FAC block with a diagonal input factor (their
    inputs are one-hot), biases and LayerNorm parameters diagonal blocks.
    """
    summary = []

    def show_preconditioner(optimizer):
        if not summary:
            print("\nU's blocks (LLQR+SAM, first seed):")
            optimizer.preconditioner.summary(print_fn=lambda line: (summary.append(line), print(line)))
            print()

    seeds = list(range(size["seeds"]))
    lm = compare(build_lm, make_optimizers(size, steps, args), train, val, size, seeds,
                 "val_perplexity", "perplexity", on_first=show_preconditioner)
    print_table(lm, "val_perplexity", "val perplexity")
    for name, e in lm.items():
        if "refreshes" in e:
            print(f"{name}: {e['refreshes'][0]} U refreshes per run (every {size['refresh_every']} steps, "
                  f"{size['refresh_steps']} inner steps), {fmt(e['refresh_seconds'], 2)} s of refresh time per run")
    lm_conclusion = conclude(lm, "val_perplexity", "perplexity", lower_is_better=True)
    print("\n" + lm_conclusion)
    facts["lm"].update(optimizers=lm, conclusion=lm_conclusion)
    facts["preconditioner_summary"] = summary

    """
    Perplexity is `exp(validation loss)`, the loss being the mean
    cross-entropy per character in nats: a perplexity of 5 means the model
    is, on average, as unsure as a uniform choice among 5 characters.
    SAM and LLQR+SAM take two gradients per step, so at the same number of
    steps they cost about twice as much (`fit s`); LLQR's extra cost is its
    refreshes.

    ## Part 2: a tiny ViT
    """
    size = sizes["vit"]
    train, val, num_classes, source = image_data(args, size)
    steps = len(train[0]) // size["batch"] * size["epochs"]
    print(f"\nimages: {source}, train {train[0].shape}, test {val[0].shape}, {num_classes} classes; {steps} steps per run")

    def build_vit():
        return tiny_vit(train[0].shape[1:], num_classes, size["patch"], size["d"], size["heads"], size["blocks"], size["ff"])

    facts["vit"] = dict(data=source, sizes=size, steps=steps, num_classes=int(num_classes),
                        num_params=int(build_vit().count_params()))
    optimizers = make_optimizers(size, steps, args)
    # AdamW against LLQR+SAM (all four with --full).
    if mode != "full":
        optimizers = {k: optimizers[k] for k in ("AdamW", "LLQR+SAM")}
    vit = compare(build_vit, optimizers, train, val, size, list(range(size["seeds"])), "val_accuracy", "accuracy")
    print_table(vit, "val_accuracy", "val accuracy")
    vit_conclusion = conclude(vit, "val_accuracy", "accuracy", lower_is_better=False)
    print("\n" + vit_conclusion)
    facts["vit"].update(optimizers=vit, conclusion=vit_conclusion)

    """
    ## What to try next

    - `--full` on a GPU: 30 modules of text, a 4-block model, 5 seeds, and
      CIFAR-10 for the ViT when cached; that is where differences of a few
      percent in perplexity become measurable.
    - `--structure diagonal` (cheaper refreshes) or `--rho 0.1`.
    - `kg.callbacks.SharpnessLogger(x, y, metrics=("riemannian_sharpness",))`
      in `fit` to watch the Fisher-geometric sharpness of each run.
    """
    facts["total_seconds"] = time.perf_counter() - start
    path = os.path.join(args.output, "facts.json")
    with open(path, "w") as f:
        json.dump(facts, f, indent=1)
    print(f"\nfacts: {path} ({facts['total_seconds']:.1f}s)")
    return facts


if __name__ == "__main__":
    main()
