"""Curvature products on any backend, never materialising a matrix.

All functions take a built single-output model, inputs ``x`` and targets
``y`` (NumPy arrays or backend tensors), and differentiate the mean loss over
all examples. Data larger than ``batch_size`` is streamed: results are exact
averages over the batches (weighted by batch size), and memory is bounded by
the batch size. Vectors are lists matching ``model.trainable_variables``.
Layers run in inference mode unless ``training=True``.
"""

from keras import ops

from keras_geosam import backend
from keras_geosam.curvature import probes
from keras_geosam.curvature.functional import ModelFunctions
from keras_geosam.curvature.functional import check_data
from keras_geosam.curvature.functional import check_labels
from keras_geosam.curvature.functional import batches
from keras_geosam.curvature.functional import model_functions
from keras_geosam.curvature.functional import num_examples
from keras_geosam.curvature.losses import LossSpec
from keras_geosam.curvature.losses import require_classifier
from keras_geosam.curvature.losses import resolve_loss
from keras_geosam.curvature.operators import EKFAC
from keras_geosam.curvature.operators import KFAC
from keras_geosam.curvature.operators import GGN
from keras_geosam.curvature.operators import BlockDiagonal
from keras_geosam.curvature.operators import Dense
from keras_geosam.curvature.operators import Diagonal
from keras_geosam.curvature.operators import Fisher
from keras_geosam.curvature.operators import GGNResidual
from keras_geosam.curvature.operators import Hessian
from keras_geosam.curvature.operators import LinearOperator
from keras_geosam.curvature.operators.model import _capture_of


def loss_and_gradient(model, x, y, params=None, loss=None, batch_size=None, training=False, include_regularization=True):
    """Mean loss and its gradient, at the model's weights or at `params`.

    Returns ``(loss, grads)``; `params` (a list like the trainable variables)
    evaluates at other weight values without assigning them. Regularisation
    losses are included unless ``include_regularization=False``.
    """
    fns = model_functions(model, loss, training, include_regularization)
    check_data(x, y)
    check_labels(fns, x, y)
    p = fns.params() if params is None else fns.check_vectors(params, "params")
    n = num_examples(x)
    kernel = fns.kernel("loss_and_grad")
    value, grads = 0.0, None
    for xb, yb, nb in batches(x, y, batch_size):
        lb, gb = kernel(p, fns.non_trainable(), xb, yb)
        w = nb / n
        value = value + w * lb
        grads = [w * g for g in gb] if grads is None else [a + w * g for a, g in zip(grads, gb)]
    return value, grads


def hvp(model, x, y, vectors, loss=None, batch_size=None, training=False):
    """Hessian of the mean loss (regularisers included) times `vectors`."""
    fns = model_functions(model, loss, training)
    vectors = fns.check_vectors(vectors)
    return Hessian(model, x, y, loss=loss, batch_size=batch_size, training=training).matvec(vectors)


def ggnvp(model, x, y=None, vectors=None, reduction="mean", loss=None, batch_size=None, training=False):
    """Gauss-Newton (= Fisher, for softmax cross-entropy) times `vectors`.

    ``G v = c * sum_n J_n^T (diag p_n - p_n p_n^T) J_n v`` with ``J_n`` the
    Jacobian of example n's logits and ``c = 1/N`` (``reduction="mean"``) or
    1 (``"sum"``). For a softmax-output model this is the Fisher of the
    predictive distribution (the GGN with respect to the pre-softmax logits).
    Labels `y` are not needed and ignored. ``GGN(model, x)`` is the operator.
    """
    if vectors is None:
        raise ValueError("ggnvp needs `vectors`.")
    if reduction not in ("mean", "sum"):
        raise ValueError(f'reduction must be "mean" or "sum", got {reduction!r}.')
    fns = model_functions(model, loss, training)
    require_classifier(fns.spec, "ggnvp")
    vectors = fns.check_vectors(vectors)
    op = GGN(model, x, kind="exact", loss=loss, batch_size=batch_size, training=training)
    out = op.matvec(vectors)
    if reduction == "sum":
        out = [o * ops.cast(op.num_examples, o.dtype) for o in out]
    return out


def per_example_gradients(model, x, y, loss=None, batch_size=None, training=False):
    """Gradient of each example's loss (no regularisers), vectorised.

    Returns a list matching the trainable variables, each with a leading axis
    of size N. Meaningless with BatchNorm in training mode, hence the default
    ``training=False``.
    """
    fns = model_functions(model, loss, training)
    check_data(x, y)
    check_labels(fns, x, y)
    capture = _capture_of(fns)
    if capture.uncovered or not capture.rules:
        return _concat(fns, fns.kernel("per_example_grads"), x, y, batch_size)
    # Every variable has a rule: from layer inputs and output gradients,
    # with no per-example map (works for torch convolutions too).
    parts = None
    for xb, yb, _ in batches(x, y, batch_size):
        out = capture.per_example_gradients(fns.params(), fns.non_trainable(), xb, ops.convert_to_tensor(yb))
        out = [out[i] for i in range(len(fns.variables))]
        parts = [[o] for o in out] if parts is None else [p + [o] for p, o in zip(parts, out)]
    return [ops.concatenate(p, axis=0) if len(p) > 1 else p[0] for p in parts]


def sampled_label_gradients(model, x, num_samples=1, seed=0, batch_size=None, training=False):
    """Per-example gradients of -log p(ŷ|x) with ŷ drawn from the model.

    Returns ``(grads, labels)``: grads with a leading axis of size
    ``N * num_samples`` (sample-major) and the labels drawn, the labels of
    ``GGN(kind="mc", seed=seed)`` (see :func:`sample_labels`), the same on
    every backend.
    """
    fns = model_functions(model, None, training)
    require_classifier(fns.spec, "sampled_label_gradients")
    check_data(x, None, labels_needed=False)
    probs = predict_probs(model, x, batch_size=batch_size, training=training)
    labels = sample_labels(probs, num_samples, seed)
    xs = _tile(x, num_samples)
    grads = _concat(fns, fns.kernel("per_example_nll_grads"), xs, labels, batch_size)
    return grads, labels


def predict_probs(model, x, batch_size=None, training=False, loss=None):
    """Softmax probabilities of the predictive distribution, as NumPy."""
    import numpy as np

    fns = model_functions(model, loss, training)
    require_classifier(fns.spec, "predict_probs")
    kernel = fns.kernel("probs")
    out = [ops.convert_to_numpy(kernel(fns.params(), fns.non_trainable(), xb)) for xb, _, _ in batches(x, None, batch_size)]
    return np.concatenate(out, axis=0).astype("float64")


def sample_labels(probs, num_samples, seed, offset=0):
    """`num_samples` labels per row of `probs` (sample-major, int32 NumPy).

    Label s of example n is the inverse CDF of ``probes.uniform(seed, n +
    offset, s)``: a counter-based draw, identical on every backend and to
    the labels of ``GGN(kind="mc")`` for the same seed.
    """
    import numpy as np

    if isinstance(num_samples, bool) or int(num_samples) < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}.")
    probs = np.asarray(probs, dtype="float64")
    rows = np.arange(offset, offset + probs.shape[0])
    u = np.asarray(ops.convert_to_numpy(probes.uniform(seed, rows, np.arange(int(num_samples)), "float32")), dtype="float64")
    cdf = np.cumsum(probs, axis=-1)
    labels = (u[:, :, None] > cdf[:, None, :]).sum(-1)
    return np.minimum(labels, probs.shape[-1] - 1).T.reshape(-1).astype("int32")


def jvp(model, x, vectors, training=False):
    """Model outputs and their directional derivative J v."""
    fns = _output_functions(model, training)
    vectors = fns.check_vectors(vectors)
    return backend.jvp(lambda p, xx: fns.outputs(p, fns.non_trainable(), xx)[0], fns.params(), vectors, x)


def vjp(model, x, cotangent, training=False):
    """J^T u for the model outputs' Jacobian J and output-shaped `u`."""
    fns = _output_functions(model, training)
    return backend.vjp(lambda p, xx: fns.outputs(p, fns.non_trainable(), xx)[0], fns.params(), ops.convert_to_tensor(cotangent), x)


def _output_functions(model, training):
    # Output-only functions need no loss; give the resolver a placeholder.
    return model_functions(model, getattr(model, "loss", None) or "mse", training)


def _tile(x, k):
    import numpy as np

    if k == 1:
        return x
    if isinstance(x, (list, tuple)):
        return type(x)(_tile(e, k) for e in x)
    return np.concatenate([np.asarray(ops.convert_to_numpy(x))] * k, axis=0)


def _concat(fns, kernel, x, y, batch_size):
    parts = None
    for xb, yb, _ in batches(x, y, batch_size):
        out = kernel(fns.params(), fns.non_trainable(), xb, ops.convert_to_tensor(yb))
        parts = [[o] for o in out] if parts is None else [p + [o] for p, o in zip(parts, out)]
    return [ops.concatenate(p, axis=0) if len(p) > 1 else p[0] for p in parts]


__all__ = [
    "BlockDiagonal",
    "Dense",
    "Diagonal",
    "EKFAC",
    "Fisher",
    "GGN",
    "GGNResidual",
    "Hessian",
    "KFAC",
    "LinearOperator",
    "LossSpec",
    "ModelFunctions",
    "ggnvp",
    "hvp",
    "jvp",
    "loss_and_gradient",
    "model_functions",
    "per_example_gradients",
    "predict_probs",
    "resolve_loss",
    "sample_labels",
    "sampled_label_gradients",
    "vjp",
]
