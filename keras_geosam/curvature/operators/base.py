"""The linear-operator type: symmetric maps on lists of variable-shaped tensors.

A vector is a list of tensors shaped like ``op.shapes`` (for a model, like
its trainable variables); a block of k vectors is the same list with a
leading axis k on every tensor. Every operator offers ``matmat`` on such
blocks (one call serves k probes), ``matvec``, ``@``, ``+``, ``-`` and
scaling; structured operators add ``diagonal()``, ``trace()`` and
``inverse`` / ``inverse_sqrt``. ``to_dense()`` materialises the matrix of a
small operator (float64 NumPy, coordinates in the order of the flattened
list), for tests and small models.
"""

import keras
import numpy as np
from keras import ops


def static_shape(x):
    """`x`'s shape as Python ints, None where only known when run (inside a
    traced TensorFlow function): a check never asks a tensor for a bool."""
    return tuple(None if d is None else int(d) for d in x.shape)


def cast_to(x, dtype):
    """`x` in `dtype`: `x` itself when it already is. ``ops.cast`` costs a
    few microseconds even then, on every tensor of every product of an
    eager step."""
    if x.dtype == dtype or keras.backend.standardize_dtype(x.dtype) == keras.backend.standardize_dtype(dtype):
        return x
    return ops.cast(x, dtype)


class LinearOperator:
    """A linear map on lists of tensors shaped like `shapes`.

    Subclasses implement ``matmat(vectors)``: ``vectors`` is a list of
    tensors of shapes ``(k,) + shape``; the result has the same shapes.
    Operators compose with ``@``, ``+``, ``-`` and scalars; ``matvec``,
    ``trace``, ``to_dense`` and the estimators in ``kg.estimators`` then
    work on any of them.

    Args:
        shapes: the shape of each tensor of a vector.
        dtype: the dtype vectors are computed in.

    Raises:
        NotImplementedError: from ``matmat``, ``diagonal``, ``inverse`` or
            ``inverse_sqrt`` where a subclass does not provide them.
        ValueError: when vectors do not match `shapes`, operators on
            different spaces are combined, or ``to_dense`` exceeds its
            ``max_dim``.

    Example:

    >>> class Twice(kg.curvature.LinearOperator):
    ...     def matmat(self, vectors):
    ...         return [2.0 * v for v in self.check(vectors)]
    >>> op = Twice([(2,), (1,)], "float32")
    >>> op.dim
    3
    >>> np.round((op @ op + op).to_dense(), 3).diagonal().tolist()
    [6.0, 6.0, 6.0]
    >>> kg.estimators.hutchinson(op, num_probes=4).value
    6.0
    """

    def __init__(self, shapes, dtype):
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.dtype = dtype

    # ------------------------------------------------------------ sizes ----
    @property
    def sizes(self):
        return [int(np.prod(s, dtype=np.int64)) for s in self.shapes]

    @property
    def dim(self):
        return int(sum(self.sizes))

    # ---------------------------------------------------------- products ----
    def matmat(self, vectors):
        raise NotImplementedError(f"{type(self).__name__} does not implement matmat.")

    def matvec(self, vector):
        return [v[0] for v in self.matmat([ops.expand_dims(x, 0) for x in vector])]

    def matvec_into(self, vector):
        """``matvec(vector)``, free to write the result into `vector`'s
        tensors: the caller reads them no more (an eager step's descent
        product; only a diagonal does so, on torch)."""
        return self.matvec(vector)

    def __matmul__(self, other):
        if isinstance(other, LinearOperator):
            return Product([self, other])
        return self.matvec(list(other))

    def __add__(self, other):
        if not isinstance(other, LinearOperator):
            return NotImplemented
        return Sum([self, other])

    def __sub__(self, other):
        if not isinstance(other, LinearOperator):
            return NotImplemented
        return Sum([self, Scaled(other, -1.0)])

    def __mul__(self, scalar):
        if isinstance(scalar, LinearOperator):
            return NotImplemented
        return Scaled(self, scalar)

    __rmul__ = __mul__

    def __neg__(self):
        return Scaled(self, -1.0)

    def __truediv__(self, scalar):
        return Scaled(self, 1.0 / float(scalar))

    # ------------------------------------------------------ structure ----
    def diagonal(self):
        """The diagonal, as a list like `shapes`."""
        raise NotImplementedError(
            f"{type(self).__name__} has no cheap diagonal; estimate it or use to_dense() on a small problem."
        )

    def trace(self):
        """The exact trace, where the structure gives it."""
        return sum(ops.sum(d) for d in self.diagonal())

    def inverse(self, damping=0.0, relative=False, rcond=None):
        raise NotImplementedError(f"{type(self).__name__} has no structured inverse.")

    def inverse_sqrt(self, damping=0.0, relative=False, rcond=None):
        raise NotImplementedError(f"{type(self).__name__} has no structured inverse square root.")

    def to_dense(self, max_dim=20000, chunk=64):
        """The explicit ``dim x dim`` matrix (float64 NumPy), built column block
        by column block from `matmat`."""
        dim = self.dim
        if dim > max_dim:
            raise ValueError(f"to_dense() of a {dim}-dimensional operator: raise max_dim (now {max_dim}) to allow it.")
        cols = []
        for start in range(0, dim, chunk):
            k = min(chunk, dim - start)
            eye = np.zeros((k, dim), dtype="float64")
            eye[np.arange(k), start + np.arange(k)] = 1.0
            out = self.matmat(unflatten(ops.convert_to_tensor(eye, dtype=self.dtype), self.shapes))
            cols.append(np.asarray(ops.convert_to_numpy(flatten(out)), dtype="float64"))
        return np.concatenate(cols, axis=0).T

    def group_key(self, vector):
        """A key shared by blocks that ``BlockDiagonal.matvec`` may multiply
        together as one batched product; None (the default): alone."""
        return None

    # Whether this operator is symmetric and maps each tensor of a vector
    # to itself alone (a diagonal, orthogonal Kronecker eigenbases, blocks
    # of those): then ``z_i . (S A S z)_i = (S z)_i . (A S z)_i`` tensor by
    # tensor, and a quadratic form needs one product with S, not two.
    symmetric_per_tensor = False

    def quadratic_pair(self, vectors, consume=False):
        """``(u, w)`` with ``z_i . (self z)_i = u_i . w_i`` for every tensor i
        of each vector z of the block `vectors`: ``(z, self z)`` here.
        `consume`: the caller holds no other reference to the list
        `vectors`, which may be emptied once no longer needed."""
        return vectors, self.matmat(vectors)

    # ------------------------------------------------------- checking ----
    def check(self, vectors, batched=True):
        """Raises unless `vectors` is a list matching `shapes` (with a
        common leading axis if `batched`)."""
        if not isinstance(vectors, (list, tuple)) or len(vectors) != len(self.shapes):
            raise ValueError(
                f"{type(self).__name__} acts on lists of {len(self.shapes)} tensors; "
                f"got {type(vectors).__name__} of length {len(vectors) if hasattr(vectors, '__len__') else '?'}."
            )
        lead = None
        for v, shape in zip(vectors, self.shapes):
            got = static_shape(v)
            body = got[1:] if batched else got
            if len(body) != len(shape) or any(g is not None and g != s for g, s in zip(body, shape)):
                raise ValueError(f"{type(self).__name__}: tensor of shape {got} where {'(k,) + ' if batched else ''}{shape} is expected.")
            if batched and got[0] is not None:
                if lead is not None and got[0] != lead:
                    raise ValueError("All tensors of a block of vectors need the same leading axis.")
                lead = got[0]
        return list(vectors)

    def __repr__(self):
        return f"{type(self).__name__}(dim={self.dim}, tensors={len(self.shapes)})"


class Sum(LinearOperator):
    """A + B + ..."""

    def __init__(self, terms):
        flat = []
        for t in terms:
            flat += t.terms if isinstance(t, Sum) else [t]
        _same_space(flat)
        super().__init__(flat[0].shapes, flat[0].dtype)
        self.terms = flat

    def matmat(self, vectors):
        out = None
        for t in self.terms:
            r = t.matmat(vectors)
            out = r if out is None else [a + b for a, b in zip(out, r)]
        return out

    def diagonal(self):
        out = None
        for t in self.terms:
            d = t.diagonal()
            out = d if out is None else [a + b for a, b in zip(out, d)]
        return out


class Scaled(LinearOperator):
    """c * A for a scalar c."""

    def __init__(self, op, scale):
        super().__init__(op.shapes, op.dtype)
        self.op, self.scale = op, float(scale)

    def matmat(self, vectors):
        return [scalar(self.scale, v.dtype) * v for v in self.op.matmat(vectors)]

    def diagonal(self):
        return [self.scale * d for d in self.op.diagonal()]

    def inverse(self, damping=0.0, relative=False, rcond=None):
        # (c A + d I)^-1 = (1/c) (A + (d/c) I)^-1; relative damping scales with A.
        if self.scale <= 0:
            raise ValueError("Only a positive multiple of an operator has a structured inverse.")
        inner = self.op.inverse(damping / self.scale if not relative else damping, relative, rcond)
        return Scaled(inner, 1.0 / self.scale)

    def inverse_sqrt(self, damping=0.0, relative=False, rcond=None):
        if self.scale <= 0:
            raise ValueError("Only a positive multiple of an operator has a structured inverse square root.")
        inner = self.op.inverse_sqrt(damping / self.scale if not relative else damping, relative, rcond)
        return Scaled(inner, self.scale**-0.5)


class Product(LinearOperator):
    """A @ B @ ...: applies the rightmost factor first."""

    def __init__(self, factors):
        flat = []
        for f in factors:
            flat += f.factors if isinstance(f, Product) else [f]
        _same_space(flat)
        super().__init__(flat[0].shapes, flat[0].dtype)
        self.factors = flat

    def matmat(self, vectors):
        for f in reversed(self.factors):
            vectors = f.matmat(vectors)
        return vectors

    def quadratic_pair(self, vectors, consume=False):
        """``S @ A @ S`` with one symmetric, per-tensor S (a metric's
        ``inverse_sqrt`` around a curvature operator): ``(S z, A S z)``,
        one product with S instead of two, the same per-tensor values. With
        `consume`, the probes z are let go once S z is formed: a copy of the
        weights less while A's product runs (its peak, at GPT-2 size)."""
        first, *middle, last = self.factors
        if first is not last or not first.symmetric_per_tensor or not middle:
            return super().quadratic_pair(vectors)
        u = w = first.matmat(vectors)
        if consume:
            vectors.clear()
        for f in reversed(middle):
            w = f.matmat(w)
        return u, w


def _same_space(ops_list):
    shapes = ops_list[0].shapes
    for o in ops_list[1:]:
        if o.shapes != shapes:
            raise ValueError(f"Operators act on different spaces: {shapes} vs {o.shapes}.")


# ---------------------------------------------------------- helpers ----
def scalar(value, dtype):
    """`value` as a scalar tensor of `dtype`. Python numbers are converted
    directly (``ops.cast`` would pass them through float32 on TensorFlow)."""
    if isinstance(value, (int, float, np.number)):
        return ops.convert_to_tensor(value, dtype=dtype)
    return ops.cast(value, dtype)


def flatten(vectors):
    """A block of vectors (leading axis k) as one (k, dim) tensor."""
    k = int(ops.shape(vectors[0])[0])
    return ops.concatenate([ops.reshape(v, (k, -1)) for v in vectors], axis=1)


def unflatten(matrix, shapes):
    """(k, dim) tensor -> list of (k,) + shape tensors."""
    k = int(ops.shape(matrix)[0])
    out, start = [], 0
    for s in shapes:
        size = int(np.prod(s, dtype=np.int64))
        out.append(ops.reshape(matrix[:, start : start + size], (k,) + tuple(s)))
        start += size
    return out


def per_tensor_inner(a, b):
    """(k, len(a)) tensor of per-tensor inner products of two blocks."""
    return ops.stack([ops.sum(ops.reshape(x * y, (ops.shape(x)[0], -1)), axis=1) for x, y in zip(a, b)], axis=1)
