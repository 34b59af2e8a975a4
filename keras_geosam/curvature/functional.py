"""Pure functions of a Keras model's weights, shared by every curvature routine.

``ModelFunctions`` turns a built model into functions of an explicit list of
trainable values (substituted through ``Layer.stateless_call``, so nothing is
assigned and the same code runs under jit on every backend). The per-batch
kernels (loss and gradient, HVP, GGN-vector product, per-example gradients)
are compiled once per model and loss and reused across probes and batches.
"""

import functools
import weakref

import keras
import numpy as np
from keras import ops

from keras_geosam import backend
from keras_geosam.curvature import probes as _probes
from keras_geosam.curvature.losses import require_classifier
from keras_geosam.curvature.losses import require_gauss_newton
from keras_geosam.curvature.losses import resolve_loss

_CACHE = weakref.WeakKeyDictionary()


def mean(values):
    """Mean of all entries. keras.ops.mean computes float64 in float32 on JAX
    and torch (Keras 3.15 result_type); a sum over the count keeps the
    input's precision."""
    return ops.sum(values) / ops.cast(ops.size(values), values.dtype)


class ModelFunctions:
    """Loss, log-probabilities and their derivatives as pure functions.

    Args:
        model: a built, single-output ``keras.Model``.
        loss: loss to use instead of the model's compiled loss.
        training: run layers in training mode (default False: BatchNorm uses
            its moving statistics and dropout is off, as curvature needs).
        include_regularization: add the model's regularisation losses to the
            loss (Fisher quantities never include them).

    Raises:
        ValueError: if the model is not built, or its loss cannot be
            resolved (see :func:`resolve_loss`).

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, kernel_initializer="zeros")])
    >>> model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> fns = kg.curvature.ModelFunctions(model)
    >>> value = fns.loss(fns.params(), fns.non_trainable(), x, y)  # a pure function of params
    >>> round(float(keras.ops.convert_to_numpy(value)), 4), fns.spec.classifier
    (1.0986, True)
    """

    def __init__(self, model, loss=None, training=False, include_regularization=True):
        if not model.built:
            raise ValueError(
                "The model is not built: call it on data (or build it) before "
                "asking for curvature."
            )
        self.model = model
        self.spec = resolve_loss(model, loss)
        self.training = bool(training)
        self.include_regularization = include_regularization
        self.variables = list(model.trainable_variables)
        self.paths = [v.path for v in self.variables]
        self._kernels = {}

    # ----------------------------------------------------------- state ----
    def params(self):
        return [v.value for v in self.variables]

    def non_trainable(self):
        return [v.value for v in self.model.non_trainable_variables]

    def check_vectors(self, vectors, what="vectors"):
        """Raises unless `vectors` is a list matching the trainable variables."""
        if not isinstance(vectors, (list, tuple)) or len(vectors) != len(self.variables):
            raise ValueError(
                f"{what} must be a list with one array per trainable variable "
                f"({len(self.variables)}); got "
                f"{type(vectors).__name__} of length "
                f"{len(vectors) if hasattr(vectors, '__len__') else '?'}."
            )
        out = []
        for v, var in zip(vectors, self.variables):
            shape = tuple(ops.shape(v))
            if shape != tuple(var.shape):
                raise ValueError(
                    f"{what}: shape {shape} does not match variable "
                    f"{var.path!r} of shape {tuple(var.shape)}."
                )
            out.append(ops.convert_to_tensor(v, dtype=var.dtype))
        return out

    # ------------------------------------------------- pure functions ----
    def outputs(self, params, nt, x):
        # stateless_call reaches call() directly: pass `training` only if
        # the model's call takes it.
        kwargs = {"training": self.training} if self.model._call_has_training_arg else {}
        out = self.model.stateless_call(params, nt, x, return_losses=True, **kwargs)
        y_pred, _, losses = out
        if isinstance(y_pred, (list, tuple, dict)):
            raise ValueError("keras_geosam curvature routines need a single-output model.")
        return y_pred, losses

    def loss(self, params, nt, x, y):
        """Mean loss over the batch, plus regularisation losses."""
        y_pred, losses = self.outputs(params, nt, x)
        value = mean(self.spec.per_example(y, y_pred))
        if self.include_regularization and losses:
            value = value + ops.sum(ops.stack([ops.cast(l, value.dtype) for l in losses]))
        return value

    def log_probs(self, params, nt, x):
        require_classifier(self.spec, "This quantity")
        return self.spec.log_probs(self.outputs(params, nt, x)[0])

    def nll(self, params, nt, x, labels):
        """Mean negative log-likelihood of integer `labels` (no regularisers)."""
        logp = self.log_probs(params, nt, x)
        picked = ops.take_along_axis(logp, ops.expand_dims(ops.cast(labels, "int32"), -1), axis=-1)
        return -mean(picked)

    def logits(self, params, nt, x):
        """Logits of the predictive distribution, or a squared error's
        outputs (see ``LossSpec.logits``)."""
        require_gauss_newton(self.spec, "This quantity")
        return self.spec.logits(self.outputs(params, nt, x)[0])

    def output_gradient(self, z, y):
        """Per-example gradients of the data loss with respect to the logits
        `z` (stop-gradient): ``r_n = dl_n / dz_n``."""
        spec = self.spec

        def total(zs):
            return ops.sum(spec.per_example(y, spec.outputs_from_logits(zs[0])))

        _, (r,) = backend.value_and_grad(total, [ops.stop_gradient(z)])
        return ops.stop_gradient(r)

    def output_factors(self, kind, z, y=None, key=None, offset=None, num_samples=1):
        """Square-root factors of the output-space curvature: ``(k, N, ...,
        C)`` tensors ``c`` shaped like `z` with a leading axis k, ``sum_j
        c_jn c_jn^T`` equal to each example's Hessian of its loss in the
        outputs (kind ``"exact"``) or an estimate of it:

        - ``"exact"``: ``diag p_n - p_n p_n^T`` (the GGN = exact Fisher of
          softmax cross-entropy), ``c_jn = sqrt(p_nj) (e_j - p_n)``, k = C;
          for the mean squared error ``2/C I``, ``c_j = sqrt(2/C) e_j``;
        - ``"mc"``: ``1/S sum_s (e_s - p_n)(e_s - p_n)^T`` for S labels drawn
          from ``p_n`` on the device (hash of `key`, example ``offset + n``
          and draw s, so every backend draws the same labels);
        - ``"empirical"``: ``r_n r_n^T``, r the data loss's gradient.

        Outputs with positions (``(N, T, C)`` logits of a sequence model):
        an example is a sequence, its loss the mean of its T per-position
        losses (as Keras averages them), so the Hessian is block-diagonal
        over positions, each block divided by T. ``"exact"`` then has k =
        T*C columns, each non-zero at one position; ``"mc"`` draws a label at
        every position (cross-position terms vanish in expectation).

        The per-example gradient of direction ``c_jn`` is ``J_n^T c_jn``.
        """
        z = ops.stop_gradient(z)
        shape = tuple(int(d) for d in z.shape)
        n, num_classes = shape[0], shape[-1]
        positions = int(np.prod(shape[1:-1], dtype=np.int64))
        if kind == "empirical":
            if y is None:
                raise ValueError('Fisher kind "empirical" needs the data labels `y`.')
            r = self.output_gradient(z, y)
            return (r if positions == 1 else r / float(positions))[None]
        if kind == "exact" and self.spec.squared_error:
            # Keras' mean_squared_error averages the last axis: Hessian 2/C I.
            eye = ops.eye(num_classes, dtype=z.dtype) * float((2.0 / num_classes) ** 0.5)
            base = ops.broadcast_to(eye[:, None, :], (num_classes, n * positions, num_classes))
            return self._per_position(ops.reshape(base, (num_classes, n, positions, num_classes)), shape)
        p = ops.exp(ops.log_softmax(z, axis=-1))
        eye = ops.eye(num_classes, dtype=z.dtype)
        if kind == "exact":
            flat = ops.reshape(p, (n * positions, num_classes))
            base = ops.sqrt(ops.transpose(flat))[:, :, None] * (eye[:, None, :] - flat[None])
            if positions == 1:
                return ops.reshape(base, (num_classes,) + shape)
            return self._per_position(ops.reshape(base, (num_classes, n, positions, num_classes)), shape)
        rows = ops.add(ops.arange(0, n, dtype="int32"), ops.cast(offset, "int32"))
        if positions > 1:  # a draw per position: row (example, position)
            rows = ops.reshape(rows[:, None] * positions + ops.arange(0, positions, dtype="int32")[None], (-1,))
        # The draw and the comparison in float32 at least: 24-bit uniforms
        # overflow float16, and every backend must see the same numbers.
        udtype = "float64" if keras.backend.standardize_dtype(z.dtype) == "float64" else "float32"
        u = _probes.uniform_from_key(key, rows, ops.arange(0, int(num_samples), dtype="int32"), udtype)
        cdf = ops.cumsum(ops.cast(ops.reshape(p, (n * positions, num_classes)), udtype), axis=-1)
        labels = ops.sum(ops.cast(ops.greater(u[:, :, None], cdf[:, None, :]), "int32"), axis=-1)
        labels = ops.minimum(labels, num_classes - 1)
        onehot = ops.reshape(ops.one_hot(ops.transpose(labels), num_classes, dtype=z.dtype), (int(num_samples),) + shape)
        return (onehot - p[None]) / ops.convert_to_tensor(float(num_samples * positions) ** 0.5, dtype=z.dtype)

    @staticmethod
    def _per_position(base, shape):
        """``(C, N, T, C)`` per-position factors (each position's Hessian
        square root) as ``(T*C, N, ...)`` columns, column ``(t, j)`` non-zero
        at position t only, scaled by ``1/sqrt(T)`` (the mean over positions)."""
        c, n, positions, _ = (int(d) for d in base.shape)
        if positions == 1:
            return ops.reshape(base, (c,) + shape)
        spread = ops.einsum("ts,jntc->tjnsc", ops.eye(positions, dtype=base.dtype), base)
        spread = spread / ops.convert_to_tensor(float(positions) ** 0.5, dtype=base.dtype)
        return ops.reshape(spread, (positions * c,) + shape)

    def ggn_surrogate_of(self, params, nt, x, y, key, offset, kind="exact", num_samples=1):
        """Batch-mean surrogate whose Hessian is the GGN of `kind`:
        ``1/(2N) sum_jn (c_jn . (z_n - sg z_n))^2``; its value and gradient
        vanish at the point, its Hessian is ``1/N sum_jn J^T c c^T J``."""
        z = self.logits(params, nt, x)
        c = self.output_factors(kind, z, y, key, offset, num_samples)
        dz = z - ops.stop_gradient(z)
        proj = ops.sum(c * dz[None], axis=-1)
        return 0.5 * ops.sum(ops.square(proj)) / ops.cast(ops.shape(z)[0], z.dtype)

    def residual_surrogate(self, params, nt, x, y):
        """Batch-mean ``1/N sum_n sg(r_n) . z_n`` plus regularisers: its
        Hessian is ``H - GGN``, the loss Hessian's second-order term
        ``1/N sum_nk r_nk grad^2 z_nk`` (exact when the loss's Hessian in the
        logits is ``diag p - p p^T``, as for cross-entropy with labels that
        sum to one)."""
        y_pred, losses = self.outputs(params, nt, x)
        z = self.spec.logits(y_pred)
        r = self.output_gradient(z, y)
        value = ops.sum(r * z) / ops.cast(ops.shape(z)[0], z.dtype)
        if self.include_regularization and losses:
            value = value + ops.sum(ops.stack([ops.cast(l, value.dtype) for l in losses]))
        return value

    # ------------------------------------------------------ kernels ----
    def kernel(self, name, **static):
        """Compiled per-batch kernel `name` (with static options), built once."""
        key = (name,) + tuple(sorted(static.items()))
        if key not in self._kernels:
            fn = getattr(self, "_k_" + name)
            self._kernels[key] = backend.compile(functools.partial(fn, **static) if static else fn)
        return self._kernels[key]

    def _k_hvp_batched(self, params, nt, vectors, x, y):
        return backend.hvp_batched(self.loss, params, vectors, nt, x, y)

    def _k_ggn_batched(self, params, nt, vectors, x, y, key, offset, kind="exact", num_samples=1):
        return backend.hvp_batched(self.ggn_surrogate_of, params, vectors, nt, x, y, key, offset, kind, num_samples)

    def _k_residual_batched(self, params, nt, vectors, x, y):
        return backend.hvp_batched(self.residual_surrogate, params, vectors, nt, x, y)

    def _k_loss_and_grad(self, params, nt, x, y):
        return backend.value_and_grad(self.loss, params, nt, x, y)

    def _k_per_example_grads(self, params, nt, x, y):
        def f(p, xi, yi):
            y_pred, _ = self.outputs(p, nt, xi)
            return mean(self.spec.per_example(yi, y_pred))

        return backend.per_example_grads(f, params, x, y)

    def _k_per_example_nll_grads(self, params, nt, x, labels):
        return backend.per_example_grads(lambda p, xi, li: self.nll(p, nt, xi, li), params, x, labels)

    def _k_probs(self, params, nt, x):
        return ops.exp(self.log_probs(params, nt, x))


def model_functions(model, loss=None, training=False, include_regularization=True):
    """Cached :class:`ModelFunctions`, so compiled kernels survive across calls.

    Args:
        model: a built, single-output ``keras.Model``.
        loss: loss to use instead of the compiled one. Defaults to `None`.
        training: run layers in training mode. Defaults to `False`.
        include_regularization: add the regularisation losses. Defaults to
            `True`.

    Returns:
        The :class:`ModelFunctions` for these arguments, built on first use
        and rebuilt when the trainable variables change.

    Raises:
        ValueError: as :class:`ModelFunctions`.

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, kernel_initializer="zeros")])
    >>> model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> fns = kg.curvature.model_functions(model)
    >>> fns is kg.curvature.model_functions(model), len(fns.params())
    (True, 2)
    """
    loss_obj = loss if loss is not None else getattr(model, "loss", None)
    var_ids = [id(v) for v in model.trainable_variables]
    per_model = _CACHE.setdefault(model, {})
    key = (id(loss_obj), bool(training), bool(include_regularization))
    fns = per_model.get(key)
    if fns is None or fns.loss_obj is not loss_obj or fns.var_ids != var_ids:
        fns = ModelFunctions(model, loss, training, include_regularization)
        fns.loss_obj, fns.var_ids = loss_obj, var_ids
        per_model[key] = fns
    return fns


# ------------------------------------------------------------ data ------
def check_data(x, y=None, labels_needed=True):
    """Validates curvature data; returns ``(x, y)``.

    Raises ``ValueError`` for datasets/generators (pass arrays; memory is
    bounded by ``batch_size``), missing labels where needed, x and y of
    different lengths, and non-finite inputs (which would give NaN curvature
    or a Fisher that looks zero).
    """
    for name, a in (("x", x), ("y", y)):
        if a is None:
            continue
        items = a if isinstance(a, (list, tuple)) else [a]
        for item in items:
            if not hasattr(item, "shape") or not hasattr(item, "dtype"):
                raise ValueError(
                    f"{name} must be an array or tensor (or a list of them for several inputs); got "
                    f"{type(item).__name__}. Datasets and generators are not taken: pass arrays, "
                    "and use batch_size to bound memory."
                )
    if y is None and labels_needed:
        raise ValueError("This quantity needs the labels `y`.")
    n = num_examples(x)
    if isinstance(x, (list, tuple)):
        for item in x:
            if int(ops.shape(item)[0]) != n:
                raise ValueError(f"The inputs in x differ in length ({int(ops.shape(item)[0])} vs {n}).")
    if y is not None and int(ops.shape(y)[0]) != n:
        raise ValueError(f"x and y differ in length: {n} inputs, {int(ops.shape(y)[0])} labels.")
    for item in x if isinstance(x, (list, tuple)) else [x]:
        if keras.backend.is_float_dtype(keras.backend.standardize_dtype(item.dtype)):
            finite = np.all(np.isfinite(item)) if isinstance(item, np.ndarray) else bool(ops.convert_to_numpy(ops.all(ops.isfinite(item))))
            if not finite:
                raise ValueError("x holds NaN or Inf: curvature of non-finite inputs is undefined.")
    return x, y


def check_labels(fns, x, y):
    """Integer labels of a sparse cross-entropy must lie in [0, classes):
    outside it some backends return numbers (JAX gathers clamp)."""
    if y is None or not (fns.spec.classifier and fns.spec.sparse):
        return
    labels = np.asarray(ops.convert_to_numpy(y))
    if labels.size == 0:
        return
    if not np.issubdtype(labels.dtype, np.integer) and not np.all(np.mod(labels, 1) == 0):
        raise ValueError("Sparse cross-entropy labels must be integers (class ids).")
    shape = getattr(fns.model, "output_shape", None)
    classes = shape[-1] if isinstance(shape, tuple) and shape and shape[-1] else None
    if classes is None:
        first = x[:1] if not isinstance(x, (list, tuple)) else type(x)(e[:1] for e in x)
        classes = int(ops.shape(fns.outputs(fns.params(), fns.non_trainable(), first)[0])[-1])
    low, high = labels.min(), labels.max()
    if low < 0 or high >= classes:
        raise ValueError(f"Labels must lie in [0, {classes}) for this {classes}-class model; got values in [{low}, {high}].")


def num_examples(x):
    first = x[0] if isinstance(x, (list, tuple)) else x
    return int(ops.shape(first)[0])


def batches(x, y=None, batch_size=None):
    """Yields `(x_b, y_b, n_b)` slices of at most `batch_size` examples."""
    n = num_examples(x)
    if n == 0:
        raise ValueError("Empty data: at least one example is needed.")
    if batch_size is None:
        batch_size = n
    batch_size = int(batch_size)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    for start in range(0, n, batch_size):
        stop = min(start + batch_size, n)
        xb = _slice(x, start, stop)
        yb = None if y is None else _slice(y, start, stop)
        yield xb, yb, stop - start


def _slice(a, start, stop):
    if isinstance(a, (list, tuple)):
        return type(a)(_slice(e, start, stop) for e in a)
    # Split over the devices of an active distribution (JAX): every
    # compiled kernel then runs data-parallel.
    return backend.distribute_batch(a[start:stop])


def to_numpy_list(tensors):
    return [np.asarray(ops.convert_to_numpy(t)) for t in tensors]


def progbar(total, verbose, name):
    if not verbose:
        return None
    return keras.utils.Progbar(total, verbose=1 if verbose is True else verbose, unit_name=name)
