"""Pure functions of a Keras model's weights, shared by every curvature routine.

``ModelFunctions`` turns a built model into functions of an explicit list of
trainable values (substituted through ``Layer.stateless_call``, so nothing is
assigned and the same code runs under jit on every backend). The per-batch
kernels (loss and gradient, HVP, GGN-vector product, per-example gradients)
are compiled once per model and loss and reused across probes and batches.
"""

import weakref

import keras
import numpy as np
from keras import ops

from keras_geosam._checks import check_rematerialisation
from keras_geosam._checks import warn_at_caller
from keras_geosam.curvature.kernels import KernelCache
from keras_geosam import backend
from keras_geosam import keras_internals
from keras_geosam.curvature import probes as _probes
from keras_geosam.curvature import likelihoods as _likelihoods
from keras_geosam.curvature.layers import is_convolutional
from keras_geosam.curvature.layers import takes_training
from keras_geosam.curvature.losses import JointSpec
from keras_geosam.curvature.losses import require_classifier
from keras_geosam.curvature.losses import require_likelihood
from keras_geosam.curvature.losses import resolve_loss
from keras_geosam.curvature.data import input_arrays
from keras_geosam.curvature.data import num_examples
from keras_geosam.curvature.tokens import check_inputs_fit
from keras_geosam.curvature import weights as token_weights
from keras_geosam.curvature.weights import check_label_shape
from keras_geosam.curvature.weights import output_mask
from keras_geosam.curvature.weights import output_shape

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
        check_rematerialisation(model, "curvature products")
        self.model = model
        self.spec = resolve_loss(model, loss)
        self.training = bool(training)
        self.include_regularization = include_regularization
        self.variables = list(model.trainable_variables)
        self.paths = [v.path for v in self.variables]
        self._kernels = KernelCache()
        # Probes per compiled product, and whether they are unrolled there
        # (``backend.unrolled_probe_block``: vmapped convolutions are slow).
        self.unroll_probes = bool(backend.unrolled_probe_block) and is_convolutional(model)
        self.probe_block = backend.unrolled_probe_block if self.unroll_probes else backend.max_probe_block

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
        kwargs = {"training": self.training} if takes_training(self.model) else {}
        out = self.model.stateless_call(params, nt, x, return_losses=True, **kwargs)
        y_pred, _, losses = out
        if isinstance(self.spec, JointSpec):
            # Several outputs, or one weighted by loss_weights: one flat
            # vector per example (losses.JointSpec).
            y_pred = self.spec.flatten_outputs(y_pred)
        elif isinstance(y_pred, (list, tuple, dict)):
            raise ValueError(
                f"The model has {len(keras.tree.flatten(y_pred))} outputs and one loss ({self.spec.name}): "
                "compile it with a loss per output (a list, or a dict by output name)."
            )
        return y_pred, losses

    def loss(self, params, nt, x, y, sw=None):
        """Mean loss over the batch, plus regularisation losses.

        `sw`: None (every loss term counts once: the mean over examples and
        positions), or per-token weights shaped like the per-token losses
        that sum to one over *all* the data (``weights.py``), so the result
        is this batch's share of the whole weighted mean: ``sum sw * l +
        sum(sw) * regularisers``.
        """
        y_pred, losses = self.outputs(params, nt, x)
        # Weights per output's loss terms meet each term (weights.py).
        values = self.spec.per_term(y, y_pred) if self.per_term(sw) else self.spec.per_example(y, y_pred)
        value = mean(values) if sw is None else ops.sum(values * ops.cast(sw, values.dtype))
        return value + self._regularisation(losses, value.dtype, sw)

    def per_term(self, sw):
        """Whether the batch weights `sw` are per output's loss terms
        (``weights.py``): ``(N, T)`` on outputs laid side by side."""
        return token_weights.is_per_term(self, sw)

    def example_share(self, sw, dtype):
        """Each example's share of the data (``(N,)``, or `sw` itself when
        it is per example or per token)."""
        sw = ops.cast(sw, dtype)
        return self.spec.example_share(sw) if self.per_term(sw) else sw

    def _regularisation(self, losses, dtype, sw):
        """The regularisers' share of a batch: their sum, times ``sum(sw)``
        when `sw` splits the whole data's weight (0 when excluded)."""
        if not (self.include_regularization and losses):
            return ops.cast(0.0, dtype)
        reg = ops.sum(ops.stack([ops.cast(l, dtype) for l in losses]))
        return reg if sw is None else reg * ops.sum(self.example_share(sw, dtype))

    def log_probs(self, params, nt, x):
        require_classifier(self.spec, "This quantity")
        return self.spec.log_probs(self.outputs(params, nt, x)[0])

    def nll(self, params, nt, x, labels):
        """Mean negative log-likelihood of integer `labels` (no regularisers)."""
        logp = self.log_probs(params, nt, x)
        picked = ops.take_along_axis(logp, ops.expand_dims(ops.cast(labels, "int32"), -1), axis=-1)
        return -mean(picked)

    def logits(self, params, nt, x):
        """The outputs the Gauss-Newton matrix linearises: logits of a
        cross-entropy, a squared error's outputs (``LossSpec.logits``)."""
        require_likelihood(self.spec, "This quantity")
        return self.spec.logits(self.outputs(params, nt, x)[0])

    def output_gradient(self, z, y):
        """Per-token gradients of the data loss with respect to the logits
        `z` (stop-gradient): ``r_nt = dl_nt / dz_nt``, unweighted."""
        spec = self.spec

        def total(zs):
            return ops.sum(spec.per_example(y, spec.outputs_from_logits(zs[0])))

        _, (r,) = backend.value_and_grad(total, [ops.stop_gradient(z)])
        return ops.stop_gradient(r)

    def token_scale(self, z, sw=None):
        """``s_nt`` with ``s_nt^2`` each token's share of the loss up to the
        final division (``(N,) + positions``): ``1/T`` per token of an
        example without weights (the result is then divided by N), the
        normalised weight ``sw`` with them (nothing divided later). Weights
        per output's terms give a scale per output coordinate instead,
        shaped like `z`."""
        shape = tuple(int(d) for d in z.shape[:-1])
        if self.per_term(sw):
            return ops.sqrt(self.spec.coordinates(ops.cast(sw, z.dtype)))
        if sw is not None:
            return ops.sqrt(ops.cast(sw, z.dtype))
        t = int(np.prod(shape[1:], dtype=np.int64))
        return ops.full(shape, float(t) ** -0.5, dtype=z.dtype)

    def num_factor_columns(self, kind, shape, num_samples=1):
        """How many output factors ``output_factors`` returns for logits of
        `shape`: ``T*C`` for ``"exact"`` (one per position and class),
        `num_samples` for ``"mc"``, 1 for ``"empirical"``."""
        positions = int(np.prod(shape[1:-1], dtype=np.int64))
        return {"exact": positions * int(shape[-1]), "mc": int(num_samples), "empirical": 1}[kind]

    def output_factors(self, kind, z, y=None, key=None, offset=None, num_samples=1, sw=None, columns=None):
        """Square-root factors of the output-space curvature: ``(k, N, ...,
        C)`` tensors ``c`` shaped like `z` with a leading axis k, ``sum_j
        c_jn c_jn^T`` equal to each example's Hessian of its loss in the
        outputs (kind ``"exact"``) or an estimate of it:

        - ``"exact"``: the likelihood's ``Q`` (the GGN = exact Fisher;
          ``likelihoods.py``), k = C: ``c_jn = sqrt(p_nj) (e_j - p_n)`` for
          ``diag p - p p^T`` (softmax cross-entropy), ``sqrt(2/C) e_j`` for
          the mean squared error, ``sqrt(p_j (1 - p_j) / C) e_j`` for a
          binary cross-entropy;
        - ``"mc"``: ``1/S sum_s c_s c_s^T`` for S targets drawn from the
          model on the device (``e_s - p_n`` for a label s drawn from
          ``p_n``; Gaussian and Bernoulli targets per output; a hash of
          `key`, example ``offset + n`` and draw s, so every backend draws
          the same);
        - ``"empirical"``: ``r_n r_n^T``, r the data loss's gradient.

        Outputs with positions (``(N, T, C)`` logits of a sequence model):
        each token is a loss term (``weights.py``), so the Hessian is
        block-diagonal over positions, each block scaled by the token's share
        ``s_nt^2`` (``token_scale``: 1/T, or the normalised weight `sw`).
        ``"exact"`` then has k = T*C columns, each non-zero at one position;
        ``"mc"`` draws a label at every position (cross-position terms vanish
        in expectation); ``"empirical"`` has one column per example, the
        gradient of that sequence's own (weighted) mean loss.

        `columns`: ``(start, count)`` builds only those factors (the exact
        kind's T*C columns are made chunk by chunk, never all at once);
        `start` may be a scalar tensor (a compiled loop's counter), `count`
        is a Python int.

        The per-example gradient of direction ``c_jn`` is ``J_n^T c_jn``.
        """
        z = ops.stop_gradient(z)
        shape = tuple(int(d) for d in z.shape)
        n, num_classes = shape[0], shape[-1]
        positions = int(np.prod(shape[1:-1], dtype=np.int64))
        k = self.num_factor_columns(kind, shape, num_samples)
        start, count = (0, k) if columns is None else (columns[0], int(columns[1]))
        dynamic = not isinstance(start, (int, np.integer))
        s = self.token_scale(z, sw)
        if kind == "empirical":
            if y is None:
                raise ValueError('Fisher kind "empirical" needs the data labels `y`.')
            r = self.output_gradient(z, y)
            if sw is None:
                out = r if positions == 1 else r / float(positions)
            elif self.per_term(sw):
                # c_n = (w_n * r_n) / sqrt(W_n): each output's terms weighted,
                # W_n the example's share (weights.py); sqrt(w_n) r_n when
                # every output has the same weights.
                inv = _inverse_sqrt_or_zero(self.example_share(sw, z.dtype))
                out = r * self.spec.coordinates(ops.cast(sw, z.dtype)) * inv[:, None]
            else:
                # c_nt = w_nt r_nt / sqrt(W_n): sum_n c c^T = sum_n W_n g_n g_n^T,
                # g_n the gradient of sequence n's weighted mean loss.
                w = ops.cast(sw, z.dtype)
                per = ops.reshape(w, (n, -1))
                inv = _inverse_sqrt_or_zero(ops.sum(per, axis=1))
                out = r * ops.expand_dims(w * ops.reshape(inv, (n,) + (1,) * (len(shape) - 2)), -1)
            return out[None]  # one column (k = 1)
        # Per output coordinate (weights per output's terms) or per token.
        coordinate = self.per_term(sw)
        s_col = s if coordinate else ops.expand_dims(s, -1)
        if kind == "exact":
            if dynamic:
                q = ops.add(ops.arange(0, count, dtype="int32"), ops.cast(start, "int32"))
                pos, cls = ops.floor_divide(q, num_classes), ops.mod(q, num_classes)
            else:
                q = np.arange(int(start), int(start) + count)
                pos, cls = q // num_classes, q % num_classes
            # Each column's token: z at its position, (k, N, C).
            zt = ops.transpose(ops.take(ops.reshape(z, (n, positions, num_classes)), _ids(pos), axis=1), (1, 0, 2))
            onehot = _rows_of_eye(cls, num_classes, z.dtype)[:, None, :]
            vals = self.spec.likelihood.exact_factors(zt, onehot)
            if coordinate:  # each column lies in one output's block of Q
                return vals * s[None]
            flat_s = ops.reshape(s, (n, positions))
            vals = vals * ops.transpose(ops.take(flat_s, _ids(pos), axis=1))[:, :, None]
            if positions == 1:
                return ops.reshape(vals, (count,) + shape)
            at = ops.one_hot(_ids(pos), positions, dtype=z.dtype)  # (k, T)
            spread = at[:, None, :, None] * vals[:, :, None, :]
            return ops.reshape(spread, (count,) + shape)
        rows = ops.add(ops.arange(0, n, dtype="int32"), ops.cast(offset, "int32"))
        if positions > 1:  # a draw per position: row (example, position)
            rows = ops.reshape(rows[:, None] * positions + ops.arange(0, positions, dtype="int32")[None], (-1,))
        # The draw and the comparison in float32 at least: 24-bit uniforms
        # overflow float16, and every backend must see the same numbers.
        udtype = "float64" if keras.backend.standardize_dtype(z.dtype) == "float64" else "float32"
        draws = ops.add(ops.arange(0, count, dtype="int32"), ops.cast(start, "int32"))
        uniform = lambda r, c: _probes.uniform_from_key(key, r, c, udtype)  # noqa: E731
        c = self.spec.likelihood.sampled_factors(ops.reshape(z, (n * positions, num_classes)), uniform, rows, draws)
        c = ops.reshape(c, (count,) + shape)
        return c * s_col[None] / ops.convert_to_tensor(float(num_samples) ** 0.5, dtype=z.dtype)

    def ggn_surrogate_of(self, params, nt, x, y, key, offset, kind="exact", num_samples=1, sw=None):
        """Batch surrogate whose Hessian is the GGN of `kind`: ``1/2 sum_n
        dz_n^T Q_n dz_n`` over ``dz = z - sg z``, divided by N (without
        `sw`), with ``Q_n = sum_j c_jn c_jn^T`` (``output_factors``); its
        value and gradient vanish at the point, its Hessian is ``1/N sum_n
        J_n^T Q_n J_n``. The exact kind is written in closed form, ``s^2
        dz^T Q dz`` per token (``Likelihood.quadratic``; ``Q = diag p - p
        p^T`` for softmax cross-entropy), at the cost of C, not C^2, per
        token."""
        z = self.logits(params, nt, x)
        dz = z - ops.stop_gradient(z)
        norm = 1.0 if sw is not None else ops.cast(ops.shape(z)[0], z.dtype)
        if kind == "exact":
            s = self.token_scale(z, sw)
            if self.per_term(sw):  # Q is block-diagonal over outputs: scale dz
                return 0.5 * ops.sum(self.spec.likelihood.quadratic(ops.stop_gradient(z), dz * s))
            quad = self.spec.likelihood.quadratic(ops.stop_gradient(z), dz)
            return 0.5 * ops.sum(ops.square(s) * quad) / norm
        c = self.output_factors(kind, z, y, key, offset, num_samples, sw)
        # A factor spans an example's positions (Monte-Carlo labels at every
        # token, an empirical gradient of the whole sequence): project each
        # example's whole output before squaring.
        proj = ops.sum(ops.reshape(c * dz[None], (int(c.shape[0]), int(c.shape[1]), -1)), axis=-1)
        return 0.5 * ops.sum(ops.square(proj)) / norm

    def residual_surrogate(self, params, nt, x, y, sw=None):
        """Batch ``sum_nt s_nt^2 sg(r_nt) . z_nt`` (divided by N without
        `sw`) plus regularisers: its Hessian is ``H - GGN``, the loss
        Hessian's second-order term ``sum_nt s_nt^2 sum_k r_ntk grad^2
        z_ntk`` (exact when the loss's Hessian in the logits is the
        likelihood's ``Q``: cross-entropy with labels that sum to one,
        binary cross-entropy with targets in [0, 1], the squared error)."""
        y_pred, losses = self.outputs(params, nt, x)
        z = self.spec.logits(y_pred)
        r = self.output_gradient(z, y)
        s2 = ops.square(self.token_scale(z, sw))
        value = ops.sum((s2 if self.per_term(sw) else ops.expand_dims(s2, -1)) * r * z)
        if sw is None:
            value = value / ops.cast(ops.shape(z)[0], z.dtype)
        return value + self._regularisation(losses, value.dtype, sw)

    # ------------------------------------------------------ kernels ----
    def kernel(self, body, **static):
        """A per-batch body (``self.<name>_body``) compiled with its static
        options, built once. (A name string, the old form, still works and
        warns.)"""
        if isinstance(body, str):
            warn_at_caller(f"ModelFunctions.kernel({body!r}) is deprecated: pass the body, "
                           f"kernel(fns.{body}_body).", DeprecationWarning)
            body = getattr(self, body + "_body")
        return self._kernels.get(body, **static)

    def hvp_batched_body(self, params, nt, vectors, x, y, sw=None):
        return backend.hvp_batched(self.loss, params, vectors, nt, x, y, sw, unroll=self.unroll_probes)

    def ggn_batched_body(self, params, nt, vectors, x, y, key, offset, kind="exact", num_samples=1, sw=None):
        return backend.hvp_batched(self.ggn_surrogate_of, params, vectors, nt, x, y, key, offset, kind, num_samples, sw,
                                   unroll=self.unroll_probes)

    def residual_batched_body(self, params, nt, vectors, x, y, sw=None):
        return backend.hvp_batched(self.residual_surrogate, params, vectors, nt, x, y, sw, unroll=self.unroll_probes)

    def loss_and_grad_body(self, params, nt, x, y, sw=None):
        return backend.value_and_grad(self.loss, params, nt, x, y, sw)

    def per_example_grads_body(self, params, nt, x, y, sw=None):
        # Each example's own (weighted) mean loss over its positions.
        def f(p, xi, yi, wi):
            y_pred, _ = self.outputs(p, nt, xi)
            if wi is None:
                return mean(self.spec.per_example(yi, y_pred))
            per_term = self.per_term(wi)
            values = self.spec.per_term(yi, y_pred) if per_term else self.spec.per_example(yi, y_pred)
            wi = ops.cast(wi, values.dtype)
            total = ops.sum(self.example_share(wi, values.dtype)) if per_term else ops.sum(wi)
            return ops.sum(values * wi) / ops.where(total > 0, total, ops.ones_like(total))

        if sw is None:
            return backend.per_example_grads(lambda p, xi, yi: f(p, xi, yi, None), params, x, y)
        return backend.per_example_grads(f, params, x, y, sw)

    def per_example_nll_grads_body(self, params, nt, x, labels):
        return backend.per_example_grads(lambda p, xi, li: self.nll(p, nt, xi, li), params, x, labels)

    def probs_body(self, params, nt, x):
        return ops.exp(self.log_probs(params, nt, x))

    def output_mask_body(self, params, nt, x):
        y_pred, _ = self.outputs(params, nt, x)
        mask = output_mask(y_pred)
        shape = ops.shape(y_pred)[:-1]
        return ops.ones(shape, dtype=y_pred.dtype) if mask is None else ops.cast(ops.reshape(mask, shape), y_pred.dtype)


def _ids(values):
    """A NumPy array of indices (or an int tensor) as an int32 tensor."""
    if isinstance(values, (np.ndarray, list, tuple, range)):
        return ops.convert_to_tensor(np.asarray(values, dtype="int32"))
    return ops.cast(values, "int32")


def _rows_of_eye(rows, size, dtype):
    """Rows `rows` (NumPy ints) of the ``size x size`` identity."""
    return ops.one_hot(_ids(rows), size, dtype=dtype)


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
    # A recompile may keep the loss object and change only its weights.
    weights = repr(keras_internals.loss_weights(model)) if loss is None else None
    key = (id(loss_obj), weights, bool(training), bool(include_regularization))
    fns = per_model.get(key)
    if fns is None or fns.loss_obj is not loss_obj or fns.var_ids != var_ids:
        fns = ModelFunctions(model, loss, training, include_regularization)
        fns.loss_obj, fns.var_ids = loss_obj, var_ids
        per_model[key] = fns
    return fns


# ------------------------------------------------------------ data ------
def _inverse_sqrt_or_zero(t):
    """``1 / sqrt(t)`` where ``t > 0``, else 0 (an example of weight zero)."""
    positive = ops.greater(t, 0)
    return ops.where(positive, 1.0 / ops.sqrt(ops.where(positive, t, ops.ones_like(t))), ops.zeros_like(t))


def check_data(x, y=None, labels_needed=True, sample_weight=None):
    """Validates curvature data; returns ``(x, y)``.

    Raises ``ValueError`` for datasets, data loaders and generators (named;
    pass arrays, and bound memory with ``batch_size``), missing labels where
    needed, x, y and `sample_weight` of different lengths, and non-finite
    inputs (which would give NaN curvature or a Fisher that looks zero).
    """
    weight_arrays = [sample_weight]
    if token_weights.per_output(sample_weight):
        # One per output (checked against the outputs by weights.resolve).
        entries = sample_weight.values() if isinstance(sample_weight, dict) else sample_weight
        weight_arrays = [w for w in entries if w is not None]
    for name, a in [("x", x), ("y", y)] + [("sample_weight", w) for w in weight_arrays]:
        if a is None:
            continue
        # x and y may be structures (several inputs; one label per output).
        items = input_arrays(a) if name in ("x", "y") else [a]
        for item in items:
            if not hasattr(item, "shape") or not hasattr(item, "dtype"):
                if name == "sample_weight" and isinstance(item, (list, tuple)):
                    continue
                raise ValueError(
                    f"{name} must be an array or tensor (or a list or dict of them for several inputs); got "
                    f"{_describe(item)}. Datasets and generators are not taken: pass arrays (for a "
                    "tf.data.Dataset, e.g. `x, y = map(np.concatenate, zip(*ds.as_numpy_iterator()))`), "
                    "and use batch_size to bound memory."
                )
    if y is None and labels_needed:
        raise ValueError("This quantity needs the labels `y`.")
    n = num_examples(x)
    for item in input_arrays(x):
        if int(ops.shape(item)[0]) != n:
            raise ValueError(f"The inputs in x differ in length ({int(ops.shape(item)[0])} vs {n}).")
    for item in [] if y is None else input_arrays(y):
        if int(ops.shape(item)[0]) != n:
            raise ValueError(f"x and y differ in length: {n} inputs, {int(ops.shape(item)[0])} labels.")
    for w in weight_arrays:
        if w is not None and len(w) != n:
            raise ValueError(f"x and sample_weight differ in length: {n} inputs, {len(w)} weights.")
    for item in input_arrays(x):
        if keras.backend.is_float_dtype(keras.backend.standardize_dtype(item.dtype)):
            finite = np.all(np.isfinite(item)) if isinstance(item, np.ndarray) else bool(ops.convert_to_numpy(ops.all(ops.isfinite(item))))
            if not finite:
                raise ValueError("x holds NaN or Inf: curvature of non-finite inputs is undefined.")
    return x, y


def _describe(item):
    """Names what a data argument is when it is not an array."""
    cls = type(item)
    where = f"{cls.__module__}.{cls.__qualname__}"
    if "tensorflow" in cls.__module__ and "data" in cls.__module__:
        return f"a tf.data.Dataset ({where})"
    if "torch.utils.data" in cls.__module__:
        return f"a torch DataLoader or Dataset ({where})"
    if isinstance(item, keras.utils.PyDataset):
        return f"a keras.utils.PyDataset ({where})"
    if hasattr(item, "__next__") or hasattr(item, "gi_frame"):
        return f"a generator or iterator ({where})"
    return where


def check_labels(fns, x, y):
    """Inputs must fit the model (``tokens.py``: named inputs present,
    token ids inside each Embedding's vocabulary) and labels its outputs
    (``weights.check_label_shape``: a sequence model's labels have its
    positions); integer labels of a sparse cross-entropy must lie in [0,
    classes) (outside it some backends return numbers: JAX gathers clamp),
    a binary cross-entropy's targets in [0, 1], a squared error's be
    finite."""
    check_inputs_fit(fns.model, x)
    check_label_shape(fns, x, y)
    if y is None:
        return
    parts = getattr(fns.spec, "parts", None)
    if parts is None:
        _check_label_values(fns.spec, y, output_shape(fns, x)[-1])
        return
    for (key, spec, _), shape, yi in zip(parts, fns.spec.output_shapes, fns.spec.labels(y)):
        _check_label_values(spec, yi, shape[-1], f" of output {key!r}")


def _check_label_values(spec, y, classes, where=""):
    if isinstance(spec.likelihood, (_likelihoods.Bernoulli, _likelihoods.Gaussian)):
        targets = np.asarray(ops.convert_to_numpy(y), dtype="float64")
        if not np.all(np.isfinite(targets)):
            raise ValueError(f"The targets y{where} of the {spec.name} hold NaN or Inf.")
        if isinstance(spec.likelihood, _likelihoods.Bernoulli) and targets.size and (targets.min() < 0 or targets.max() > 1):
            raise ValueError(
                f"Binary cross-entropy targets{where} must lie in [0, 1] (a probability per output); got values in "
                f"[{targets.min():g}, {targets.max():g}]."
            )
    if not (spec.classifier and spec.sparse):
        return
    labels = np.asarray(ops.convert_to_numpy(y))
    if labels.size == 0:
        return
    if not np.issubdtype(labels.dtype, np.integer) and not np.all(np.mod(labels, 1) == 0):
        raise ValueError(f"Sparse cross-entropy labels{where} must be integers (class ids).")
    low, high = labels.min(), labels.max()
    if low < 0 or high >= classes:
        raise ValueError(f"Labels{where} must lie in [0, {classes}) for this {classes}-class model; got values in [{low}, {high}].")


def progbar(total, verbose, name):
    if not verbose:
        return None
    return keras.utils.Progbar(total, verbose=1 if verbose is True else verbose, unit_name=name)
