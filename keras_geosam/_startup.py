"""What importing keras_geosam does: load every module that registers itself
with Keras, except when the command line starts (it answers ``--help``
before importing Keras)."""

import importlib
import os
import sys

# Modules that register with Keras on import: the optimizers (for
# ``keras.saving``) and the attached-model reload hook, and what they need.
REGISTERING = ("backend", "callbacks", "curvature", "datasets", "estimators",
               "optimizers", "preconditioner", "reparam", "sharpness", "training")


def load_all(package="keras_geosam"):
    for name in REGISTERING:
        importlib.import_module(f"{package}.{name}")


def command_line_start():
    # `python -m keras_geosam` sets argv[0] to "-m" while the package loads;
    # the console script is named keras-geosam. Both parse their arguments
    # before importing Keras, so `--help` answers without the 2-15 s import.
    argv0 = sys.argv[0] if sys.argv else ""
    return argv0 == "-m" or os.path.basename(argv0) in ("keras-geosam", "keras-geosam.exe")
