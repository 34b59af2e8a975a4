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

from keras_geosam.experiments import DAMPING
from keras_geosam.experiments.arguments import fraction as _fraction
from keras_geosam.experiments.arguments import open_fraction as _open_fraction
from keras_geosam.experiments.arguments import nonneg_float as _nonneg_float
from keras_geosam.experiments.arguments import positive_float as _positive_float
from keras_geosam.experiments.arguments import positive_int as _positive_int
from keras_geosam.experiments.arguments import positive_ints as _positive_ints
from keras_geosam.experiments.data import PROBE_SOURCES
from keras_geosam.experiments.data import probe_subset
from keras_geosam.experiments.optimizers import OPTIMIZERS
from keras_geosam.experiments.results import ResultsFile as _ResultsFile
from keras_geosam.experiments.optimizers import names_help as _optimizer_names
from keras_geosam.experiments.run import initialised_mlp
from keras_geosam.experiments.run import train_run
from keras_geosam.experiments.validity import check_run


def backend_that_will_run():
    """``(backend, where it comes from)`` as Keras will choose it, found
    without importing Keras: ``KERAS_BACKEND``, else ``keras.json`` in
    ``KERAS_HOME`` (default ``~/.keras``), else Keras' default."""
    if os.environ.get("KERAS_BACKEND"):
        return os.environ["KERAS_BACKEND"], "KERAS_BACKEND"
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    path = os.path.join(home, "keras.json")
    try:
        import json

        with open(path) as f:
            return json.load(f)["backend"], "keras.json"
    except (OSError, ValueError, KeyError, TypeError):
        return "tensorflow", "Keras' default"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each default once, and none for flags and unset options."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default:" in text or any(action.default is v for v in (None, False, argparse.SUPPRESS)):
            return text
        return super()._get_help_string(action)


def _parse(argv):
    backend, source = backend_that_will_run()
    p = argparse.ArgumentParser(
        prog="keras-geosam",
        description=(
            f"{__doc__.splitlines()[0]} Runs on the {backend} backend ({source}; "
            f"--backend or KERAS_BACKEND picks another)."
        ),
        epilog=(
            "Other commands: 'keras-geosam study --help' runs the study 'Does "
            "sharpness predict generalisation?' (a grid of batch sizes, learning rates, "
            "optimizers and seeds, with rank correlations and confidence intervals). "
            "Runs already in OUTPUT/results.csv are skipped (resumable); --fresh starts over."
        ),
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--dataset", default="digits", help="comma-separated: digits, mnist1d (offline), mnist, cifar10 (cached keras.datasets)")
    p.add_argument("--data", metavar="PATH.npz", help="your own data instead of --dataset: an .npz with x_train, y_train, x_test, y_test (optional num_classes)")
    p.add_argument("--compare", action="store_true", help=f"optimizer comparison: --optimizers {COMPARISON} at batch size 32 on digits and mnist1d, unless given")
    p.add_argument("--epochs", type=_positive_int, default=20, help="training epochs per run")
    p.add_argument("--batch-sizes", type=_positive_ints, default="16,256", help="comma-separated batch sizes, one run each per optimizer")
    p.add_argument("--optimizers", default="sgd", help="comma-separated: " + _optimizer_names())
    p.add_argument("--lr", type=_positive_float, default=0.05, help="learning rate of the base optimizer")
    p.add_argument("--probe-data", choices=PROBE_SOURCES, default="train", help="where the examples sharpness is measured on come from: the training set (the Hessian of the training loss, which the papers' claims are about) or the test set")
    p.add_argument("--probe-size", type=_positive_int, default=256, help="examples (the first of --probe-data) sharpness is measured on")
    p.add_argument("--damping", type=_nonneg_float, default=DAMPING, help=f"relative damping of the damped S_R and lambda_max R columns (default: {DAMPING}; the library's functions default to 1e-3)")
    p.add_argument("--min-train-acc", type=_fraction, default=None, help="final train accuracy below which a run is flagged as collapsed (default: twice chance, 2 / classes)")
    p.add_argument("--num-probes", type=_positive_int, default=20, help="Hutchinson probes per round (more rounds until stderr <= 5%% of the value, at most 100 probes)")
    p.add_argument("--log-every", type=_positive_int, default=None, help="epochs between sharpness logs during training, whatever they cost (default: --log-budget decides)")
    p.add_argument("--log-budget", type=_open_fraction, default=0.1, help="the largest share of each run's training time sharpness logging may take: the first and last epochs are logged, others as the budget allows (default: 0.1; ignored with --log-every)")
    p.add_argument("--output", default="geosam_output", help="folder for results.csv, sharpness.png and per-run histories")
    p.add_argument("--fresh", action="store_true", help="recompute runs already in OUTPUT/results.csv (without it they are skipped)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, the data order, the probes and the sampled labels")
    p.add_argument("--backend", choices=["jax", "tensorflow", "torch"], help=f"re-runs under this KERAS_BACKEND (default: {backend})")
    p.add_argument("--verbose", type=int, choices=[0, 1, 2], default=1, help="0: the table only; 1: a line per run and per sharpness phase; 2: also a line per epoch")
    p.add_argument("--no-plot", action="store_true", help="skip sharpness.png")
    args = p.parse_args(argv)
    if args.log_every is not None:
        args.log_budget = None
    return args


COMPARISON = "sgd,sam,asam,llqr,llqrsam,llqrsam-kfac"


def _datasets(args):
    if args.data:
        return [args.data]
    return [d.strip() for d in args.dataset.split(",") if d.strip()]


def run(args):
    """Runs every (dataset, optimizer, batch size) not already in
    ``results.csv``; returns this job's table rows."""
    os.makedirs(args.output, exist_ok=True)
    results = ResultsFile(os.path.join(args.output, "results.csv"), fresh=args.fresh)
    rows, curves = [], {}
    for dataset in _datasets(args):
        r, c = run_dataset(args, dataset, results)
        rows += r
        curves[_dataset_label(dataset)] = c
    print()
    print(format_table(rows))
    print(
        f"\nvalue ± standard error ((~0): within 2 standard errors of zero; ± 0: exact).\n"
        f"S_R diag: undamped diagonal exact-Fisher S_R; for ReLU nets it equals\n"
        f"'nonzero F' (the parameters with nonzero Fisher), so read 'S_R diag/nnz'. Damped\n"
        f"columns use relative damping {args.damping}. tr H and lambda_max are Euclidean;\n"
        f"lambda_max R is the top eigenvalue of M^-1/2 H M^-1/2 (K-FAC metric); for\n"
        f"lambda_max the ± is the Lanczos residual bound. S_R mc(8): the metric from 8\n"
        f"sampled labels per example, drawn {MC_DRAWS} times; the mean of the draws ± their spread.\n"
        f"All on the first {args.probe_size} (at most) {dict(train='training', test='test')[args.probe_data]} examples, {args.num_probes} probes per "
        f"round, seed {args.seed}.\nnote: a run whose final train accuracy is below "
        f"{'--min-train-acc ' + str(args.min_train_acc) if args.min_train_acc is not None else 'twice chance'} "
        f"collapsed (or diverged): its sharpness describes no minimum."
    )
    bad = [r for r in rows if r.get("note")]
    if bad:
        print(f"\n{len(bad)} of {len(rows)} run(s) did not train: " + "; ".join(f"{r['run']}: {r['note']}" for r in bad))
    print(f"\nresults: {results.path}")
    if not args.no_plot:
        png = os.path.join(args.output, "sharpness.png")
        plot(curves, png, damping=args.damping)
        print(f"plot:    {png}")
    return rows


def _dataset_label(dataset):
    return os.path.splitext(os.path.basename(dataset))[0] if dataset.endswith(".npz") else dataset


def _config(args, dataset):
    """What a run's row depends on besides (dataset, optimizer, batch): a
    re-run with the same configuration skips the row."""
    import hashlib
    import json

    from keras_geosam import __version__

    data = os.path.abspath(dataset) if dataset.endswith(".npz") else dataset
    if dataset.endswith(".npz"):
        stat = os.stat(dataset)
        data = f"{data}:{stat.st_size}:{int(stat.st_mtime)}"
    fields = [data, args.epochs, args.lr, args.seed, args.probe_data, args.probe_size, args.num_probes, args.log_every,
              args.log_budget,
              args.damping, args.min_train_acc, __version__, f"mc draws {MC_DRAWS}"]
    return hashlib.sha1(json.dumps(fields).encode()).hexdigest()[:12]


class _TimedLogger:
    """Mixin: adds up the wall time SharpnessLogger spends, so the job can
    report logging's share of training time."""

    seconds = 0.0
    announce = None  # a label: print a line before each logging phase

    def on_epoch_end(self, epoch, logs=None):
        self._epoch = epoch
        super().on_epoch_end(epoch, logs)

    def compute(self):
        if self.announce:
            print(
                f"    {self.announce} epoch {getattr(self, '_epoch', 0) + 1}: sharpness "
                f"({', '.join(self.metrics)}) on {len(self.x)} examples...",
                flush=True,
            )
        t0 = time.perf_counter()
        try:
            return super().compute()
        finally:
            self.seconds += time.perf_counter() - t0


def _epoch_printer(label, epochs):
    import keras

    class EpochLine(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.t0 = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            logs = logs or {}
            parts = [f"{k} {logs[k]:.4g}" for k in ("loss", "accuracy", "val_loss", "val_accuracy") if k in logs]
            sharp = [k for k in ("riemannian_sharpness_kfac", "hessian_trace") if k in logs and logs[k] == logs[k]]
            parts += [f"{k} {logs[k]:.4g} ± {logs.get(k + '_stderr', 0):.2g}" for k in sharp]
            print(f"    {label} epoch {epoch + 1}/{epochs}: " + ", ".join(parts) + f" ({time.perf_counter() - self.t0:.1f}s)", flush=True)

    return EpochLine()


def run_dataset(args, dataset, results):
    import keras

    import keras_geosam as kg
    from keras_geosam import datasets

    (x_tr, y_tr), (x_te, y_te), classes = datasets.load(dataset, seed=args.seed)
    name_of_data = _dataset_label(dataset)
    if x_tr.ndim > 2:
        x_tr, x_te = x_tr.reshape(len(x_tr), -1), x_te.reshape(len(x_te), -1)
    xp, yp = probe_subset((x_tr, y_tr), (x_te, y_te), args.probe_size, args.probe_data)
    names = [s.strip() for s in args.optimizers.split(",") if s.strip()]
    for n in names:
        if n not in OPTIMIZERS:
            raise SystemExit(f"unknown optimizer {n!r}; {_optimizer_names()}")
    batch_sizes = list(args.batch_sizes)
    config = _config(args, dataset)
    print(
        f"keras_geosam main job: backend={keras.backend.backend()} dataset={name_of_data} "
        f"train={len(x_tr)} test={len(x_te)} classes={classes} epochs={args.epochs} "
        f"probe examples={len(xp)} ({args.probe_data}) sharpness "
        + (f"every {args.log_every} epoch(s)" if args.log_every else
           f"within {args.log_budget:.0%} of training time (the first and last epochs always)"),
        flush=True,
    )
    Logger = type("SharpnessLogger", (_TimedLogger, kg.callbacks.SharpnessLogger), {})
    runs = [(n, bs) for n in names for bs in batch_sizes]
    out, curves = [], {}
    for i, (name, bs) in enumerate(runs, 1):
        label = f"{name_of_data} {name} B={bs}"
        hist_path = os.path.join(args.output, "history", f"{name_of_data}_{name}_B{bs}_{config}.json")
        done = results.get(label, config)
        if done is not None and os.path.exists(hist_path):
            if args.verbose:
                print(f"  [{i}/{len(runs)}] {label}: already in {results.path}, skipped (--fresh recomputes)", flush=True)
            out.append(done)
            curves[f"{name} B={bs}"] = _read_json(hist_path)
            continue
        if args.verbose:
            print(f"  [{i}/{len(runs)}] {label}: training {args.epochs} epochs", flush=True)
        # One model per architecture, re-initialised for each run: the
        # curvature kernels compiled for it serve every later run.
        model, loss = initialised_mlp(x_tr.shape[1], classes, args.seed)
        logger = Logger(
            xp, yp,
            metrics=LOGGED,
            every_n_epochs=args.log_every, budget=args.log_budget, num_probes=args.num_probes, seed=args.seed,
            options={"riemannian_sharpness_kfac": {"damping": args.damping}},
            verbose=int(args.verbose >= 2),
        )
        logger.announce = label if args.verbose else None
        callbacks = [logger] + ([_epoch_printer(label, args.epochs)] if args.verbose >= 2 else [])
        t0 = time.perf_counter()
        hist, budget = train_run(model, loss, name, args.lr, x_tr, y_tr, bs, epochs=args.epochs, callbacks=callbacks,
                                 validation_data=(x_te, y_te))
        seconds = budget["seconds"]
        if args.verbose:
            print(
                f"  [{i}/{len(runs)}] {label}: trained in {seconds:.1f}s, of which sharpness logging "
                f"{logger.seconds:.1f}s ({100 * logger.seconds / max(seconds, 1e-9):.0f}%); final sharpness "
                f"({len(FINAL_ESTIMATES)} estimates on {len(xp)} examples)...",
                flush=True,
            )
        row = {"run": label, "config": config, "dataset": name_of_data, "optimizer": name, "batch": bs,
               "seconds": seconds, "logging seconds": logger.seconds}
        t1 = time.perf_counter()
        row.update(final_metrics(model, (x_tr, y_tr), (x_te, y_te), xp, yp, args, classes))
        row["final sharpness seconds"] = time.perf_counter() - t1
        _write_json(hist_path, hist.history)
        results.append(row)
        out.append(row)
        curves[f"{name} B={bs}"] = hist.history
        if args.verbose:
            print(f"  [{i}/{len(runs)}] {label}: train acc {row['train_acc']:.4f}, test acc {row['test_acc']:.4f} "
                  f"({time.perf_counter() - t0:.1f}s in all)" + (f"; {row['note']}" if row["note"] else ""), flush=True)
    return out, curves


def _read_json(path):
    import json

    with open(path) as f:
        history = json.load(f)
    # null is a NaN (an epoch a metric was not logged in)
    return {k: [float("nan") if v is None else v for v in vals] for k, vals in history.items()}


def _write_json(path, obj):
    """History as strict JSON: a NaN (an epoch the logger skipped) is null,
    which every JSON reader takes (bare NaN is not JSON)."""
    import json
    import math

    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    plain = {k: [float(v) if math.isfinite(float(v)) else None for v in vals] for k, vals in obj.items()}
    with open(tmp, "w") as f:
        json.dump(plain, f, allow_nan=False)
    os.replace(tmp, path)  # atomic: a kill leaves the old file or the new one


class ResultsFile(_ResultsFile):
    """``results.csv``, one row per finished run, appended as runs finish
    (``keras_geosam.experiments.results``), keyed by ``(run, config)``: a
    re-run with the same configuration skips the rows it finds."""

    def __init__(self, path, fresh=False):
        super().__init__(path, fresh=fresh, text_fields=("run", "config", "dataset", "optimizer", "note"))

    def get(self, run, config):
        for row in self.rows:
            if row.get("run") == run and str(row.get("config")) == config:
                return row
        return None

    def append(self, row):
        try:
            super().append(row)
        except ValueError as e:
            raise SystemExit(str(e)) from None


# Draws of the sampled-label metric behind "S_R mc(8) damped": its ± is
# their spread (one draw's stderr would leave the labels' sampling out).
MC_DRAWS = 5
FINAL_ESTIMATES = ("S_R diag", "S_R diag damped", "S_R mc(8) damped", "S_R kfac", "tr H", "lambda_max", "lambda_max R")
# Logged during training (the plot's curves); the final table has them all.
# Each estimator's first call compiles, which costs more than later calls,
# so the logged set is kept to two.
LOGGED = ("hessian_trace", "riemannian_sharpness_kfac")


def final_metrics(model, train, test, xp, yp, args, num_classes):
    """Train and test accuracy and every sharpness measure at the final
    weights, each with its standard error (``<name> stderr``), and ``note``:
    empty, or why the run is not a trained network (``check_run``). A
    diverged run (non-finite weights or loss) gets NaN sharpness; a
    collapsed one is measured and flagged."""
    import math
    import warnings

    import numpy as np

    from keras_geosam import sharpness as S

    train_loss, train_acc = model.evaluate(*train, batch_size=1024, verbose=0)
    out = {"train_acc": float(train_acc), "test_acc": float(model.evaluate(*test, batch_size=1024, verbose=0)[1])}
    finite = all(np.all(np.isfinite(np.asarray(w))) for w in model.get_weights())
    _, out["note"] = check_run(train_loss, train_acc, num_classes, weights_finite=finite,
                               min_train_acc=args.min_train_acc)
    if out["note"].startswith("diverged"):
        for name in FINAL_ESTIMATES:
            out[name] = out[name + " stderr"] = math.nan
        out.update({"nonzero F": math.nan, "params": model.count_params(), "S_R diag/nnz": math.nan})
        return out
    damping = args.damping
    kw = dict(num_probes=args.num_probes, seed=args.seed)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*piecewise linear.*")
        d = S.riemannian_sharpness(model, xp, yp, structure="diagonal", damping=0.0, **kw)
        estimates = {
            "S_R diag": d,
            "S_R diag damped": S.riemannian_sharpness(model, xp, yp, structure="diagonal", damping=damping, **kw),
            "S_R mc(8) damped": S.riemannian_sharpness(model, xp, yp, structure="diagonal", kind="mc", num_samples=8,
                                                       damping=damping, metric_draws=MC_DRAWS, **kw),
            "S_R kfac": S.riemannian_sharpness(model, xp, yp, structure="kfac", damping=damping, **kw),
            "tr H": S.hessian_trace(model, xp, yp, **kw),
            "lambda_max": S.hessian_max_eigenvalue(model, xp, yp, seed=args.seed),
            "lambda_max R": S.riemannian_max_eigenvalue(model, xp, yp, structure="kfac", damping=damping, seed=args.seed),
        }
    for name, est in estimates.items():
        out[name] = float(est.value)
        out[name + " stderr"] = float(est.stderr)
    out["nonzero F"] = d.info["num_nonzero_fisher"]
    out["params"] = d.info["num_params"]
    out["S_R diag/nnz"] = d.info["normalized"]
    return out


# Table columns; a column with a "<name> stderr" partner prints "value ± stderr".
COLUMNS = ["run", "test_acc", "train_acc", "S_R diag", "nonzero F", "S_R diag/nnz", "S_R diag damped", "S_R mc(8) damped", "S_R kfac", "tr H", "lambda_max", "lambda_max R", "note"]

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


def plot(curves_by_dataset, path, damping=DAMPING):
    """One row of panels per dataset: accuracy, then each logged sharpness
    measure per epoch with a band of two standard errors."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = [
        ("val_accuracy", "test accuracy"),
        ("riemannian_sharpness_kfac", f"K-FAC S_R (damping {damping:g})"),
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


def _reexec_under(backend, argv):
    # Keras fixes its backend at import: re-run in a fresh process.
    env = dict(os.environ, KERAS_BACKEND=backend)
    os.execvpe(sys.executable, [sys.executable, "-m", "keras_geosam"] + list(argv), env)


def _pop_backend(argv):
    """``(argv without --backend X, X or None)``, for the study command."""
    rest, backend, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        if a == "--backend" and i + 1 < len(argv):
            backend, i = argv[i + 1], i + 2
            continue
        if a.startswith("--backend="):
            backend = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    if backend is not None and backend not in ("jax", "tensorflow", "torch"):
        raise SystemExit(f"keras-geosam study: --backend must be jax, tensorflow or torch, got {backend!r}")
    return rest, backend


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    # Keep TensorFlow's C++ start-up lines out of the output unless asked for.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if argv[:1] == ["study"]:
        rest, backend = _pop_backend(argv[1:])
        if backend and os.environ.get("KERAS_BACKEND") != backend:
            _reexec_under(backend, ["study"] + rest)
        from keras_geosam import study

        return study.main(rest)
    args = _parse(argv)
    if args.compare:
        if not any(a.startswith("--optimizers") for a in argv):
            args.optimizers = COMPARISON
        if not any(a.startswith("--batch-sizes") for a in argv):
            args.batch_sizes = [32]
        if not any(a.startswith("--dataset") for a in argv) and not args.data:
            args.dataset = "digits,mnist1d"
    if args.data:
        # Checked before Keras loads: a malformed file costs no start-up.
        from keras_geosam.datasets import load_npz

        try:
            load_npz(args.data)
        except (OSError, ValueError) as e:
            raise SystemExit(f"keras-geosam: --data: {e}") from None
    if args.backend and os.environ.get("KERAS_BACKEND") != args.backend:
        _reexec_under(args.backend, argv)
    import keras_geosam

    keras_geosam._startup.load_all()
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
