"""Curvature operators of a model's mean loss: Hessian, GGN / Fisher, H - GGN.

Each is a :class:`LinearOperator` over lists shaped like the model's
trainable variables, evaluated at the model's current weights on data
``(x, y)``, streamed in `batch_size` pieces (exact batch-size-weighted
means). ``matmat`` linearises once per data batch for all k vectors (a
Hessian-vector product of a surrogate whose Hessian is the wanted matrix):

- ``Hessian``: the loss itself (regularisers included);
- ``GGN`` (alias ``Fisher``): ``1/N sum_jn J^T c c^T J`` for the output
  factors ``c`` of its kind: ``"exact"`` (the GGN, equal to the exact Fisher
  for softmax cross-entropy), ``"mc"`` (labels drawn from the model) or
  ``"empirical"`` (data labels; not the Fisher). Its ``diagonal()``,
  ``kfac()`` and ``trace_with()`` are exact and probe-free, from layer
  inputs and output gradients (``capture.py``);
- ``GGNResidual``: ``H - GGN``, the second-order term of the Hessian.

Curvature is taken in inference mode (``training=False``) by default.
"""

import keras
import numpy as np
from keras import ops

from keras_geosam import backend
from keras_geosam.curvature import probes
from keras_geosam.curvature.capture import Capture
from keras_geosam.curvature.functional import batches
from keras_geosam.curvature.functional import check_data
from keras_geosam.curvature.functional import check_labels
from keras_geosam.curvature.functional import model_functions
from keras_geosam.curvature.functional import num_examples
from keras_geosam.curvature.losses import require_classifier
from keras_geosam.curvature.losses import require_gauss_newton
from keras_geosam.curvature.operators.base import LinearOperator
from keras_geosam.curvature.layers import warn_diagonal_fallback
from keras_geosam.curvature.operators.structured import EKFAC
from keras_geosam.curvature.operators.structured import DiagonalInputKFAC
from keras_geosam.curvature.operators.structured import KFAC
from keras_geosam.curvature.operators.structured import BlockDiagonal
from keras_geosam.curvature.operators.structured import Diagonal

KINDS = ("exact", "mc", "empirical")
DEFAULT_BATCH_SIZE = 256


def check_kind(kind):
    if kind not in KINDS:
        raise ValueError(f"Fisher kind must be one of {KINDS}, got {kind!r}.")


class ModelOperator(LinearOperator):
    """A curvature matrix of `model`'s mean loss over ``(x, y)``.

    Args:
        model: a built single-output ``keras.Model``.
        x, y: data (NumPy arrays or tensors of equal length).
        loss: loss to use instead of the compiled one.
        batch_size: examples per streamed batch (default 256).
        training: layers in training mode (default False).
    """

    needs_labels = True

    def __init__(self, model, x, y=None, loss=None, batch_size=None, training=False):
        self.fns = model_functions(model, loss, training)
        super().__init__([tuple(v.shape) for v in self.fns.variables], self.fns.variables[0].dtype)
        self.x, self.y = check_data(x, y, labels_needed=self.needs_labels)
        check_labels(self.fns, self.x, self.y)
        self.num_examples = num_examples(self.x)
        self.batch_size = DEFAULT_BATCH_SIZE if batch_size is None else batch_size

    def batches(self):
        """Yields ``(x_b, y_b, n_b, offset)``."""
        offset = 0
        for xb, yb, nb in batches(self.x, self.y, self.batch_size):
            yield xb, yb, nb, offset
            offset += nb

    def _mean_over_batches(self, fn):
        """``sum_b (n_b / N) fn(batch)`` for list-valued `fn`."""
        total = None
        def share_of(xb, yb, offset, share):
            out = fn(xb, yb, offset)
            return out if share is None else [o * ops.cast(share, o.dtype) for o in out]

        for xb, yb, nb, offset in self.batches():
            out = backend.sum_over_replicas(self.fns.model, share_of, xb, yb, offset)
            w = nb / self.num_examples
            out = [o * backend.device_constant(np.asarray(w, keras.backend.standardize_dtype(o.dtype))) for o in out]
            total = out if total is None else [t + o for t, o in zip(total, out)]
        return total

    def matmat(self, vectors):
        vectors = [ops.convert_to_tensor(v, dtype=self.dtype) for v in self.check(vectors)]
        params, nt = self.fns.params(), self.fns.non_trainable()
        return self._mean_over_batches(lambda xb, yb, offset: self._matmat_batch(params, nt, vectors, xb, yb, offset))

    def _matmat_batch(self, params, nt, vectors, xb, yb, offset):
        raise NotImplementedError


class Hessian(ModelOperator):
    """The Hessian of the mean loss (regularisers included).

    ``H = grad^2 (1/N sum_n loss_n + regularisers)`` at the model's current
    weights, over lists shaped like its trainable variables; products
    stream over the data in `batch_size` pieces. ``kg.curvature.hvp`` is
    its ``matvec``.

    Args:
        model: a built single-output ``keras.Model`` with a loss.
        x: inputs: a NumPy array or tensor (or a list of them).
        y: targets of the same length.
        loss: loss to use instead of the compiled one. Defaults to `None`.
        batch_size: examples per streamed batch. Defaults to `None` (256).
        training: layers in training mode. Defaults to `False`.

    Raises:
        ValueError: if the model is not built or has no loss, or the data
            is invalid (labels missing, lengths differ, non-finite inputs,
            labels that are not class ids of the model).

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, kernel_initializer="zeros")])
    >>> model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> H = kg.curvature.Hessian(model, x, y)
    >>> H
    Hessian(dim=15, tensors=2)
    >>> dense = H.to_dense()
    >>> np.allclose(dense, dense.T, atol=1e-6), round(float(np.trace(dense)), 3)
    (True, 2.429)
    """

    def _matmat_batch(self, params, nt, vectors, xb, yb, offset):
        return self.fns.kernel("hvp_batched")(params, nt, vectors, xb, yb)


class GGNResidual(ModelOperator):
    """``H - GGN``: the second-order term of the Hessian.

    ``1/N sum_nk r_nk grad^2 z_nk`` plus the regularisers' Hessian, with r
    the loss gradient in the logits z. Zero on every per-layer diagonal
    block of a piecewise-linear network, and zero for a linear model.

    Args:
        model: a built classifier with a categorical cross-entropy loss.
        x, y: data, as for :class:`Hessian`.
        loss, batch_size, training: as for :class:`Hessian`.

    Raises:
        ValueError: if the loss is not a categorical cross-entropy, or for
            the reasons :class:`Hessian` gives.

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> model = keras.Sequential([
    ...     keras.Input((4,)),
    ...     keras.layers.Dense(5, activation="tanh"),
    ...     keras.layers.Dense(3),
    ... ])
    >>> model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> R = kg.curvature.GGNResidual(model, x, y)
    >>> H = kg.curvature.Hessian(model, x, y).to_dense()
    >>> G = kg.curvature.GGN(model, x).to_dense()
    >>> np.allclose(R.to_dense(), H - G, atol=1e-5)
    True
    """

    def __init__(self, model, x, y, loss=None, batch_size=None, training=False):
        super().__init__(model, x, y, loss, batch_size, training)
        require_classifier(self.fns.spec, "GGNResidual")

    def _matmat_batch(self, params, nt, vectors, xb, yb, offset):
        return self.fns.kernel("residual_batched")(params, nt, vectors, xb, yb)


class GGN(ModelOperator):
    """Generalised Gauss-Newton / Fisher of the mean loss, of a given kind.

    ``1/N sum_jn J_n^T c_jn c_jn^T J_n``, J_n the Jacobian of example n's
    logits, for the output factors c of `kind`: ``"exact"`` (the GGN,
    equal to the Fisher for softmax cross-entropy), ``"mc"`` (labels drawn
    from the model) or ``"empirical"`` (data labels; not the Fisher).
    ``diagonal()``, ``kfac()`` and ``trace_with()`` are exact and
    probe-free. ``kg.curvature.Fisher`` is the same class.

    Args:
        model, x, loss, batch_size, training: see :class:`ModelOperator`.
        y: labels, needed only for ``kind="empirical"``. Defaults to
            `None`.
        kind: ``"exact"`` | ``"mc"`` | ``"empirical"``. Defaults to
            ``"exact"``.
        num_samples: labels drawn per example for ``"mc"``. Defaults to
            `1`.
        seed: seeds the ``"mc"`` labels (the same on every backend).
            Defaults to `0`.

    Raises:
        ValueError: if `kind` is unknown, `num_samples` is not an integer
            >= 1, the loss is not a categorical cross-entropy, labels are
            missing for ``"empirical"``, or for the reasons
            :class:`Hessian` gives.

    Example:

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(8, 4)).astype("float32")
    >>> y = rng.integers(0, 3, size=8)
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, kernel_initializer="zeros")])
    >>> model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> G = kg.curvature.GGN(model, x)
    >>> [tuple(d.shape) for d in G.diagonal()]
    [(4, 3), (3,)]
    >>> # A linear softmax model's Hessian is its Gauss-Newton matrix.
    >>> np.allclose(G.to_dense(), kg.curvature.Hessian(model, x, y).to_dense(), atol=1e-5)
    True
    >>> type(G.kfac()).__name__
    'BlockDiagonal'
    """

    def __init__(self, model, x, y=None, kind="exact", num_samples=1, seed=0, loss=None, batch_size=None, training=False):
        check_kind(kind)
        if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)) or num_samples < 1:
            raise ValueError(f"num_samples must be an integer >= 1, got {num_samples!r}.")
        self.needs_labels = kind == "empirical"
        super().__init__(model, x, y if kind == "empirical" else None, loss, batch_size, training)
        if kind == "exact":
            require_gauss_newton(self.fns.spec, "GGN (exact)")
        else:
            require_classifier(self.fns.spec, f"GGN / Fisher ({kind})")
        self.kind, self.num_samples, self.seed = kind, int(num_samples), seed
        self._key = probes.key(seed, "labels")
        self._capture = None

    def _offset(self, offset):
        # Placed explicitly: a Python int would be an implicit host
        # transfer on every batch (JAX).
        if isinstance(offset, (int, np.integer)):
            return backend.device_constant(np.int32(offset))
        return ops.cast(offset, "int32")  # a replica's own offset

    def _matmat_batch(self, params, nt, vectors, xb, yb, offset):
        kernel = self.fns.kernel("ggn_batched", kind=self.kind, num_samples=self.num_samples)
        return kernel(params, nt, vectors, xb, yb, self._key, self._offset(offset))

    # ------------------------------------------ exact, probe-free parts ----
    @property
    def capture(self):
        if self._capture is None:
            self._capture = _capture_of(self.fns)
        return self._capture

    def statistics(self, **options):
        """Batch statistics of :meth:`Capture.statistics`, summed over the data
        (device tensors, not yet divided by N)."""
        params, nt = self.fns.params(), self.fns.non_trainable()
        total = None
        def sums(xb, yb, offset, _):
            return self.capture.statistics(params, nt, xb, yb, self._key, self._offset(offset), self.kind, self.num_samples, **options)

        for xb, yb, nb, offset in self.batches():
            out = backend.sum_over_replicas(self.fns.model, sums, xb, yb, offset)
            total = out if total is None else _add_stats(total, out)
        return total

    def to_dense(self, max_dim=20000, chunk=None):
        """The explicit matrix (float64 NumPy) as ``1/N sum_jn g_jn g_jn^T``
        from per-example factor gradients: positive semi-definite with the
        exact rank, as a pseudo-inverse needs."""
        if self.dim > max_dim:
            raise ValueError(f"to_dense() of a {self.dim}-dimensional operator: raise max_dim (now {max_dim}) to allow it.")
        params, nt = self.fns.params(), self.fns.non_trainable()
        G = np.zeros((self.dim, self.dim))
        for xb, yb, nb, offset in self.batches():
            grads = self.capture.factor_gradients(params, nt, xb, yb, self._key, self._offset(offset), self.kind, self.num_samples)
            k = int(ops.shape(grads[0])[0])
            J = np.concatenate([np.asarray(ops.convert_to_numpy(g), "float64").reshape(k * nb, -1) for g in grads], axis=1)
            G += J.T @ J
        return G / self.num_examples

    def diagonal(self):
        """The exact diagonal of this kind (no probes), a list like the variables."""
        stats = self.statistics()
        return [stats["diag"][i] / ops.cast(self.num_examples, self.dtype) for i in range(len(self.shapes))]

    def kfac(self, approximation="expand"):
        """K-FAC approximation of this kind: a :class:`BlockDiagonal` with a
        :class:`KFAC` block for every covered kernel (Dense, Conv,
        EinsumDense; a :class:`DiagonalInputKFAC` for an Embedding) and a
        :class:`Diagonal` block (the exact diagonal) for every other
        variable.

        Args:
            approximation: for layers applied at every position of a
                sequence or image, ``"expand"`` (default: ``A`` the mean over
                examples and positions of input rows ``a a^T``, ``B = 1/N
                sum_{n,t} delta delta^T``) or ``"reduce"`` (``A`` the mean
                over examples of ``abar abar^T``, ``abar`` the mean row over
                positions, ``B = 1/N sum_n (sum_t delta)(sum_t delta)^T``);
                Eschenhagen et al. (2023). The two agree for layers with one
                position per example. An Embedding's input factor is kept
                diagonal in both.

        The returned operator's ``summary()`` lists each variable's block
        and 2-D view. A tensor of two or more axes without a K-FAC rule
        falls back to a diagonal block, with one warning naming it.
        """
        stats = self.statistics(kernel_diag=(), factors=True, approximation=approximation)
        n = ops.cast(self.num_examples, self.dtype)
        kernels = {}
        for j, rule in enumerate(self.capture.kfac_rules):
            i = self.capture.position[id(rule.kernel)]
            cls = DiagonalInputKFAC if rule.diagonal_input else KFAC
            kernels[i] = cls(stats["A"][j] / stats["rows"][j], stats["B"][j] / n, self.shapes[i], rule.split)
        warn_diagonal_fallback([(self.fns.paths[i], self.shapes[i]) for i in self.capture.uncovered], "the K-FAC metric")
        blocks = [kernels[i] if i in kernels else Diagonal([stats["diag"][i] / n]) for i in range(len(self.shapes))]
        return BlockDiagonal(blocks, paths=self.fns.paths)

    def trace_with(self, weight=None):
        """Exact ``tr(weight @ GGN)`` (or ``tr(GGN)`` for ``weight=None``).

        `weight` is block-diagonal with one block per variable: a
        :class:`Diagonal`, or an orthogonal :class:`EKFAC` (e.g.
        ``KFAC.inverse()``) on a covered kernel. Returns ``(total,
        per_variable)`` as Python floats, the per-variable list in the order
        of the variables."""
        blocks = _one_block_per_variable(weight, self.shapes)
        kernel_pos = {self.capture.position[id(r.kernel)]: j for j, r in enumerate(self.capture.kfac_rules)}
        bases, diag_rules = {}, []
        for i, b in enumerate(blocks):
            if isinstance(b, EKFAC):
                if not b.orthogonal or i not in kernel_pos:
                    raise ValueError(
                        f"trace_with: the EKFAC block of variable {i} needs orthogonal bases and a "
                        "Dense/Conv/EinsumDense kernel."
                    )
                if (b.QA is None) != self.capture.kfac_rules[kernel_pos[i]].diagonal_input:
                    raise ValueError(f"trace_with: the EKFAC block of variable {i} does not match its layer's K-FAC view.")
                bases[kernel_pos[i]] = (b.QA, b.QG, b.s)
            elif i in kernel_pos:
                diag_rules.append(kernel_pos[i])
        stats = self.statistics(kernel_diag=tuple(diag_rules), bases=bases)
        parts = []
        for i, b in enumerate(blocks):
            if isinstance(b, EKFAC):
                value = stats["quad"][i]
            else:
                d = stats["diag"][i]
                value = ops.sum(d) if b is None else ops.sum(d * ops.cast(b.values[0], d.dtype))
            parts.append(float(ops.convert_to_numpy(value)) / self.num_examples)
        return float(sum(parts)), parts


Fisher = GGN


def _one_block_per_variable(weight, shapes):
    if weight is None:
        return [None] * len(shapes)
    if weight.shapes != [tuple(s) for s in shapes]:
        raise ValueError(f"trace_with: the weight acts on tensors {weight.shapes}, the model's variables are {list(shapes)}.")
    if isinstance(weight, Diagonal):
        return [Diagonal([v]) for v in weight.values]
    if isinstance(weight, BlockDiagonal) and all(len(b.shapes) == 1 and isinstance(b, (Diagonal, EKFAC)) for b in weight.blocks):
        return list(weight.blocks)
    raise ValueError(
        "trace_with needs a Diagonal, or a BlockDiagonal with one Diagonal or orthogonal EKFAC block per "
        "variable (e.g. GGN(...).kfac().inverse(...)); got "
        f"{type(weight).__name__}" + (f" with blocks {[type(b).__name__ for b in weight.blocks]}" if isinstance(weight, BlockDiagonal) else "") + "."
    )


def _add_stats(a, b):
    out = {"A": [x + y for x, y in zip(a["A"], b["A"])], "B": [x + y for x, y in zip(a["B"], b["B"])]}
    out["rows"] = [x + y for x, y in zip(a["rows"], b["rows"])]
    for key in ("diag", "quad"):
        out[key] = {k: a[key][k] + b[key][k] for k in a[key]}
    return out


def _capture_of(fns):
    if getattr(fns, "_capture", None) is None:
        fns._capture = Capture(fns)
    return fns._capture
