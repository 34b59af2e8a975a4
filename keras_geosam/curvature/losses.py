"""Which loss a curvature routine differentiates, and its likelihood.

Fisher and Gauss-Newton quantities need a loss that is a negative
log-likelihood (``likelihoods.py``): a categorical cross-entropy, the mean
squared error (Gaussian) or a binary cross-entropy (Bernoulli), on logits or
on probabilities. Anything else (MAE, Huber, hinge, custom losses) gets a
``ValueError`` naming the loss and the families supported, never a number.
"""

import dataclasses

import keras
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
            none passed), several losses (multi-output), an unknown name,
            or something that is not a loss.

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
        raise ValueError(
            "keras_geosam curvature routines support single-output models with "
            f"one loss; got {loss!r}."
        )
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

