"""Diagonal Fisher information, three honestly named kinds.

All three average over examples (F = 1/N sum_n ...), matching the Hessian
of the *mean* loss:

- ``"exact"``: the Fisher of the model's predictive distribution,
  ``sum_k p_k (grad log p_k)^2`` per example: C per-example backward passes.
- ``"mc"``: the same with ``num_samples`` labels per example drawn from the
  model's softmax (the paper's estimator); unbiased but noisy, and zero
  wherever no drawn label moves a parameter.
- ``"empirical"``: data labels with the model's loss. Not the Fisher: it is
  the second moment of per-example gradients.
"""

import numpy as np
from keras import ops

from keras_geosam.curvature import predict_probs
from keras_geosam.curvature import sample_labels
from keras_geosam.curvature.functional import batches
from keras_geosam.curvature.functional import model_functions
from keras_geosam.curvature.functional import num_examples
from keras_geosam.curvature.functional import progbar
from keras_geosam.curvature.losses import require_classifier
from keras_geosam.sharpness import _common

KINDS = ("exact", "mc", "empirical")


def check_kind(kind):
    if kind not in KINDS:
        raise ValueError(f"Fisher kind must be one of {KINDS}, got {kind!r}.")


def label_passes(fns, kind, xb, yb, num_samples, rng):
    """Yields `(kernel_name, labels, weights)` whose weighted per-example
    gradient outer products average to the chosen Fisher on batch `xb`.

    ``weights`` has one entry per example (a row of the passes' mixture).
    """
    if kind == "empirical":
        if yb is None:
            raise ValueError('fisher kind "empirical" needs the data labels `y`.')
        yield "per_example_grads", yb, np.ones(num_examples(xb))
        return
    kernel = fns.kernel("probs")
    probs = np.asarray(ops.convert_to_numpy(kernel(fns.params(), fns.non_trainable(), xb)), dtype="float64")
    if kind == "exact":
        for k in range(probs.shape[-1]):
            yield "per_example_nll_grads", np.full(probs.shape[0], k, "int32"), probs[:, k]
    else:
        labels = sample_labels(probs, num_samples, rng).reshape(num_samples, -1)
        for s in range(num_samples):
            yield "per_example_nll_grads", labels[s], np.full(probs.shape[0], 1.0 / num_samples)


def fisher_diagonal(model, x, y=None, kind="exact", num_samples=1, seed=0, batch_size=_common.DEFAULT_BATCH_SIZE, loss=None, verbose=0):
    """Diagonal of the Fisher information (averaged over examples).

    Args:
        model: a built classifier compiled with a categorical cross-entropy
            (logits or softmax outputs); anything else raises ValueError.
        x, y: data; `y` is needed only for ``kind="empirical"``.
        kind: ``"exact"`` | ``"mc"`` | ``"empirical"`` (see module doc).
        num_samples: labels drawn per example for ``"mc"``.
        seed: seeds the label draw (NumPy, identical on every backend).
        batch_size: examples per vectorised per-example-gradient pass;
            memory is about ``batch_size * num_params`` floats.

    Returns:
        A list of float64 NumPy arrays matching ``model.trainable_variables``.
    """
    check_kind(kind)
    num_samples = _common.check_positive_int("num_samples", num_samples)
    fns = model_functions(model, loss, training=False)
    require_classifier(fns.spec, "fisher_diagonal")
    rng = np.random.default_rng(seed)
    n = num_examples(x)
    total = [np.zeros(tuple(v.shape)) for v in fns.variables]
    bar = progbar(-(-n // (batch_size or n)), verbose, "batch")
    for xb, yb, _ in batches(x, y, batch_size):
        for kernel_name, labels, weights in label_passes(fns, kind, xb, yb, num_samples, rng):
            grads = fns.kernel(kernel_name)(fns.params(), fns.non_trainable(), xb, ops.convert_to_tensor(labels))
            for t, g in zip(total, grads):
                g = np.asarray(ops.convert_to_numpy(g), dtype="float64")
                t += np.tensordot(weights, g * g, axes=1)
        if bar is not None:
            bar.add(1)
    return [t / n for t in total]
