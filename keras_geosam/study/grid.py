"""The study's grid: one training run per (dataset, seed, optimizer, batch
size, learning rate), each measured at its final weights and appended to a
CSV as soon as it finishes.

Resuming: a run whose key (dataset, optimizer, batch size, learning rate,
seed) is already in the CSV, written under the same per-run settings
(``fingerprint``), is not run again. Every run reseeds Python, NumPy and the
backend before building its model, so a run's row does not depend on which
runs came before it in the process: an interrupted and resumed study writes
the same rows as an uninterrupted one (up to the timing columns).

Keras is imported inside the functions that train, so importing this module
(and parsing the command line) stays fast.
"""

import dataclasses
import hashlib
import json
import math
import os
import time
import warnings

import numpy as np

from keras_geosam._checks import check_choice
from keras_geosam._checks import check_int
from keras_geosam._checks import check_number
from keras_geosam.experiments import DAMPING
from keras_geosam.experiments.budget import budget_text
from keras_geosam.experiments.budget import epoch_cap
from keras_geosam.experiments.data import PROBE_SOURCES
from keras_geosam.experiments.data import probe_subset
from keras_geosam.experiments.data import symmetric_label_noise
from keras_geosam.experiments.models import build_mlp
from keras_geosam.experiments.optimizers import OPTIMIZERS
from keras_geosam.experiments.results import ResultsFile
from keras_geosam.experiments.run import initialised_mlp
from keras_geosam.experiments.run import train_run
from keras_geosam.experiments.validity import check_run

# Sizes of the study. ``smoke`` takes seconds (tests); ``small`` is the
# guide's default (label noise 0 and 0.4, trajectories: about ten minutes on
# 2 CPU cores); ``full`` is meant
# for an accelerator. Keras datasets in ``full`` are skipped, with a notice,
# when they are not in Keras' cache.
PRESETS = {
    "smoke": dict(
        datasets=("digits",), optimizers=("sgd", "sam"), batch_sizes=(32, 128), learning_rates=(0.05,),
        seeds=(0,), epochs=1, steps=24, train_size=256, probe_size=48, num_probes=4, width=16, max_iter=8,
        alignment_size=256, alignment_batches=4, n_resamples=200,
    ),
    "small": dict(
        datasets=("digits",), optimizers=("sgd", "sam", "llqrsam"), batch_sizes=(16, 128),
        learning_rates=(0.02, 0.1), seeds=(0,), label_noises=(0.0, 0.4), trajectory=True, epochs=8, steps=600,
        train_size=0, probe_size=128, num_probes=10,
        width=32, max_iter=20, alignment_size=256, alignment_batches=8, n_resamples=1000,
    ),
    "full": dict(
        datasets=("digits", "mnist1d", "fashion_mnist", "cifar10"),
        optimizers=("sgd", "sam", "llqrsam", "llqrsam-kfac"), batch_sizes=(16, 64, 256),
        learning_rates=(0.01, 0.03, 0.1), seeds=(0, 1, 2), epochs=10, steps=3000, train_size=10000, probe_size=512,
        num_probes=20, width=128, max_iter=100, alignment_size=2048, alignment_batches=64, n_resamples=2000,
    ),
}
# Settings a preset may leave out.
DEFAULTS = dict(depth=2, activation="relu", data_seed=0, damping=None, confidence=0.95, data=None, probe_data="train",
                min_train_acc=None, target_train_loss=None, label_noises=(0.0,), trajectory=False, trajectory_points=6)
PRESET_NAMES = tuple(PRESETS)
DEFAULT_PRESET = "small"
# Environment variable that picks the preset when no flag does (CI: smoke).
MODE_ENV = "KERAS_GEOSAM_GUIDE_MODE"

GRID_KEYS = ("datasets", "label_noises", "optimizers", "batch_sizes", "learning_rates", "seeds")
# Per-run settings: a row is reused only when these match (its fingerprint).
RUN_SETTINGS = (
    "epochs", "steps", "target_train_loss", "train_size", "probe_size", "num_probes", "width", "depth", "activation", "max_iter",
    "alignment_size", "alignment_batches", "data_seed", "damping", "probe_data", "min_train_acc",
    "trajectory", "trajectory_points",
)
KEY_FIELDS = ("dataset", "label_noise", "optimizer", "batch_size", "lr", "seed")
FIELDS = (
    *KEY_FIELDS, "label_noise_changed", "b_over_eta", "backend", "fingerprint", "probe_data", "diverged", "valid", "invalid_reason",
    "steps", "epochs_run", "converged",
    "train_loss", "train_acc", "test_loss", "test_acc", "gap_loss", "gap_acc",
    "sr_kfac", "sr_kfac_stderr", "sr_diag", "sr_diag_stderr", "trace_h", "trace_h_stderr",
    "lambda_max", "lambda_max_stderr", "lambda_max_r", "lambda_max_r_stderr",
    "align_cosine", "align_rank_correlation", "align_log_cosine", "align_alpha", "align_alpha_b",
    "align_finite_population", "align_note", "params", "nonzero_fisher",
    "seconds", "measure_seconds", "complete",
)
# Wall times differ between two executions of the same run; nothing else may.
TIMING_FIELDS = ("seconds", "measure_seconds")
KERAS_DATASETS = ("mnist", "fashion_mnist", "cifar10")
CSV_NAME, SUMMARY_NAME, FIGURE_NAME, CONFIG_NAME = "study.csv", "summary.json", "study.png", "study_config.json"


class StudyInterrupted(RuntimeError):
    """Stops a study midway; raise it from an ``on_run`` hook.

    The rows appended so far stay in the CSV, and the next call of
    :func:`run_study` on the same folder resumes from there.

    Args:
        *args: the message, as for any exception.

    Raises:
        Nothing when created; :func:`run_study` lets it propagate.

    Example:

    >>> def stop_after_first(row, index, total):
    ...     raise StudyInterrupted(f"stopped after run {index + 1} of {total}")
    >>> isinstance(StudyInterrupted("stop"), RuntimeError)
    True
    """


@dataclasses.dataclass
class StudyResult:
    """What :func:`run_study` returns.

    Attributes:
        rows: one dict per run of the requested grid, in grid order, as read
            back from the CSV (numbers as floats/ints).
        summary: what ``summary.json`` holds: the settings, and per dataset
            (``summary["datasets"]``) the statistics of
            :func:`keras_geosam.study.stats.summarize`; undefined values
            (NaN) are None.
        csv_path: the CSV, one row per run.
        summary_path: ``summary.json``.
        figure_path: ``study.png``, or None without ``plot``.
        num_run: runs computed by this call.
        num_skipped: runs found in the CSV and not run again.
        skipped_datasets: ``{name: reason}`` for preset datasets that were
            not available offline.

    Raises:
        Nothing of its own: a plain record.

    Example:

    >>> result = StudyResult(rows=[], summary={}, csv_path="study.csv", summary_path="summary.json",
    ...                      figure_path=None, num_run=0, num_skipped=0, skipped_datasets={})
    >>> result.num_run + result.num_skipped
    0
    """

    rows: list
    summary: dict
    csv_path: str
    summary_path: str
    figure_path: str
    num_run: int
    num_skipped: int
    skipped_datasets: dict


def resolve_settings(preset=None, **overrides):
    """The study's settings: a preset updated by the non-None `overrides`.

    Args:
        preset: ``"smoke"``, ``"small"`` or ``"full"``; None reads the
            ``KERAS_GEOSAM_GUIDE_MODE`` environment variable, else
            ``"small"``.
        **overrides: any key of the presets (lists as tuples), plus
            ``depth``, ``activation``, ``data_seed``, ``damping``,
            ``confidence``, ``data`` (an .npz path).

    Returns:
        A dict of every setting, with ``preset`` recorded.

    Raises:
        ValueError: for an unknown preset, optimizer or setting.

    Example:

    >>> resolve_settings("smoke", epochs=2)["epochs"]
    2
    """
    preset = preset or os.environ.get(MODE_ENV) or DEFAULT_PRESET
    if preset not in PRESETS:
        raise ValueError(f"Unknown study preset {preset!r}; choose from {PRESET_NAMES} (or set {MODE_ENV}).")
    s = dict(DEFAULTS, **PRESETS[preset], preset=preset)
    unknown = set(overrides) - set(s)
    if unknown:
        raise ValueError(f"Unknown study setting(s) {sorted(unknown)}; known: {sorted(s)}.")
    explicit_datasets = overrides.get("datasets") is not None or overrides.get("data") is not None
    s.update({k: v for k, v in overrides.items() if v is not None})
    for k in GRID_KEYS:
        s[k] = tuple(s[k]) if not isinstance(s[k], str) else tuple(t.strip() for t in s[k].split(",") if t.strip())
    if s["data"] is not None and overrides.get("datasets") is None:
        s["datasets"] = ()
    # Datasets the user names must load; those a preset adds may be skipped.
    s["explicit_datasets"] = explicit_datasets
    if s["damping"] is None:
        s["damping"] = DAMPING
    bad = [o for o in s["optimizers"] if o not in OPTIMIZERS]
    if bad:
        from keras_geosam.experiments.optimizers import names_help

        raise ValueError(f"Unknown optimizer(s) {bad}; {names_help()}.")
    check_choice("probe_data", s["probe_data"], PROBE_SOURCES)
    s["min_train_acc"] = check_number("min_train_acc", s["min_train_acc"], 0.0, allow_none=True)
    if s["min_train_acc"] is not None and s["min_train_acc"] > 1:
        raise ValueError(f"min_train_acc must be in [0, 1] (None: twice chance), got {s['min_train_acc']}.")
    s["confidence"] = check_number("confidence", s["confidence"], 0.0, strict=True, below=1)
    for k in ("batch_sizes", "seeds"):
        s[k] = tuple(int(v) for v in s[k])
    s["learning_rates"] = tuple(float(v) for v in s["learning_rates"])
    s["label_noises"] = tuple(float(v) for v in s["label_noises"])
    if any(not 0 <= p < 1 for p in s["label_noises"]):
        raise ValueError(f"label noise fractions must be in [0, 1), got {s['label_noises']}.")
    if any(b < 1 for b in s["batch_sizes"]) or any(not lr > 0 for lr in s["learning_rates"]):
        raise ValueError("batch sizes must be >= 1 and learning rates > 0.")
    # Plain ints and floats, so that the fingerprint of 16 and np.int64(16) agree.
    s["trajectory"] = bool(s["trajectory"])
    for k in ("trajectory_points", "epochs", "probe_size", "num_probes", "width", "depth", "max_iter", "alignment_size",
              "alignment_batches", "n_resamples"):
        s[k] = check_int(k, s[k])
    s["steps"] = check_int("steps", s["steps"], 0)  # 0: train by epochs
    s["train_size"] = check_int("train_size", s["train_size"], 0)  # 0: all
    s["data_seed"] = check_int("data_seed", s["data_seed"], 0)
    s["target_train_loss"] = check_number("target_train_loss", s["target_train_loss"], 0.0, strict=True, allow_none=True)
    s["damping"] = check_number("damping", s["damping"], 0.0)
    if any(not s[k] for k in GRID_KEYS if k != "datasets") or not (s["datasets"] or s["data"]):
        raise ValueError("every grid axis needs at least one value (datasets or data, optimizers, batch sizes, "
                         "learning rates, seeds).")
    return s


def _fingerprint(settings, backend, data_digest):
    run = {k: settings[k] for k in RUN_SETTINGS}
    run.update(backend=backend, data=data_digest)
    text = json.dumps(run, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12], run


def _file_digest(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def load_study_data(name, data_seed=0, path=None):
    """Loads one dataset of the study, inputs flattened for the MLP.

    Args:
        name: ``digits`` / ``mnist1d`` (offline), ``mnist`` / ``cifar10`` /
            ``fashion_mnist`` (Keras' cache), or, with `path`, a label.
        data_seed: seeds the split (digits) or the generator (mnist1d); fixed
            across runs so every run sees the same train/test/probe data.
        path: an ``.npz`` with ``x_train, y_train, x_test, y_test``.

    Returns:
        ``(x_train, y_train), (x_test, y_test), num_classes``.

    Raises:
        RuntimeError: a Keras dataset is neither cached nor downloadable.
        ValueError: an unknown name, or an invalid .npz (from
            ``keras_geosam.datasets.load_npz``).

    Example:

    >>> (x, y), (xt, yt), classes = load_study_data("digits")
    >>> x.shape[1], classes
    (64, 10)
    """
    from keras_geosam import datasets

    if path is not None:
        loader = getattr(datasets, "load_npz", None)
        if loader is None:  # pragma: no cover - older package
            raise RuntimeError("This keras_geosam has no datasets.load_npz; --data needs it.")
        data = loader(path)
    elif name == "fashion_mnist":
        # datasets.load covers mnist and cifar10; Fashion-MNIST is read here
        # the same way, with the same kind of message when it is not cached.
        import keras

        try:
            (x_tr, y_tr), (x_te, y_te) = keras.datasets.fashion_mnist.load_data()
        except Exception as e:
            raise RuntimeError(
                f"fashion_mnist is not in Keras' dataset cache and could not be downloaded: {e}. "
                f"Fetch it once with keras.datasets.fashion_mnist.load_data() on a machine with "
                f"internet access, pass --data file.npz, or use 'digits' or 'mnist1d'."
            ) from e
        data = ((x_tr.astype("float32") / 255.0, y_tr.reshape(-1).astype("int32")),
                (x_te.astype("float32") / 255.0, y_te.reshape(-1).astype("int32")), 10)
    else:
        data = datasets.load(name, seed=data_seed)
    (x_tr, y_tr), (x_te, y_te), classes = data
    flat = lambda x: np.asarray(x, "float32").reshape(len(x), -1)
    return (flat(x_tr), np.asarray(y_tr, "int32")), (flat(x_te), np.asarray(y_te, "int32")), int(classes)


# The study's classifier is the command line's MLP (one builder for both).
build_model = build_mlp


def _est(row, name, est):
    row[name] = float(est.value)
    row[name + "_stderr"] = float(est.stderr)


def measure_run(model, train, test, probe, settings, batch_size, lr, seed, num_classes=None):
    """Every per-run quantity at the model's current weights.

    Losses and accuracies on the whole train and test sets give the gaps
    (``gap_loss = test loss - train loss``, ``gap_acc = train accuracy -
    test accuracy``). ``valid`` is 0 with an ``invalid_reason`` for a run
    that diverged or collapsed (train accuracy below
    ``settings["min_train_acc"]``, default twice chance; see
    ``keras_geosam.experiments.validity``): statistics leave it out. The
    sharpness measures use the fixed probe subset (the first
    ``probe_size`` examples of the training set, or of the test set with
    ``probe_data="test"``) with the package's defaults of the main job: S_R with the
    K-FAC and the diagonal exact-Fisher metric at relative damping
    ``settings["damping"]``, tr H (exact GGN part plus probed residual),
    lambda_max and the K-FAC Riemannian lambda_max (Lanczos, ``stderr`` the
    Ritz residual). ``gradient_noise_alignment`` compares minibatch noise at
    the run's batch size with the Fisher on a training subset of
    ``alignment_size`` examples, enlarged to four batches for large batch
    sizes; only a batch as large as the training set leaves it empty, with
    ``align_note`` saying why.

    Args:
        model: a compiled, trained classifier.
        train, test, probe: ``(x, y)`` pairs; `train` may be the alignment
            subset's source.
        settings: from :func:`resolve_settings`.
        batch_size, lr, seed: the run's.
        num_classes: for the default validity threshold (default: one more
            than the largest training label).

    Returns:
        A dict of the measure columns of :data:`FIELDS`.

    Raises:
        ValueError: from ``keras_geosam.sharpness`` for a model that is not
            a classifier.

    Example:

    >>> # row = measure_run(model, (x, y), (xt, yt), (xt[:64], yt[:64]), settings, 32, 0.05, 0)
    """
    from keras_geosam import sharpness as S

    (x_tr, y_tr), (x_te, y_te), (xp, yp) = train, test, probe
    row = {}
    train_loss, train_acc = model.evaluate(x_tr, y_tr, batch_size=1024, verbose=0)
    test_loss, test_acc = model.evaluate(x_te, y_te, batch_size=1024, verbose=0)
    row.update(train_loss=float(train_loss), train_acc=float(train_acc), test_loss=float(test_loss),
               test_acc=float(test_acc), gap_loss=float(test_loss - train_loss), gap_acc=float(train_acc - test_acc))
    nan_names = ("sr_kfac", "sr_diag", "trace_h", "lambda_max", "lambda_max_r")
    weights_ok = all(np.all(np.isfinite(np.asarray(v))) for v in model.get_weights())
    row["diverged"] = int(not (weights_ok and math.isfinite(train_loss)))
    classes = int(num_classes) if num_classes is not None else int(np.max(y_tr)) + 1
    valid, row["invalid_reason"] = check_run(train_loss, train_acc, classes, weights_finite=weights_ok,
                                             min_train_acc=settings.get("min_train_acc"))
    row["valid"] = int(valid)
    row["align_note"] = ""
    if row["diverged"]:
        for n in nan_names:
            row[n] = row[n + "_stderr"] = math.nan
        for n in ("align_cosine", "align_rank_correlation", "align_log_cosine", "align_alpha", "align_alpha_b",
                  "align_finite_population", "nonzero_fisher"):
            row[n] = math.nan
        row["align_note"] = "diverged: not measured"
        row["params"] = int(model.count_params())
        return row
    damping = settings["damping"]
    kw = dict(num_probes=settings["num_probes"], seed=seed)
    with warnings.catch_warnings():
        # The undamped-diagonal degeneracy warning does not apply (damped
        # here); unconverged probe rounds still show in the stderr column.
        warnings.filterwarnings("ignore", message=".*piecewise linear.*")
        warnings.filterwarnings("ignore", category=RuntimeWarning)
        kfac = S.riemannian_sharpness(model, xp, yp, structure="kfac", damping=damping, **kw)
        diag = S.riemannian_sharpness(model, xp, yp, structure="diagonal", damping=damping, **kw)
        _est(row, "sr_kfac", kfac)
        _est(row, "sr_diag", diag)
        _est(row, "trace_h", S.hessian_trace(model, xp, yp, **kw))
        _est(row, "lambda_max", S.hessian_max_eigenvalue(model, xp, yp, max_iter=settings["max_iter"], seed=seed))
        _est(row, "lambda_max_r", S.riemannian_max_eigenvalue(
            model, xp, yp, structure="kfac", damping=damping, max_iter=settings["max_iter"], seed=seed))
        # Minibatch noise needs batches smaller than the subset they are
        # drawn from: at least four batches' worth, when the data has it.
        n_al = min(max(int(settings["alignment_size"]), 4 * int(batch_size)), len(x_tr))
        if batch_size < n_al:
            al = S.gradient_noise_alignment(
                model, x_tr[:n_al], y_tr[:n_al], batch_size=batch_size,
                num_batches=settings["alignment_batches"], learning_rate=lr, seed=seed,
            )
            row.update(align_cosine=al.cosine, align_rank_correlation=al.rank_correlation,
                       align_log_cosine=al.log_cosine, align_alpha=al.alpha, align_alpha_b=al.alpha * batch_size,
                       align_finite_population=al.finite_population)
        else:  # no minibatch noise to measure: the batch is the whole training set
            row["align_note"] = f"full batch (B={batch_size} >= {len(x_tr)} training examples): no minibatch noise"
            row.update(align_cosine=math.nan, align_rank_correlation=math.nan, align_log_cosine=math.nan,
                       align_alpha=math.nan, align_alpha_b=math.nan, align_finite_population=math.nan)
    row["params"] = int(diag.info["num_params"])
    row["nonzero_fisher"] = int(diag.info["num_nonzero_fisher"])
    return row


def run_key(row):
    """The key a row is found by when resuming: ``(dataset, label_noise,
    optimizer, batch_size, lr, seed)`` with typed values.

    Args:
        row: a dict with the :data:`KEY_FIELDS` (strings or numbers).

    Returns:
        A hashable tuple.

    Raises:
        KeyError, ValueError: if a field is missing or does not parse.

    Example:

    >>> run_key({"dataset": "digits", "label_noise": "0.4", "optimizer": "sgd", "batch_size": "16", "lr": "0.05",
    ...          "seed": "0"})
    ('digits', 0.4, 'sgd', 16, 0.05, 0)
    """
    return (str(row["dataset"]), float(row["label_noise"]), str(row["optimizer"]), int(row["batch_size"]),
            float(row["lr"]), int(row["seed"]))


def read_rows(path):
    """Reads the study's CSV, dropping a row cut short by an interruption.

    A complete row ends with ``complete=1``; anything else (a process killed
    mid-write) is dropped and the file is rewritten without it.

    Args:
        path: the CSV (missing: no rows).

    Returns:
        A list of dicts, values parsed to int/float where they parse.

    Raises:
        ValueError: if the file's header is not the study's
            (:data:`FIELDS`), e.g. a CSV from another tool.

    Example:

    >>> read_rows("no_such_study.csv")
    []
    """
    return _results_file(path).rows


def _complete(raw):
    if raw.get("complete") != "1":
        return False
    try:
        run_key(raw)
    except (KeyError, ValueError):
        return False
    return True


def _results_file(path):
    try:
        return ResultsFile(path, fields=FIELDS, is_complete=_complete,
                           text_fields=("dataset", "optimizer", "backend", "fingerprint", "probe_data"))
    except ValueError as e:
        raise ValueError(f"{path} is not a study CSV of this version: {e}") from None


def append_row(path, row):
    """Appends one finished run to the CSV (header first if new) and flushes
    it to disk, so a kill loses at most the run in progress.

    Args:
        path: the CSV.
        row: a dict with every :data:`FIELDS` key.

    Returns:
        None.

    Raises:
        KeyError: if a field is missing.

    Example:

    >>> # append_row("out/study.csv", row)
    """
    missing = [k for k in FIELDS if k not in row]
    if missing:
        raise KeyError(f"row lacks {missing}")
    _results_file(path).append({k: row[k] for k in FIELDS})


def _check_config(output, fingerprints, run_settings, rows):
    # study_config.json maps each fingerprint to its settings, so that a
    # mismatch can be explained by name rather than by hash.
    path = os.path.join(output, CONFIG_NAME)
    configs = {}
    if os.path.exists(path):
        with open(path) as f:
            configs = json.load(f)
    for r in rows:
        name = r["dataset"]
        if name in fingerprints and r["fingerprint"] != fingerprints[name]:
            old = configs.get(r["fingerprint"], {})
            now = run_settings[name]
            diff = {k: (old.get(k), now.get(k)) for k in sorted(set(old) | set(now)) if old.get(k) != now.get(k)}
            raise ValueError(
                f"{os.path.join(output, CSV_NAME)} holds {name} runs made with other per-run settings "
                f"({diff or 'settings not recorded'}, as (theirs, now)). Use another output folder, or "
                f"fresh=True (--fresh) to start over."
            )
    for name, fp in fingerprints.items():
        configs[fp] = run_settings[name]
    with open(path, "w") as f:
        json.dump(configs, f, indent=1, sort_keys=True, default=str)


def grid_runs(settings, dataset_names):
    """The runs of the grid in the order they execute: dataset, seed,
    optimizer, batch size, learning rate (seeds outer, so an interrupted
    study has covered whole grids of the first seeds).

    Args:
        settings: from :func:`resolve_settings`.
        dataset_names: the datasets to include.

    Returns:
        A list of dicts with the :data:`KEY_FIELDS`.

    Raises:
        Nothing.

    Example:

    >>> s = resolve_settings("smoke")
    >>> len(grid_runs(s, ["digits"]))
    4
    """
    return [
        dict(dataset=d, label_noise=p, optimizer=o, batch_size=b, lr=lr, seed=sd)
        for d in dataset_names for sd in settings["seeds"] for p in settings["label_noises"] for o in settings["optimizers"]
        for b in settings["batch_sizes"] for lr in settings["learning_rates"]
    ]


def run_study(output="geosam_output/study", preset=None, *, fresh=False, plot=True, verbose=1, on_run=None,
              **overrides):
    """Runs (or resumes) the study and writes its CSV, summary and figure.

    For every (dataset, seed, optimizer, batch size, learning rate) of the
    grid: train an MLP with the optimizer from ``keras_geosam.experiments.optimizers.OPTIMIZERS``
    (each wraps SGD with momentum 0.9 at that learning rate), measure it
    (:func:`measure_run`) and append its row to ``output/study.csv``. Then
    compute the statistics (:func:`keras_geosam.study.stats.summarize`:
    Kendall tau and Spearman rho of each measure with each gap, with
    bootstrap intervals; the exponent of S_R against B/eta), write
    ``summary.json`` and ``study.png``, and print the tables.

    Args:
        output: folder for ``study.csv``, ``summary.json``, ``study.png``
            and ``study_config.json``.
        preset: ``"smoke"``, ``"small"`` or ``"full"`` (see :data:`PRESETS`);
            None: ``$KERAS_GEOSAM_GUIDE_MODE`` or ``"small"``.
        fresh: delete an existing CSV first instead of resuming.
        plot: write the figure (needs matplotlib).
        verbose: 0 silent; 1 a line per run and the tables.
        on_run: ``f(row, index, total)`` called after each computed row is
            appended (e.g. progress, or raising to stop the study).
        **overrides: settings replacing the preset's (see
            :func:`resolve_settings`): ``datasets``, ``optimizers``,
            ``batch_sizes``, ``learning_rates``, ``seeds``, ``epochs``,
            ``train_size`` (0: all), ``probe_size``, ``num_probes``,
            ``width``, ``depth``, ``activation``, ``max_iter``,
            ``alignment_size``, ``alignment_batches``, ``n_resamples``,
            ``confidence``, ``damping``, ``data_seed``, ``data`` (.npz).

    Returns:
        A :class:`StudyResult`.

    Raises:
        ValueError: unknown settings or optimizers, or a CSV in `output`
            written with other per-run settings (use `fresh` or another
            folder).
        RuntimeError: a dataset you named is not available.

    Example:

    One SGD run of the smoke preset, then the same call again, which finds
    the run in the CSV and only recomputes the statistics:

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as out:
    ...     first = run_study(out, "smoke", optimizers=("sgd",), batch_sizes=(64,), plot=False, verbose=0)
    ...     again = run_study(out, "smoke", optimizers=("sgd",), batch_sizes=(64,), plot=False, verbose=0)
    >>> (first.num_run, first.num_skipped), (again.num_run, again.num_skipped)
    ((1, 0), (0, 1))
    >>> sorted(first.rows[0])[:4]
    ['align_alpha', 'align_alpha_b', 'align_cosine', 'align_finite_population']
    >>> first.rows[0]["sr_kfac"] > 0
    True
    """
    s = resolve_settings(preset, **overrides)
    import keras

    from keras_geosam.study import report
    from keras_geosam.study import stats
    from keras_geosam.study import trajectory

    backend = keras.backend.backend()
    os.makedirs(output, exist_ok=True)
    csv_path = os.path.join(output, CSV_NAME)
    traj_path = os.path.join(output, trajectory.CSV_NAME)
    if fresh:
        for path in (csv_path, traj_path):
            if os.path.exists(path):
                os.remove(path)
    say = print if verbose else (lambda *a, **k: None)

    # Data, loaded once per dataset and shared by its runs.
    data, skipped, digests = {}, {}, {}
    names = list(s["datasets"])
    if s["data"] is not None:
        label = os.path.splitext(os.path.basename(s["data"]))[0]
        data[label] = load_study_data(label, s["data_seed"], path=s["data"])
        digests[label] = _file_digest(s["data"])
        names = [label] + [n for n in names if n != label]
    for name in names:
        if name in data:
            continue
        try:
            data[name] = load_study_data(name, s["data_seed"])
        except (RuntimeError, ImportError) as e:
            if s["explicit_datasets"] or name not in KERAS_DATASETS:
                raise
            skipped[name] = str(e).split(". ")[0]
            say(f"skipping {name}: not available offline ({skipped[name]})")
    names = [n for n in names if n in data]
    prepared = {}
    for name in names:
        (x_tr, y_tr), (x_te, y_te), classes = data[name]
        if s["train_size"]:
            x_tr, y_tr = x_tr[: s["train_size"]], y_tr[: s["train_size"]]
        for p in s["label_noises"]:
            # Noise on training labels only, the same draw for every run at
            # this fraction; the probe (training data) carries it too.
            y_noisy, changed = symmetric_label_noise(y_tr, p, classes, seed=s["data_seed"])
            probe = probe_subset((x_tr, y_noisy), (x_te, y_te), s["probe_size"], s["probe_data"])
            prepared[name, p] = ((x_tr, y_noisy), (x_te, y_te), probe, classes, changed)

    fingerprints, run_settings = {}, {}
    for name in names:
        fingerprints[name], run_settings[name] = _fingerprint(s, backend, digests.get(name, name))
    rows_before = read_rows(csv_path)
    _check_config(output, fingerprints, run_settings, rows_before)
    done = {run_key(r): r for r in rows_before if fingerprints.get(r["dataset"]) == r["fingerprint"]}

    runs = grid_runs(s, names)
    say(f"study ({s['preset']}): backend={backend}, {len(runs)} runs "
        f"({len(names)} dataset(s) x {len(s['seeds'])} seed(s) x {len(s['optimizers'])} optimizer(s) x "
        f"{len(s['batch_sizes'])} batch size(s) x {len(s['learning_rates'])} learning rate(s)), "
        f"{budget_text(s)} each; rows -> {csv_path}")
    num_run = num_skipped = 0
    for i, run in enumerate(runs):
        label = (f"[{i + 1}/{len(runs)}] {group_name(run)} {run['optimizer']} B={run['batch_size']} "
                 f"lr={run['lr']:g} seed={run['seed']}")
        if run_key(run) in done:
            num_skipped += 1
            say(f"{label}: in the CSV, skipped")
            continue
        train, test, probe, classes, changed = prepared[run["dataset"], run["label_noise"]]
        model, loss = initialised_mlp(train[0].shape[1], classes, run["seed"], s["width"], s["depth"],
                                      s["activation"])
        traced = []
        if s["trajectory"]:
            cap = epoch_cap(len(train[0]), run["batch_size"], s["steps"], s["epochs"])
            traced = trajectory.callbacks(probe, s, cap, run["seed"])
        _, budget = train_run(model, loss, run["optimizer"], run["lr"], train[0], train[1], run["batch_size"],
                              steps=s["steps"], epochs=s["epochs"], target_train_loss=s["target_train_loss"],
                              callbacks=traced)
        seconds = budget["seconds"]
        t1 = time.perf_counter()
        row = dict(run, b_over_eta=run["batch_size"] / run["lr"], backend=backend,
                   fingerprint=fingerprints[run["dataset"]], probe_data=s["probe_data"], label_noise_changed=changed,
                   steps=budget["steps"], epochs_run=budget["epochs"], converged=budget["converged"])
        row.update(measure_run(model, train, test, probe, s, run["batch_size"], run["lr"], run["seed"], classes))
        row.update(seconds=seconds, measure_seconds=time.perf_counter() - t1, complete=1)
        if traced:  # before the row: a run without its row is re-run, and its points replaced
            trajectory.replace_rows(traj_path, KEY_FIELDS, run, traced[1].points)
        append_row(csv_path, row)
        num_run += 1
        say(f"{label}: test acc {row['test_acc']:.4f}, gap {row['gap_loss']:.4f}, "
            f"S_R K-FAC {row['sr_kfac']:.4g}, tr H {row['trace_h']:.4g} "
            f"({seconds:.1f}s train, {row['measure_seconds']:.1f}s measures)"
            + ("" if row["valid"] else f" INVALID ({row['invalid_reason']})"))
        if on_run is not None:
            on_run(row, i, len(runs))

    # Statistics over the requested grid, read back from the CSV so that
    # resumed and fresh runs are treated alike.
    by_key = {run_key(r): r for r in read_rows(csv_path) if fingerprints.get(r["dataset"]) == r["fingerprint"]}
    rows = [by_key[run_key(r)] for r in runs if run_key(r) in by_key]
    # Statistics see trained runs only (summarize drops the others): a
    # collapsed or diverged network's sharpness describes no minimum. They
    # stay in the CSV and the figure.
    usable = [r for r in rows if int(r["valid"])]
    # Label noise moves the gap by itself: statistics never mix noise levels.
    grouped = [dict(r, dataset=group_name(r)) for r in rows]
    summary = stats.summarize(
        grouped, measures=list(stats.MEASURES), gaps=list(stats.GAPS), n_resamples=s["n_resamples"],
        confidence=s["confidence"], seed=0,
        extra_columns=("align_cosine", "align_rank_correlation", "align_log_cosine", "align_alpha_b"),
    )
    settings_out = {k: (list(v) if isinstance(v, tuple) else v) for k, v in s.items()}
    result_summary = {
        "settings": settings_out, "backend": backend, "num_runs": len(rows),
        "num_diverged": sum(int(r["diverged"]) for r in rows), "num_invalid": len(rows) - len(usable),
        "invalid_runs": [dict(_short_key(r), reason=r["invalid_reason"]) for r in rows if not int(r["valid"])],
        "skipped_datasets": skipped,
        "gap_definitions": dict(stats.GAPS), "measures": dict(stats.MEASURES), "datasets": summary,
    }
    summary_path = os.path.join(output, SUMMARY_NAME)
    plain = _plain(result_summary)
    with open(summary_path, "w") as f:
        json.dump(plain, f, indent=1)
    figure_path = None
    if plot and rows and s["trajectory"]:
        wanted = {run_key(r) for r in rows}
        points = [p for p in trajectory.read_rows(traj_path) if run_key(p) in wanted]
        if points:
            trajectory.plot(points, os.path.join(output, trajectory.FIGURE_NAME), group=group_name)
    if plot and rows:
        figure_path = os.path.join(output, FIGURE_NAME)
        report.plot(grouped, summary, figure_path)
    if verbose:
        print()
        print(report.format_report(grouped, result_summary))
        print(f"\nrows: {csv_path}\nsummary: {summary_path}" + (f"\nfigure: {figure_path}" if figure_path else ""))
    return StudyResult(rows, plain, csv_path, summary_path, figure_path, num_run, num_skipped, skipped)


def group_name(row):
    """The group a row's statistics are computed in: its dataset, with the
    label noise when there is any (``"digits, label noise 0.4"``)."""
    p = float(row.get("label_noise", 0) or 0)
    return str(row["dataset"]) + (f", label noise {p:g}" if p else "")


def _short_key(row):
    return {k: row[k] for k in KEY_FIELDS}


def _plain(v):
    """JSON-ready: NaN/inf become null (strict JSON has no NaN)."""
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, (np.floating, np.integer)):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    return str(v)
