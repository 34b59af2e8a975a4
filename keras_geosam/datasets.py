"""Small offline datasets for the main job, guides and tests.

``digits`` (scikit-learn's 1797 8x8 handwritten digits, shipped with the
package) and ``mnist1d`` (generated locally, deterministic by seed) need no
download. ``mnist`` and ``cifar10`` go through ``keras.datasets`` and fail
with a clear message when the file is not already cached.
"""

import os

import numpy as np

from keras_geosam._checks import warn_at_caller

# Inputs whose largest magnitude exceeds this are far from the [0, 1] or
# standardised scale a freshly initialised network trains on: a warning.
SANE_MAGNITUDE = 10.0


class InputScalingWarning(UserWarning):
    """:func:`load_npz` rescaled integer inputs, or found inputs far outside
    a sane range (the message names the key).

    Args:
        *args: the message, as for any warning.

    Raises:
        Nothing when created; the loaders issue it.

    Example:

    >>> import warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore", InputScalingWarning)  # e.g. known uint8 pixels
    ...     issubclass(InputScalingWarning, UserWarning)
    True
    """


NAMES = ("digits", "mnist1d", "mnist", "cifar10")
NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")


def load(name, seed=0, test_fraction=0.25):
    """Returns ``(x_train, y_train), (x_test, y_test), num_classes``, float32
    inputs and int32 labels. A name ending in ``.npz`` is read by
    :func:`load_npz`.

    ``digits``: 64 features scaled to [0, 1], a seeded random split.
    ``mnist1d``: 40 features standardised with the training mean and
    standard deviation. ``mnist`` (28x28x1) and ``cifar10`` (32x32x3):
    Keras' own split, pixels scaled to [0, 1].

    Args:
        name: one of ``"digits"``, ``"mnist1d"``, ``"mnist"``,
            ``"cifar10"``, or the path of an ``.npz`` file.
        seed: for ``digits`` the seed of the train/test shuffle; for
            ``mnist1d`` an offset to the generator's seed (42). Ignored
            otherwise. Defaults to `0`.
        test_fraction: the share of ``digits`` held out for testing.
            Ignored otherwise. Defaults to `0.25`.

    Returns:
        ``(x_train, y_train), (x_test, y_test), num_classes``: NumPy arrays,
        float32 inputs with examples on the first axis and int32 labels in
        ``[0, num_classes)``.

    Raises:
        ValueError: if `name` is not a known dataset (or, for an ``.npz``
            file, its contents are invalid, see :func:`load_npz`).
        ImportError: if ``digits`` is asked for without scikit-learn or
            ``mnist1d`` without the mnist1d package.
        RuntimeError: if ``mnist`` or ``cifar10`` is not in Keras' dataset
            cache and cannot be downloaded.
        FileNotFoundError: if an ``.npz`` path does not exist.

    Example:

    >>> from keras_geosam.datasets import load
    >>> (x, y), (x_test, y_test), num_classes = load("digits")  # no download
    >>> x.shape, x.dtype, y.shape, y.dtype
    ((1348, 64), dtype('float32'), (1348,), dtype('int32'))
    >>> x_test.shape, num_classes, sorted(set(y.tolist())) == list(range(10))
    ((449, 64), 10, True)
    >>> load("imagenet")
    Traceback (most recent call last):
    ...
    ValueError: Unknown dataset 'imagenet'; choose from ('digits', 'mnist1d', 'mnist', 'cifar10').
    """
    if str(name).endswith(".npz"):
        return load_npz(name)
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


def load_npz(path):
    """Reads a classification dataset from an ``.npz`` file.

    The file holds ``x_train, y_train, x_test, y_test`` and, optionally,
    ``num_classes`` (otherwise one more than the largest training label).
    Labels are integers in ``[0, num_classes)``, one per example (shape
    ``(N,)`` or ``(N, 1)``; one-hot rows are accepted and turned into
    indices). Inputs are cast to float32 and must be finite.

    Integer inputs are image pixels, as CIFAR-10 and MNIST are usually
    stored: they are scaled to [0, 1] as the ``keras.datasets`` path does
    (divided by 255 when every value lies in [0, 255], otherwise by the
    dtype's largest value), with an :class:`InputScalingWarning` that says
    so. Unscaled 8-bit pixels train a dead network at the usual learning
    rates. Inputs (after that) with magnitudes above
    :data:`SANE_MAGNITUDE` get an :class:`InputScalingWarning` naming the
    key; they are used as they are.

    Args:
        path: the ``.npz`` file, e.g. written by
            ``np.savez(path, x_train=..., y_train=..., x_test=..., y_test=...)``.

    Returns:
        ``(x_train, y_train), (x_test, y_test), num_classes``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a key is missing, or lengths, shapes, labels or values
            are invalid; the message names the key.

    Warns:
        InputScalingWarning: integer inputs were scaled, or inputs lie far
            outside a sane range.

    Example:

    >>> import os, tempfile
    >>> import numpy as np
    >>> from keras_geosam.datasets import load_npz
    >>> path = os.path.join(tempfile.mkdtemp(), "toy.npz")
    >>> np.savez(path, x_train=np.zeros((4, 3)), y_train=[0, 1, 2, 1],
    ...          x_test=np.ones((2, 3)), y_test=[2, 0])
    >>> (x, y), (xt, yt), classes = load_npz(path)
    >>> x.shape, y.tolist(), classes
    ((4, 3), [0, 1, 2, 1], 3)
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"No such data file: {path!r} (want an .npz with keys {', '.join(NPZ_KEYS)}).")
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except Exception as e:
        raise ValueError(f"{path!r} is not a readable .npz file (numpy.savez output): {e}") from e
    missing = [k for k in NPZ_KEYS if k not in arrays]
    if missing:
        raise ValueError(
            f"{path!r} lacks key(s) {missing}; it has {sorted(arrays)}. Expected "
            f"{', '.join(NPZ_KEYS)} (and optionally num_classes)."
        )
    xs = {}
    for split in ("train", "test"):
        x = arrays[f"x_{split}"]
        if x.ndim < 2 or len(x) == 0:
            raise ValueError(f"x_{split} must hold at least one example with features, shape (N, ...); got shape {x.shape}.")
        if not np.issubdtype(x.dtype, np.number) or np.issubdtype(x.dtype, np.complexfloating):
            raise ValueError(f"x_{split} must be real numbers, got dtype {x.dtype}.")
        if np.issubdtype(x.dtype, np.integer):
            x = _scale_integer_pixels(x, f"x_{split}", path)
        x = x.astype("float32")
        if not np.all(np.isfinite(x)):
            raise ValueError(f"x_{split} holds NaN or Inf (or values beyond float32's range).")
        peak = float(np.max(np.abs(x)))
        if peak > SANE_MAGNITUDE:
            warn_at_caller(
                f"{path!r}: x_{split} has values of magnitude up to {peak:.4g}, far outside [0, 1] or a "
                f"standardised range; a network trained on it may collapse or diverge. Scale it (e.g. divide "
                f"pixels by 255, or standardise each feature).",
                InputScalingWarning,
            )
        xs[split] = x
    if xs["train"].shape[1:] != xs["test"].shape[1:]:
        raise ValueError(
            f"x_train examples have shape {xs['train'].shape[1:]} but x_test examples "
            f"have shape {xs['test'].shape[1:]}."
        )
    ys = {}
    for split in ("train", "test"):
        y = np.asarray(arrays[f"y_{split}"])
        n = len(xs[split])
        if y.ndim == 2 and y.shape[1] > 1:
            # one-hot rows (or probabilities): the class is the largest entry
            y = np.argmax(y, axis=1)
        elif y.ndim == 2:
            y = y[:, 0]
        if y.ndim != 1:
            raise ValueError(f"y_{split} must have shape (N,), (N, 1) or one-hot (N, C); got {y.shape}.")
        if len(y) != n:
            raise ValueError(f"y_{split} has {len(y)} labels but x_{split} has {n} examples.")
        if not np.issubdtype(y.dtype, np.number) or not np.all(np.isfinite(y)) or np.any(y != np.round(y)):
            raise ValueError(f"y_{split} must hold integer class labels; got dtype {y.dtype} with non-integer values.")
        ys[split] = y.astype("int64")
    if "num_classes" in arrays:
        classes = int(arrays["num_classes"])
        if classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {classes}.")
    else:
        classes = int(ys["train"].max()) + 1
        if classes < 2:
            raise ValueError("y_train holds a single class; a classifier needs at least 2 (or store num_classes).")
    for split in ("train", "test"):
        y = ys[split]
        bad = (y < 0) | (y >= classes)
        if np.any(bad):
            source = "num_classes" if "num_classes" in arrays else "the largest y_train label + 1"
            raise ValueError(
                f"y_{split} has label {int(y[bad][0])} outside [0, {classes}) ({classes} classes from "
                f"{source}); store num_classes in the file if some classes are missing from y_train."
            )
    return (xs["train"], ys["train"].astype("int32")), (xs["test"], ys["test"].astype("int32")), classes


def _scale_integer_pixels(x, key, path):
    low, high = int(x.min()), int(x.max())
    if low < 0:
        return x  # signed integer features, not pixels: the range check judges them
    top = 255 if high <= 255 else int(np.iinfo(x.dtype).max)
    warn_at_caller(
        f"{path!r}: {key} holds integers ({x.dtype}, {low}..{high}); read as pixels and divided by {top} "
        f"to [0, 1], as keras.datasets images are. Store float inputs to use them unscaled.",
        InputScalingWarning,
    )
    return x.astype("float32") / np.float32(top)
