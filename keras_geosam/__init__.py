"""keras_geosam: geometry-aware sharpness minimisation and Fisher-geometric
sharpness metrics for every Keras 3 backend."""

import importlib
import os
import sys

__version__ = "0.1.0"

_SUBMODULES = (
    "backend", "callbacks", "curvature", "datasets", "distribution", "estimators",
    "experiments", "optimizers", "preconditioner", "reparam", "sharpness", "study", "training",
)
_TRAINING = ("Model", "Sequential", "attach")
__all__ = list(_SUBMODULES) + list(_TRAINING)


def __getattr__(name):
    # Submodules load on first use; see _load_all for when that matters.
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _TRAINING:
        return getattr(importlib.import_module(f"{__name__}.training"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


def _load_all():
    """Imports everything that registers itself with Keras: the optimizers
    (for ``keras.saving``) and the attached-model reload hook."""
    for name in ("backend", "callbacks", "curvature", "datasets", "estimators",
                 "optimizers", "preconditioner", "reparam", "sharpness", "training"):
        importlib.import_module(f"{__name__}.{name}")


def _command_line_start():
    # `python -m keras_geosam` sets argv[0] to "-m" while the package loads;
    # the console script is named keras-geosam. Both parse their arguments
    # before importing Keras, so `--help` answers without the 2-15 s import.
    argv0 = sys.argv[0] if sys.argv else ""
    return argv0 == "-m" or os.path.basename(argv0) in ("keras-geosam", "keras-geosam.exe")


if not _command_line_start():
    _load_all()
