"""The layout of LLQR's U: one block per trainable tensor, from the
curvature operator classes.

Each kernel with a 2-D view X of shape ``(m, n)``, input axes by output
axes, gets the chosen structure: the views are the K-FAC metric's own
(``kg.curvature.layers.kernel_views``): Dense ``(d_in, d_out)``, Conv
``(kh*kw*c_in, c_out)``, EinsumDense the axes contracted with the input by
the axes that form the output (a MultiHeadAttention query, key or value
kernel ``(d_model, heads, head_dim)`` is ``d_model x heads*head_dim``, its
output kernel ``heads*head_dim x d_model``), Embedding ``(vocabulary,
d)`` with a diagonal input factor. Every other tensor (biases,
normalisation scales, tensors of layers without a rule, which warn once)
gets a diagonal block:

| structure   | block class | parameters                        | U(X)                            | init           |
|-------------|-------------|-----------------------------------|---------------------------------|----------------|
| "diagonal"  | Diagonal    | d (tensor's shape)                | d * X                           | ones           |
| "kfac"      | KFAC        | A (m x m), B (n x n)              | A X B^T                         | identity       |
| "ekfac"     | EKFAC       | Q_A (m x m), Q_G (n x n), s (m, n)| Q_A (s * (Q_A^T X Q_G)) Q_G^T   | identity, ones |

An Embedding's blocks keep the input factor diagonal (the vocabulary-wide
factor is never formed): ``DiagonalInputKFAC`` (a (m,), B: ``diag(a) X
B^T``) and ``DiagonalInputEKFAC`` (Q_G, s: ``(s * (X Q_G)) Q_G^T``).

U is ``BlockDiagonal.from_params(layout, params)``: the same classes serve
as Fisher metrics in ``keras_geosam.sharpness``, so the K-FAC product exists
once (``KFAC.matmat``).
"""

from keras_geosam.curvature.operators import EKFAC
from keras_geosam.curvature.operators import KFAC
from keras_geosam.curvature.operators import BlockDiagonal
from keras_geosam.curvature.operators import Diagonal
from keras_geosam.curvature.operators import DiagonalInputEKFAC
from keras_geosam.curvature.operators import DiagonalInputKFAC
from keras_geosam.curvature.layers import warn_diagonal_fallback

STRUCTURES = ("diagonal", "kfac", "ekfac")
# (structure, diagonal input factor) -> block class
_CLASSES = {
    ("kfac", False): KFAC, ("kfac", True): DiagonalInputKFAC,
    ("ekfac", False): EKFAC, ("ekfac", True): DiagonalInputEKFAC,
}


def is_matrix_kernel(variable):
    """A Dense/EinsumDense/Conv kernel: named ``kernel`` with >= 2 axes."""
    name = getattr(variable, "name", "") or ""
    return name.split("/")[-1] == "kernel" and len(variable.shape) >= 2


def layout(variables, structure, views=None):
    """U's layout: ``[(block class, shape, split)]``, one entry per variable.

    Kernels with a K-FAC view get the `structure`'s block, every other
    tensor a :class:`~keras_geosam.curvature.Diagonal` (module doc).

    Args:
        variables: the trainable variables U acts on.
        structure: ``"diagonal"``, ``"kfac"`` or ``"ekfac"``.
        views: ``{id(variable): (split, diagonal_input) or None}`` from
            ``kg.curvature.layers.kernel_views(model)`` (what LLQR uses);
            a tensor of two or more axes missing from it warns once.
            Defaults to `None`: without the model, a variable named
            ``kernel`` with two or more axes is viewed as its leading axes
            by its last one (right for Dense and Conv only).

    Returns:
        A list of ``(block class, shape, split)`` tuples, ``split`` the
        axis where the matrix view's columns start (None for diagonals).

    Raises:
        ValueError: if `structure` is unknown.

    Example:

    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    >>> layout = kg.preconditioner.layout(model.trainable_variables, "kfac")
    >>> [(cls.__name__, shape, split) for cls, shape, split in layout]
    [('KFAC', (4, 3), 1), ('Diagonal', (3,), None)]
    """
    if structure not in STRUCTURES:
        raise ValueError(f"structure must be one of {STRUCTURES}, got {structure!r}.")
    out, fallback = [], []
    for v in variables:
        shape = tuple(int(s) for s in v.shape)
        if structure == "diagonal":
            out.append((Diagonal, shape, None))
        elif views is not None and views.get(id(v)) is not None:
            split, diagonal_input = views[id(v)]
            out.append((_CLASSES[(structure, diagonal_input)], shape, split))
        elif views is None and is_matrix_kernel(v):
            out.append((_CLASSES[(structure, False)], shape, len(shape) - 1))
        else:
            out.append((Diagonal, shape, None))
            if views is not None and id(v) not in views:
                fallback.append((getattr(v, "path", None) or v.name, shape))
    if views is not None:
        warn_diagonal_fallback(fallback, f'LLQR structure="{structure}"')
    return out


def param_specs(layout):
    """U's flat parameters: ``[(block index, name, shape, initializer, positive)]``.

    Args:
        layout: a layout from :func:`layout`.

    Returns:
        One tuple per parameter tensor, in the order :func:`operator`
        takes them; ``positive`` marks entries kept >= ``min_diagonal``.

    Raises:
        ValueError: if a Kronecker entry's shape and split have no matrix
            view (only for hand-made layouts).

    Example:

    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    >>> layout = kg.preconditioner.layout(model.trainable_variables, "kfac")
    >>> kg.preconditioner.param_specs(layout)  # doctest: +NORMALIZE_WHITESPACE
    [(0, 'A', (4, 4), 'identity', False), (0, 'B', (3, 3), 'identity', False),
     (1, 'd', (3,), 'ones', True)]
    """
    return [(i, *spec) for i, (cls, shape, split) in enumerate(layout) for spec in cls.param_specs(shape, split)]


def operator(layout, params, paths=None):
    """U as a :class:`BlockDiagonal` operator built from its parameters.

    Args:
        layout: a layout from :func:`layout`.
        params: tensors in the order of :func:`param_specs`.

    Returns:
        A :class:`~keras_geosam.curvature.BlockDiagonal` operator.

    Raises:
        ValueError: if `params` does not hold one tensor per parameter of
            the layout, or a Kronecker factor has the wrong shape.

    Example:

    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    >>> layout = kg.preconditioner.layout(model.trainable_variables, "kfac")
    >>> params = [np.eye(4, dtype="float32"), np.eye(3, dtype="float32"), np.ones(3, "float32")]
    >>> U = kg.preconditioner.operator(layout, params)  # the initial U: the identity
    >>> U.dim, np.allclose(U.to_dense(), np.eye(15))
    (15, True)
    """
    return BlockDiagonal.from_params(layout, params, paths)


def clip_groups(layout, variables, structure):
    """Parameter indices clipped together in a refresh, as the reference groups them.

    For a diagonal U one group per layer (all of a layer's tensors, e.g.
    kernel and bias); otherwise one group per parameter tensor (K-FAC's A
    and B, EK-FAC's Q_A, Q_G and s, each diagonal block alone).

    Args:
        layout: a layout from :func:`layout`.
        variables: the variables the layout was made from.
        structure: the layout's structure.

    Returns:
        A list of lists of parameter indices (positions in
        :func:`param_specs`).

    Example:

    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    >>> variables = model.trainable_variables
    >>> for structure in ("diagonal", "kfac"):
    ...     layout = kg.preconditioner.layout(variables, structure)
    ...     print(structure, kg.preconditioner.clip_groups(layout, variables, structure))
    diagonal [[0, 1]]
    kfac [[0], [1], [2]]
    """
    groups, index = {}, 0
    for (cls, shape, split), v in zip(layout, variables):
        for _ in cls.param_specs(shape, split):
            if structure == "diagonal":
                key = ("layer", (getattr(v, "path", None) or v.name).rsplit("/", 1)[0])
            else:
                key = ("tensor", index)
            groups.setdefault(key, []).append(index)
            index += 1
    return list(groups.values())
