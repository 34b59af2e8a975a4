"""Small offline datasets for the main job, guides and tests.

``digits`` (scikit-learn's 1797 8x8 handwritten digits, shipped with the
package) and ``mnist1d`` (generated locally, deterministic by seed) need no
download. ``mnist`` and ``cifar10`` go through ``keras.datasets`` and fail
with a clear message when the file is not already cached.
"""

import os

import numpy as np

NAMES = ("digits", "mnist1d", "mnist", "cifar10")


def load(name, seed=0, test_fraction=0.25):
    """Returns ``(x_train, y_train), (x_test, y_test), num_classes``, float32
    inputs and int32 labels."""
    if name == "digits":
        try:
            from sklearn.datasets import load_digits
        except ImportError as e:  # pragma: no cover - dependency message
            raise ImportError("The digits dataset needs scikit-learn: pip install keras-geosam[data].") from e
        d = load_digits()
        x = (d.data / 16.0).astype("float32")
        y = d.target.astype("int32")
        rng = np.random.default_rng(seed)
        order = rng.permutation(len(x))
        n_test = int(round(len(x) * test_fraction))
        test, train = order[:n_test], order[n_test:]
        return (x[train], y[train]), (x[test], y[test]), 10
    if name == "mnist1d":
        try:
            from mnist1d.data import get_dataset_args
            from mnist1d.data import make_dataset
        except ImportError as e:  # pragma: no cover
            raise ImportError("MNIST-1D needs the mnist1d package: pip install keras-geosam[data].") from e
        args = get_dataset_args()
        args.seed = 42 + seed
        d = make_dataset(args)
        x_tr, x_te = d["x"].astype("float32"), d["x_test"].astype("float32")
        mu, sd = x_tr.mean(), x_tr.std()
        return ((x_tr - mu) / sd, d["y"].astype("int32")), ((x_te - mu) / sd, d["y_test"].astype("int32")), 10
    if name in ("mnist", "cifar10"):
        import keras

        fname = {"mnist": "mnist.npz", "cifar10": "cifar-10-batches-py"}[name]
        cache = os.path.join(os.path.expanduser(os.environ.get("KERAS_HOME", "~/.keras")), "datasets")
        try:
            (x_tr, y_tr), (x_te, y_te) = getattr(keras.datasets, name).load_data()
        except Exception as e:
            raise RuntimeError(
                f"{name} is not cached in Keras' dataset cache ({fname} under "
                f"{cache}, or /tmp/.keras/datasets when that is not writable) "
                f"and could not be downloaded: {e}. Fetch it once with "
                f"keras.datasets.{name}.load_data() on a machine with internet "
                f"access, or use the offline datasets 'digits' or 'mnist1d'."
            ) from e
        x_tr = x_tr.astype("float32") / 255.0
        x_te = x_te.astype("float32") / 255.0
        if name == "mnist":
            x_tr, x_te = x_tr[..., None], x_te[..., None]
        return (x_tr, y_tr.reshape(-1).astype("int32")), (x_te, y_te.reshape(-1).astype("int32")), 10
    raise ValueError(f"Unknown dataset {name!r}; choose from {NAMES}.")
