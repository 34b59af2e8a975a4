"""Does sharpness predict generalisation? A resumable study.

Trains a grid of small classifiers (batch size x learning rate x optimizer x
seed, on one or more datasets), measures each at its final weights
(Riemannian sharpness S_R with the K-FAC and diagonal Fisher metrics, tr H,
lambda_max, the Riemannian lambda_max, the generalisation gap, and the
gradient-noise / Fisher alignment), and reports rank correlations of each
measure with the gap, with bootstrap intervals, and the exponent of S_R
against B/eta.

Python::

    from keras_geosam import study
    result = study.run_study("out", preset="small")

Command line (the parser imports no Keras)::

    python -m keras_geosam.study --smoke --output out
    KERAS_GEOSAM_GUIDE_MODE=smoke python -m keras_geosam.study

The guide ``guides/sharpness_generalisation.py`` walks through it.
"""

from keras_geosam.study import stats
from keras_geosam.study.command import add_arguments, build_parser, main, run_from_args
from keras_geosam.study.grid import (
    FIELDS, MODE_ENV, PRESETS, StudyInterrupted, StudyResult, read_rows, resolve_settings, run_study,
)

__all__ = [
    "FIELDS", "MODE_ENV", "PRESETS", "StudyInterrupted", "StudyResult", "add_arguments", "build_parser",
    "main", "read_rows", "resolve_settings", "run_from_args", "run_study", "stats",
]
