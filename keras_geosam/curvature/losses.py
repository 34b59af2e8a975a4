"""Which loss a curvature routine differentiates, and its likelihood.

Fisher and Gauss-Newton quantities need a loss that is a negative
log-likelihood (``likelihoods.py``): a categorical cross-entropy, the mean
squared error (Gaussian) or a binary cross-entropy (Bernoulli), on logits or
on probabilities. Anything else (MAE, Huber, hinge, custom losses) gets a
``ValueError`` naming the loss and the families supported, never a number.
"""

import dataclasses

import keras
import numpy as np
from keras import ops

from keras_geosam import keras_internals
from keras_geosam.curvature import likelihoods

_CLASSIFIER_FNS = {
    "sparse_categorical_crossentropy": True,
    "categorical_crossentropy": False,
}
_LIKELIHOODS = {
    "sparse_categorical_crossentropy": likelihoods.Categorical,
    "categorical_crossentropy": likelihoods.Categorical,
    "mean_squared_error": likelihoods.Gaussian,
    "binary_crossentropy": likelihoods.Bernoulli,
}


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """A resolved loss: per-example values plus what it means for a classifier.

    Attributes:
        name: readable name of the loss.
        per_example: ``fn(y_true, y_pred) -> (batch,)`` per-example losses.
        classifier: True for a categorical cross-entropy.
        from_logits: whether ``y_pred`` holds logits (else probabilities).
        sparse: whether labels are integer class ids (else one-hot/soft).

    Example:

    >>> spec = kg.curvature.resolve_loss(None, keras.losses.CategoricalCrossentropy())
    >>> spec.name, spec.classifier, spec.from_logits, spec.sparse
    ('categorical_crossentropy', True, False, False)
    >>> log_p = spec.log_probs(np.array([[0.5, 0.25, 0.25]], "float32"))
    >>> np.round(np.exp(keras.ops.convert_to_numpy(log_p)), 3).tolist()
    [[0.5, 0.25, 0.25]]
    >>> kg.curvature.LossSpec("mse", keras.losses.mean_squared_error).classifier
    False
    >>> kg.curvature.resolve_loss(None, "binary_crossentropy").likelihood
    Bernoulli(from_logits=False)
    """

    name: str
    per_example: object
    classifier: bool = False
    from_logits: bool = False
    sparse: bool = False
    squared_error: bool = False
    likelihood: object = None

    def __post_init__(self):
        if self.likelihood is None and self.squared_error:
            object.__setattr__(self, "likelihood", likelihoods.Gaussian())
        if self.likelihood is None and self.classifier:
            object.__setattr__(self, "likelihood", likelihoods.Categorical(self.from_logits))

    def logits(self, y_pred):
        """The outputs the Gauss-Newton matrix linearises
        (``Likelihood.natural``): logits for a cross-entropy (the outputs
        themselves, or the log of softmax / logit of sigmoid outputs, clipped
        as Keras' own losses clip), the outputs for the squared error."""
        return y_pred if self.likelihood is None else self.likelihood.natural(y_pred)

    def outputs_from_logits(self, z):
        """Inverse of :meth:`logits` (up to the clip): what the loss takes."""
        return z if self.likelihood is None else self.likelihood.outputs(z)

    def log_probs(self, y_pred):
        """Log-probabilities of the model's predictive distribution."""
        return ops.log_softmax(self.logits(y_pred), axis=-1)


class JointSpec:
    """The loss of a model with several outputs: Keras' weighted sum.

    ``L = sum_i w_i L_i`` over the outputs (``loss_weights``, 1 by
    default), each ``L_i`` the mean of output i's loss terms (its own
    :class:`LossSpec`). Curvature routines see one output: each example's
    outputs flattened and laid side by side (``flatten_outputs``), with a
    :class:`~keras_geosam.curvature.likelihoods.Joint` likelihood; labels
    stay a list or dict like the outputs. Outputs with a Keras mask are
    refused. One ``(N,)`` sample weight weighs every output's terms of an
    example, as in Keras; sample weights per output (a list or dict) make
    each ``L_i`` its own weighted mean (``weights.py``).

    Attributes:
        parts: ``[(key, LossSpec, weight)]`` in the flattened order of the
            model's outputs (``keras.tree.flatten``: list order, or sorted
            names of a dict); `key` is the index or the name.
    """

    classifier = False
    from_logits = False
    sparse = False
    squared_error = False

    def __init__(self, parts):
        self.parts = list(parts)
        self.name = "weighted sum of " + ", ".join(f"{w:g} x {spec.name} ({k})" for k, spec, w in self.parts)
        self.output_shapes = None
        missing = [f"{spec.name} ({k})" for k, spec, _ in self.parts if spec.likelihood is None]
        self.likelihood = None if missing else likelihoods.Joint(self.segments)
        if missing:
            self.name += f"; no likelihood for {', '.join(missing)}"

    # Layout -----------------------------------------------------------
    def flatten_outputs(self, y_pred):
        """``(N, D)``: each example's outputs reshaped and concatenated, in
        the order of ``parts``; records their shapes (the layout)."""
        leaves = keras.tree.flatten(y_pred)
        if len(leaves) != len(self.parts):
            raise ValueError(f"The model has {len(leaves)} outputs and the loss {len(self.parts)} parts.")
        if any(keras_internals.keras_mask(leaf) is not None for leaf in leaves):
            raise ValueError(
                "keras_geosam curvature routines do not take Keras masks on a model with several outputs "
                "or with loss_weights; pass the padding as sample_weight of a single-output model compiled "
                "without loss_weights, or drop mask_zero."
            )
        self.output_shapes = [tuple(int(d) for d in leaf.shape[1:]) for leaf in leaves]
        n = ops.shape(leaves[0])[0]
        return ops.concatenate([ops.reshape(leaf, (n, -1)) for leaf in leaves], axis=-1)

    def split(self, flat):
        """The outputs back from ``(N, D)``, one tensor per part."""
        if self.output_shapes is None:
            raise ValueError("The model has not been run yet: its outputs' shapes are unknown.")
        out, offset = [], 0
        n = ops.shape(flat)[0]
        for shape in self.output_shapes:
            size = int(np.prod(shape, dtype=np.int64))
            out.append(ops.reshape(flat[:, offset:offset + size], (n,) + shape))
            offset += size
        return out

    def segments(self):
        """``[(offset, positions, classes, likelihood, scale)]`` per part:
        scale ``w_i / positions``, the weight of each of its loss terms."""
        out, offset = [], 0
        for (_, spec, weight), shape in zip(self.parts, self.output_shapes):
            positions, classes = int(np.prod(shape[:-1], dtype=np.int64)), int(shape[-1])
            out.append((offset, positions, classes, spec.likelihood, weight / positions))
            offset += positions * classes
        return out

    def labels(self, y):
        """`y` as one label per part (a list or tuple in order, or a dict by
        output name)."""
        if isinstance(y, dict):
            missing = [k for k, _, _ in self.parts if k not in y]
            if missing:
                raise ValueError(f"y is a dict without labels for the output(s) {missing}.")
            return [y[k] for k, _, _ in self.parts]
        if isinstance(y, (list, tuple)) and len(y) == len(self.parts):
            return list(y)
        if len(self.parts) == 1 and hasattr(y, "shape"):
            return [y]  # one output weighted by loss_weights
        raise ValueError(
            f"A model with {len(self.parts)} outputs needs its labels as a list of {len(self.parts)} arrays "
            f"or a dict by output name ({[k for k, _, _ in self.parts]}); got {type(y).__name__}."
        )

    # The LossSpec interface, on flattened outputs ---------------------
    def per_example(self, y, flat):
        """``(N,)``: ``sum_i w_i`` times the mean of example n's terms of
        output i."""
        total = None
        for (_, spec, weight), yi, pred in zip(self.parts, self.labels(y), self.split(flat)):
            values = spec.per_example(yi, pred)
            values = ops.reshape(values, (ops.shape(values)[0], -1))
            term = ops.sum(values, axis=1) * (weight / int(values.shape[1]))
            total = term if total is None else total + term
        return total

    # Per-output sample weights: one weight per loss term -------------
    def term_counts(self):
        """Loss terms per example of each part (its positions, 1 for an
        output without positions), in the order of ``parts``."""
        return [positions for _, positions, _, _, _ in self.segments()]

    def per_term(self, y, flat):
        """``(N, T)``, T the terms of all parts side by side: each loss term
        times its part's ``w_i / T_i``, so a row sums to ``per_example``."""
        columns = []
        for (_, spec, weight), yi, pred in zip(self.parts, self.labels(y), self.split(flat)):
            values = spec.per_example(yi, pred)
            values = ops.reshape(values, (ops.shape(values)[0], -1))
            columns.append(values * (weight / int(values.shape[1])))
        return ops.concatenate(columns, axis=1)

    def coordinates(self, term_values):
        """``(N, D)`` from ``(N, T)``: each term's value over its output
        coordinates (the classes at its position)."""
        out, start = [], 0
        n = ops.shape(term_values)[0]
        for _, positions, classes, _, _ in self.segments():
            part = term_values[:, start:start + positions]
            out.append(ops.reshape(ops.broadcast_to(part[:, :, None], (n, positions, classes)), (n, positions * classes)))
            start += positions
        return ops.concatenate(out, axis=1)

    def example_share(self, term_weights):
        """``(N,)``: an example's share of the data, the mean over outputs of
        its terms' mean weight (weights normalised per output as
        ``weights.resolve`` gives them: every output's shares sum to one, and
        so do these)."""
        total, start = None, 0
        counts = self.term_counts()
        for positions in counts:
            part = ops.sum(term_weights[:, start:start + positions], axis=1) / float(positions)
            total = part if total is None else total + part
            start += positions
        return total / float(len(counts))

    def logits(self, flat):
        parts = [spec.logits(p) for (_, spec, _), p in zip(self.parts, self.split(flat))]
        n = ops.shape(flat)[0]
        return ops.concatenate([ops.reshape(p, (n, -1)) for p in parts], axis=-1)

    def outputs_from_logits(self, z):
        parts = [spec.outputs_from_logits(p) for (_, spec, _), p in zip(self.parts, self.split(z))]
        n = ops.shape(z)[0]
        return ops.concatenate([ops.reshape(p, (n, -1)) for p in parts], axis=-1)


def _joint(model, loss):
    """A :class:`JointSpec` for `loss`, a list or dict with one loss per
    output of `model`, weighted by the compiled ``loss_weights``."""
    names = list(getattr(model, "output_names", None) or [])
    weights = keras_internals.loss_weights(model) if loss is getattr(model, "loss", None) else None
    if isinstance(loss, dict):
        keys = sorted(loss)  # keras.tree.flatten's order of a dict of outputs
        if names and set(keys) != set(names):
            raise ValueError(f"The loss names the outputs {keys}; the model's are {names}.")
    else:
        keys = list(range(len(loss)))
    parts = []
    for k in keys:
        w = 1.0
        if isinstance(weights, dict):
            w = weights.get(k, 1.0)
        elif isinstance(weights, (list, tuple)):
            w = weights[k] if isinstance(k, int) else weights[names.index(k)]
        elif weights is not None:
            w = weights
        part = loss[k]
        if part is None:
            raise ValueError(f"Output {k!r} has no loss: curvature needs one loss per output.")
        parts.append((names[k] if isinstance(k, int) and k < len(names) else k, resolve_loss(None, part), float(w)))
    return JointSpec(parts)


def _weighted(model, loss, spec):
    """`spec`, or a one-part :class:`JointSpec` when the model's one loss
    is compiled with ``loss_weights`` other than 1 (Keras scales the loss,
    so its gradient, Hessian and Fisher, by the weight)."""
    if model is None or loss is not getattr(model, "loss", None):
        return spec
    weights = keras_internals.loss_weights(model)
    if isinstance(weights, dict):
        weights = list(weights.values())
    if isinstance(weights, (list, tuple)):
        weights = weights[0] if len(weights) == 1 else None
    if weights is None or float(weights) == 1.0:
        return spec
    names = list(getattr(model, "output_names", None) or [])
    return JointSpec([(names[0] if names else 0, spec, float(weights))])


def resolve_loss(model, loss=None):
    """The model's compiled loss (or ``loss``) as a :class:`LossSpec`.

    Args:
        model: a ``keras.Model``; its compiled loss is used when `loss` is
            `None`.
        loss: a loss name, ``keras.losses.Loss`` or function ``fn(y_true,
            y_pred)``. Defaults to `None`.

    Returns:
        A :class:`LossSpec`; ``likelihood`` is the loss's family
        (``likelihoods.py``; None for a loss that is not a negative
        log-likelihood), ``classifier`` True for a (sparse) categorical
        cross-entropy.

    Raises:
        ValueError: if there is no loss (model not compiled with one and
            none passed), an unknown name, or something that is not a loss.
            A list or dict of losses (one per output) gives a
            :class:`JointSpec`.

    Example:

    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    >>> model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> spec = kg.curvature.resolve_loss(model)
    >>> spec.name, spec.classifier, spec.from_logits, spec.sparse
    ('sparse_categorical_crossentropy', True, True, True)
    >>> kg.curvature.resolve_loss(model, "mse").classifier
    False
    """
    if loss is None:
        loss = getattr(model, "loss", None)
        if loss is None:
            raise ValueError(
                "No loss to differentiate: compile the model with a loss or "
                "pass `loss=` explicitly."
            )
    if isinstance(loss, (list, tuple, dict)):
        if len(loss) == 1:
            spec = resolve_loss(model, next(iter(loss.values())) if isinstance(loss, dict) else loss[0])
            return _weighted(model, loss, spec)
        return _joint(model, loss)
    if model is not None and loss is getattr(model, "loss", None):
        return _weighted(model, loss, resolve_loss(None, loss))
    if isinstance(loss, str):
        obj = keras.losses.get(loss)
        if obj is None:
            raise ValueError(f"Unknown loss {loss!r}.")
        loss = obj
    if isinstance(loss, keras.losses.Loss):
        fn = getattr(loss, "fn", None)
        kwargs = keras_internals.loss_fn_kwargs(loss)
        fn_name = getattr(fn, "__name__", type(loss).__name__)
        per_example = loss.call
    elif callable(loss):
        fn, kwargs = loss, {}
        fn_name = getattr(loss, "__name__", repr(loss))
        per_example = loss
    else:
        raise ValueError(f"Cannot use {loss!r} as a loss.")
    sparse = _CLASSIFIER_FNS.get(fn_name)
    classifier = sparse is not None
    from_logits = bool(kwargs.get("from_logits", False))
    family = _LIKELIHOODS.get(fn_name)
    # A reduction over another axis than the outputs' is not the family's.
    likelihood = family(from_logits) if family is not None and kwargs.get("axis", -1) == -1 else None
    return LossSpec(
        name=fn_name,
        per_example=per_example,
        classifier=classifier and likelihood is not None,
        from_logits=from_logits,
        sparse=bool(sparse),
        squared_error=fn_name == "mean_squared_error",
        likelihood=likelihood,
    )


def require_classifier(spec, what):
    if not spec.classifier:
        raise ValueError(
            f"{what} needs a probabilistic classifier: a categorical or sparse "
            f"categorical cross-entropy on logits or softmax outputs. The loss "
            f"here is {spec.name!r}, for which the Fisher information of the "
            f"model's predictive distribution is not defined by keras_geosam."
        )


def require_likelihood(spec, what, hint=""):
    """Raises unless `spec`'s loss is a negative log-likelihood of a family
    keras_geosam knows (its Fisher and Gauss-Newton matrix are then
    defined); `hint` ends the message (another route, where one exists)."""
    if spec.likelihood is None:
        raise ValueError(
            f"{what} needs a loss that is a negative log-likelihood: {likelihoods.FAMILIES}, on logits "
            f"or probabilities, reduced over the last axis. The loss here is {spec.name!r}, which has no "
            f"likelihood in keras_geosam (MAE, Huber, hinge and custom losses have none).{hint}"
        )
