"""Printed tables and the figure of the sharpness / generalisation study.

Every estimate prints as ``value ± stderr``; correlations as ``value [low,
high]`` (bootstrap interval); means over seeds as ``mean ± standard error``.
No Keras here: the report can be redrawn from a CSV and summary alone.
"""

import math

import numpy as np

from keras_geosam.experiments.budget import budget_text
from keras_geosam.study.stats import EXPONENT_MEASURES
from keras_geosam.study.stats import GAPS
from keras_geosam.study.stats import MEASURES
from keras_geosam.study.stats import describe_comparison

# Runs that did not train (kept in the figure, left out of its statistics).
INVALID_COLOR = "lightgray"
# Measures with a stderr column, in table and figure order.
ESTIMATES = ("sr_kfac", "sr_diag", "trace_h", "lambda_max", "lambda_max_r")


def _num(v, digits=4):
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "nan"
    v = float(v)
    return f"{v:.{digits}f}" if abs(v) < 10 else f"{v:.{digits}g}"


def _pm(v, se):
    """``value ± stderr``; ``± 0`` marks an exact value (no probe noise)."""
    if se is None or (isinstance(se, float) and not math.isfinite(se)):
        return f"{_num(v)} ± nan"
    return f"{_num(v)} ± {float(se):.2g}"


def _ci(c):
    return f"{_num(c['value'], 3)} [{_num(c['ci_low'], 3)}, {_num(c['ci_high'], 3)}]"


def _table(header, body):
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(header)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths))
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in body])


def format_runs(rows):
    """One line per run: accuracies, gaps and every measure ± its stderr.

    Args:
        rows: the study's rows (dicts as read from its CSV).

    Returns:
        The table as a string.

    Raises:
        KeyError: if a row lacks a study column.

    Example:

    >>> # print(format_runs(result.rows))
    """
    header = (["run", "train acc", "test acc", "gap loss", "gap acc"] + [MEASURES[m] for m in ESTIMATES]
              + ["noise cos", "alpha*B", "valid"])
    body = []
    for r in rows:
        label = f"{r['dataset']} {r['optimizer']} B={r['batch_size']} lr={float(r['lr']):g} s={r['seed']}"
        cells = [label, _num(r["train_acc"]), _num(r["test_acc"]), _num(r["gap_loss"]), _num(r["gap_acc"])]
        cells += [_pm(r[m], r[m + "_stderr"]) for m in ESTIMATES]
        if r.get("align_note"):  # an empty alignment cell says why
            cells += ["n/a: " + str(r["align_note"]).split(":")[0], ""]
        else:
            cells += [_num(r["align_cosine"], 3), _num(r["align_alpha_b"], 3)]
        cells.append("yes" if int(r["valid"]) else "NO: " + str(r["invalid_reason"]).split(",")[0])
        body.append(cells)
    return _table(header, body)


def format_report(rows, summary):
    """The study's whole printed report.

    Args:
        rows: the study's rows.
        summary: :func:`keras_geosam.study.run_study`'s ``summary`` (with
            ``"datasets"`` from :func:`keras_geosam.study.stats.summarize`).

    Returns:
        A string: the per-run table, then per dataset the correlations with
        each gap, the S_R ~ (B/eta)^b fits and the per-optimizer means.

    Raises:
        KeyError: if the summary lacks a section.

    Example:

    >>> # print(format_report(result.rows, result.summary))
    """
    settings = summary["settings"]
    conf = settings["confidence"]
    pct = f"{100 * conf:g}%"
    source = {"train": "training", "test": "test"}[settings.get("probe_data", "test")]
    need = settings.get("min_train_acc")
    out = [format_runs(rows), "",
           "value ± stderr (± 0: exact, no probe noise; for lambda_max the Lanczos residual). "
           f"S_R and lambda_max R with relative damping {settings['damping']:g}; sharpness on the first "
           f"{settings['probe_size']} {source} examples; noise cos / alpha*B: gradient_noise_alignment "
           "(cosine of diag Cov[g_B] with diag F; alpha*B ~ 1 when the noise scale is 1/B). "
           f"valid: the run trained (finite loss, train accuracy >= "
           f"{'twice chance' if need is None else need}); invalid runs are left out of every statistic. "
           f"Training: {budget_text(settings)}."]
    for dataset, d in summary["datasets"].items():
        bad = [r for r in rows if r["dataset"] == dataset and not int(r["valid"])]
        why = {}
        for r in bad:
            kind = str(r["invalid_reason"]).split(":")[0]
            why[kind] = why.get(kind, 0) + 1
        left_out = ", ".join(f"{n} {k}" for k, n in why.items()) or "none"
        out += ["", f"== {dataset}: {d['n_runs']} valid runs (left out: {left_out}) =="]
        for gap, gap_name in GAPS.items():
            body = []
            for m, c in d["correlations"][gap].items():
                k, s = c["kendall"], c["spearman"]
                body.append([MEASURES.get(m, m), _ci(k), _num(k["pvalue"], 3), _ci(s), _num(s["pvalue"], 3), str(k["n"])])
            out += ["", f"rank correlation with the gap ({gap_name}); [{pct} paired percentile bootstrap over runs]",
                    _table(["measure", "Kendall tau", "p", "Spearman rho", "p", "n"], body)]
        body, words = [], []
        for gap, gap_name in GAPS.items():
            for pair, c in d.get("comparisons", {}).get(gap, {}).items():
                a, b = pair.split(" - ")
                body.append([gap, f"{MEASURES.get(a, a)} vs {MEASURES.get(b, b)}", _num(c.get("corr1"), 3),
                             _num(c.get("corr2"), 3), _ci(c), str(c["n"])])
                words.append(f"  {gap}: {describe_comparison(pair, c, gap)}")
        if body:
            out += ["", f"Riemannian vs Euclidean: which ranks the runs by the gap more strongly, in either "
                        f"direction: |tau(Riemannian, gap)| - |tau(Euclidean, gap)| [{pct} paired bootstrap]; "
                        f"> 0 favours the Riemannian measure; an interval containing 0: no evidence either way",
                    _table(["gap", "measures", "tau R", "tau E", "|tau| difference", "n"], body), *words]
        body = []
        for m, fits in d["exponents"].items():
            for group, f in fits.items():
                body.append([MEASURES.get(m, m), group, _pm(f["exponent"], f["stderr"]),
                             f"[{_num(f['ci_low'], 3)}, {_num(f['ci_high'], 3)}]",
                             f"[{_num(f['boot_low'], 3)}, {_num(f['boot_high'], 3)}]", _num(f["r_squared"], 3), str(f["n"])])
        out += ["", f"S_R ~ (B/eta)^b, least squares in log-log: b ± stderr, t-based {pct} interval, bootstrap {pct} interval",
                _table(["measure", "runs", "b", "t interval", "bootstrap", "R^2", "n"], body)]
        body = []
        for opt, cols in d["optimizers"].items():
            ms = lambda c: (_pm(cols[c][0], cols[c][1]) if c in cols else "")
            body.append([opt, ms("test_acc"), ms("gap_loss"), ms("gap_acc"), ms("sr_kfac"),
                         ms("align_cosine"), ms("align_alpha_b"), str(cols["test_acc"][2])])
        out += ["", "per optimizer, mean ± standard error over its runs (all batch sizes, learning rates, seeds)",
                _table(["optimizer", "test acc", "gap loss", "gap acc", "S_R K-FAC", "noise cos", "alpha*B", "n"], body)]
    if summary.get("skipped_datasets"):
        out += ["", "skipped (not available offline): " + ", ".join(summary["skipped_datasets"])]
    return "\n".join(out)


def plot(rows, summary, path, gap="gap_loss"):
    """The study's figure: per dataset, one scatter panel per measure against
    the gap (horizontal bars: 2 stderr), and a log-log panel of S_R against
    B/eta with the fitted lines.

    Args:
        rows: the study's rows.
        summary: per-dataset statistics (``summary["datasets"]`` of
            :func:`keras_geosam.study.run_study`, or
            :func:`keras_geosam.study.stats.summarize`'s output).
        path: the PNG to write.
        gap: the gap on the vertical axis.

    Returns:
        `path`.

    Raises:
        ImportError: without matplotlib.

    Example:

    >>> # plot(result.rows, result.summary["datasets"], "study.png")
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import NullFormatter

    datasets = [d for d in summary if any(r["dataset"] == d for r in rows)]
    # Per dataset, two rows of three panels: the five measures, then B/eta.
    ncols, per = 3, 2
    fig, grid = plt.subplots(per * len(datasets), ncols, figsize=(4.2 * ncols, 3.3 * per * len(datasets)),
                             squeeze=False)
    optimizers = list(dict.fromkeys(r["optimizer"] for r in rows))
    batches = sorted({int(r["batch_size"]) for r in rows})
    colors = {o: f"C{i}" for i, o in enumerate(optimizers)}
    markers = {b: m for b, m in zip(batches, "osD^v<>ph*")}
    f = lambda r, k: float(r[k]) if r[k] not in ("", None) else math.nan
    for i, dataset in enumerate(datasets):
        axes = grid[per * i: per * (i + 1)].ravel()
        sub = [r for r in rows if r["dataset"] == dataset and not int(r["diverged"])]
        stats = summary[dataset]
        for ax, m in zip(axes, ESTIMATES):
            for r in sub:
                ok = int(r["valid"])  # collapsed runs: grey, left out of the statistics
                ax.errorbar(f(r, m), f(r, gap), xerr=2 * f(r, m + "_stderr"), fmt=markers.get(int(r["batch_size"]), "o"),
                            color=colors[r["optimizer"]] if ok else INVALID_COLOR, ms=5, capsize=2,
                            alpha=0.85 if ok else 0.6, zorder=2 if ok else 1)
            vals = np.array([f(r, m) for r in sub])
            vals = vals[np.isfinite(vals) & (vals > 0)]
            if vals.size and vals.max() / vals.min() > 20:
                ax.set_xscale("log")
            c = stats["correlations"][gap][m]
            ax.set_title(f"{dataset}: {MEASURES[m]}\nKendall tau {_ci(c['kendall'])}", fontsize=9)
            ax.set_xlabel(MEASURES[m], fontsize=8)
            ax.set_ylabel(GAPS[gap], fontsize=8)
            ax.tick_params(labelsize=7)
        ax = axes[len(ESTIMATES)]
        # Colours apart from the optimizers': here colour is the metric.
        for m, style, color in zip(EXPONENT_MEASURES, ("*", "x"), ("black", "darkviolet")):
            grey = [r for r in sub if not int(r["valid"])]
            if grey:
                ax.plot([f(r, "b_over_eta") for r in grey], [f(r, m) for r in grey], style, color=INVALID_COLOR, ms=6)
            good = [r for r in sub if int(r["valid"])]
            x = np.array([f(r, "b_over_eta") for r in good])
            y = np.array([f(r, m) for r in good])
            se = np.array([f(r, m + "_stderr") for r in good])
            # a log axis cannot show a bar that reaches zero: clip it
            lower = np.minimum(2 * se, 0.999 * y)
            ax.errorbar(x, y, yerr=[lower, 2 * se], fmt=style, color=color, ms=6, capsize=2, alpha=0.8,
                        label=MEASURES[m])
            fits = stats["exponents"].get(m, {})
            fit = fits.get("all") or next(iter(fits.values()), None)
            if fit and fit["exponent"] is not None and np.isfinite(fit["exponent"]) and np.isfinite(x).any():
                xs = np.geomspace(np.nanmin(x), np.nanmax(x), 20)
                ax.plot(xs, fit["prefactor"] * xs ** fit["exponent"], "--", color=color,
                        label=f"fit: b = {_num(fit['exponent'], 2)} [{_num(fit['ci_low'], 2)}, {_num(fit['ci_high'], 2)}]")
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("B / eta", fontsize=8)
        ax.set_ylabel("S_R", fontsize=8)
        ax.set_title(f"{dataset}: S_R ~ (B/eta)^b, log-log\n(t {100 * stats_conf(stats):g}% interval; prediction b = 1)",
                     fontsize=9)
        ax.legend(fontsize=7)
        ax.tick_params(labelsize=7)
    handles = [plt.Line2D([], [], color=colors[o], marker="o", ls="", label=o) for o in optimizers]
    handles += [plt.Line2D([], [], color="gray", marker=markers[b], ls="", label=f"B={b}") for b in batches]
    if any(not int(r["valid"]) for r in rows):
        handles.append(plt.Line2D([], [], color=INVALID_COLOR, marker="o", ls="", label="collapsed (left out)"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=7, frameon=False)
    sources = sorted({str(r.get("probe_data", "test")) for r in rows})
    fig.suptitle("Does sharpness predict generalisation? Sharpness on " + "/".join(
                 {"train": "training", "test": "test"}.get(p, p) for p in sources) + " examples; bars: 2 stderr "
                 "(none: exact); Kendall tau with the gap [bootstrap interval], valid runs only", fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 0.97))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def stats_conf(stats):
    """The confidence level recorded in a dataset's statistics."""
    for fits in stats.get("exponents", {}).values():
        for fit in fits.values():
            return fit["confidence"]
    return 0.95
