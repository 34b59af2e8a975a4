"""Sharpness along training (``--trajectory``): ``SharpnessLogger`` records
S_R (K-FAC metric), tr H and both lambda_max at evenly spaced epochs of each
run; the points go to ``trajectories.csv`` (one row per run and point) and
``trajectories.png`` (one column per batch size, bands of two standard
errors).
"""

import csv
import math
import os

# logger metric -> (CSV column, display name)
METRICS = {
    "riemannian_sharpness_kfac": ("sr_kfac", "S_R K-FAC"),
    "hessian_trace": ("trace_h", "tr H"),
    "lambda_max": ("lambda_max", "lambda_max"),
    "riemannian_lambda_max_kfac": ("lambda_max_r", "lambda_max R (K-FAC)"),
}
CSV_NAME, FIGURE_NAME = "trajectories.csv", "trajectories.png"


def fields(key_fields):
    """The columns of ``trajectories.csv``."""
    cols = [c for c, _ in METRICS.values()]
    return (*key_fields, "epoch", "step", "train_loss", *(x for c in cols for x in (c, c + "_stderr")))


def callbacks(probe, settings, max_epochs, seed):
    """``(logger, recorder)``: pass both to ``fit`` (in that order); after
    training ``recorder.points`` holds one dict per logged epoch.

    Args:
        probe: ``(x, y)`` the sharpness is measured on.
        settings: the study's (``num_probes``, ``damping``, ``max_iter``,
            ``trajectory_points``).
        max_epochs: the run's epoch cap; about ``trajectory_points`` epochs
            are logged, evenly spaced, the last one included.
        seed: the probes' seed.
    """
    import keras

    from keras_geosam.callbacks import SharpnessLogger

    every = max(1, math.ceil(max_epochs / int(settings["trajectory_points"])))
    logger = SharpnessLogger(
        probe[0], probe[1], metrics=tuple(METRICS), every_n_epochs=every, num_probes=settings["num_probes"],
        seed=seed, options={
            "riemannian_sharpness_kfac": {"damping": settings["damping"]},
            "riemannian_lambda_max_kfac": {"damping": settings["damping"], "max_iter": settings["max_iter"]},
            "lambda_max": {"max_iter": settings["max_iter"]},
        },
    )

    class Recorder(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.points = []

        def on_epoch_end(self, epoch, logs=None):
            logs = logs or {}
            if (epoch + 1) % every and not getattr(self, "final", False):
                return  # not a logging epoch (the logger filled in NaN)
            point = {"epoch": epoch + 1, "step": int(keras.ops.convert_to_numpy(self.model.optimizer.iterations)),
                     "train_loss": float(logs.get("loss", math.nan))}
            for name, (col, _) in METRICS.items():
                point[col] = float(logs[name])
                point[col + "_stderr"] = float(logs.get(name + "_stderr", math.nan))
            self.points.append(point)

    class LastEpoch(keras.callbacks.Callback):
        # The budget may end training on any epoch: log that one too.
        def on_train_end(self, logs=None):
            if not recorder.points or recorder.points[-1]["epoch"] != self._epoch + 1:
                logs = dict(self._logs)
                logs.update(logger.compute())
                recorder.final = True
                recorder.on_epoch_end(self._epoch, logs)

        def on_epoch_end(self, epoch, logs=None):
            self._epoch, self._logs = epoch, dict(logs or {})

    recorder = Recorder()
    return [logger, recorder, LastEpoch()]


def replace_rows(path, key_fields, key, points):
    """Writes `points` for the run `key` into ``trajectories.csv``, dropping
    rows of that run left by an interrupted earlier attempt."""
    cols = fields(key_fields)
    rows = []
    if os.path.exists(path) and os.path.getsize(path):
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            if tuple(reader.fieldnames or ()) == cols:
                rows = [r for r in reader if tuple(str(r[k]) for k in key_fields) != tuple(str(key[k]) for k in key_fields)]
    rows += [dict({k: key[k] for k in key_fields}, **p) for p in points]
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, path)


def read_rows(path):
    """``trajectories.csv`` as dicts (numbers parsed)."""
    from keras_geosam.experiments.arguments import from_csv

    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return [{k: (v if k in ("dataset", "optimizer") else from_csv(v)) for k, v in r.items()} for r in csv.DictReader(f)]


def plot(rows, path, group=lambda r: r["dataset"]):
    """One column per (group, batch size), one row per measure: each run's
    points against the optimizer step, with a band of two standard errors.

    Returns:
        `path`.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = sorted({(group(r), int(r["batch_size"])) for r in rows}, key=lambda t: (t[0], t[1]))
    fig, grid = plt.subplots(len(METRICS), len(panels), figsize=(3.6 * len(panels), 2.6 * len(METRICS)),
                             squeeze=False)
    runs = {}
    for r in rows:
        runs.setdefault((group(r), int(r["batch_size"]), r["optimizer"], float(r["lr"]), int(r["seed"])), []).append(r)
    labels = sorted({(k[2], k[3]) for k in runs})
    colors = {lab: f"C{i % 10}" for i, lab in enumerate(labels)}
    for j, (g, b) in enumerate(panels):
        for i, (col, name) in enumerate(METRICS.values()):
            ax = grid[i, j]
            for key, pts in runs.items():
                if key[:2] != (g, b):
                    continue
                pts = sorted(pts, key=lambda p: p["step"])
                x = np.array([p["step"] for p in pts], float)
                v = np.array([p[col] for p in pts], float)
                se = np.array([p[col + "_stderr"] for p in pts], float)
                color = colors[key[2], key[3]]
                ax.plot(x, v, marker=".", color=color, label=f"{key[2]} lr={key[3]:g}")
                band = np.isfinite(se)
                if band.any():
                    ax.fill_between(x[band], (v - 2 * se)[band], (v + 2 * se)[band], color=color, alpha=0.2, lw=0)
            ax.set_title(f"{g}, B={b}: {name}", fontsize=8)
            ax.tick_params(labelsize=7)
            if i == len(METRICS) - 1:
                ax.set_xlabel("optimizer step", fontsize=8)
    handles = [plt.Line2D([], [], color=colors[lab], marker=".", label=f"{lab[0]} lr={lab[1]:g}") for lab in labels]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=7, frameon=False)
    fig.suptitle("Sharpness along training (bands: 2 stderr)", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
