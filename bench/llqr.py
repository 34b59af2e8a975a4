#!/usr/bin/env python
"""Benchmark of LLQR+SAM's cost against plain SGD.

One backend per process (Keras cannot switch backends inside a process):

    KERAS_BACKEND=jax python bench/llqr.py [--quick] [--json out.json]
    python bench/llqr.py --all [--quick]

Per backend, on MLPs 784-w-w-10 (ReLU, batch 128, random data):

- step time of SGD(momentum 0.9), SAM and LLQRSAM (diagonal and K-FAC) when
  no refresh is due, measured side by side with ``train_on_batch`` after
  warm-up (median of repeats);
- refresh wall time per structure (``optimizer.refresh_now``: 50 inner steps,
  compiled, after a warm-up refresh);
- the amortised LLQRSAM step at ``refresh_every=1000``:
  ``t_step + t_refresh / 1000``, and its ratio to the SGD step;
- the growth of LLQRSAM's overhead over SGD (amortised step - SGD step)
  with the parameter count P across the widths: the exponent k of a
  least-squares fit ``overhead ~ P^k`` in log-log and its 95% interval
  (``fit_power_law``, which ``sam_step.py --vit-widths`` uses too);
- ``--refresh-goals``: one refresh of U measured in SGD steps of the same
  model and batch, against the goals: the MLP 784-512-512-10 at batch 256
  (diagonal <= 60, K-FAC <= 120) and a small BatchNorm ResNet on 32x32x3
  images at batch 64 (<= 120, both structures).
"""

import argparse
import json
import statistics
import sys
import time

from _backends import run_each_backend  # noqa: E402  (bench/ is the script's own folder)
BATCH = 128
REFRESH_EVERY = 1000


def _mlp(width, kg, keras):
    keras.utils.set_random_seed(0)
    return kg.Sequential([
        keras.Input((784,)),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.Dense(10),
    ])


def _step_time(model, x, y, repeats):
    for _ in range(3):  # compile + settle
        model.train_on_batch(x, y)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        model.train_on_batch(x, y)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(width, repeats, refresh_repeats):
    import keras
    import numpy as np

    import keras_geosam as kg

    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, 784)).astype("float32")
    y = rng.integers(0, 10, size=BATCH).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    base = lambda: keras.optimizers.SGD(0.01, momentum=0.9)
    row = {"width": width}
    configs = {
        "sgd": lambda: base(),
        "sam": lambda: kg.optimizers.SAM(base(), rho=0.05),
        # refresh_source="callback": no refresh inside these timed steps;
        # the refresh is timed on its own below.
        "llqrsam_diagonal": lambda: kg.optimizers.LLQRSAM(base(), structure="diagonal", refresh_source="callback"),
        "llqrsam_kfac": lambda: kg.optimizers.LLQRSAM(base(), structure="kfac", refresh_source="callback"),
    }
    for name, make in configs.items():
        model = _mlp(width, kg, keras)
        opt = make()
        model.compile(optimizer=opt, loss=loss)
        row["params"] = int(sum(np.prod(v.shape) for v in model.trainable_variables))
        row[f"{name}_step_ms"] = 1e3 * _step_time(model, x, y, repeats)
        if name.startswith("llqrsam"):
            opt.refresh_now(model, x, y)  # compile
            times = []
            for _ in range(refresh_repeats):
                t = time.perf_counter()
                opt.refresh_now(model, x, y)
                keras.ops.convert_to_numpy(opt.preconditioner.variables[0])  # synchronise
                times.append(time.perf_counter() - t)
            refresh = statistics.median(times)
            row[f"{name}_refresh_s"] = refresh
            row[f"{name}_amortised_ms"] = row[f"{name}_step_ms"] + 1e3 * refresh / REFRESH_EVERY
    sgd = row["sgd_step_ms"]
    row["sam_ratio"] = row["sam_step_ms"] / sgd
    for s in ("diagonal", "kfac"):
        row[f"llqrsam_{s}_ratio"] = row[f"llqrsam_{s}_amortised_ms"] / sgd
    return row


def fit_power_law(P, overhead, confidence=0.95):
    """``overhead ~ P^k``: least squares of log(overhead) on log(P) over the
    points with a positive overhead. Returns ``{"k", "lo", "hi", "stderr",
    "r2", "n"}``: the slope, its `confidence` interval k +- t(n-2) stderr
    (``scipy.stats.linregress``'s stderr, Student t quantile; nan below 3
    points), r^2 and the number of points used."""
    import numpy as np
    from scipy import stats

    P, over = np.asarray(P, float), np.asarray(overhead, float)
    ok = over > 0
    n = int(ok.sum())
    nan = float("nan")
    if n < 2:
        return {"k": nan, "lo": nan, "hi": nan, "stderr": nan, "r2": nan, "n": n}
    fit = stats.linregress(np.log(P[ok]), np.log(over[ok]))
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 2) * fit.stderr) if n > 2 else nan
    return {"k": float(fit.slope), "lo": float(fit.slope) - half, "hi": float(fit.slope) + half,
            "stderr": float(fit.stderr) if n > 2 else nan, "r2": float(fit.rvalue ** 2), "n": n}


def fit_exponent(rows, key):
    """The power law of ``rows[key] - sgd_step_ms`` in the parameter count."""
    return fit_power_law([r["params"] for r in rows], [r[key] - r["sgd_step_ms"] for r in rows])


def run_backend(quick):
    import keras

    widths = (64, 128, 256, 512) if quick else (64, 128, 256, 512, 1024)
    repeats, refresh_repeats = (5, 1) if quick else (20, 3)
    rows = []
    for w in widths:
        print(f"  {keras.backend.backend()}: width {w}", file=sys.stderr, flush=True)
        rows.append(measure(w, repeats, refresh_repeats))
    return {
        "backend": keras.backend.backend(),
        "rows": rows,
        "exponent_diagonal": fit_exponent(rows, "llqrsam_diagonal_amortised_ms"),
        "exponent_kfac": fit_exponent(rows, "llqrsam_kfac_amortised_ms"),
    }


def table(results):
    lines = [
        "| backend | width | params | SGD ms | SAM / SGD | LLQRSAM diag / SGD | LLQRSAM K-FAC / SGD | refresh diag s | refresh K-FAC s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        for r in res["rows"]:
            lines.append(
                f"| {res['backend']} | {r['width']} | {r['params']} | {r['sgd_step_ms']:.2f} | {r['sam_ratio']:.2f} | "
                f"{r['llqrsam_diagonal_ratio']:.2f} | {r['llqrsam_kfac_ratio']:.2f} | "
                f"{r['llqrsam_diagonal_refresh_s']:.3f} | {r['llqrsam_kfac_refresh_s']:.3f} |"
            )
    lines.append("")
    lines.append("| backend | overhead exponent (diag) [95% interval] | overhead exponent (K-FAC) [95% interval] |")
    lines.append("|---|---|---|")
    show = lambda f: f"{f['k']:.2f} [{f['lo']:.2f}, {f['hi']:.2f}]"  # noqa: E731
    for res in results:
        lines.append(f"| {res['backend']} | {show(res['exponent_diagonal'])} | {show(res['exponent_kfac'])} |")
    return "\n".join(lines)


REFRESH_GOALS = {("mlp", "diagonal"): 60, ("mlp", "kfac"): 120, ("resnet", "diagonal"): 120, ("resnet", "kfac"): 120}


def _small_resnet(kg, keras):
    """Conv 16 -> two residual stages (32, 64 filters, BatchNorm, ReLU) -> 10."""
    keras.utils.set_random_seed(0)
    L = keras.layers
    inputs = keras.Input((32, 32, 3))
    h = L.ReLU()(L.BatchNormalization()(L.Conv2D(16, 3, padding="same", use_bias=False)(inputs)))
    for filters in (32, 64):
        shortcut = L.Conv2D(filters, 1, strides=2, use_bias=False)(h)
        h = L.ReLU()(L.BatchNormalization()(L.Conv2D(filters, 3, strides=2, padding="same", use_bias=False)(h)))
        h = L.BatchNormalization()(L.Conv2D(filters, 3, padding="same", use_bias=False)(h))
        h = L.ReLU()(L.Add()([h, shortcut]))
    outputs = L.Dense(10)(L.GlobalAveragePooling2D()(h))
    return kg.Model(inputs, outputs)


def refresh_goals(repeats):
    """Refresh time / SGD step time per (model, structure)."""
    import keras
    import numpy as np

    import keras_geosam as kg

    rng = np.random.default_rng(0)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    cases = {
        "mlp": (lambda: _mlp(512, kg, keras), rng.normal(size=(256, 784)).astype("float32"), 256),
        "resnet": (lambda: _small_resnet(kg, keras), rng.normal(size=(64, 32, 32, 3)).astype("float32"), 64),
    }
    rows = []
    for name, (build, x, batch) in cases.items():
        y = rng.integers(0, 10, size=batch).astype("int32")
        model = build()
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss=loss)
        sgd = _step_time(model, x, y, max(repeats, 10))
        for structure in ("diagonal", "kfac"):
            model = build()
            opt = kg.optimizers.LLQRSAM(keras.optimizers.SGD(0.01, momentum=0.9), structure=structure, refresh_source="callback")
            model.compile(optimizer=opt, loss=loss)
            model.train_on_batch(x, y)
            opt.refresh_now(model, x, y)  # compile
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                opt.refresh_now(model, x, y)
                keras.ops.convert_to_numpy(opt.preconditioner.variables[0])  # synchronise
                times.append(time.perf_counter() - t)
            refresh = statistics.median(times)
            rows.append({
                "backend": keras.backend.backend(), "model": name, "structure": structure, "batch": batch,
                "sgd_step_ms": 1e3 * sgd, "refresh_s": refresh, "refresh_in_sgd_steps": refresh / sgd,
                "goal": REFRESH_GOALS[(name, structure)],
            })
            print(f"  {rows[-1]['backend']} {name} {structure}: refresh = {refresh / sgd:.0f} SGD steps", file=sys.stderr, flush=True)
    return rows


def goals_table(rows):
    lines = ["| backend | model | U | batch | SGD step ms | refresh s | refresh / SGD step | goal |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        met = "met" if r["refresh_in_sgd_steps"] <= r["goal"] else "NOT met"
        lines.append(
            f"| {r['backend']} | {r['model']} | {r['structure']} | {r['batch']} | {r['sgd_step_ms']:.2f} | "
            f"{r['refresh_s']:.3f} | {r['refresh_in_sgd_steps']:.0f} | <= {r['goal']} ({met}) |"
        )
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--all", action="store_true", help="one subprocess per backend, combined table")
    p.add_argument("--json")
    p.add_argument("--refresh-goals", action="store_true", help="refresh time in SGD steps against the goals")
    args = p.parse_args()
    if args.refresh_goals:
        if args.all:
            runs, failed = run_each_backend(__file__, ["--refresh-goals"] + (["--quick"] if args.quick else []))
            if failed:
                sys.exit(f"backends failed: {', '.join(failed)}")
            rows = [row for run in runs for row in run]
        else:
            rows = refresh_goals(3 if args.quick else 5)
        print(goals_table(rows))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    if args.all:
        results, failed = run_each_backend(__file__, ["--quick"] if args.quick else [])
        if failed:
            sys.exit(f"backends failed: {', '.join(failed)}")
    else:
        results = [run_backend(args.quick)]
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results[0] if not args.all else results, f, indent=1)


if __name__ == "__main__":
    main()
