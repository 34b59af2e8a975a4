"""The layout of LLQR's U: one block per trainable tensor, from the
curvature operator classes.

Each kernel with a 2-D view X of shape ``(m, n)`` (Dense ``(d_in, d_out)``,
EinsumDense and Conv kernels ``(prod(shape[:-1]), shape[-1])``) gets the
chosen structure; every other tensor (biases, normalisation scales, ...) a
diagonal block:

| structure   | block class | parameters                        | U(X)                            | init           |
|-------------|-------------|-----------------------------------|---------------------------------|----------------|
| "diagonal"  | Diagonal    | d (tensor's shape)                | d * X                           | ones           |
| "kfac"      | KFAC        | A (m x m), B (n x n)              | A X B^T                         | identity       |
| "ekfac"     | EKFAC       | Q_A (m x m), Q_G (n x n), s (m, n)| Q_A (s * (Q_A^T X Q_G)) Q_G^T   | identity, ones |

U is ``BlockDiagonal.from_params(layout, params)``: the same classes serve
as Fisher metrics in ``keras_geosam.sharpness``, so the K-FAC product exists
once (``KFAC.matmat``).
"""

from keras_geosam.curvature.operators import EKFAC
from keras_geosam.curvature.operators import KFAC
from keras_geosam.curvature.operators import BlockDiagonal
from keras_geosam.curvature.operators import Diagonal

STRUCTURES = ("diagonal", "kfac", "ekfac")
_CLASSES = {"kfac": KFAC, "ekfac": EKFAC}


def is_matrix_kernel(variable):
    """A Dense/EinsumDense/Conv kernel: named ``kernel`` with >= 2 axes."""
    name = getattr(variable, "name", "") or ""
    return name.split("/")[-1] == "kernel" and len(variable.shape) >= 2


def layout(variables, structure):
    """``[(block class, shape, split)]``, one entry per variable."""
    if structure not in STRUCTURES:
        raise ValueError(f"structure must be one of {STRUCTURES}, got {structure!r}.")
    out = []
    for v in variables:
        shape = tuple(int(s) for s in v.shape)
        if structure != "diagonal" and is_matrix_kernel(v):
            out.append((_CLASSES[structure], shape, len(shape) - 1))
        else:
            out.append((Diagonal, shape, None))
    return out


def param_specs(layout):
    """``[(block index, name, shape, initializer, positive)]`` in order."""
    return [(i, *spec) for i, (cls, shape, split) in enumerate(layout) for spec in cls.param_specs(shape, split)]


def operator(layout, params):
    """U as a :class:`BlockDiagonal` operator built from its parameters."""
    return BlockDiagonal.from_params(layout, params)


def clip_groups(layout, variables, structure):
    """Parameter indices clipped together in a refresh, as the reference
    groups them: for a diagonal U one group per layer (all of a layer's
    tensors, e.g. kernel and bias); otherwise one group per parameter
    tensor (K-FAC's A and B, EK-FAC's Q_A, Q_G and s, each diagonal block
    alone)."""
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
