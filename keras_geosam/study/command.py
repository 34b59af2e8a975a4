"""The study's command line: ``python -m keras_geosam.study`` and
``keras-geosam study`` (the parser imports no Keras)."""

import argparse
import os
import sys

from keras_geosam.experiments import DAMPING
from keras_geosam.experiments.arguments import fraction as _fraction
from keras_geosam.experiments.arguments import nonneg_float as _nonneg_float
from keras_geosam.experiments.arguments import nonneg_int as _nonneg_int
from keras_geosam.experiments.arguments import positive_int as _pos_int
from keras_geosam.experiments.data import PROBE_SOURCES
from keras_geosam.experiments.optimizers import names_help as _optimizer_names
from keras_geosam.study.grid import DEFAULTS
from keras_geosam.study.grid import MODE_ENV
from keras_geosam.study.grid import PRESETS
from keras_geosam.study.grid import run_study

__all__ = ["add_arguments", "build_parser", "main", "run_from_args"]


def _list(cast):
    def parse(text):
        try:
            values = tuple(cast(t.strip()) for t in text.split(",") if t.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {cast.__name__}s") from None
        if not values:
            raise argparse.ArgumentTypeError("the list is empty")
        return values

    return parse


def _preset_help(key):
    def text(v):
        return ",".join(map(str, v)) if isinstance(v, tuple) else str(v)

    return "; ".join(f"{name}: {text(p[key] if key in p else DEFAULTS[key])}" for name, p in PRESETS.items())


def add_arguments(parser):
    """Adds the study's options to an ``argparse`` parser (or subparser).

    Nothing here imports Keras, so ``--help`` is immediate. Options left
    unset take the preset's value (``--smoke``, ``--full``, ``--preset``,
    else ``$KERAS_GEOSAM_GUIDE_MODE``, else ``small``).

    Args:
        parser: an ``argparse.ArgumentParser`` (e.g. from
            ``subparsers.add_parser("study")``).

    Returns:
        `parser`.

    Raises:
        argparse.ArgumentError: if `parser` already has one of the options.

    Example:

    >>> import argparse
    >>> args = add_arguments(argparse.ArgumentParser()).parse_args(["--smoke", "--epochs", "2"])
    >>> args.preset, args.epochs
    ('smoke', 2)
    """
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--preset", choices=list(PRESETS), default=None,
                      help=f"size of the study (default: ${MODE_ENV}, else small)")
    mode.add_argument("--smoke", dest="preset", action="store_const", const="smoke",
                      help="a tiny grid of 4 one-epoch runs, for CI (same as --preset smoke)")
    mode.add_argument("--full", dest="preset", action="store_const", const="full",
                      help="the large grid, meant for an accelerator (same as --preset full)")
    parser.add_argument("--output", default=os.path.join("geosam_output", "study"),
                        help="folder for study.csv, summary.json, study.png (default: %(default)s)")
    parser.add_argument("--fresh", action="store_true", help="start over instead of resuming from OUTPUT/study.csv")
    g = parser.add_argument_group("grid (comma-separated; unset: the preset's)")
    g.add_argument("--datasets", type=_list(str), help="digits, mnist1d (offline); mnist, fashion_mnist, cifar10 "
                   "(Keras' cache). Preset: " + _preset_help("datasets"))
    g.add_argument("--data", metavar="PATH.npz", help="your own data: x_train, y_train, x_test, y_test")
    g.add_argument("--optimizers", type=_list(str), help=_optimizer_names() + ". Preset: " + _preset_help("optimizers"))
    g.add_argument("--label-noise", dest="label_noises", type=_list(float), help="fractions of training labels "
                   "changed to another class (symmetric noise; test labels untouched), e.g. 0,0.4,0.8; statistics "
                   "are computed per fraction. Preset: " + _preset_help("label_noises"))
    g.add_argument("--batch-sizes", type=_list(int), help="Preset: " + _preset_help("batch_sizes"))
    g.add_argument("--lrs", "--learning-rates", dest="learning_rates", type=_list(float),
                   help="learning rates of the base optimizer (SGD with momentum 0.9 unless METHOD@BASE). Preset: "
                   + _preset_help("learning_rates"))
    g.add_argument("--seeds", type=_list(int), help="Preset: " + _preset_help("seeds"))
    r = parser.add_argument_group("each run (unset: the preset's)")
    r.add_argument("--steps", type=_nonneg_int, help="optimizer steps per run, the same for every batch size, so "
                   "that B/eta is not confounded with under-training (0: train by --epochs). Preset: "
                   + _preset_help("steps"))
    r.add_argument("--epochs", type=_pos_int, help="epochs per run when --steps is 0. Preset: " + _preset_help("epochs"))
    r.add_argument("--target-train-loss", type=float, help="stop a run at the end of the first epoch whose mean train "
                   "loss is at most this (--steps or --epochs is the cap; a run that does not reach it is recorded "
                   "as not converged)")
    r.add_argument("--train-size", type=_nonneg_int, help="training examples, 0 for all. Preset: " + _preset_help("train_size"))
    r.add_argument("--probe-data", choices=PROBE_SOURCES, help="where the examples sharpness is measured on come "
                   "from (default: train, the Hessian of the training loss the papers' claims are about)")
    r.add_argument("--probe-size", type=_pos_int, help="examples (the first of --probe-data) the sharpness is measured "
                   "on. Preset: " + _preset_help("probe_size"))
    r.add_argument("--min-train-acc", type=_fraction, help="final train accuracy below which a run counts as collapsed "
                   "and is left out of the statistics (default: twice chance, 2 / classes)")
    r.add_argument("--num-probes", type=_pos_int, help="Hutchinson probes per round. Preset: " + _preset_help("num_probes"))
    r.add_argument("--width", type=_pos_int, help="MLP hidden units. Preset: " + _preset_help("width"))
    r.add_argument("--depth", type=_pos_int, help="MLP hidden layers (default 2)")
    r.add_argument("--activation", help="hidden activation (default relu; tanh makes S_R's residual non-zero)")
    r.add_argument("--max-iter", type=_pos_int, help="Lanczos iterations for lambda_max. Preset: " + _preset_help("max_iter"))
    r.add_argument("--alignment-size", type=_pos_int, help="training examples for the noise/Fisher alignment. "
                   "Preset: " + _preset_help("alignment_size"))
    r.add_argument("--alignment-batches", type=_pos_int, help="minibatches for the noise/Fisher alignment. Preset: "
                   + _preset_help("alignment_batches"))
    r.add_argument("--damping", type=_nonneg_float, help=f"relative damping of the Fisher metric (default: {DAMPING}, "
                   "the command line's; the library's functions default to 1e-3)")
    r.add_argument("--trajectory", action=argparse.BooleanOptionalAction, default=None, help="also log S_R "
                   "(K-FAC), tr H and both lambda_max at about --trajectory-points epochs of each run "
                   "(SharpnessLogger) into trajectories.csv and trajectories.png. Preset: " + _preset_help("trajectory"))
    r.add_argument("--trajectory-points", type=_pos_int, help="logged epochs per run with --trajectory (default 6)")
    a = parser.add_argument_group("statistics")
    a.add_argument("--resamples", dest="n_resamples", type=_pos_int, help="bootstrap resamples. Preset: "
                   + _preset_help("n_resamples"))
    a.add_argument("--confidence", type=float, help="interval coverage (default 0.95)")
    parser.add_argument("--no-plot", action="store_true", help="skip study.png")
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")
    return parser


def build_parser(parser=None):
    """The study's parser: `parser` with :func:`add_arguments`, or a new one.

    Args:
        parser: an existing parser or subparser; None creates
            ``argparse.ArgumentParser(prog="keras-geosam study")``.

    Returns:
        The parser.

    Raises:
        argparse.ArgumentError: if `parser` already has one of the options.

    Example:

    >>> build_parser().parse_args([]).preset is None
    True
    """
    if parser is None:
        parser = argparse.ArgumentParser(
            prog="keras-geosam study",
            description="Does sharpness predict generalisation? Trains a grid (batch size x learning rate x "
                        "optimizer x seed), measures S_R, tr H, lambda_max and the gap per run, and reports rank "
                        "correlations with bootstrap intervals and the exponent of S_R against B/eta. "
                        "Resumable: finished runs in OUTPUT/study.csv are skipped.",
        )
    return add_arguments(parser)


_OVERRIDES = ("datasets", "data", "optimizers", "batch_sizes", "learning_rates", "seeds", "epochs", "train_size",
              "probe_size", "num_probes", "width", "depth", "activation", "max_iter", "alignment_size", "alignment_batches",
              "damping", "n_resamples", "confidence", "probe_data", "min_train_acc", "steps", "target_train_loss",
              "label_noises", "trajectory", "trajectory_points")


def run_from_args(args):
    """Runs the study from parsed arguments (:func:`add_arguments`).

    Args:
        args: an ``argparse.Namespace``.

    Returns:
        The :class:`StudyResult`.

    Raises:
        ValueError, RuntimeError: as :func:`run_study`.

    Example:

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as out:
    ...     args = build_parser().parse_args(["--smoke", "--optimizers", "sgd", "--batch-sizes", "64",
    ...                                       "--output", out, "--quiet", "--no-plot"])
    ...     result = run_from_args(args)
    >>> result.num_run, result.rows[0]["optimizer"]
    (1, 'sgd')
    """
    overrides = {k: getattr(args, k, None) for k in _OVERRIDES}
    return run_study(args.output, args.preset, fresh=args.fresh, plot=not args.no_plot,
                     verbose=0 if args.quiet else 1, **overrides)


def main(argv=None):
    """Command-line entry point: parse `argv`, run the study, return 0.

    Args:
        argv: arguments without the program name (default ``sys.argv[1:]``).

    Returns:
        0 on success; 2 (with a message, no traceback) when the study
        refuses its settings or data.

    Raises:
        SystemExit: from argparse for bad arguments or ``--help``.

    Example:

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as out:
    ...     main(["--smoke", "--optimizers", "sgd", "--batch-sizes", "64", "--output", out, "--quiet", "--no-plot"])
    0
    >>> main(["--smoke", "--optimizers", "adamw-sam", "--quiet"])  # refused: message on stderr
    2
    """
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run_from_args(args)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"keras-geosam study: error: {e}", file=sys.stderr)
        return 2
    return 0
