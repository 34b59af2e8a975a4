"""What `SharpnessLogger` costs on a small Transformer, in training epochs.

The model is the trial Transformer of the sequence-sharpness work (an
Embedding, one post-LN block with 2-head MultiHeadAttention and a gelu
feed-forward, mean pooling, 2 classes; 11.2k parameters), trained on 512
random sequences of 16 tokens at batch 32, with Adam and with LLQR+SAM
(K-FAC U, refreshed every 100 steps). The logger evaluates K-FAC S_R and
tr H on 64 of them with its defaults (20 probes a round, rtol 0.05, at most
100).

Reported per backend, all warm (after the first call, which compiles):
one training epoch with each optimizer, one logger call, their ratios, and
each metric's time and probe count. Run:
``python bench/logger_cost.py [--backends jax,torch]``.

``--goals`` checks the logger's two goals: the default logger (budget
0.1) in an Adam fit of 8192 sequences whose epoch count makes it take at
least ``--fit-seconds`` (150) without the logger, against the same fit
without it (its share, and which epochs it logged); and a warm log against
its probes' floor: each measure's probe count times the time of one probe's
product alone (H for tr H; ``M^-1/2 (H - GGN) M^-1/2`` for K-FAC S_R),
with the parts a log pays once (the K-FAC metric, the exact GGN part)
timed apart.

``--deflation`` compares the probed residual's estimators instead, on the
same model after the same training (4 Adam epochs): K-FAC S_R and tr H
with ``estimator="hutchinson"`` and ``"deflated"`` (rtol 0.05, at most 100
products each), over `--repeats` seeds: the value, its relative stderr and
the products used, and for the deflated one the first round's stderr
against the rest's (how much of the probes' variance the sketched
directions carried).
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

VOCAB, SEQ, D, HEADS, FF = 96, 16, 32, 2, 64
N_TRAIN, N_PROBE, BATCH = 512, 64, 32
N_FIT = 8192  # --goals: a fit long enough to be worth logging (>= 2 min at its epoch count)
METRICS = ("riemannian_sharpness_kfac", "hessian_trace")


def build(keras):
    ids = keras.Input((SEQ,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, D)(ids)
    a = keras.layers.MultiHeadAttention(HEADS, D // HEADS)(h, h)
    h = keras.layers.LayerNormalization()(h + a)
    f = keras.layers.Dense(FF, activation="gelu")(h)
    h = keras.layers.LayerNormalization()(h + keras.layers.Dense(D)(f))
    out = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(h))
    return keras.Model(ids, out)


def data_and_model(keras):
    """The 512 training sequences (label: whether token 7 occurs) and the
    Transformer, compiled with Adam, seeded."""
    import numpy as np

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, size=(N_TRAIN, SEQ)).astype("int32")
    y = (x == 7).any(axis=1).astype("int32")
    model = build(keras)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return x, y, model


def measure(repeats):
    import numpy as np
    import keras

    import keras_geosam as kg

    x, y, model = data_and_model(keras)
    logger = kg.callbacks.SharpnessLogger(x[:N_PROBE], y[:N_PROBE], metrics=METRICS)
    sam = kg.attach(build(keras))
    sam.compile(optimizer=kg.optimizers.LLQRSAM(keras.optimizers.Adam(1e-3), rho=0.05, structure="kfac",
                                                refresh_every=100),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    epochs = {"adam": [], "llqrsam": []}
    for name, m in (("adam", model), ("llqrsam", sam)):
        m.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)  # compiles the step
        for _ in range(repeats):
            t0 = time.perf_counter()
            m.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
            epochs[name].append(time.perf_counter() - t0)
    logger.set_model(model)
    first = time.perf_counter()
    logger.compute()
    first = time.perf_counter() - first
    calls, per_metric = [], {}
    for _ in range(repeats):
        t0 = time.perf_counter()
        for name in METRICS:
            one = kg.callbacks.SharpnessLogger(x[:N_PROBE], y[:N_PROBE], metrics=(name,))
            one.set_model(model)
            s = time.perf_counter()
            values = one.compute()
            per_metric.setdefault(name, []).append(time.perf_counter() - s)
        calls.append(time.perf_counter() - t0)
    estimates = {}
    for name in METRICS:
        fn = {"riemannian_sharpness_kfac": lambda: kg.sharpness.riemannian_sharpness(
                  model, x[:N_PROBE], y[:N_PROBE], structure="kfac", seed=0),
              "hessian_trace": lambda: kg.sharpness.hessian_trace(model, x[:N_PROBE], y[:N_PROBE], seed=0)}[name]
        est = fn()
        estimates[name] = {"value": float(est.value), "stderr": float(est.stderr), "samples": int(est.num_samples)}
    epoch = {k: float(np.median(v)) for k, v in epochs.items()}
    call = float(np.median(calls))
    return {
        "backend": keras.backend.backend(),
        "params": int(model.count_params()),
        "epoch_s": epoch,
        "logger_s": call,
        "ratio": {k: call / v for k, v in epoch.items()},
        "first_call_s": first,
        "per_metric_s": {k: float(np.median(v)) for k, v in per_metric.items()},
        "estimates": estimates,
        "last_values": values,
    }


def deflation(seeds):
    """Hutchinson against deflated Hutchinson on the residual (module doc)."""
    import warnings

    import keras

    import keras_geosam as kg

    x, y, model = data_and_model(keras)
    model.fit(x, y, batch_size=BATCH, epochs=4, verbose=0)
    xs, ys = x[:N_PROBE], y[:N_PROBE]
    calls = {"riemannian_sharpness_kfac": lambda e, s: kg.sharpness.riemannian_sharpness(
                 model, xs, ys, structure="kfac", estimator=e, seed=s),
             "hessian_trace": lambda e, s: kg.sharpness.hessian_trace(model, xs, ys, estimator=e, seed=s)}
    rows = []
    for name, call in calls.items():
        for estimator in ("hutchinson", "deflated"):
            for seed in range(seeds):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    t0 = time.perf_counter()
                    est = call(estimator, seed)
                    seconds = time.perf_counter() - t0
                d = est.info.get("deflation")
                products = d["products"] if isinstance(d, dict) else est.num_samples
                rows.append({"metric": name, "estimator": estimator, "seed": seed, "value": float(est.value),
                             "stderr": float(est.stderr), "relative_stderr": float(est.relative_stderr),
                             "residual": float(est.info["residual"]), "products": int(products), "seconds": seconds,
                             "deflation": d})
    return {"backend": keras.backend.backend(), "params": int(model.count_params()), "rows": rows}


def goals(seconds):
    """The issue's goals (module doc, ``--goals``): the default logger's
    share of an Adam fit of at least `seconds`, and a warm log against its
    probes' product kernels."""
    import math
    import warnings

    import numpy as np
    import keras

    import keras_geosam as kg

    rng = np.random.default_rng(1)
    x_fit = rng.integers(0, VOCAB, size=(N_FIT, SEQ)).astype("int32")
    y_fit = (x_fit == 7).any(axis=1).astype("int32")
    xs, ys = x_fit[:N_PROBE], y_fit[:N_PROBE]

    def fit(epochs, callbacks):
        _, _, model = data_and_model(keras)  # the same seeded model each time
        t0 = time.perf_counter()
        model.fit(x_fit, y_fit, batch_size=BATCH, epochs=epochs, verbose=0, callbacks=callbacks)
        return time.perf_counter() - t0, model

    _, model = fit(1, [])
    t0 = time.perf_counter()
    model.fit(x_fit, y_fit, batch_size=BATCH, epochs=1, verbose=0)
    epoch = time.perf_counter() - t0
    epochs = max(3, math.ceil(seconds / epoch))
    plain, _ = fit(epochs, [])
    logger = kg.callbacks.SharpnessLogger(xs, ys, metrics=METRICS)  # the defaults: budget 0.1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logged, model = fit(epochs, [logger])
    logged_epochs = [e for e, _ in logger.history]

    # A warm log against its kernels: each probe is one product of its
    # operator (H for tr H; H - GGN, sandwiched by M^-1/2, for S_R's residual).
    def timed(fn, repeats=3):
        fn()
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return float(np.median(out))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        log_s = timed(logger.compute)
        sr = kg.sharpness.riemannian_sharpness(model, xs, ys, structure="kfac")
        tr = kg.sharpness.hessian_trace(model, xs, ys)
        block = 20

        def probes(k):
            return [np.sign(rng.normal(size=(k,) + tuple(v.shape))).astype(v.dtype) for v in model.trainable_variables]

        V = probes(block)
        H = kg.curvature.Hessian(model, xs, ys)
        M = kg.sharpness.fisher_metric(model, xs, ys, structure="kfac")
        S = M.inverse_sqrt(1e-3, relative=True)
        R = S @ kg.curvature.GGNResidual(model, xs, ys) @ S
        per_probe = {"hessian_trace": timed(lambda: H.matmat(V)) / block,
                     "riemannian_sharpness_kfac": timed(lambda: R.matmat(V)) / block}
        fixed = {"riemannian_sharpness_kfac": timed(lambda: kg.sharpness.riemannian_sharpness(
                     model, xs, ys, structure="kfac", num_probes=1, rtol=None)) - per_probe["riemannian_sharpness_kfac"],
                 "hessian_trace": timed(lambda: kg.sharpness.hessian_trace(
                     model, xs, ys, num_probes=1, rtol=None)) - per_probe["hessian_trace"]}
    samples = {"riemannian_sharpness_kfac": int(sr.num_samples), "hessian_trace": int(tr.num_samples)}
    floor = sum(samples[k] * per_probe[k] for k in METRICS)
    return {
        "backend": keras.backend.backend(), "params": int(model.count_params()), "fit_examples": N_FIT,
        "epochs": epochs, "epoch_s": epoch, "fit_s": plain, "fit_with_logger_s": logged,
        "overhead": logged / plain - 1.0, "logger_spent_s": logger._spent, "logged_epochs": logged_epochs,
        "warm_log_s": log_s, "probes": samples, "per_probe_s": per_probe, "fixed_s": fixed, "probe_floor_s": floor,
        "log_over_floor": log_s / floor, "log_over_floor_and_fixed": log_s / (floor + sum(fixed.values())),
    }


def print_goals(results, seconds):
    print(f"Default SharpnessLogger (budget 0.1; {', '.join(METRICS)} on {N_PROBE} sequences) in an Adam fit of "
          f"{N_FIT} sequences (batch {BATCH}) sized to take >= {seconds:.0f} s without it; a warm log against its "
          "probes' products (each probe one product of its operator, timed alone over a block of 20).")
    print("| backend | epochs | fit s: plain, with logger | overhead | logger's own s (share of its fit) | logged epochs "
          "| warm log s | probes (S_R, tr H) | probes' floor s | fixed parts s (S_R, tr H) | log / floor "
          "| log / (floor + fixed) |")
    print("|---|---:|---|---:|---|---|---:|---|---:|---|---:|---:|")
    for r in results:
        e = r["logged_epochs"]
        shown = ", ".join(str(i) for i in e) if len(e) <= 6 else f"{e[0]}, {e[1]}, ... {e[-1]} ({len(e)})"
        p, f = r["probes"], r["fixed_s"]
        print(f"| {r['backend']} | {r['epochs']} | {r['fit_s']:.0f}, {r['fit_with_logger_s']:.0f} | "
              f"{100 * r['overhead']:.1f}% | {r['logger_spent_s']:.1f} ({100 * r['logger_spent_s'] / r['fit_with_logger_s']:.1f}%) | "
              f"{shown} | {r['warm_log_s']:.2f} | "
              f"{p['riemannian_sharpness_kfac']}, {p['hessian_trace']} | {r['probe_floor_s']:.2f} | "
              f"{f['riemannian_sharpness_kfac']:.2f}, {f['hessian_trace']:.2f} | {r['log_over_floor']:.2f} | "
              f"{r['log_over_floor_and_fixed']:.2f} |")
    for r in results:
        last = r["epochs"] - 1
        print(f"- {r['backend']}: adds <= 10% to a >= 2 min fit, first and last epochs logged: "
              f"{'met' if r['overhead'] <= 0.10 and r['fit_s'] >= 120 and r['logged_epochs'][:1] == [0] and r['logged_epochs'][-1:] == [last] else 'not met'}"
              f" ({100 * r['overhead']:.1f}%); warm log <= 1.2x its probes' floor: "
              f"{'met' if r['log_over_floor'] <= 1.2 else 'not met'} ({r['log_over_floor']:.2f}x)")


def print_deflation(results):
    print("| backend | metric | estimator | value ± stderr per seed | median relative stderr | products | "
          "deflated: first round's stderr -> rest's |")
    print("|---|---|---|---|---:|---:|---|")
    for r in results:
        cells = {}
        for row in r["rows"]:
            cells.setdefault((row["metric"], row["estimator"]), []).append(row)
        for (metric, estimator), rows in cells.items():
            values = "; ".join(f"{x['value']:.4g} ± {x['stderr']:.2g}" for x in rows)
            rel = float(sorted(x["relative_stderr"] for x in rows)[len(rows) // 2])
            products = "/".join(str(x["products"]) for x in rows)
            deflated = "; ".join(f"{x['deflation']['first_round']['stderr']:.2g} -> {x['deflation']['rest_stderr']:.2g}"
                                 for x in rows if isinstance(x["deflation"], dict)) or "-"
            print(f"| {r['backend']} | {metric} | {estimator} | {values} | {rel:.3g} | {products} | {deflated} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="jax,tensorflow,torch")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--deflation", action="store_true", help="Hutchinson against deflated Hutchinson on the residual")
    ap.add_argument("--goals", action="store_true",
                    help="the default logger's share of a >= --fit-seconds Adam fit, and a warm log against its probes")
    ap.add_argument("--fit-seconds", type=float, default=150.0)
    ap.add_argument("--json", help=argparse.SUPPRESS)  # set by the per-backend parent
    args = ap.parse_args()
    if args.json:
        with open(args.json, "w") as f:
            if args.goals:
                json.dump(goals(args.fit_seconds), f)
            else:
                json.dump(deflation(args.repeats) if args.deflation else measure(args.repeats), f)
        return
    from _backends import run_each_backend

    extra = ["--deflation"] if args.deflation else []
    extra += ["--goals", "--fit-seconds", str(args.fit_seconds)] if args.goals else []
    results, failed = run_each_backend(__file__, ["--repeats", str(args.repeats)] + extra, args.backends.split(","))
    if args.deflation or args.goals:
        (print_deflation(results) if args.deflation else print_goals(results, args.fit_seconds))
        if failed:
            print(f"failed: {', '.join(failed)}")
        sys.exit(1 if failed else 0)
    print(f"SharpnessLogger ({', '.join(METRICS)}) on {N_PROBE} sequences vs one epoch of "
          f"{N_TRAIN} sequences (batch {BATCH}), warm; medians of {args.repeats}.")
    print("| backend | epoch s: Adam, LLQR+SAM | logger s | logger / epoch: Adam, LLQR+SAM | first call s | "
          "per metric s (probes; one probe in Adam steps) |")
    print("|---|---:|---:|---:|---:|---|")
    for r in results:
        step = r["epoch_s"]["adam"] / (N_TRAIN // BATCH)
        per = ", ".join(f"{k} {v:.2f} ({n} probes, {v / max(n, 1) / step:.1f} Adam steps each)"
                        for k, v in r["per_metric_s"].items() for n in [r["estimates"][k]["samples"]])
        e, q = r["epoch_s"], r["ratio"]
        print(f"| {r['backend']} | {e['adam']:.3f}, {e['llqrsam']:.3f} | {r['logger_s']:.2f} | "
              f"{q['adam']:.1f}, {q['llqrsam']:.1f} | {r['first_call_s']:.1f} | {per} |")
    if failed:
        print(f"failed: {', '.join(failed)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
