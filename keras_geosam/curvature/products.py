"""The functional curvature API: products with a model's curvature and
its outputs' derivatives, as plain functions.

All functions take a built model (one with several outputs takes a loss
per output, ``losses.JointSpec``), inputs ``x`` and targets ``y`` (NumPy
arrays or backend tensors, or lists or dicts of them), and differentiate
the mean loss over all examples. Data larger than ``batch_size`` is
streamed: results are exact averages over the batches (weighted by batch
size), and memory is bounded by the batch size. Vectors are lists matching ``model.trainable_variables``.
Layers run in inference mode unless ``training=True``. ``hvp`` and ``ggnvp``
are one product of the :class:`Hessian` and :class:`GGN` operators.
"""

import keras
from keras import ops

from keras_geosam._checks import check_int
from keras_geosam import backend
from keras_geosam.curvature import probes
from keras_geosam.curvature import weights as token_weights
from keras_geosam.curvature.functional import check_data
from keras_geosam.curvature.functional import check_labels
from keras_geosam.curvature.data import batches
from keras_geosam.curvature.functional import model_functions
from keras_geosam.curvature.data import num_examples
from keras_geosam.curvature.losses import require_classifier
from keras_geosam.curvature.losses import require_likelihood
from keras_geosam.curvature.operators import GGN
from keras_geosam.curvature.operators import Hessian
from keras_geosam.curvature.operators.model import capture_of


def loss_and_gradient(model, x, y, params=None, loss=None, batch_size=None, training=False, include_regularization=True,
                      sample_weight=None):
    """Mean loss and its gradient, at the model's weights or at `params`.

    The loss is averaged over all of ``(x, y)`` (streamed in `batch_size`
    pieces, weighted by their size); regularisation losses are included
    unless ``include_regularization=False``.

    Args:
        model: a built ``keras.Model`` (several outputs take a loss each).
        x: inputs: a NumPy array or backend tensor (or a list or dict of them for
            several inputs).
        y: targets of the same length.
        params: a list like the trainable variables, to evaluate at other
            weight values without assigning them. Defaults to `None` (the
            model's weights).
        loss: loss to use instead of the compiled one. Defaults to `None`.
        batch_size: examples per streamed batch. Defaults to `None` (256).
        training: run layers in training mode. Defaults to `False`.
        include_regularization: add the model's regularisation losses.
            Defaults to `True`.
        sample_weight: ``(N,)`` or per-token ``(N,) + positions`` weights
            (with the model's own output mask they make the loss a weighted
            mean over tokens; ``keras_geosam.curvature.weights``), or, for
            several outputs, one per output (a list in output order or a
            dict by name; each output's loss is then its own weighted mean).
            Defaults to `None`.

    Returns:
        A tuple ``(loss, grads)``: a scalar tensor and a list of tensors
        shaped like the trainable variables.

    Raises:
        ValueError: if the model is not built or has no loss, `params` does
            not match the trainable variables, or the data is invalid (not
            arrays, lengths differ, non-finite inputs, labels that are not
            class ids of the model).

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, kernel_initializer="zeros")])
    >>> model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> loss, grads = kg.curvature.loss_and_gradient(model, x, y)
    >>> round(float(loss), 4)  # log(3): uniform predictions
    1.0986
    >>> [tuple(g.shape) for g in grads]
    [(4, 3), (3,)]
    """
    fns = model_functions(model, loss, training, include_regularization)
    check_data(x, y, sample_weight=sample_weight)
    check_labels(fns, x, y)
    p = fns.params() if params is None else fns.check_vectors(params, "params")
    n = num_examples(x)
    weights = _normalised_weights(fns, x, y, sample_weight, batch_size)
    kernel = fns.kernel(fns.loss_and_grad_body)
    value, grads = 0.0, None
    for (xb, yb, nb), swb in zip(batches(x, y, batch_size), token_weights.batch_slices(weights, n, batch_size, _dtype(fns))):
        lb, gb = kernel(p, fns.non_trainable(), xb, yb, swb)
        w = nb / n if swb is None else 1.0  # a weighted batch returns its share
        if w != 1.0:  # one whole batch is not multiplied (an eager op per tensor)
            lb, gb = w * lb, [w * g for g in gb]
        value = lb if grads is None else value + lb
        grads = list(gb) if grads is None else [a + g for a, g in zip(grads, gb)]
    return value, grads


def hvp(model, x, y, vectors, loss=None, batch_size=None, training=False, sample_weight=None):
    """Hessian of the mean loss (regularisers included) times `vectors`.

    Computes ``H v`` at the model's weights, for ``H`` the Hessian of the
    mean loss over all of ``(x, y)``, without forming ``H``: one
    linearisation per data batch. ``kg.curvature.Hessian`` is the operator.

    Args:
        model: a built ``keras.Model`` (several outputs take a loss each).
        x: inputs: a NumPy array or backend tensor (or a list or dict of them for
            several inputs).
        y: targets of the same length.
        vectors: a list with one array per trainable variable, shaped like
            it.
        loss: loss to use instead of the compiled one. Defaults to `None`.
        batch_size: examples per streamed batch. Defaults to `None` (256).
        training: run layers in training mode. Defaults to `False`.
        sample_weight: weights of the loss terms, as for
            :func:`loss_and_gradient`. Defaults to `None`.

    Returns:
        A list of tensors shaped like the trainable variables.

    Raises:
        ValueError: if the model is not built or has no loss, `vectors` does
            not match the trainable variables, or the data is invalid (not
            arrays, lengths differ, non-finite inputs, labels that are not
            class ids of the model).

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, kernel_initializer="zeros")])
    >>> model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> v = [rng.normal(size=w.shape).astype("float32") for w in model.trainable_weights]
    >>> hv = kg.curvature.hvp(model, x, y, v)
    >>> [tuple(t.shape) for t in hv]
    [(4, 3), (3,)]
    >>> vhv = sum(np.sum(a * keras.ops.convert_to_numpy(b)) for a, b in zip(v, hv))
    >>> round(float(vhv), 3)  # positive: this loss is convex in the weights
    1.674
    """
    fns = model_functions(model, loss, training)
    vectors = fns.check_vectors(vectors)
    return Hessian(model, x, y, loss=loss, batch_size=batch_size, training=training, sample_weight=sample_weight).matvec(vectors)


def ggnvp(model, x, y=None, vectors=None, reduction="mean", loss=None, batch_size=None, training=False, sample_weight=None):
    """Gauss-Newton (= Fisher, for softmax cross-entropy) times `vectors`.

    ``G v = c * sum_n J_n^T (diag p_n - p_n p_n^T) J_n v`` with ``J_n`` the
    Jacobian of example n's logits and ``c = 1/N`` (``reduction="mean"``) or
    1 (``"sum"``). For a softmax-output model this is the Fisher of the
    predictive distribution (the GGN with respect to the pre-softmax logits).
    Labels `y` are not needed and ignored. ``GGN(model, x)`` is the operator.

    Args:
        model: a built ``keras.Model`` (several outputs take a loss each).
        x: inputs: a NumPy array or backend tensor (or a list or dict of them for
            several inputs).
        y: ignored (the GGN needs no labels). Defaults to `None`.
        vectors: a list with one array per trainable variable, shaped like
            it (required).
        reduction: ``"mean"`` or ``"sum"`` over examples. Defaults to
            ``"mean"``.
        loss: loss to use instead of the compiled one. Defaults to `None`.
        batch_size: examples per streamed batch. Defaults to `None` (256).
        training: run layers in training mode. Defaults to `False`.
        sample_weight: weights of the loss terms, as for
            :func:`loss_and_gradient`. Defaults to `None`.

    Returns:
        A list of tensors shaped like the trainable variables.

    Raises:
        ValueError: if `vectors` is missing or does not match the trainable
            variables, `reduction` is neither ``"mean"`` nor ``"sum"``, the
            loss is not a categorical cross-entropy, the model is not built,
            or the data is invalid (not arrays, lengths differ, non-finite
            inputs, labels that are not class ids of the model).

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, kernel_initializer="zeros")])
    >>> model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> v = [rng.normal(size=w.shape).astype("float32") for w in model.trainable_weights]
    >>> gv = kg.curvature.ggnvp(model, x, vectors=v)
    >>> hv = kg.curvature.hvp(model, x, y, v)
    >>> # A linear softmax model's Hessian is its Gauss-Newton matrix.
    >>> all(np.allclose(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b), atol=1e-5)
    ...     for a, b in zip(gv, hv))
    True
    """
    if vectors is None:
        raise ValueError("ggnvp needs `vectors`.")
    if reduction not in ("mean", "sum"):
        raise ValueError(f'reduction must be "mean" or "sum", got {reduction!r}.')
    fns = model_functions(model, loss, training)
    require_likelihood(fns.spec, "ggnvp")
    vectors = fns.check_vectors(vectors)
    op = GGN(model, x, y, kind="exact", loss=loss, batch_size=batch_size, training=training, sample_weight=sample_weight)
    out = op.matvec(vectors)
    if reduction == "sum":
        out = [o * ops.cast(op.num_examples, o.dtype) for o in out]
    return out


def per_example_gradients(model, x, y, loss=None, batch_size=None, training=False, sample_weight=None):
    """Gradient of each example's loss (no regularisers), vectorised.

    An example's loss is its own mean over its positions (a sequence's
    tokens, weighted by `sample_weight` and the model's mask where given;
    an example without a counted token has a zero gradient), so for
    unweighted data the mean of the per-example gradients is the gradient of
    the mean loss. Meaningless with BatchNorm in training mode, hence the
    default ``training=False``.

    Args:
        model: a built ``keras.Model`` (several outputs take a loss each).
        x: inputs: a NumPy array or backend tensor (or a list or dict of them for
            several inputs).
        y: targets of the same length.
        loss: loss to use instead of the compiled one. Defaults to `None`.
        batch_size: examples per streamed batch. Defaults to `None` (256).
        training: run layers in training mode. Defaults to `False`.
        sample_weight: ``(N,)`` or per-token weights (see
            :func:`loss_and_gradient`). Defaults to `None`.

    Returns:
        A list matching the trainable variables, each tensor with a leading
        axis of size N (the number of examples).

    Raises:
        ValueError: if the model is not built or has no loss, or the data is
            invalid (not arrays, lengths differ, non-finite inputs, labels
            that are not class ids of the model).

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, kernel_initializer="zeros")])
    >>> model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> grads = kg.curvature.per_example_gradients(model, x, y)
    >>> [tuple(g.shape) for g in grads]
    [(8, 4, 3), (8, 3)]
    >>> _, mean_grads = kg.curvature.loss_and_gradient(model, x, y)
    >>> np.allclose(np.mean(keras.ops.convert_to_numpy(grads[0]), axis=0),
    ...             keras.ops.convert_to_numpy(mean_grads[0]), atol=1e-6)
    True
    """
    fns = model_functions(model, loss, training)
    check_data(x, y, sample_weight=sample_weight)
    check_labels(fns, x, y)
    weights = token_weights.resolve(fns, x, y, sample_weight, batch_size)
    capture = capture_of(fns)
    if capture.uncovered or not capture.rules:
        return _concat(fns, fns.kernel(fns.per_example_grads_body), x, y, batch_size, weights)
    # Every variable has a rule: from layer inputs and output gradients,
    # with no per-example map (works for torch convolutions too).
    def from_layers(params, nt, xb, yb, swb=None):
        out = capture.per_example_gradients(params, nt, xb, yb, swb)
        return [out[i] for i in range(len(fns.variables))]

    return _concat(fns, from_layers, x, y, batch_size, weights)


def sampled_label_gradients(model, x, num_samples=1, seed=0, batch_size=None, training=False):
    """Per-example gradients of -log p(ŷ|x) with ŷ drawn from the model.

    The labels are those of ``GGN(kind="mc", seed=seed)`` (see
    :func:`sample_labels`), the same on every backend.

    Args:
        model: a built ``keras.Model`` (several outputs take a loss each).
        x: inputs: a NumPy array or backend tensor (or a list or dict of them for
            several inputs).
        num_samples: labels drawn per example. Defaults to `1`.
        seed: seeds the draw. Defaults to `0`.
        batch_size: examples per streamed batch. Defaults to `None` (256).
        training: run layers in training mode. Defaults to `False`.

    Returns:
        A tuple ``(grads, labels)``: a list like the trainable variables,
        each tensor with a leading axis of size ``N * num_samples``
        (sample-major), and the drawn labels (int32 NumPy).

    Raises:
        ValueError: if the loss is not a categorical cross-entropy,
            `num_samples` is below 1, or `x` is invalid.

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, kernel_initializer="zeros")])
    >>> model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> grads, labels = kg.curvature.sampled_label_gradients(model, x, num_samples=2)
    >>> [tuple(g.shape) for g in grads], labels.shape
    ([(16, 4, 3), (16, 3)], (16,))
    """
    fns = model_functions(model, None, training)
    require_classifier(fns.spec, "sampled_label_gradients")
    check_data(x, None, labels_needed=False)
    probs = predict_probs(model, x, batch_size=batch_size, training=training)
    labels = sample_labels(probs, num_samples, seed)
    xs = _tile(x, num_samples)
    grads = _concat(fns, fns.kernel(fns.per_example_nll_grads_body), xs, labels, batch_size)
    return grads, labels


def predict_probs(model, x, batch_size=None, training=False, loss=None):
    """Softmax probabilities of the predictive distribution, as NumPy.

    Args:
        model: a built ``keras.Model`` (several outputs take a loss each).
        x: inputs: a NumPy array or backend tensor (or a list or dict of them for
            several inputs).
        batch_size: examples per batch. Defaults to `None` (256).
        training: run layers in training mode. Defaults to `False`.
        loss: loss to use instead of the compiled one. Defaults to `None`.

    Returns:
        A float64 NumPy array of shape ``(N, num_classes)``.

    Raises:
        ValueError: if the loss is not a categorical cross-entropy (on
            logits or softmax outputs).

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, kernel_initializer="zeros")])
    >>> model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> probs = kg.curvature.predict_probs(model, x)
    >>> probs.shape, probs.dtype, np.round(probs[0], 3).tolist()
    ((8, 3), dtype('float64'), [0.333, 0.333, 0.333])
    """
    import numpy as np

    fns = model_functions(model, loss, training)
    require_classifier(fns.spec, "predict_probs")
    kernel = fns.kernel(fns.probs_body)
    out = [ops.convert_to_numpy(kernel(fns.params(), fns.non_trainable(), xb)) for xb, _, _ in batches(x, None, batch_size)]
    return np.concatenate(out, axis=0).astype("float64")


def sample_labels(probs, num_samples, seed, offset=0):
    """`num_samples` labels per row of `probs` (sample-major, int32 NumPy).

    Label s of example n is the inverse CDF of ``probes.uniform(seed, n +
    offset, s)``: a counter-based draw, identical on every backend and to
    the labels of ``GGN(kind="mc")`` for the same seed.

    Args:
        probs: ``(N, num_classes)`` probabilities, rows summing to one.
        num_samples: labels per row.
        seed: seeds the draw.
        offset: index of the first row in the whole data (so streamed
            batches draw as one pass would). Defaults to `0`.

    Returns:
        An int32 NumPy array of ``N * num_samples`` labels, all of row 0..N-1
        for the first sample, then the second, and so on.

    Raises:
        ValueError: if `num_samples` is below 1.

    Example:

    >>> probs = np.array([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    >>> kg.curvature.sample_labels(probs, num_samples=2, seed=0).tolist()
    [0, 2, 0, 2]
    """
    import numpy as np

    num_samples = check_int("num_samples", num_samples)
    probs = np.asarray(probs, dtype="float64")
    rows = np.arange(offset, offset + probs.shape[0])
    u = np.asarray(ops.convert_to_numpy(probes.uniform(seed, rows, np.arange(int(num_samples)), "float32")), dtype="float64")
    cdf = np.cumsum(probs, axis=-1)
    labels = (u[:, :, None] > cdf[:, None, :]).sum(-1)
    return np.minimum(labels, probs.shape[-1] - 1).T.reshape(-1).astype("int32")


def jvp(model, x, vectors, training=False):
    """Model outputs and their directional derivative J v.

    ``J`` is the Jacobian of the model's outputs (for all examples) with
    respect to its trainable variables; no loss is involved.

    Args:
        model: a built ``keras.Model`` (several outputs take a loss each).
        x: inputs: a NumPy array or backend tensor (or a list or dict of them for
            several inputs).
        vectors: a list with one array per trainable variable, shaped like
            it.
        training: run layers in training mode. Defaults to `False`.

    Returns:
        A tuple ``(outputs, jv)`` of two tensors shaped like the model's
        output.

    Raises:
        ValueError: if the model is not built, is not single-output, or
            `vectors` does not match the trainable variables.

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, kernel_initializer="zeros")])
    >>> model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> v = [np.ones(w.shape, "float32") for w in model.trainable_weights]
    >>> outputs, jv = kg.curvature.jvp(model, x, v)
    >>> tuple(outputs.shape), tuple(jv.shape)
    ((8, 3), (8, 3))
    """
    fns = _output_functions(model, training)
    vectors = fns.check_vectors(vectors)
    return backend.jvp(lambda p, xx: fns.outputs(p, fns.non_trainable(), xx)[0], fns.params(), vectors, x)


def vjp(model, x, cotangent, training=False):
    """J^T u for the model outputs' Jacobian J and output-shaped `u`.

    Args:
        model: a built ``keras.Model`` (several outputs take a loss each).
        x: inputs: a NumPy array or backend tensor (or a list or dict of them for
            several inputs).
        cotangent: ``u``, an array shaped like the model's output on `x`.
        training: run layers in training mode. Defaults to `False`.

    Returns:
        A list of tensors shaped like the trainable variables.

    Raises:
        ValueError: if the model is not built or is not single-output.

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, kernel_initializer="zeros")])
    >>> model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> jtu = kg.curvature.vjp(model, x, np.ones((8, 3), "float32"))
    >>> [tuple(t.shape) for t in jtu]
    [(4, 3), (3,)]
    """
    fns = _output_functions(model, training)
    return backend.vjp(lambda p, xx: fns.outputs(p, fns.non_trainable(), xx)[0], fns.params(), ops.convert_to_tensor(cotangent), x)


def _output_functions(model, training):
    # Output-only functions need no loss; give the resolver a placeholder.
    return model_functions(model, getattr(model, "loss", None) or "mse", training)


def _dtype(fns):
    import keras

    return keras.backend.standardize_dtype(fns.variables[0].dtype)


def _normalised_weights(fns, x, y, sample_weight, batch_size):
    """Per-token weights summing to one (None: every token counts once)."""
    return token_weights.normalise(fns, token_weights.resolve(fns, x, y, sample_weight, batch_size))


def _tile(x, k):
    import numpy as np

    if k == 1:
        return x
    import keras

    return keras.tree.map_structure(lambda a: np.concatenate([np.asarray(ops.convert_to_numpy(a))] * k, axis=0), x)


def _concat(fns, kernel, x, y, batch_size, weights=None):
    """``kernel``'s per-example rows over all batches, concatenated."""
    parts = None
    slices = token_weights.batch_slices(weights, num_examples(x), batch_size, _dtype(fns))
    for (xb, yb, _), swb in zip(batches(x, y, batch_size), slices):
        args = () if swb is None else (swb,)
        out = kernel(fns.params(), fns.non_trainable(), xb, keras.tree.map_structure(ops.convert_to_tensor, yb), *args)
        parts = [[o] for o in out] if parts is None else [p + [o] for p, o in zip(parts, out)]
    return [ops.concatenate(p, axis=0) if len(p) > 1 else p[0] for p in parts]
