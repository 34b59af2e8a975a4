"""Structured preconditioner blocks U, one per trainable tensor, as products.

Each kernel with a 2-D view X of shape ``(m, n)`` (Dense ``(d_in, d_out)``,
EinsumDense and Conv kernels ``(prod(shape[:-1]), shape[-1])``) gets the
chosen structure; every other tensor (biases, normalisation scales, ...) a
diagonal block:

| structure   | parameters                      | U(X)                            | init          |
|-------------|---------------------------------|---------------------------------|---------------|
| "diagonal"  | d (tensor's shape)              | d * X                           | ones          |
| "kfac"      | A (m x m), B (n x n)            | A X B^T                         | identity      |
| "ekfac"     | Q_A (m x m), Q_G (n x n), s (m*n) | Q_A (s * (Q_A^T X Q_G)) Q_G^T | identity, ones|

Kronecker products are never formed: products cost two small matmuls.
"""

import dataclasses

import numpy as np
from keras import ops

STRUCTURES = ("diagonal", "kfac", "ekfac")


@dataclasses.dataclass(frozen=True)
class Block:
    """How one trainable tensor is preconditioned."""

    kind: str
    shape: tuple
    view: tuple = None  # (m, n) for matrix structures

    def param_specs(self):
        """``[(name, shape, initializer)]`` of this block's parameters."""
        if self.kind == "diagonal":
            return [("d", self.shape, "ones")]
        m, n = self.view
        if self.kind == "kfac":
            return [("A", (m, m), "identity"), ("B", (n, n), "identity")]
        return [("QA", (m, m), "identity"), ("QG", (n, n), "identity"), ("s", (m, n), "ones")]

    def apply(self, params, x):
        """U x for a tensor `x` of this block's shape."""
        if self.kind == "diagonal":
            return params[0] * x
        X = ops.reshape(x, self.view)
        if self.kind == "kfac":
            A, B = params
            Y = ops.matmul(ops.matmul(A, X), ops.transpose(B))
        else:
            QA, QG, s = params
            inner = ops.matmul(ops.matmul(ops.transpose(QA), X), QG)
            Y = ops.matmul(ops.matmul(QA, s * inner), ops.transpose(QG))
        return ops.reshape(Y, self.shape)

    def diagonal_params(self):
        """Indices of parameters that are diagonal entries (kept >= min)."""
        return [0] if self.kind == "diagonal" else ([2] if self.kind == "ekfac" else [])


def is_matrix_kernel(variable):
    """A Dense/EinsumDense/Conv kernel: named ``kernel`` with >= 2 axes."""
    name = getattr(variable, "name", "") or ""
    return name.split("/")[-1] == "kernel" and len(variable.shape) >= 2


def make_blocks(variables, structure):
    if structure not in STRUCTURES:
        raise ValueError(f"structure must be one of {STRUCTURES}, got {structure!r}.")
    blocks = []
    for v in variables:
        shape = tuple(int(s) for s in v.shape)
        if structure != "diagonal" and is_matrix_kernel(v):
            view = (int(np.prod(shape[:-1])), shape[-1])
            blocks.append(Block(structure, shape, view))
        else:
            blocks.append(Block("diagonal", shape))
    return blocks


def split(blocks, flat):
    """Flat parameter list -> one list per block."""
    out, i = [], 0
    for b in blocks:
        k = len(b.param_specs())
        out.append(list(flat[i : i + k]))
        i += k
    return out


def precondition(blocks, flat_params, vectors):
    """[U_b v_b for each block], from a flat parameter list."""
    return [b.apply(p, v) for b, p, v in zip(blocks, split(blocks, flat_params), vectors)]
