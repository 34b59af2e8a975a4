"""The main job: train small classifiers and report accuracy beside sharpness.

``python -m keras_geosam`` (or ``keras-geosam``) with no arguments trains an
MLP on scikit-learn's digits at a small and a large batch size, logs
sharpness every epoch with :class:`~keras_geosam.callbacks.SharpnessLogger`,
then prints one table row per run (test accuracy, each S_R estimator, tr H,
lambda_max) and saves ``sharpness.png`` and ``results.csv`` in the output
folder. Nothing is downloaded.
"""

import argparse
import os
import sys
import time


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_ints(text):
    return [_positive_int(t.strip()) for t in text.split(",") if t.strip()] or _positive_int("")


def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _parse(argv):
    p = argparse.ArgumentParser(prog="keras-geosam", description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="digits", help="comma-separated: digits, mnist1d (offline), mnist, cifar10 (cached keras.datasets)")
    p.add_argument("--compare", action="store_true", help=f"optimizer comparison: --optimizers {COMPARISON} at one batch size (32) on digits and mnist1d unless given")
    p.add_argument("--epochs", type=_positive_int, default=20)
    p.add_argument("--batch-sizes", type=_positive_ints, default="16,256", help="comma-separated batch sizes, one run each per optimizer")
    p.add_argument("--optimizers", default="sgd", help="comma-separated: " + ", ".join(sorted(OPTIMIZERS)))
    p.add_argument("--lr", type=_positive_float, default=0.05)
    p.add_argument("--probe-size", type=_positive_int, default=256, help="examples used for sharpness")
    p.add_argument("--num-probes", type=_positive_int, default=20, help="Hutchinson probes per round (rtol 0.05)")
    p.add_argument("--log-every", type=_positive_int, default=1, help="epochs between sharpness logs")
    p.add_argument("--output", default="geosam_output")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=["jax", "tensorflow", "torch"], help="re-runs under this KERAS_BACKEND")
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args(argv)


def _sgd(lr, **_):
    import keras

    return keras.optimizers.SGD(lr, momentum=0.9)


def _two_pass(cls, **kw):
    def make(lr):
        from keras_geosam import optimizers

        return getattr(optimizers, cls)(_sgd(lr), **kw)

    return make


# name -> factory(lr); every two-pass optimizer wraps the same SGD-momentum
# base, with the spec's suggested radius for small image classifiers.
# LLQR refreshes every 100 steps here (the reference's 1000 would mean one
# refresh every ~24 digits epochs).
OPTIMIZERS = {
    "sgd": _sgd,
    "sam": _two_pass("SAM", rho=0.05),
    "asam": _two_pass("SAM", rho=0.5, adaptive=True),
    "fsam": _two_pass("FSAM", rho=0.05),
    "fishersam": _two_pass("FisherSAM", rho=0.05),
    "llqr": _two_pass("LLQR", refresh_every=100),
    "llqr-kfac": _two_pass("LLQR", structure="kfac", refresh_every=100),
    "llqrsam": _two_pass("LLQRSAM", rho=0.1, refresh_every=100),
    "llqrsam-kfac": _two_pass("LLQRSAM", rho=0.1, structure="kfac", refresh_every=100),
}
COMPARISON = "sgd,sam,asam,llqr,llqrsam,llqrsam-kfac"


def build_mlp(input_dim, num_classes, seed, width=128):
    import keras

    from keras_geosam.training import Sequential

    keras.utils.set_random_seed(seed)
    return Sequential(
        [
            keras.Input((input_dim,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(num_classes),
        ]
    )


def run(args):
    """Runs every (dataset, optimizer, batch size); returns the table rows."""
    rows, curves = [], {}
    for dataset in [d.strip() for d in args.dataset.split(",") if d.strip()]:
        r, c = run_dataset(args, dataset)
        rows += r
        curves[dataset] = c
    print()
    print(format_table(rows))
    print(
        f"\nvalue ± standard error ((~0): within 2 standard errors of zero; ± 0: exact).\n"
        f"S_R diag: undamped diagonal exact-Fisher S_R; for ReLU nets it equals\n"
        f"'nonzero F' (the parameters with nonzero Fisher), so read 'S_R diag/nnz'. Damped\n"
        f"columns use relative damping {DAMPING}. tr H and lambda_max are Euclidean;\n"
        f"lambda_max R is the top eigenvalue of M^-1/2 H M^-1/2 (K-FAC metric); for\n"
        f"lambda_max the ± is the Lanczos residual bound.\n"
        f"All on up to {args.probe_size} test examples, {args.num_probes} probes per round, seed {args.seed}."
    )
    csv_path = os.path.join(args.output, "results.csv")
    write_csv(rows, csv_path)
    print(f"\nresults: {csv_path}")
    if not args.no_plot:
        png = os.path.join(args.output, "sharpness.png")
        plot(curves, png)
        print(f"plot:    {png}")
    return rows


def run_dataset(args, dataset):
    import keras

    import keras_geosam as kg
    from keras_geosam import datasets

    (x_tr, y_tr), (x_te, y_te), classes = datasets.load(dataset, seed=args.seed)
    if x_tr.ndim > 2:
        x_tr, x_te = x_tr.reshape(len(x_tr), -1), x_te.reshape(len(x_te), -1)
    probe = slice(0, min(args.probe_size, len(x_te)))
    xp, yp = x_te[probe], y_te[probe]
    os.makedirs(args.output, exist_ok=True)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    names = [s.strip() for s in args.optimizers.split(",") if s.strip()]
    for n in names:
        if n not in OPTIMIZERS:
            raise SystemExit(f"unknown optimizer {n!r}; choose from {sorted(OPTIMIZERS)}")
    batch_sizes = list(args.batch_sizes)
    print(
        f"keras_geosam main job: backend={keras.backend.backend()} dataset={dataset} "
        f"train={len(x_tr)} test={len(x_te)} epochs={args.epochs} probe examples={len(xp)}"
    )
    results, curves = [], {}
    for name in names:
        for bs in batch_sizes:
            label = f"{dataset} {name} B={bs}"
            model = build_mlp(x_tr.shape[1], classes, args.seed)
            model.compile(optimizer=OPTIMIZERS[name](args.lr), loss=loss, metrics=["accuracy"])
            logger = kg.callbacks.SharpnessLogger(
                xp, yp,
                metrics=("hessian_trace", "riemannian_sharpness", "riemannian_sharpness_kfac"),
                every_n_epochs=args.log_every, num_probes=args.num_probes, seed=args.seed,
                options={"riemannian_sharpness": {"damping": DAMPING}, "riemannian_sharpness_kfac": {"damping": DAMPING}},
            )
            t0 = time.perf_counter()
            hist = model.fit(
                x_tr, y_tr, batch_size=bs, epochs=args.epochs, verbose=0,
                validation_data=(x_te, y_te), callbacks=[logger],
            )
            seconds = time.perf_counter() - t0
            row = {"run": label, "dataset": dataset, "optimizer": name, "batch": bs, "seconds": seconds}
            row.update(final_metrics(model, x_te, y_te, xp, yp, args))
            results.append(row)
            curves[f"{name} B={bs}"] = hist.history
            print(f"  {label:>28}: test acc {row['test_acc']:.4f}  ({seconds:.1f}s)")
    return results, curves


def final_metrics(model, x_te, y_te, xp, yp, args):
    """Test accuracy and every sharpness measure at the final weights, each
    with its standard error (``<name> stderr``)."""
    import warnings

    from keras_geosam import sharpness as S

    out = {"test_acc": float(model.evaluate(x_te, y_te, verbose=0)[1])}
    kw = dict(num_probes=args.num_probes, seed=args.seed)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*piecewise linear.*")
        d = S.riemannian_sharpness(model, xp, yp, metric="diagonal", damping=0.0, **kw)
        estimates = {
            "S_R diag": d,
            "S_R diag damped": S.riemannian_sharpness(model, xp, yp, metric="diagonal", damping=DAMPING, **kw),
            "S_R mc(8) damped": S.riemannian_sharpness(model, xp, yp, metric="diagonal", fisher="mc", num_samples=8, damping=DAMPING, **kw),
            "S_R kfac": S.riemannian_sharpness(model, xp, yp, metric="kfac", damping=DAMPING, **kw),
            "tr H": S.hessian_trace(model, xp, yp, **kw),
            "lambda_max": S.hessian_max_eigenvalue(model, xp, yp, seed=args.seed),
            "lambda_max R": S.riemannian_max_eigenvalue(model, xp, yp, metric="kfac", damping=DAMPING, seed=args.seed),
        }
    for name, est in estimates.items():
        out[name] = float(est.value)
        out[name + " stderr"] = float(est.stderr)
    out["nonzero F"] = d.info["num_nonzero_fisher"]
    out["params"] = d.info["num_params"]
    out["S_R diag/nnz"] = d.info["normalized"]
    return out


# Table columns; a column with a "<name> stderr" partner prints "value ± stderr".
COLUMNS = ["run", "test_acc", "S_R diag", "nonzero F", "S_R diag/nnz", "S_R diag damped", "S_R mc(8) damped", "S_R kfac", "tr H", "lambda_max", "lambda_max R"]

# Relative damping of the damped S_R columns: a tenth of each block's mean
# Fisher eigenvalue. Undamped, the K-FAC and Monte-Carlo estimates are
# dominated by near-null directions.
DAMPING = 0.1


def _number(v):
    return f"{v:.4f}" if abs(v) < 10 else f"{v:.4g}"


def format_cell(row, column):
    """A table cell: the value, with ``± stderr`` where the row has one and
    ``(~0)`` when the value is within two standard errors of zero."""
    v = row.get(column, "")
    if not isinstance(v, float):
        return str(v)
    se = row.get(column + " stderr")
    if se is None:
        return _number(v)
    flag = " (~0)" if se > 0 and abs(v) <= 2 * se else ""
    return f"{_number(v)} ± {se:.2g}{flag}"


def format_table(rows):
    cells = [[format_cell(r, c) for c in COLUMNS] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(COLUMNS)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths))
    return "\n".join([line(COLUMNS), line(["-" * w for w in widths])] + [line(r) for r in cells])


def write_csv(rows, path):
    import csv

    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def plot(curves_by_dataset, path):
    """One row of panels per dataset: accuracy, then each logged sharpness
    measure per epoch with a band of two standard errors."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = [
        ("val_accuracy", "test accuracy"),
        ("riemannian_sharpness", f"diagonal S_R (damping {DAMPING})"),
        ("riemannian_sharpness_kfac", f"K-FAC S_R (damping {DAMPING})"),
        ("hessian_trace", "tr H (Euclidean)"),
    ]
    rows = len(curves_by_dataset)
    fig, grid = plt.subplots(rows, len(panels), figsize=(4.2 * len(panels), 3.4 * rows), squeeze=False)
    for axes, (dataset, curves) in zip(grid, curves_by_dataset.items()):
        for ax, (key, name) in zip(axes, panels):
            for label, hist in curves.items():
                v = np.asarray(hist.get(key, []), dtype=float)
                e = np.arange(1, len(v) + 1)
                ok = np.isfinite(v)
                (line,) = ax.plot(e[ok], v[ok], marker=".", label=label)
                se = np.asarray(hist.get(key + "_stderr", []), dtype=float)
                if se.size == v.size and np.any(se[ok] > 0):
                    ax.fill_between(e[ok], (v - 2 * se)[ok], (v + 2 * se)[ok], color=line.get_color(), alpha=0.2, linewidth=0)
            title = f"{dataset}: {name}" + ("" if key == "val_accuracy" else "\n(band: ±2 stderr where estimated)")
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("epoch")
            if key == "hessian_trace":
                ax.set_yscale("log")
        axes[0].legend(fontsize=7)
    fig.suptitle("keras_geosam: accuracy and sharpness per epoch")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.compare:
        argv_given = sys.argv[1:] if argv is None else argv
        if not any(a.startswith("--optimizers") for a in argv_given):
            args.optimizers = COMPARISON
        if not any(a.startswith("--batch-sizes") for a in argv_given):
            args.batch_sizes = [32]
        if not any(a.startswith("--dataset") for a in argv_given):
            args.dataset = "digits,mnist1d"
    if args.backend and os.environ.get("KERAS_BACKEND") != args.backend:
        # Keras fixes its backend at import: re-run in a fresh process.
        env = dict(os.environ, KERAS_BACKEND=args.backend)
        argv = [a for a in (sys.argv[1:] if argv is None else argv)]
        os.execvpe(sys.executable, [sys.executable, "-m", "keras_geosam"] + argv, env)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
