"""keras_geosam: geometry-aware sharpness minimisation and Fisher-geometric
sharpness metrics for every Keras 3 backend."""

import importlib

from keras_geosam import _startup

__version__ = "0.1.0"

_SUBMODULES = (
    "backend", "callbacks", "curvature", "datasets", "distribution", "estimators",
    "experiments", "optimizers", "preconditioner", "reparam", "sharpness", "study", "training",
)
_TRAINING = ("Model", "Sequential", "attach")
__all__ = list(_SUBMODULES) + list(_TRAINING)


def __getattr__(name):
    # Submodules load on first use (PEP 562); _startup says when that matters.
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _TRAINING:
        return getattr(importlib.import_module(f"{__name__}.training"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


if not _startup.command_line_start():
    _startup.load_all(__name__)
