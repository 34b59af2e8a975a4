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

import copy

import keras
import numpy as np
from keras import ops

from keras_geosam import backend
from keras_geosam._checks import check_int
from keras_geosam.curvature import memory
from keras_geosam.curvature import probes
from keras_geosam.curvature import weights as token_weights
from keras_geosam.curvature.capture import Capture
from keras_geosam.curvature.data import DEFAULT_BATCH_SIZE
from keras_geosam.curvature.data import batches
from keras_geosam.curvature.functional import check_data
from keras_geosam.curvature.functional import check_labels
from keras_geosam.curvature.functional import model_functions
from keras_geosam.curvature.data import num_examples
from keras_geosam.curvature.losses import require_likelihood
from keras_geosam.curvature.operators.base import LinearOperator
from keras_geosam.curvature.layers import warn_diagonal_fallback
from keras_geosam.curvature.operators.structured import EKFAC
from keras_geosam.curvature.operators.structured import DiagonalInputKFAC
from keras_geosam.curvature.operators.structured import KFAC
from keras_geosam.curvature.operators.structured import BlockDiagonal
from keras_geosam.curvature.operators.structured import Diagonal

KINDS = ("exact", "mc", "empirical")
# Above this many classes the probe-free exact parts sample labels instead
# of one backward column per class (a language model's vocabulary).
MAX_EXACT_CLASSES = 64


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
        sample_weight: ``(N,)`` or per-token ``(N,) + positions`` weights;
            with the model's own mask they make the loss a weighted mean
            over tokens (``keras_geosam.curvature.weights``); or, for
            several outputs, one per output (a list in output order or a
            dict by name; each output's loss is then its own weighted mean).
    """

    needs_labels = True

    def __init__(self, model, x, y=None, loss=None, batch_size=None, training=False, sample_weight=None):
        self.fns = model_functions(model, loss, training)
        super().__init__([tuple(v.shape) for v in self.fns.variables], self.fns.variables[0].dtype)
        self.x, self.y = check_data(x, y, labels_needed=self.needs_labels, sample_weight=sample_weight)
        check_labels(self.fns, self.x, self.y)
        self.num_examples = num_examples(self.x)
        self.batch_size = DEFAULT_BATCH_SIZE if batch_size is None else batch_size
        weights = token_weights.resolve(self.fns, self.x, self.y, sample_weight, self.batch_size)
        # Normalised to sum to one: a batch's kernels then return its share
        # of the whole weighted mean, and nothing is divided afterwards.
        self.weights = token_weights.normalise(self.fns, weights)
        self.total_weight = None if weights is None else float(weights.sum())

    @property
    def weighted(self):
        return self.weights is not None

    @property
    def normaliser(self):
        """What sums over examples are divided by: N, or 1 with weights
        (normalised to sum to one already)."""
        return 1 if self.weighted else self.num_examples

    def batches(self, with_labels=True):
        """Yields ``(x_b, y_b, sw_b, n_b, offset)``: `sw_b` the batch's
        normalised weights as a tensor, or None without weights."""
        offset = 0
        y = self.y if with_labels else None
        dtype = keras.backend.standardize_dtype(self.dtype)
        slices = token_weights.batch_slices(self.weights, self.num_examples, self.batch_size, dtype)
        for (xb, yb, nb), swb in zip(batches(self.x, y, self.batch_size), slices):
            yield xb, yb, swb, nb, offset
            offset += nb

    def over_replicas(self, fn, xb, yb, swb, offset):
        """``fn(x, y, sw, offset, share)`` over the replicas of a
        tf.distribute strategy (``backend.sum_over_replicas``), summed;
        `share` the replica's fraction of an unweighted batch (None with
        weights, whose kernels return their share of the total already)."""
        if swb is None:
            return backend.sum_over_replicas(self.fns.model, lambda x, y, o, share: fn(x, y, None, o, share), xb, yb, offset)
        return backend.sum_over_replicas(self.fns.model, lambda x, ys, o, share: fn(x, ys[0], ys[1], o, None), xb, (yb, swb), offset)

    def _mean_over_batches(self, fn):
        """``sum_b (n_b / N) fn(batch)`` for list-valued `fn` (with weights:
        ``sum_b fn(batch)``, each already its share of the weighted mean)."""
        total = None
        def share_of(xb, yb, swb, offset, share):
            out = fn(xb, yb, swb, offset)
            return out if share is None else [o * ops.cast(share, o.dtype) for o in out]

        for xb, yb, swb, nb, offset in self.batches():
            out = self.over_replicas(share_of, xb, yb, swb, offset)
            if swb is None and nb != self.num_examples:  # one whole batch: its share is 1
                w = nb / self.num_examples
                out = _scaled(out, [backend.device_constant(np.asarray(w, keras.backend.standardize_dtype(o.dtype))) for o in out])
            total = out if total is None else _added(total, out)
        return total

    def matmat(self, vectors):
        vectors = [ops.convert_to_tensor(v, dtype=self.dtype) for v in self.check(vectors)]
        block, k = self.fns.probe_block, int(vectors[0].shape[0])
        if block and k > block:  # blocks of probes: a kernel's graph stays `block` probes long
            parts = [self.matmat([v[s:s + block] for v in vectors]) for s in range(0, k, block)]
            return [ops.concatenate(p, axis=0) for p in zip(*parts)]
        check = (min(self.batch_size, self.num_examples), k)
        if check not in self.__dict__.setdefault("_memory_checked", set()):
            itemsize = np.dtype(keras.backend.standardize_dtype(self.dtype)).itemsize
            memory.check_product(self.fns.model, check[0], k, f"A product with {type(self).__name__}", itemsize)
            self._memory_checked.add(check)
        params, nt = self.fns.params(), self.fns.non_trainable()
        return self._mean_over_batches(lambda xb, yb, swb, offset: self._matmat_batch(params, nt, vectors, xb, yb, swb, offset))

    def _matmat_batch(self, params, nt, vectors, xb, yb, swb, offset):
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
        sample_weight: ``(N,)`` or per-token weights (``(N,) +
            positions`` of a sequence model's outputs); with the model's
            own mask they weight the mean loss. Defaults to `None`.

    Raises:
        ValueError: if the model is not built or has no loss, or the data
            is invalid (labels missing, lengths differ, non-finite inputs,
            labels that are not class ids of the model, labels or weights
            that do not fit the outputs' positions).

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

    def _matmat_batch(self, params, nt, vectors, xb, yb, swb, offset):
        return self.fns.kernel(self.fns.hvp_batched_body)(params, nt, vectors, xb, yb, swb)


class GGNResidual(ModelOperator):
    """``H - GGN``: the second-order term of the Hessian.

    ``1/N sum_nk r_nk grad^2 z_nk`` plus the regularisers' Hessian, with r
    the loss gradient in the logits z. Zero on every per-layer diagonal
    block of a piecewise-linear network, and zero for a linear model.

    Args:
        model: a built classifier with a categorical cross-entropy loss.
        x, y: data, as for :class:`Hessian`.
        loss, batch_size, training, sample_weight: as for :class:`Hessian`.

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

    def __init__(self, model, x, y, loss=None, batch_size=None, training=False, sample_weight=None):
        super().__init__(model, x, y, loss, batch_size, training, sample_weight)
        require_likelihood(self.fns.spec, "GGNResidual")

    def _matmat_batch(self, params, nt, vectors, xb, yb, swb, offset):
        return self.fns.kernel(self.fns.residual_batched_body)(params, nt, vectors, xb, yb, swb)


class GGN(ModelOperator):
    """Generalised Gauss-Newton / Fisher of the mean loss, of a given kind.

    ``1/N sum_jn J_n^T c_jn c_jn^T J_n``, J_n the Jacobian of example n's
    logits, for the output factors c of `kind`: ``"exact"`` (the GGN,
    equal to the Fisher for softmax cross-entropy), ``"mc"`` (labels drawn
    from the model) or ``"empirical"`` (data labels; not the Fisher).
    ``diagonal()``, ``kfac()`` and ``trace_with()`` are exact and
    probe-free. ``kg.curvature.Fisher`` is the same class.

    Args:
        model, x, loss, batch_size, training, sample_weight: see
            :class:`ModelOperator`.
        y: labels, needed only for ``kind="empirical"`` (checked against
            the outputs whenever given). Defaults to `None`.
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

    def __init__(self, model, x, y=None, kind="exact", num_samples=1, seed=0, loss=None, batch_size=None, training=False,
                 sample_weight=None):
        check_kind(kind)
        check_int("num_samples", num_samples)
        self.needs_labels = kind == "empirical"
        super().__init__(model, x, y, loss, batch_size, training, sample_weight)
        require_likelihood(self.fns.spec, f"GGN / Fisher ({kind})")
        self.kind, self.num_samples, self.seed = kind, int(num_samples), seed
        self._key = probes.key(seed, "labels")
        self._capture = None

    def _offset(self, offset):
        # Placed explicitly: a Python int would be an implicit host
        # transfer on every batch (JAX).
        if isinstance(offset, (int, np.integer)):
            return backend.device_constant(np.int32(offset))
        return ops.cast(offset, "int32")  # a replica's own offset

    def _matmat_batch(self, params, nt, vectors, xb, yb, swb, offset):
        kernel = self.fns.kernel(self.fns.ggn_batched_body, kind=self.kind, num_samples=self.num_samples)
        return kernel(params, nt, vectors, xb, yb if self.kind == "empirical" else None, self._key, self._offset(offset), sw=swb)

    # ------------------------------------------ exact, probe-free parts ----
    @property
    def capture(self):
        if self._capture is None:
            self._capture = capture_of(self.fns)
        return self._capture

    def statistics(self, **options):
        """Batch statistics of :meth:`Capture.statistics`, summed over the data
        (device tensors, not yet divided by N)."""
        params, nt = self.fns.params(), self.fns.non_trainable()
        total = None
        def sums(xb, yb, swb, offset, _):
            return self.capture.statistics(params, nt, xb, yb, self._key, self._offset(offset), self.kind, self.num_samples, sw=swb, **options)

        for xb, yb, swb, nb, offset in self.batches(with_labels=self.kind == "empirical"):
            out = self.over_replicas(sums, xb, yb, swb, offset)
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
        for xb, yb, swb, nb, offset in self.batches(with_labels=self.kind == "empirical"):
            grads = self.capture.factor_gradients(params, nt, xb, yb, self._key, self._offset(offset), self.kind, self.num_samples, swb)
            k = int(ops.shape(grads[0])[0])
            J = np.concatenate([np.asarray(ops.convert_to_numpy(g), "float64").reshape(k * nb, -1) for g in grads], axis=1)
            G += J.T @ J
        return G / self.normaliser

    def diagonal(self):
        """The exact diagonal of this kind (no probes), a list like the variables."""
        stats = self.statistics()
        return [stats["diag"][i] / ops.cast(self.normaliser, self.dtype) for i in range(len(self.shapes))]

    def kfac(self, approximation="expand"):
        """K-FAC approximation of this kind: a :class:`BlockDiagonal` with a
        :class:`KFAC` block for every covered kernel (Dense, Conv,
        EinsumDense; a :class:`DiagonalInputKFAC` for an Embedding) and a
        :class:`Diagonal` block (the exact diagonal) for every other
        variable (a ``ReversibleEmbedding``'s table, used as a lookup and
        as the output projection, among them: ``curvature/tables.py``).

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
        gram = self._gram_rules(approximation)
        stats = self.statistics(kernel_diag=(), factors=True, approximation=approximation, gram=gram)
        n = ops.cast(self.normaliser, self.dtype)
        rules = list(enumerate(self.capture.kfac_rules))
        covered = {self.capture.position[id(rule.kernel)] for _, rule in rules}
        diagonal = [i for i in range(len(self.shapes)) if i not in covered]
        # Every factor's normalisation at once: one program on JAX, not an
        # eager division per factor shape.
        inputs, outputs, diags = _divided(
            [stats["R"][j] if j in gram else stats["A"][j] for j, _ in rules],
            [ops.sqrt(stats["rows"][j]) if j in gram else stats["rows"][j] for j, _ in rules],
            [stats["B"][j] for j, _ in rules], [stats["diag"][i] for i in diagonal], n)
        blocks = dict(zip(diagonal, (Diagonal([d]) for d in diags)))
        for (j, rule), a, b in zip(rules, inputs, outputs):
            i = self.capture.position[id(rule.kernel)]
            if j in gram:
                blocks[i] = KFAC.from_rows(a, b, self.shapes[i], rule.split)
            else:
                blocks[i] = (DiagonalInputKFAC if rule.diagonal_input else KFAC)(a, b, self.shapes[i], rule.split)
        warn_diagonal_fallback([(self.fns.paths[i], self.shapes[i]) for i in self.capture.uncovered], "the K-FAC metric")
        return BlockDiagonal([blocks[i] for i in range(len(self.shapes))], paths=self.fns.paths)

    def _gram_rules(self, approximation):
        """K-FAC rules whose input factor is built from fewer rows than it is
        wide (``r < m``: e.g. 256 examples into a 784-wide Dense layer): their
        rows are kept, and the factor's eigenvectors come from the ``r x r``
        Gram matrix (``KFAC.from_rows``). Not under tf.distribute, whose
        replicas would sum row blocks instead of stacking them."""
        if backend.data_parallel_shards(self.fns.model) > 1:
            return ()
        shapes = self.capture.call_shapes(next(iter(batches(self.x, None, self.batch_size)))[0])
        index = {id(r): i for i, r in enumerate(self.capture.rules)}
        out = []
        for j, rule in enumerate(self.capture.kfac_rules):
            if rule.diagonal_input:
                continue
            split = rule.split
            m = int(np.prod(rule.kernel.shape[:split]))
            n_out = int(np.prod(rule.kernel.shape[split:]))
            per_example = sum(int(np.prod(s[1:])) // n_out for s in shapes[index[id(rule)]])
            r = self.num_examples * (per_example if approximation == "expand" else 1)
            if r < m:
                out.append(j)
        return tuple(out)

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
                scales, null = b._range_scales()
                bases[kernel_pos[i]] = (b.QA, b.QG, scales)
                if null is not None:  # + null * ||g||^2: the plain squared gradients too
                    diag_rules.append(kernel_pos[i])
            elif i in kernel_pos:
                diag_rules.append(kernel_pos[i])
        stats = self.statistics(kernel_diag=tuple(diag_rules), bases=bases)
        ekfac = [isinstance(b, EKFAC) for b in blocks]
        parts = _trace_parts(
            [stats["quad"][i] if e else None for i, e in enumerate(ekfac)],
            [b.null if e else None for b, e in zip(blocks, ekfac)],
            [stats["diag"][i] if not e or b.null is not None else None for i, (b, e) in enumerate(zip(blocks, ekfac))],
            [None if e or b is None else b.values[0] for b, e in zip(blocks, ekfac)], dtype=self.dtype)
        # One transfer for every variable's part.
        values = np.asarray(ops.convert_to_numpy(parts), "float64")
        parts = [float(v) / self.normaliser for v in values]
        return float(sum(parts)), parts


    # ------------------------------------ large output spaces ----
    @property
    def num_classes(self):
        return int(token_weights.output_shape(self.fns, self.x)[-1])

    def sampled(self, num_samples, key):
        """This operator with Monte-Carlo factors: `num_samples` labels per
        token drawn with `key` (same data, weights and model)."""
        other = copy.copy(self)
        other.kind, other.num_samples, other._key, other._capture = "mc", int(num_samples), key, self._capture
        other.needs_labels = False
        return other

    def trace_estimate(self, weight=None, max_exact_classes=MAX_EXACT_CLASSES, num_samples=8, seed=0):
        """``tr(weight @ GGN)`` for the exact kind, with its standard error.

        Exact (:meth:`trace_with`, stderr 0) when the outputs have at most
        `max_exact_classes` classes: that costs one backward column per class
        and position. Above it, ``diag p - p p^T`` of every token is replaced
        by ``(e_s - p)(e_s - p)^T`` for a label s drawn from the model's
        softmax, an unbiased estimate: `num_samples` independent draws (each
        one backward column for every token at once) give the value as
        their mean and the standard error from their spread.

        Returns ``(value, stderr, per_variable, info)``.
        """
        if self.kind != "exact":
            raise ValueError("trace_estimate is for the exact GGN; use trace_with for the other kinds.")
        classes = self.num_classes
        if classes <= max_exact_classes:
            value, parts = self.trace_with(weight)
            return value, 0.0, parts, {"exact_part_sampled": False}
        num_samples = check_int("num_samples", num_samples, 2)
        base = probes.key(seed, "exact-part")
        draws = [self.sampled(1, probes.subkey(base, g)).trace_with(weight) for g in range(num_samples)]
        totals = np.array([d[0] for d in draws])
        parts = list(np.mean(np.array([d[1] for d in draws]), axis=0))
        info = {
            "exact_part_sampled": True,
            "exact_part_samples": num_samples,
            "exact_part_note": (
                f"{classes} classes > max_exact_classes={max_exact_classes}: diag p - p p^T of each token "
                f"estimated from {num_samples} labels drawn from the model (one backward column per draw), "
                "unbiased, stderr from the draws' spread"
            ),
        }
        return float(totals.mean()), float(totals.std(ddof=1) / np.sqrt(num_samples)), parts, info


Fisher = GGN


def _scaled_body(tensors, scales):
    return [t * c for t, c in zip(tensors, scales)]


def _added_body(a, b):
    return [x + y for x, y in zip(a, b)]


def _divided_body(inputs, rows, outputs, diags, n):
    """K-FAC factors and diagonal blocks over their normalisers."""
    return [a / r for a, r in zip(inputs, rows)], [b / n for b in outputs], [d / n for d in diags]


def _trace_parts_body(quads, nulls, diags, weights, dtype):
    """Each variable's part of ``tr(weight @ GGN)`` (``trace_with``):
    an EK-FAC block's quadratic form (plus `null` times the squared
    gradients' sum), or a diagonal block's weighted sum."""
    parts = []
    for quad, null, d, w in zip(quads, nulls, diags, weights):
        if quad is not None:
            value = quad if null is None else quad + ops.cast(null, quad.dtype) * ops.sum(d)
        else:
            value = ops.sum(d) if w is None else ops.sum(d * ops.cast(w, d.dtype))
        parts.append(ops.cast(value, dtype))
    return ops.stack(parts)


_divided = backend.block_kernel(_divided_body)
_trace_parts = backend.block_kernel(_trace_parts_body, static_argnames=("dtype",))


# Sums over batches of a product's hundreds of tensors: one program per
# layout on JAX, not one eager op per tensor shape.
_scaled = backend.block_kernel(_scaled_body)
_added = backend.block_kernel(_added_body)


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
    out = {"A": [None if x is None else x + y for x, y in zip(a["A"], b["A"])], "B": [x + y for x, y in zip(a["B"], b["B"])]}
    out["rows"] = [x + y for x, y in zip(a["rows"], b["rows"])]
    out["R"] = {j: ops.concatenate([a["R"][j], b["R"][j]], axis=0) for j in a.get("R", {})}
    for key in ("diag", "quad"):
        out[key] = {k: a[key][k] + b[key][k] for k in a[key]}
    return out


def capture_of(fns):
    if getattr(fns, "_capture", None) is None:
        fns._capture = Capture(fns)
    return fns._capture
