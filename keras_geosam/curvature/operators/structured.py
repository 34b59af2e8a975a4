"""Structured operators: Diagonal, KFAC, EKFAC, BlockDiagonal and Dense.

They serve twice: as curvature metrics (a Fisher diagonal, K-FAC factors
of the Fisher) and, with learnable parameters, as LLQR's preconditioner U.
Each class can be rebuilt from a flat list of parameter tensors
(``param_specs`` / ``from_params``), so a function of U's parameters can be
differentiated through ``op.matvec``.

Products are written with ``ops.einsum`` (Keras 3.15's ``ops.matmul``
computes float64 in float32 on torch); a Kronecker product's two matmuls
are ``backend.sandwich``. A KFAC or EKFAC block acts on one tensor viewed as a matrix ``X`` of shape
``(m, n)``: the tensor's axes before `split` make the rows, the others the
columns (Dense kernel ``(d_in, d_out)``; Conv kernel
``(kh*kw*c_in, c_out)``). With the row-major ``vec``,
``(A kron B) vec(X) = vec(A X B^T)``: the Kronecker product is never formed.

Inverses are pseudo-inverses: eigenvalues (after damping) at or below
``rcond`` times the block's largest are treated as zero, so a zero-Fisher
direction is excluded instead of inverted. ``relative=True`` scales
`damping` by each block's mean eigenvalue (trace / dimension): each
tensor's diagonal, each Kronecker block.
"""

import keras
import numpy as np
from keras import ops

from keras_geosam import backend
from keras_geosam.curvature.functional import mean
from keras_geosam.curvature.operators.base import LinearOperator
from keras_geosam.curvature.operators.base import cast_to
from keras_geosam.curvature.operators.base import flatten
from keras_geosam.curvature.operators.base import scalar
from keras_geosam.curvature.operators.base import static_shape
from keras_geosam.curvature.operators.base import unflatten
from keras_geosam.curvature.operators.eigh import EigenDecompositionError
from keras_geosam.curvature.operators.eigh import symmetric_eigh
from keras_geosam.curvature.operators.eigh import symmetric_eighs


# A block of a metric whose largest eigenvalue is this far below the
# metric's largest is rounding noise, not information (BlockDiagonal).
BLOCK_RCOND = 1e-10


def _eps(dtype):
    return float(np.finfo(keras.backend.standardize_dtype(dtype)).eps)


def spectral(values, damping, power, rcond):
    """``(values + damping)^-power`` where above ``rcond * max``, else 0.

    Values whose inverse would overflow count as zero too: a block of
    rounding-level curvature (products of two tiny Kronecker factors
    underflow to denormals in float32) would otherwise invert to Inf."""
    return _spectral_kernel(values, damping, rcond, power=power)


def _spectral_body(values, damping, rcond, power):
    shifted = values + scalar(damping, values.dtype)
    cutoff = scalar(rcond, values.dtype) * ops.maximum(ops.max(shifted), scalar(0.0, values.dtype))
    edge = 1.0 / float(np.finfo(keras.backend.standardize_dtype(values.dtype)).max) if power == 1 else 0.0
    keep = ops.logical_and(ops.greater(shifted, cutoff), ops.greater(shifted, scalar(edge, values.dtype)))
    safe = ops.where(keep, shifted, ops.ones_like(shifted))
    scaled = 1.0 / safe if power == 1 else 1.0 / ops.sqrt(safe)
    return ops.where(keep, scaled, ops.zeros_like(shifted))


_spectral_kernel = backend.block_kernel(_spectral_body, static_argnames=("power",))


def _absolute(damping, relative, mean_eigenvalue):
    if not relative:
        return damping
    return scalar(damping, mean_eigenvalue.dtype) * mean_eigenvalue


def _diagonal_body(values, damping, rcond, relative, power):
    return _spectral_body(values, _absolute(damping, relative, mean(values)), rcond, power)


def _kronecker_body(la, lb, damping, rcond, relative, power):
    s = la[:, None] * lb[None, :]
    return _spectral_body(s, _absolute(damping, relative, mean(s)), rcond, power)


def _gram_kronecker_body(la, lb, damping, rcond, size, relative, power):
    # The input factor's null space (rank r < m): eigenvalue 0 in every
    # column, so one scale there, (0 + lambda)^-power, cut off as the
    # others are; `size` = m * n, the mean's denominator.
    s = la[:, None] * lb[None, :]
    lam = _absolute(damping, relative, ops.sum(s) / scalar(size, s.dtype))
    both = _spectral_body(ops.concatenate([ops.reshape(s, (-1,)), ops.zeros((1,), s.dtype)]), lam, rcond, power)
    return ops.reshape(both[:-1], ops.shape(s)), both[-1]


def _each(body):
    """`body` over lists: ``[body(*args) for args in zip(*lists)]``, the
    keyword (static) arguments shared. As one ``backend.block_kernel`` it is
    one call for every block of a metric: TensorFlow spends ~2 ms a call, and
    a convolutional network's 140 blocks made 1200 calls per S_R."""

    def many(*lists, **static):
        return [body(*args, **static) for args in zip(*lists)]

    return many


# One compiled program per set of blocks on JAX (backend.block_kernel): the
# blocks of one metric, or one block alone.
_diagonal_scales = backend.block_kernel(_each(_diagonal_body), static_argnames=("relative", "power"))
_kronecker_scales = backend.block_kernel(_each(_kronecker_body), static_argnames=("relative", "power"))
_gram_kronecker_scales = backend.block_kernel(_each(_gram_kronecker_body), static_argnames=("relative", "power"))


def _where_body(keep, tensors):
    # where, not a product: a masked block's Inf must not become NaN.
    return [ops.where(keep, t, ops.zeros_like(t)) for t in tensors]


def _kronecker_top_body(la, lb):
    return ops.max(la) * ops.max(lb)


# Also one program per block shape on JAX: ``_blockwise`` masks every block.
_where_kept = backend.block_kernel(_where_body)
_kronecker_tops = backend.block_kernel(_each(_kronecker_top_body))


def _kept(keep, tensors):
    """`tensors` where `keep`, else zeros. `keep` a scalar boolean tensor,
    or a Python bool read on the host once for many blocks (no kernel)."""
    if isinstance(keep, (bool, np.bool_)):
        return list(tensors) if keep else [ops.zeros_like(t) for t in tensors]
    return _where_kept(keep, list(tensors))


def _diagonal_tops_body(values):
    return ops.stack([ops.max(ops.stack([ops.max(v) for v in vs])) for vs in values])


# Every diagonal block's largest entry in one call, not three ops a block.
_diagonal_tops = backend.block_kernel(_diagonal_tops_body)


def _diagonal_trace_body(values):
    return sum(ops.sum(v) for v in values)


def _kfac_trace_body(full, gram, diagonal):
    # tr(A kron B) = tr A tr B, tr A from A itself, its rows (A = R^T R) or
    # its diagonal; each a list of (A's source, B) pairs.
    return ([ops.trace(A) * ops.trace(B) for A, B in full] + [ops.sum(ops.square(R)) * ops.trace(B) for R, B in gram]
            + [ops.sum(a) * ops.trace(B) for a, B in diagonal])


# A metric's trace (its finiteness check) in one call per class.
_diagonal_traces = backend.block_kernel(_each(_diagonal_trace_body))
_kfac_traces = backend.block_kernel(_kfac_trace_body)


def _gram_body(R):
    return ops.einsum("rm,sm->rs", R, R)


def _gram_basis_body(R, w, U):
    """``_kfac_eighs``' eigenvalues and ``m x r`` eigenvectors from the
    Gram matrix's ``(w, U)``; rounding-level eigenvalues count as zero."""
    tol = scalar(int(R.shape[0]) * _eps(w.dtype), w.dtype) * ops.abs(ops.max(w))
    keep = ops.greater(w, tol)
    w = ops.where(keep, w, ops.zeros_like(w))
    inv = ops.where(keep, 1.0 / ops.sqrt(ops.where(keep, w, ops.ones_like(w))), ops.zeros_like(w))
    return w, ops.einsum("rm,rs->ms", R, U) * inv[None, :]


_grams = backend.block_kernel(_each(_gram_body))
_gram_bases = backend.block_kernel(_each(_gram_basis_body))


def _matrix_view(shape, split):
    split = len(shape) - 1 if split is None else int(split)
    if not 1 <= split < len(shape):
        raise ValueError(f"A Kronecker block needs a tensor of >= 2 axes split inside; got shape {shape}, split {split}.")
    return split, (int(np.prod(shape[:split])), int(np.prod(shape[split:])))


class _Spectral:
    """``inverse`` and ``inverse_sqrt`` of an operator that knows its
    eigendecomposition (``_spectral(damping, relative, power, rcond)``).

    ``_spectral_many`` and ``_top_eigenvalues_many`` do the same for many
    operators of one class at once (``BlockDiagonal``); a class whose
    kernels take lists overrides them, and its one-operator methods call
    them with a list of one, so both paths are the same code."""

    def inverse(self, damping=0.0, relative=False, rcond=None):
        return self._spectral(damping, relative, 1, rcond)

    def inverse_sqrt(self, damping=0.0, relative=False, rcond=None):
        return self._spectral(damping, relative, 0.5, rcond)

    @classmethod
    def _spectral_many(cls, blocks, damping, relative, power, rcond):
        return [b._spectral(damping, relative, power, rcond) for b in blocks]

    @classmethod
    def _top_eigenvalues_many(cls, blocks):
        return [b.top_eigenvalue() for b in blocks]


class Diagonal(_Spectral, LinearOperator):
    """``diag(values)``: element-wise products with a list of tensors.

    Its ``inverse`` and ``inverse_sqrt`` are pseudo-inverses: zero entries
    stay zero (module doc).

    Args:
        values: a list of arrays or tensors, the diagonal, one per tensor
            of a vector.

    Raises:
        ValueError: when applied to vectors that do not match the shapes
            of `values`.

    Example:

    >>> D = kg.curvature.Diagonal([np.array([1.0, 4.0], "float32"), np.array([0.0], "float32")])
    >>> D.dim, float(D.trace())
    (3, 5.0)
    >>> [keras.ops.convert_to_numpy(t).tolist() for t in D.inverse_sqrt().diagonal()]
    [[1.0, 0.5], [0.0]]
    """

    symmetric_per_tensor = True

    def __init__(self, values):
        values = [ops.convert_to_tensor(v) for v in values]
        super().__init__([tuple(ops.shape(v)) for v in values], values[0].dtype)
        self.values = values

    @property
    def params(self):
        return list(self.values)

    @staticmethod
    def param_specs(shape, split=None):
        return [("d", tuple(shape), "ones", True)]

    @classmethod
    def from_params(cls, params, shape=None, split=None):
        return cls(list(params))

    def matmat(self, vectors):
        vectors = self.check(vectors)
        return [cast_to(d, v.dtype)[None] * v for d, v in zip(self.values, vectors)]

    def matvec(self, vector):
        # Without matmat's probe axis: LLQR applies a diagonal U twice per
        # step, and on eager torch the axis costs two ops per tensor.
        vector = self.check(vector, batched=False)
        return [cast_to(d, v.dtype) * v for d, v in zip(self.values, vector)]

    def matvec_into(self, vector):
        vector = self.check(vector, batched=False)
        return backend.multiply_into(vector, [cast_to(d, v.dtype) for d, v in zip(self.values, vector)])

    def diagonal(self):
        return list(self.values)

    def trace(self):
        return self._traces_many([self])[0]

    @classmethod
    def _traces_many(cls, blocks):
        return _diagonal_traces([b.values for b in blocks])

    def top_eigenvalue(self):
        return self._top_eigenvalues_many([self])[0]

    @classmethod
    def _top_eigenvalues_many(cls, blocks):
        tops = _diagonal_tops([b.values for b in blocks])
        return [tops[i] for i in range(len(blocks))]

    def masked(self, keep):
        """This operator where `keep` (a scalar boolean tensor or a Python
        bool), else zero."""
        return Diagonal(_kept(keep, self.values))

    def _spectral(self, damping, relative, power, rcond):
        return self._spectral_many([self], damping, relative, power, rcond)[0]

    @classmethod
    def _spectral_many(cls, blocks, damping, relative, power, rcond):
        # Every tensor of every block in one call; relative damping is each
        # tensor's own mean, as alone.
        rcond = 0.0 if rcond is None else rcond
        values = [v for b in blocks for v in b.values]
        scales = iter(_diagonal_scales(values, [damping] * len(values), [rcond] * len(values), relative=relative, power=power))
        return [Diagonal([next(scales) for _ in b.values]) for b in blocks]



class KFAC(_Spectral, LinearOperator):
    """``A kron B`` on one tensor: ``X -> A X B^T`` (see module doc).

    As a Fisher block, ``A`` is the second moment of the layer's inputs and
    ``B`` that of the gradients of its outputs; as LLQR's U, ``A`` and ``B``
    are learned and need not be symmetric. ``inverse`` and
    ``inverse_sqrt`` return an orthogonal :class:`EKFAC`.

    Args:
        A: ``(m, m)`` factor acting on the rows of the matrix view.
        B: ``(n, n)`` factor acting on its columns.
        shape: the tensor's shape.
        split: the tensor's axes before `split` make the rows (``m`` is
            their product). Defaults to `None` (the last axis is the
            columns).

    Raises:
        ValueError: if `shape` has fewer than two axes, `split` is not
            inside it, or `A` and `B` do not fit the matrix view.

    Example:

    >>> A = np.array([[2.0, 1.0], [1.0, 2.0]], "float32")
    >>> B = np.diag([1.0, 2.0, 3.0]).astype("float32")
    >>> K = kg.curvature.KFAC(A, B, shape=(2, 3))
    >>> np.allclose(K.to_dense(), np.kron(A, B)), float(K.trace())
    (True, 24.0)
    >>> K_inv = K.inverse()
    >>> type(K_inv).__name__, np.allclose(K_inv.to_dense(), np.linalg.inv(np.kron(A, B)), atol=1e-5)
    ('EKFAC', True)
    """

    def __init__(self, A, B, shape, split=None):
        shape = tuple(int(s) for s in shape)
        self.split, self.view = _matrix_view(shape, split)
        A, B = ops.convert_to_tensor(A), ops.convert_to_tensor(B)
        # A vector A is a diagonal input factor (an Embedding's token counts).
        rows = (self.view[0],) if len(A.shape) == 1 else (self.view[0],) * 2
        if static_shape(A) != rows or static_shape(B) != (self.view[1],) * 2:
            raise ValueError(f"KFAC factors of shapes {static_shape(A)}, {static_shape(B)} do not fit the view {self.view}.")
        super().__init__([shape], A.dtype)
        self._A, self.B = A, B
        self.rows = None
        self.diagonal_input = len(A.shape) == 1

    @classmethod
    def from_rows(cls, R, B, shape, split=None):
        """``A = R^T R`` given by its ``(r, m)`` rows (a Fisher block built
        from fewer input rows than the layer is wide): ``A`` is formed only
        if asked for, and the eigendecomposition that ``inverse`` needs comes
        from the ``r x r`` Gram matrix ``R R^T`` (see :meth:`eigh`)."""
        R = ops.convert_to_tensor(R)
        _, (m, _) = _matrix_view(tuple(int(d) for d in shape), split)
        if len(R.shape) != 2 or int(R.shape[1]) != m:
            raise ValueError(f"KFAC rows of shape {static_shape(R)} do not fit a view with {m} rows.")
        op = cls(ops.zeros((m,), R.dtype), B, shape, split)
        op._A, op.rows, op.diagonal_input = None, R, False
        return op

    @property
    def A(self):
        if self._A is None:
            self._A = ops.einsum("rm,rl->ml", self.rows, self.rows)
        return self._A

    @property
    def params(self):
        return [self.A, self.B]

    @staticmethod
    def param_specs(shape, split=None):
        _, (m, n) = _matrix_view(tuple(shape), split)
        return [("A", (m, m), "identity", False), ("B", (n, n), "identity", False)]

    @classmethod
    def from_params(cls, params, shape, split=None):
        return cls(params[0], params[1], shape, split)

    def matmat(self, vectors):
        (X,) = self.check(vectors)
        k = ops.shape(X)[0]
        Y = ops.reshape(X, (k,) + self.view)
        A, B = ops.cast(self.A, X.dtype), ops.cast(self.B, X.dtype)
        if self.diagonal_input:
            Y = A[None, :, None] * backend.sandwich(None, Y, B)
        else:
            Y = backend.sandwich(A, Y, B)
        return [ops.reshape(Y, ops.shape(X))]

    def group_key(self, vector):
        """Blocks with equal keys are multiplied together, as one batched
        product (``BlockDiagonal.matvec``): a Transformer's query, key, value
        and output kernels share one view, and on eager backends (and
        TensorFlow's executor) dozens of small matmuls cost more in dispatch
        and thread wake-ups than in arithmetic. Large factors (over
        ``GROUP_MAX_FACTOR_ELEMENTS``) are not grouped: the stacking copies
        them every product, which costs more than the dispatch it saves.
        None: multiply alone."""
        if type(self) is not KFAC or self.diagonal_input or self.rows is not None:
            return None
        m, n = self.view
        if m * m + n * n > GROUP_MAX_FACTOR_ELEMENTS:
            return None
        return (self.view, str(vector[0].dtype))

    def _input_diagonal(self):
        if self.rows is not None and self._A is None:
            return ops.sum(ops.square(self.rows), axis=0)
        return self.A if self.diagonal_input else ops.diagonal(self.A)

    def diagonal(self):
        d = self._input_diagonal()[:, None] * ops.diagonal(self.B)[None, :]
        return [ops.reshape(d, self.shapes[0])]

    def trace(self):
        return self._traces_many([self])[0]

    @classmethod
    def _traces_many(cls, blocks):
        def source(b):
            if b.diagonal_input:
                return "diagonal", b.A
            if b.rows is not None and b._A is None:
                return "gram", b.rows
            return "full", b.A

        kinds = {"full": [], "gram": [], "diagonal": []}
        order = []
        for b in blocks:
            kind, first = source(b)
            order.append((kind, len(kinds[kind])))
            kinds[kind].append((first, b.B))
        found = _kfac_traces(kinds["full"], kinds["gram"], kinds["diagonal"])
        start = {"full": 0, "gram": len(kinds["full"]), "diagonal": len(kinds["full"]) + len(kinds["gram"])}
        return [found[start[kind] + j] for kind, j in order]

    def eigh(self):
        """Eigenvalues and eigenvectors of both (symmetrised) factors, computed
        once per operator (inverse and inverse_sqrt share them). A diagonal
        input factor is its own eigendecomposition (basis None: identity)."""
        _kfac_eighs([self])
        return self._eigh

    @property
    def gram(self):
        """Whether the input factor's eigenvectors come from its rows'
        Gram matrix: ``A = R^T R`` with fewer rows r than columns m."""
        return self.rows is not None and int(self.rows.shape[0]) < self.view[0]

    def top_eigenvalue(self):
        return self._top_eigenvalues_many([self])[0]

    @classmethod
    def _top_eigenvalues_many(cls, blocks):
        _kfac_eighs(blocks)
        return _kronecker_tops([b._eigh[0] for b in blocks], [b._eigh[2] for b in blocks])

    def _spectral(self, damping, relative, power, rcond):
        return self._spectral_many([self], damping, relative, power, rcond)[0]

    @classmethod
    def _spectral_many(cls, blocks, damping, relative, power, rcond):
        # Damping acts on the Kronecker product itself, A kron B + lambda I,
        # diagonal in the factors' joint eigenbasis: an EKFAC operator. The
        # scales of all blocks in one call, the Gram-built ones in another.
        _kfac_eighs(blocks)
        out = [None] * len(blocks)
        for gram in (False, True):
            members = [i for i, b in enumerate(blocks) if b.gram == gram]
            if not members:
                continue
            eighs = [blocks[i]._eigh for i in members]
            las, lbs = [e[0] for e in eighs], [e[2] for e in eighs]
            dampings = [damping] * len(members)
            rconds = [max(blocks[i].view) * _eps(e[0].dtype) if rcond is None else rcond for i, e in zip(members, eighs)]
            if not gram:
                scales = _kronecker_scales(las, lbs, dampings, rconds, relative=relative, power=power)
                nulls = [None] * len(members)
            else:
                sizes = [blocks[i].view[0] * blocks[i].view[1] for i in members]
                scales, nulls = zip(*_gram_kronecker_scales(las, lbs, dampings, rconds, sizes, relative=relative, power=power))
            for i, e, s, null in zip(members, eighs, scales, nulls):
                b = blocks[i]
                out[i] = EKFAC(e[1], e[3], s, b.shapes[0], b.split, orthogonal=True, null=null)
        return out


def _kfac_eighs(blocks):
    """Each K-FAC block's ``eigh`` (cached on it), every factor of the
    blocks not yet decomposed solved in one call (``symmetric_eighs``).

    A Gram-built input factor ``A = R^T R`` of rank at most r < m: ``R R^T
    = U diag(w) U^T`` (r x r, cheap) gives A's nonzero eigenvalues w and
    eigenvectors ``R^T U w^-1/2`` (m x r); the other m - r eigenvalues are
    zero, their eigenvectors any basis of the complement, never formed.
    Eigenvalues at rounding level (below r * eps * max) count as zero, their
    columns too."""
    todo = [b for b in blocks if getattr(b, "_eigh", None) is None]
    if not todo:
        return
    grams = [b for b in todo if b.gram]
    gram_matrices = iter(_grams([b.rows for b in grams]) if grams else [])
    matrices, whats = [], []
    for b in todo:
        if b.diagonal_input:
            pass
        elif b.gram:
            matrices.append(next(gram_matrices))
            whats.append("the Gram matrix of the K-FAC input factor")
        else:
            matrices.append(b.A)
            whats.append("the K-FAC input factor")
        matrices.append(b.B)
        whats.append("the K-FAC output factor")
    solved = iter(symmetric_eighs(matrices, whats))
    inputs, outputs = [], []
    for b in todo:
        inputs.append((b.A, None) if b.diagonal_input else next(solved))
        outputs.append(next(solved))
    if grams:
        at = [i for i, b in enumerate(todo) if b.gram]
        bases = _gram_bases([todo[i].rows for i in at], [inputs[i][0] for i in at], [inputs[i][1] for i in at])
        for i, basis in zip(at, bases):
            inputs[i] = tuple(basis)
    for b, (la, qa), (lb, qb) in zip(todo, inputs, outputs):
        b._eigh = (la, qa, lb, qb)


def _ekfac_body(QA, QG, s, null, X, view):
    """``Q_A (s * (Q_A^T X_k Q_G)) Q_G^T`` for each ``X_k`` of `X`
    (``EKFAC.matmat``; QA None: the identity)."""
    k = ops.shape(X)[0]
    QG, s = ops.cast(QG, X.dtype), ops.cast(s, X.dtype)
    Y = ops.reshape(X, (k,) + tuple(view))
    QGt = ops.transpose(QG)
    if QA is None:
        Y = backend.sandwich(None, s[None] * backend.sandwich(None, Y, QGt), QG)
    else:
        QA = ops.cast(QA, X.dtype)
        inner = backend.sandwich(ops.transpose(QA), Y, QGt)
        if null is None:
            Y = backend.sandwich(QA, s[None] * inner, QG)
        else:  # QA QA^T Y = QA (QA^T Y QG) QG^T: the same inner product
            null = ops.cast(null, X.dtype)
            Y = backend.sandwich(QA, (s - null)[None] * inner, QG) + null * Y
    return ops.reshape(Y, ops.shape(X))


# One program per block shape on JAX, as the scales above: an EK-FAC
# product is ten eager ops, each compiled for each shape.
_ekfac_product = backend.block_kernel(_ekfac_body, static_argnames=("view",))


class EKFAC(_Spectral, LinearOperator):
    """Eigenvalue-corrected K-FAC: ``X -> Q_A (s * (Q_A^T X Q_G)) Q_G^T``.

    Acts on one tensor (see module doc). With orthogonal ``Q_A``, ``Q_G``
    (as from ``KFAC.inverse``) ``s`` holds the eigenvalues and the inverse
    is exact; LLQR learns ``Q_A``, ``Q_G`` freely, which has no structured
    inverse.

    Args:
        QA: ``(m, m)`` basis of the rows of the matrix view.
        QG: ``(n, n)`` basis of its columns.
        s: the ``m * n`` scales, reshaped to ``(m, n)``.
        shape: the tensor's shape.
        split: as for :class:`KFAC`. Defaults to `None`.
        orthogonal: whether `QA` and `QG` are orthogonal (enables
            ``inverse`` and the exact ``trace``). Defaults to `False`.
        null: with an ``(m, r)`` `QA` of orthonormal (or zero) columns and
            ``(r, n)`` scales, the operator's one eigenvalue on the rows'
            complement: ``X -> QA ((s - null) * (QA^T X QG)) QG^T + null X``
            (``KFAC.inverse`` of a factor of rank r < m). Defaults to `None`
            (QA is square).

    Raises:
        ValueError: if `shape` has fewer than two axes or `split` is not
            inside it.
        NotImplementedError: from ``inverse`` / ``inverse_sqrt`` when not
            `orthogonal`.

    Example:

    >>> QA = np.array([[0.6, -0.8], [0.8, 0.6]], "float32")
    >>> s = np.arange(1, 7, dtype="float32").reshape(2, 3)
    >>> E = kg.curvature.EKFAC(QA, np.eye(3, dtype="float32"), s, shape=(2, 3), orthogonal=True)
    >>> np.round(np.linalg.eigvalsh(E.to_dense()), 3).tolist()
    [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    >>> float(E.trace())
    21.0
    """

    def __init__(self, QA, QG, s, shape, split=None, orthogonal=False, null=None):
        shape = tuple(int(d) for d in shape)
        self.split, self.view = _matrix_view(shape, split)
        # QA None: the rows' basis is the identity (a diagonal input factor).
        QA = None if QA is None else ops.convert_to_tensor(QA)
        QG, s = ops.convert_to_tensor(QG), ops.convert_to_tensor(s)
        if null is not None:
            if QA is None or not orthogonal:
                raise ValueError("An EKFAC null-space scale needs orthonormal columns QA.")
            s = ops.reshape(s, (int(QA.shape[1]), self.view[1]))
            null = ops.cast(ops.convert_to_tensor(null), s.dtype)
        else:
            s = ops.reshape(s, self.view)
        super().__init__([shape], s.dtype)
        self.QA, self.QG, self.s = QA, QG, s
        # With `null`, QA has r <= m orthonormal (or zero) columns and the
        # operator is ``null`` on the rest of the row space.
        self.null = null
        self.orthogonal = bool(orthogonal)
        # Q s Q^T with orthonormal bases is symmetric (``LinearOperator.symmetric_per_tensor``).
        self.symmetric_per_tensor = self.orthogonal

    @property
    def params(self):
        return [self.QG, self.s] if self.QA is None else [self.QA, self.QG, self.s]

    @staticmethod
    def param_specs(shape, split=None):
        _, (m, n) = _matrix_view(tuple(shape), split)
        return [("QA", (m, m), "identity", False), ("QG", (n, n), "identity", False), ("s", (m, n), "ones", True)]

    @classmethod
    def from_params(cls, params, shape, split=None):
        return cls(params[0], params[1], params[2], shape, split)

    def matmat(self, vectors):
        (X,) = self.check(vectors)
        return [_ekfac_product(self.QA, self.QG, self.s, self.null, X, view=self.view)]

    def _range_scales(self):
        """Scales on QA's columns, and the constant added everywhere."""
        if self.null is None:
            return self.s, None
        return self.s - self.null, self.null

    def diagonal(self):
        s, null = self._range_scales()
        if self.QA is None:
            d = ops.einsum("jl,ml->jm", s, ops.square(self.QG))
        else:
            d = ops.einsum("ij,jl,ml->im", ops.square(self.QA), s, ops.square(self.QG))
        if null is not None:
            d = d + null
        return [ops.reshape(d, self.shapes[0])]

    def trace(self):
        if self.orthogonal and self.null is None:
            return ops.sum(self.s)
        return ops.sum(self.diagonal()[0])

    def top_eigenvalue(self):
        if not self.orthogonal:
            raise NotImplementedError("An EKFAC operator with learned bases has no known top eigenvalue.")
        # ops.max of a stack: Keras' torch maximum of two float64 tensors
        # returns float32 (keras 3.15).
        return ops.max(self.s) if self.null is None else ops.max(ops.stack([ops.max(self.s), self.null]))

    def masked(self, keep):
        kept = _kept(keep, [self.s] if self.null is None else [self.s, self.null])
        null = None if self.null is None else kept[1]
        return EKFAC(self.QA, self.QG, kept[0], self.shapes[0], self.split, self.orthogonal, null)

    def _spectral(self, damping, relative, power, rcond):
        if not self.orthogonal:
            raise NotImplementedError("An EKFAC operator with learned (non-orthogonal) bases has no structured inverse.")
        rcond = max(self.view) * _eps(self.s.dtype) if rcond is None else rcond
        if self.null is None:
            lam = _absolute(damping, relative, mean(self.s))
            return EKFAC(self.QA, self.QG, spectral(self.s, lam, power, rcond), self.shapes[0], self.split, orthogonal=True)
        lam = _absolute(damping, relative, self.trace() / float(self.dim))
        both = spectral(ops.concatenate([ops.reshape(self.s, (-1,)), ops.reshape(self.null, (1,))]), lam, power, rcond)
        return EKFAC(self.QA, self.QG, ops.reshape(both[:-1], ops.shape(self.s)), self.shapes[0], self.split, True, both[-1])



class DiagonalInputKFAC(KFAC):
    """:class:`KFAC` with a diagonal input factor: ``X -> diag(a) X B^T``.

    The block of an Embedding (its input rows are one-hot tokens, so the
    input factor is diagonal: token counts) for LLQR's U and the metric;
    the ``vocabulary x vocabulary`` factor is never formed.

    Args:
        a: ``(m,)`` diagonal of the input factor.
        B: ``(n, n)`` output factor.
        shape, split: as for :class:`KFAC`.

    Raises:
        ValueError: as for :class:`KFAC`.

    Example:

    >>> K = kg.curvature.DiagonalInputKFAC(np.array([1.0, 2.0], "float32"), 3.0 * np.eye(2, dtype="float32"), (2, 2))
    >>> np.allclose(K.to_dense(), np.kron(np.diag([1.0, 2.0]), 3.0 * np.eye(2))), float(K.trace())
    (True, 18.0)
    """

    @staticmethod
    def param_specs(shape, split=None):
        _, (m, n) = _matrix_view(tuple(shape), split)
        return [("a", (m,), "ones", False), ("B", (n, n), "identity", False)]


class DiagonalInputEKFAC(EKFAC):
    """:class:`EKFAC` whose input basis is the identity:
    ``X -> (s * (X Q_G)) Q_G^T`` (an Embedding's EK-FAC block; LLQR learns
    ``Q_G`` and ``s``).

    Args:
        QG: ``(n, n)`` basis of the columns.
        s: the ``m * n`` scales.
        shape, split, orthogonal: as for :class:`EKFAC`.

    Raises:
        ValueError: as for :class:`EKFAC`.

    Example:

    >>> s = np.arange(1, 5, dtype="float32").reshape(2, 2)
    >>> E = kg.curvature.DiagonalInputEKFAC(np.eye(2, dtype="float32"), s, shape=(2, 2), orthogonal=True)
    >>> np.diag(E.to_dense()).tolist(), float(E.trace())
    ([1.0, 2.0, 3.0, 4.0], 10.0)
    >>> K = kg.curvature.DiagonalInputKFAC(np.array([1.0, 2.0], "float32"), np.eye(2, dtype="float32"), (2, 2))
    >>> type(K.inverse()).__name__, K.inverse().QA is None  # the identity input basis, never formed
    ('EKFAC', True)
    """

    def __init__(self, QG, s, shape, split=None, orthogonal=False):
        super().__init__(None, QG, s, shape, split, orthogonal)

    @staticmethod
    def param_specs(shape, split=None):
        _, (m, n) = _matrix_view(tuple(shape), split)
        return [("QG", (n, n), "identity", False), ("s", (m, n), "ones", True)]

    @classmethod
    def from_params(cls, params, shape, split=None):
        return cls(params[0], params[1], shape, split)


# K-FAC blocks whose two factors hold more elements than this are multiplied
# alone: grouping stacks the factors afresh each product, and at ViT-B/16's
# 768- and 3072-wide factors (torch) the copies took 1.8 s of a 12.5 s step,
# more than the batched products saved (each product is milliseconds of
# arithmetic there, so one dispatch each costs nothing).
GROUP_MAX_FACTOR_ELEMENTS = 2 * 512 * 512


def _kfac_group_matvec(blocks, xs):
    """``A_i X_i B_i^T`` for K-FAC blocks of one view (``group_key``), as two
    batched matmuls over the stacked blocks."""
    dtype = xs[0].dtype
    view = blocks[0].view
    A = ops.stack([cast_to(b.A, dtype) for b in blocks])
    B = ops.stack([cast_to(b.B, dtype) for b in blocks])
    X = ops.stack([ops.reshape(x, view) for x in xs])
    Y = ops.matmul(A, ops.matmul(X, ops.swapaxes(B, -1, -2)))
    return [ops.reshape(y, ops.shape(x)) for y, x in zip(ops.unstack(Y), xs)]


class BlockDiagonal(LinearOperator):
    """Blocks acting on consecutive tensors of the list, nothing across them.

    `damping` in ``inverse`` / ``inverse_sqrt`` is one number for every block
    or a list with one per block. Fisher metrics (``kg.sharpness.
    fisher_metric``) and LLQR's U have this form.

    Args:
        blocks: a non-empty list of operators; each acts on the next
            ``len(block.shapes)`` tensors of a vector.

    Raises:
        ValueError: if `blocks` is empty, or a list of dampings does not
            have one entry per block.

    Example:

    >>> K = kg.curvature.KFAC(np.eye(2, dtype="float32"), np.eye(3, dtype="float32"), shape=(2, 3))
    >>> M = kg.curvature.BlockDiagonal([K, kg.curvature.Diagonal([np.full(3, 2.0, "float32")])])
    >>> M.shapes, float(M.trace())
    ([(2, 3), (3,)], 12.0)
    >>> [type(b).__name__ for b in M.inverse(damping=[0.0, 0.5]).blocks]
    ['EKFAC', 'Diagonal']
    """

    def __init__(self, blocks, paths=None):
        blocks = list(blocks)
        if not blocks:
            raise ValueError("BlockDiagonal needs at least one block.")
        shapes = [s for b in blocks for s in b.shapes]
        super().__init__(shapes, blocks[0].dtype)
        self.blocks = blocks
        self.symmetric_per_tensor = all(len(b.shapes) == 1 and b.symmetric_per_tensor for b in blocks)
        if paths is not None and len(paths) != len(shapes):
            raise ValueError(f"{len(paths)} paths for {len(shapes)} tensors.")
        self.paths = None if paths is None else list(paths)

    def describe(self):
        """One dict per block: ``path`` (the variable's, where known),
        ``block`` (its class), ``shape`` and ``view`` (the ``(m, n)`` matrix
        view of a Kronecker block, the tensor's shape for a diagonal one)."""
        out, i = [], 0
        for b in self.blocks:
            for shape in b.shapes:
                path = self.paths[i] if self.paths else f"tensor {i}"
                view = tuple(b.view) if hasattr(b, "view") else tuple(shape)
                out.append({"path": path, "block": type(b).__name__, "shape": tuple(shape), "view": view})
                i += 1
        return out

    def _path_of_block(self, index):
        """The variable path(s) of block `index`, for messages."""
        start = sum(len(b.shapes) for b in self.blocks[:index])
        count = len(self.blocks[index].shapes)
        if not self.paths:
            return f"block {index}"
        return ", ".join(self.paths[start:start + count])

    def summary(self, print_fn=print):
        """Prints each variable's block type and 2-D view (see ``describe``)."""
        rows = [(d["path"], d["block"], "x".join(map(str, d["shape"])) or "()",
                 " x ".join(map(str, d["view"])) if d["block"] != "Diagonal" else "diagonal")
                for d in self.describe()]
        head = ("variable", "block", "shape", "2-D view")
        widths = [max(len(str(r[c])) for r in rows + [head]) for c in range(4)]
        for r in [head] + rows:
            print_fn("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip())

    # Learnable layout: [(block class, shape, split)] with one tensor per block.
    @classmethod
    def from_params(cls, layout, params, paths=None):
        blocks, i = [], 0
        for kind, shape, split in layout:
            k = len(kind.param_specs(shape, split))
            blocks.append(kind.from_params(list(params[i : i + k]), shape, split))
            i += k
        if i != len(params):
            raise ValueError(f"{len(params)} parameters for a layout that takes {i}.")
        return cls(blocks, paths)

    @property
    def params(self):
        return [p for b in self.blocks for p in b.params]

    def split_list(self, vectors):
        out, i = [], 0
        for b in self.blocks:
            out.append(list(vectors[i : i + len(b.shapes)]))
            i += len(b.shapes)
        return out

    def matmat(self, vectors):
        vectors = self.check(vectors)
        return [y for b, v in zip(self.blocks, self.split_list(vectors)) for y in b.matmat(v)]

    def matvec(self, vector):
        vector = self.check(vector, batched=False)
        parts = self.split_list(vector)
        out = [None] * len(self.blocks)
        groups = {}  # same-shaped Kronecker blocks: one batched product each
        for i, (b, v) in enumerate(zip(self.blocks, parts)):
            key = b.group_key(v) if backend.batch_small_products else None
            if key is None:
                out[i] = b.matvec(v)
            else:
                groups.setdefault(key, []).append(i)
        for members in groups.values():
            if len(members) == 1:
                out[members[0]] = self.blocks[members[0]].matvec(parts[members[0]])
                continue
            ys = _kfac_group_matvec([self.blocks[i] for i in members], [parts[i][0] for i in members])
            for i, y in zip(members, ys):
                out[i] = [y]
        return [y for ys in out for y in ys]

    def matvec_into(self, vector):
        if not all(isinstance(b, Diagonal) for b in self.blocks):
            return self.matvec(vector)
        parts = self.split_list(self.check(vector, batched=False))
        return [y for b, v in zip(self.blocks, parts) for y in b.matvec_into(v)]

    def diagonal(self):
        return [d for b in self.blocks for d in b.diagonal()]

    def trace(self):
        total = None
        for many, members in self._by_class("_traces_many").items():
            blocks = [self.blocks[i] for i in members]
            for t in (many(blocks) if many else [b.trace() for b in blocks]):
                total = t if total is None else total + t
        return total

    def _per_block(self, damping):
        if isinstance(damping, (list, tuple)):
            if len(damping) != len(self.blocks):
                raise ValueError(f"{len(damping)} damping values for {len(self.blocks)} blocks.")
            return list(damping)
        return [damping] * len(self.blocks)

    def inverse(self, damping=0.0, relative=False, rcond=None, block_rcond=None):
        return self._blockwise("inverse", damping, relative, rcond, block_rcond)

    def inverse_sqrt(self, damping=0.0, relative=False, rcond=None, block_rcond=None):
        return self._blockwise("inverse_sqrt", damping, relative, rcond, block_rcond)

    def _by_class(self, method):
        """Block indices grouped by their class's `method` (a classmethod
        taking a list of blocks: ``_spectral_many``, ``_traces_many``, ...),
        in order; blocks without it under None."""
        groups = {}
        for i, b in enumerate(self.blocks):
            groups.setdefault(getattr(type(b), method, None), []).append(i)
        return groups

    def _top_eigenvalues(self):
        """Each block's largest eigenvalue, stacked (half precision read in
        float32); the blocks of one class in one call."""
        def dtype(b):
            return "float32" if b.dtype in ("float16", "bfloat16") else b.dtype

        tops = [None] * len(self.blocks)
        for many, members in self._by_class("_top_eigenvalues_many").items():
            found = many([self.blocks[i] for i in members]) if many else [self.blocks[i].top_eigenvalue() for i in members]
            for i, t in zip(members, found):
                tops[i] = t
        return ops.stack([ops.cast(t, dtype(b)) for b, t in zip(self.blocks, tops)])

    def _blockwise(self, method, damping, relative, rcond, block_rcond):
        """Each block's (pseudo-)inverse; with relative damping, a block whose
        largest eigenvalue is at most `block_rcond` (default
        ``BLOCK_RCOND``) times the largest of all blocks counts as zero.

        Relative damping scales with each block, so a block that is zero in
        exact arithmetic but holds rounding noise (an attention key bias,
        which softmax ignores: its Fisher is ~1e-14 of the others' in float32)
        would otherwise be inverted as if it were information, and its
        inverse multiply noise by ~1e14. No block-local cutoff can tell such
        a block from a real one; its scale next to the others can.

        With one damping for all, the blocks of one class are inverted in a
        few calls (``_spectral_many``); a block whose eigendecomposition
        fails is then named by the one-block path."""
        out = None
        if not isinstance(damping, (list, tuple)):
            try:
                out = self._grouped(method, damping, relative, rcond)
            except EigenDecompositionError:
                out = None  # the loop below raises again, naming the block
        if out is None:
            out = []
            for i, (b, d) in enumerate(zip(self.blocks, self._per_block(damping))):
                try:
                    out.append(getattr(b, method)(d, relative, rcond))
                except EigenDecompositionError as error:
                    raise EigenDecompositionError(f"{self._path_of_block(i)}: {error}") from error
        floor = BLOCK_RCOND if block_rcond is None else float(block_rcond)
        if relative and floor > 0 and all(hasattr(b, "top_eigenvalue") for b in self.blocks) and all(hasattr(o, "masked") for o in out):
            tops = self._top_eigenvalues()
            keep = ops.greater(tops, floor * ops.max(tops))
            if backend.is_concrete(keep):
                # Read once on the host: a kept block stays as it is and a
                # dropped one becomes zeros, with no kernel call per block
                # (500 of 1717 calls in MobileNetV3Small's K-FAC S_R on
                # TensorFlow).
                keep = [bool(k) for k in np.asarray(ops.convert_to_numpy(keep))]
            out = [o.masked(keep[i]) for i, o in enumerate(out)]
        return BlockDiagonal(out, self.paths)

    def _grouped(self, method, damping, relative, rcond):
        out = [None] * len(self.blocks)
        power = {"inverse": 1, "inverse_sqrt": 0.5}[method]
        for many, members in self._by_class("_spectral_many").items():
            blocks = [self.blocks[i] for i in members]
            found = many(blocks, damping, relative, power, rcond) if many else [getattr(b, method)(damping, relative, rcond) for b in blocks]
            for i, o in zip(members, found):
                out[i] = o
        return out


class Dense(_Spectral, LinearOperator):
    """An explicit symmetric ``dim x dim`` matrix (small problems, references).

    Args:
        matrix: the ``(dim, dim)`` matrix, coordinates in the order of the
            flattened list of tensors.
        shapes: the shape of each tensor of a vector.

    Raises:
        ValueError: if `matrix` is not ``dim x dim`` for the `shapes`.

    Example:

    >>> D = kg.curvature.Dense(np.array([[2.0, 1.0], [1.0, 2.0]], "float32"), [(2,)])
    >>> np.round(D.inverse().to_dense(), 3).tolist()
    [[0.667, -0.333], [-0.333, 0.667]]
    >>> keras.ops.convert_to_numpy(D.matvec([np.array([1.0, 0.0], "float32")])[0]).tolist()
    [2.0, 1.0]
    """

    def __init__(self, matrix, shapes):
        matrix = ops.convert_to_tensor(matrix)
        super().__init__(shapes, matrix.dtype)
        if tuple(ops.shape(matrix)) != (self.dim, self.dim):
            raise ValueError(f"A {tuple(ops.shape(matrix))} matrix does not act on {self.dim} coordinates.")
        self.matrix = matrix

    def matmat(self, vectors):
        V = flatten(self.check(vectors))
        return unflatten(ops.einsum("kj,ij->ki", V, ops.cast(self.matrix, V.dtype)), self.shapes)

    def diagonal(self):
        return [d[0] for d in unflatten(ops.diagonal(self.matrix)[None], self.shapes)]

    def trace(self):
        return ops.trace(self.matrix)

    def _spectral(self, damping, relative, power, rcond):
        w, q = symmetric_eigh(self.matrix, "the dense block")
        lam = _absolute(damping, relative, mean(w))
        rcond = self.dim * _eps(w.dtype) if rcond is None else rcond
        f = spectral(w, lam, power, rcond)
        return Dense(ops.einsum("ij,kj->ik", q * f[None, :], q), self.shapes)

