"""The metric M of Riemannian sharpness, as a curvature operator.

``fisher_metric`` returns a :class:`~keras_geosam.curvature.BlockDiagonal`
with one block per trainable variable: the Fisher diagonal
(``structure="diagonal"``) or K-FAC blocks on Dense/Conv/EinsumDense
kernels with diagonal blocks elsewhere (``"kfac"``). These are the same
block classes LLQR learns as its preconditioner U.

Damping is relative: block b is inverted as ``M_b + damping * mean
eigenvalue(M_b) I`` (each tensor's mean Fisher entry; each Kronecker
block's mean eigenvalue, applied in the factors' joint eigenbasis). Scaling
one layer's parameters scales its Fisher block and its damping together,
so the damped S_R is unchanged by per-layer rescalings such as Dinh et
al.'s. ``damping=0`` is a pseudo-inverse: zero-Fisher directions are
excluded and counted.
"""

from keras import ops

from keras_geosam.curvature.operators import GGN
from keras_geosam.curvature.operators import BlockDiagonal
from keras_geosam.curvature.operators import Diagonal
from keras_geosam.curvature.operators.model import MAX_EXACT_CLASSES
from keras_geosam._checks import renamed_arguments
from keras_geosam.curvature.finite import require_finite
from keras_geosam.sharpness import _common

STRUCTURES = ("diagonal", "kfac")


def samples_labels(kind, num_classes, max_exact_classes=MAX_EXACT_CLASSES):
    """Whether a metric of Fisher `kind` over `num_classes` output classes is
    built from sampled labels: ``"mc"`` always, ``"exact"`` above
    `max_exact_classes` classes (a language model's vocabulary)."""
    return kind == "mc" or (kind == "exact" and num_classes > max_exact_classes)


@renamed_arguments(fisher="kind")
def fisher_metric(model, x, y=None, structure="diagonal", kind="exact", num_samples=1, seed=0, batch_size=_common.DEFAULT_BATCH_SIZE,
                  loss=None, sample_weight=None, max_exact_classes=MAX_EXACT_CLASSES, exact_samples=8):
    """The Fisher metric of kind `kind` with the given block `structure`.

    Args:
        model, x, y, num_samples, seed, batch_size, loss: as for
            :func:`fisher_diagonal`.
        structure: ``"diagonal"`` or ``"kfac"`` (K-FAC blocks on
            Dense/Conv/EinsumDense kernels, diagonal blocks elsewhere).
            Defaults to ``"diagonal"``.
        kind: the Fisher kind, ``"exact"``, ``"mc"`` or ``"empirical"``
            (as for :func:`fisher_diagonal`; ``fisher=`` is a deprecated
            alias). Defaults to ``"exact"``.
        sample_weight: weights of the loss terms (``(N,)`` or per token).
            Defaults to `None`.
        max_exact_classes, exact_samples: above `max_exact_classes` output
            classes, ``kind="exact"`` draws `exact_samples` labels per
            token from the model (one backward column each) instead of one
            column per class and position; ``M.info`` says so. Defaults to
            `64` and `8`.

    Returns:
        A :class:`~keras_geosam.curvature.BlockDiagonal` operator with one
        block per trainable variable; invert it with
        ``inverse(damping, relative=True)`` (module doc). Its ``info``
        names the Fisher computed (``metric_fisher``) and whether it was
        built from sampled labels (``metric_sampled``).

    Raises:
        ValueError: if `structure` is unknown, or for the reasons
            :func:`fisher_diagonal` gives.

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, kernel_initializer="zeros")])
    >>> model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> M = kg.sharpness.fisher_metric(model, x, structure="kfac")
    >>> [type(block).__name__ for block in M.blocks]
    ['KFAC', 'Diagonal']
    >>> M_inv = M.inverse(1e-3, relative=True)
    >>> [type(block).__name__ for block in M_inv.blocks]
    ['EKFAC', 'Diagonal']
    """
    if structure not in STRUCTURES:
        raise ValueError(f"structure must be one of {STRUCTURES}, got {structure!r}.")
    _common.require_fisher(model, loss, "fisher_metric")
    G = GGN(model, x, y, kind=kind, num_samples=num_samples, seed=seed, loss=loss, batch_size=batch_size,
            sample_weight=sample_weight)
    info = {"metric_fisher": kind, "metric_sampled": samples_labels(kind, G.num_classes, max_exact_classes)}
    if kind == "exact" and info["metric_sampled"]:
        G = G.sampled(exact_samples, G._key)
        info["metric_fisher"] = (
            f"mc: {exact_samples} labels per token drawn from the model "
            f"({G.num_classes} classes > max_exact_classes={max_exact_classes})"
        )
    M = G.kfac() if structure == "kfac" else BlockDiagonal([Diagonal([d]) for d in G.diagonal()], paths=G.fns.paths)
    # Before anything inverts it: a NaN metric is the data's or the model's.
    require_finite(float(ops.convert_to_numpy(M.trace())), model, x, "the Fisher metric", batch_size)
    M.info = info
    return M
