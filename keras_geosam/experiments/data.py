"""The data a run's sharpness is measured on, and label noise."""

import numpy as np

PROBE_SOURCES = ("train", "test")


def probe_subset(train, test, size, source="train"):
    """The fixed examples sharpness is measured on: the first `size` of the
    training set (``source="train"``, the default: the claims are about the
    Hessian of the training loss at the trained weights) or of the test set.

    Args:
        train, test: ``(x, y)`` pairs; the loaders shuffle once, by seed.
        size: examples (fewer if the set is smaller).
        source: ``"train"`` or ``"test"``.

    Returns:
        ``(x, y)``.

    Raises:
        ValueError: an unknown `source`.

    Example:

    >>> x = np.arange(10.0)[:, None]
    >>> probe_subset((x, x[:, 0]), (-x, -x[:, 0]), 3)[1].tolist()
    [0.0, 1.0, 2.0]
    """
    if source not in PROBE_SOURCES:
        raise ValueError(f"probe data must be one of {PROBE_SOURCES}, got {source!r}.")
    x, y = train if source == "train" else test
    n = min(int(size), len(x))
    return x[:n], y[:n]


def symmetric_label_noise(y, fraction, num_classes, seed=0):
    """Labels with exactly ``round(fraction * N)`` of them changed, each to
    one of the other classes drawn uniformly (symmetric noise).

    The fraction given is the fraction actually changed (not the fraction
    resampled, some of which would land on the true class again).

    Args:
        y: integer labels, shape ``(N,)``.
        fraction: in [0, 1].
        num_classes: classes (>= 2).
        seed: the draw.

    Returns:
        ``(noisy labels, fraction changed)``; the input is not modified.

    Raises:
        ValueError: `fraction` outside [0, 1] or fewer than 2 classes.

    Example:

    >>> y = np.zeros(10, "int32")
    >>> noisy, changed = symmetric_label_noise(y, 0.4, 10, seed=0)
    >>> int((noisy != y).sum()), changed
    (4, 0.4)
    """
    if not 0 <= float(fraction) <= 1:
        raise ValueError(f"label noise must be in [0, 1], got {fraction!r}.")
    if int(num_classes) < 2:
        raise ValueError(f"label noise needs at least 2 classes, got {num_classes}.")
    y = np.asarray(y)
    rng = np.random.default_rng(seed)
    chosen = rng.choice(len(y), size=int(round(float(fraction) * len(y))), replace=False)
    # an offset in 1..C-1 moves a label to each other class with equal odds
    offset = rng.integers(1, int(num_classes), size=len(chosen))
    noisy = y.copy()
    noisy[chosen] = (y[chosen] + offset) % int(num_classes)
    return noisy, float(np.mean(noisy != y)) if len(y) else 0.0
