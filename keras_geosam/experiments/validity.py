"""Whether a run trained: the sharpness of a collapsed or diverged network
describes no minimum, so such runs are flagged and kept out of statistics.
"""

import math

# A run is valid when its final train accuracy is at least this many times
# chance (1 / classes): a network stuck at chance predicts one class, and
# its Fisher is non-zero only for the output biases.
CHANCE_MULTIPLE = 2.0


def min_train_accuracy(num_classes, min_train_acc=None):
    """The train accuracy a run must reach: `min_train_acc`, or
    :data:`CHANCE_MULTIPLE` times chance (``2 / num_classes``, capped at 1).

    Example:

    >>> min_train_accuracy(10), min_train_accuracy(10, 0.5)
    (0.2, 0.5)
    """
    if min_train_acc is not None:
        return float(min_train_acc)
    return min(1.0, CHANCE_MULTIPLE / int(num_classes))


def check_run(train_loss, train_acc, num_classes, *, weights_finite=True, min_train_acc=None):
    """``(valid, reason)`` for a finished run; `reason` is ``""`` when valid.

    Args:
        train_loss, train_acc: on the whole training set at the final weights.
        num_classes: for the default threshold.
        weights_finite: False if any weight is NaN or infinite.
        min_train_acc: the threshold (default: :func:`min_train_accuracy`).

    Returns:
        ``(True, "")``, ``(False, "diverged: ...")`` or
        ``(False, "collapsed: train acc 0.10 < 0.20, sharpness of a dead network")``.

    Example:

    >>> check_run(0.3, 0.95, 10)
    (True, '')
    >>> check_run(2.30, 0.1, 10)
    (False, 'collapsed: train acc 0.10 < 0.20 (twice chance), sharpness of a dead network')
    >>> check_run(float("nan"), 0.1, 10)
    (False, 'diverged: train loss nan')
    """
    if not weights_finite:
        return False, "diverged: non-finite weights"
    if not math.isfinite(float(train_loss)):
        return False, f"diverged: train loss {float(train_loss)}"
    need = min_train_accuracy(num_classes, min_train_acc)
    if not float(train_acc) >= need:
        why = "twice chance" if min_train_acc is None and need < 1 else "min_train_acc"
        return False, f"collapsed: train acc {float(train_acc):.2f} < {need:.2f} ({why}), sharpness of a dead network"
    return True, ""
