"""Per-example gradients from layer inputs and output gradients, per layer type.

For a Dense, Conv or EinsumDense kernel, the gradient of one example's loss
is ``sum_t a_t delta_t^T``: ``a_t`` the layer's input rows (Conv: unfolded
input patches, ordered like the kernel's rows), ``delta_t`` the gradient
with respect to the layer's pre-activation output at the same position
``t``. A rule turns what a layer received and the gradient of what it
produced into these rows, so squared per-example gradients (Fisher
diagonals), K-FAC factors and exact quadratic forms are reductions over
rows: no N x P matrix is formed and nothing is looped over examples.

Rules:

- ``Dense``: rows are the inputs (``T`` = the product of the middle axes).
- ``Conv1D/2D/3D`` (``groups=1``): unfolded patches, any strides, dilation
  and ``valid``/``same``/``causal`` padding, channels first or last.
- ``EinsumDense`` whose kernel axes are input axes followed by output axes
  (``"ab,bc->ac"``, ``"abc,cde->abde"``, ...).
- ``Embedding``: the input rows are one-hot token vectors, kept as the
  token ids (never a ``vocabulary``-wide row): the gradient of one example is
  ``sum_t e_{id_t} delta_t^T``, so sums over tokens are scatter-adds by id,
  and the K-FAC input factor is diagonal (token counts).
- ``BatchNormalization`` in inference mode and ``LayerNormalization``:
  ``gamma`` and ``beta`` from the normalised input (no K-FAC block).

Each rule also does the reductions that depend on its rows (squared
per-example gradients, K-FAC's input factor, exact quadratic forms), so the
capture (``capture.py``) is the same for every layer type.

K-FAC and weight sharing (Eschenhagen et al., NeurIPS 2023): a layer applied
at every position t of a sequence (or image) has per-example gradient
``sum_t a_t delta_t^T``. ``"expand"`` treats positions as examples: ``A =
mean_{n,t} a a^T``, ``B = 1/N sum_{n,t} delta delta^T`` (exact for deep
linear networks whose loss has a term per position); ``"reduce"`` sums
positions first: ``A = mean_n abar abar^T`` with ``abar`` the mean input
row over t, ``B = 1/N sum_n (sum_t delta)(sum_t delta)^T`` (exact for deep
linear networks that pool the positions before the loss).

Tables other than ``Embedding`` (Keras' ``ReversibleEmbedding``, keras-hub's
``PositionEmbedding``) have rules in ``tables.py``. The trainable variables
of any other layer are "uncovered": their per-example gradients come from
the backend's vectorised map instead.
"""

import inspect
import string
import weakref

import keras
import numpy as np
from keras import ops

from keras_geosam import keras_internals
from keras_geosam._checks import warn_at_caller

KFAC_APPROXIMATIONS = ("expand", "reduce")

_CONV = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)

# Largest intermediate (in elements) a chunk may create: 4 MB in float32,
# about one batch of activations of a mid-sized MLP (bounds peak memory).
MAX_ELEMENTS = 1 << 20
_CONV_CALLS = {c.call for c in _CONV}


class Rule:
    """How one layer's per-example gradients follow from its input rows.

    Attributes:
        layer: the Keras layer.
        kernel: its K-FAC-able kernel variable when trainable, else None.
        split: axes of the kernel that make the rows of its matrix view.
        variables: the layer's trainable variables this rule covers.
        splits_activation: the probe goes before the layer's activation.
    """

    splits_activation = True

    def __init__(self, layer):
        self.layer = layer
        kernel = getattr(layer, "kernel", None)
        self.kernel = kernel if kernel is not None and kernel.trainable else None
        self.split = None if kernel is None else len(kernel.shape) - 1
        self.variables = [v for v in self._all_variables() if v is not None and v.trainable]

    def _all_variables(self):
        return [getattr(self.layer, "kernel", None), getattr(self.layer, "bias", None)]

    def record(self, inputs):
        """What the rule keeps from the layer's input (inside the call)."""
        return inputs

    def record_call(self, inputs, args, kwargs):
        """What the rule keeps from one call, given all its arguments (a
        layer whose call arguments change what it computes reads them)."""
        return self.record(inputs)

    def rows(self, rec):
        """Input rows ``(N, T, m)``."""
        raise NotImplementedError

    def delta_rows(self, delta):
        """Output-gradient rows ``(k, N, T, n)`` from ``delta`` (k, N, ...)."""
        raise NotImplementedError

    def small_grads(self, rec, delta):
        """``{variable: (k, N) + shape}`` per-example gradients of the
        variables other than the kernel (biases, scales)."""
        bias = getattr(self.layer, "bias", None)
        if bias is None or not bias.trainable:
            return {}
        d = self.delta_rows(delta)
        return {id(bias): ops.reshape(ops.sum(d, axis=2), ops.shape(d)[:2] + tuple(bias.shape))}

    def squared_small_grads(self, recs, deltas):
        """``{variable: sum_jn g_jn^2}`` for the variables :meth:`small_grads`
        covers, from all the layer's calls (`recs`, `deltas`: lists over
        calls): each example's gradient is summed over the calls, then
        squared."""
        per_example = {}
        for rec, delta in zip(recs, deltas):
            for vid, g in self.small_grads(rec, delta).items():
                per_example[vid] = g if vid not in per_example else per_example[vid] + g
        return {vid: ops.sum(ops.square(g), axis=(0, 1)) for vid, g in per_example.items()}

    # ------------------------------------------- reductions over rows ----
    # Input rows are ``(N, T, m)`` tensors here; ``EmbeddingRule`` keeps ids.
    diagonal_input = False

    def cast_rows(self, rows, dtype):
        return ops.cast(rows, dtype)

    def input_factor(self, a, approximation, rw=None):
        """``(sum of a a^T, count)``: over examples and positions
        (``"expand"``), or of each example's mean row (``"reduce"``). With
        row weights `rw` ``(N, T)``: weighted sums, the count the weights'
        sum (``"reduce"``: each example's weighted mean row, weighted by the
        example's total)."""
        if rw is not None:
            rw = ops.cast(rw, a.dtype)
            if approximation == "reduce":
                total = ops.sum(rw, axis=1)
                abar = ops.einsum("nt,ntm->nm", rw, a)  # = total * weighted mean row
                inv = ops.where(total > 0, 1.0 / ops.where(total > 0, total, ops.ones_like(total)), ops.zeros_like(total))
                return ops.einsum("nm,nl->ml", abar * inv[:, None], abar), ops.sum(total)
            return ops.einsum("ntm,nt,ntl->ml", a, rw, a), ops.sum(rw)
        if approximation == "reduce":
            abar = ops.sum(a, axis=1) / ops.cast(ops.shape(a)[1], a.dtype)
            return ops.einsum("nm,nl->ml", abar, abar), int(a.shape[0])
        return ops.einsum("ntm,ntl->ml", a, a), int(a.shape[0]) * int(a.shape[1])

    def input_rows(self, a, approximation, rw=None):
        """``(R, count)`` with ``R^T R`` the sum :meth:`input_factor` forms:
        the factor's rows, for a layer wider than its rows are many (the
        Gram matrix ``R R^T`` is then the cheaper one to decompose)."""
        m = int(a.shape[-1])
        if approximation == "reduce":
            if rw is None:
                return ops.sum(a, axis=1) / float(int(a.shape[1])), int(a.shape[0])
            rw = ops.cast(rw, a.dtype)
            total = ops.sum(rw, axis=1)
            inv = ops.where(total > 0, 1.0 / ops.sqrt(ops.where(total > 0, total, ops.ones_like(total))), ops.zeros_like(total))
            return ops.einsum("nt,ntm->nm", rw, a) * inv[:, None], ops.sum(total)
        if rw is None:
            return ops.reshape(a, (-1, m)), int(a.shape[0]) * int(a.shape[1])
        rw = ops.cast(rw, a.dtype)
        return ops.reshape(a * ops.sqrt(rw)[:, :, None], (-1, m)), ops.sum(rw)

    def squared_gradients(self, a, d):
        """``sum_jn (sum_t a_nt d_jnt^T)^2``, shape (m, n)."""
        return _squared_gradients(a, d)

    def square_single(self, a, s):
        """The same for one position, ``s = sum_j d_jn^2`` (N, n) summed
        over the column chunks first: ``a^2`` meets it once."""
        return ops.einsum("nm,nj->mj", ops.square(a[:, 0]), s)

    def rotate(self, a, QA):
        """Rows in the basis ``QA`` of the input factor."""
        return ops.einsum("ntm,ml->ntl", a, ops.cast(QA, a.dtype))

    def weighted_squares(self, a, d, W):
        """``sum_jn sum_mj W_mj g_jn[m, j]^2`` for rotated rows and deltas."""
        return ops.sum(ops.cast(W, d.dtype) * _squared_gradients(a, d))

    def weighted_single(self, a, s, W):
        # sum_mj W_mj sum_n a_nm^2 s_nj, without forming the m x n product
        return ops.sum(ops.einsum("nm,mj->nj", ops.square(a[:, 0]), ops.cast(W, s.dtype)) * s)

    def per_example(self, a, d):
        """Per-example kernel gradients ``(N, m, n)`` from rows and one
        column of deltas ``(N, T, n)``."""
        return ops.einsum("ntm,ntj->nmj", a, d)


class DenseRule(Rule):
    def rows(self, rec):
        return ops.reshape(rec, (ops.shape(rec)[0], -1, ops.shape(rec)[-1]))

    def delta_rows(self, delta):
        s = ops.shape(delta)
        return ops.reshape(delta, (s[0], s[1], -1, s[-1]))


class ConvRule(Rule):
    def _channels_last(self, t, lead):
        if self.layer.data_format == "channels_last":
            return t
        return ops.moveaxis(t, lead, -1)

    def rows(self, rec):
        layer = self.layer
        a = self._channels_last(rec, 1)
        spatial = tuple(a.shape[1:-1])
        ks, st, dl = layer.kernel_size, layer.strides, layer.dilation_rate
        pads = []
        for size, k, s, d in zip(spatial, ks, st, dl):
            eff = (k - 1) * d + 1
            if layer.padding == "same":
                out = -(-size // s)
                total = max((out - 1) * s + eff - size, 0)
                pads.append((total // 2, total - total // 2))
            elif layer.padding == "causal":
                pads.append((eff - 1, 0))
            else:
                pads.append((0, 0))
        if any(p != (0, 0) for p in pads):
            a = ops.pad(a, [(0, 0)] + pads + [(0, 0)])
        outs = [(a.shape[1 + j] - ((k - 1) * d + 1)) // s + 1 for j, (k, s, d) in enumerate(zip(ks, st, dl))]
        pieces = []
        for offset in np.ndindex(*ks):  # row-major over the kernel window, channels last
            index = [slice(None)]
            for j, (o, s, d) in enumerate(zip(offset, st, dl)):
                index.append(slice(o * d, o * d + (outs[j] - 1) * s + 1, s))
            index.append(slice(None))
            pieces.append(a[tuple(index)])
        patches = ops.concatenate(pieces, axis=-1) if len(pieces) > 1 else pieces[0]
        return ops.reshape(patches, (ops.shape(patches)[0], -1, ops.shape(patches)[-1]))

    def delta_rows(self, delta):
        d = self._channels_last(delta, 2)
        s = ops.shape(d)
        return ops.reshape(d, (s[0], s[1], -1, s[-1]))


class EinsumDenseRule(Rule):
    """``EinsumDense`` with kernel axes = contracted input axes, then output axes."""

    def __init__(self, layer):
        super().__init__(layer)
        lhs, ker, out = self.equation(layer)
        self.kernel_letters = ker
        self.split = len([c for c in ker if c in lhs])
        self._expanded = {}
        self.rank = None

    def record(self, inputs):
        self.rank = len(inputs.shape)
        return inputs

    @staticmethod
    def equation(layer):
        lhs_kernel, out = layer.equation.split("->")
        lhs, ker = lhs_kernel.split(",")
        return lhs, ker, out

    @classmethod
    def roles(cls, layer, rank):
        """``(lhs, out, input letters, output letters, position letters)`` with
        any ellipsis expanded for an input of `rank` axes; None when the rule
        does not apply."""
        try:
            lhs, ker, out = cls.equation(layer)
        except ValueError:
            return None
        if "..." in ker:
            return None
        if "..." in lhs or "..." in out:
            free = [c for c in string.ascii_letters if c not in lhs + ker + out]
            fill = "".join(free[: rank - (len(lhs) - 3)])
            lhs, out = lhs.replace("...", fill), out.replace("...", fill)
        if len(lhs) != rank or not lhs or lhs[0] != out[0] or lhs[0] in ker or len(set(lhs)) != len(lhs):
            return None
        b = lhs[0]
        inp = [c for c in ker if c in lhs and c not in out]
        outl = [c for c in ker if c in out and c not in lhs]
        pos = [c for c in lhs[1:] if c in out and c not in ker]
        if list(ker) != inp + outl or set(lhs) != {b, *inp, *pos} or set(out) != {b, *pos, *outl}:
            return None
        return lhs, out, inp, outl, pos

    def _roles(self, rank):
        if rank not in self._expanded:
            roles = self.roles(self.layer, rank)
            if roles is None:
                raise ValueError(f"EinsumDense {self.layer.name!r}: equation {self.layer.equation!r} unsupported at rank {rank}.")
            self._expanded[rank] = roles
        return self._expanded[rank]

    def rows(self, rec):
        lhs, _, inp, _, pos = self._roles(len(rec.shape))
        a = ops.transpose(rec, [lhs.index(c) for c in [lhs[0]] + pos + inp])
        m = int(np.prod(a.shape[1 + len(pos) :]))
        return ops.reshape(a, (ops.shape(a)[0], -1, m))

    def delta_rows(self, delta):
        lhs, out, _, outl, pos = self._roles(self.rank)
        d = ops.transpose(delta, [0] + [1 + out.index(c) for c in [out[0]] + pos + outl])
        n = int(np.prod(d.shape[2 + len(pos) :]))
        return ops.reshape(d, (ops.shape(d)[0], ops.shape(d)[1], -1, n))

    def small_grads(self, rec, delta):
        bias = getattr(self.layer, "bias", None)
        if bias is None or not bias.trainable:
            return {}
        _, out, _, _, _ = self._roles(len(rec.shape))
        k = [c for c in string.ascii_letters if c not in out][0]
        # Keras orders the bias's axes as they appear in the output.
        axes = "".join(c for c in out if c in (self.layer.bias_axes or ""))
        g = ops.einsum(f"{k}{out}->{k}{out[0]}{axes}", delta)
        return {id(bias): ops.reshape(g, tuple(ops.shape(g)[:2]) + tuple(bias.shape))}


class BatchNormRule(Rule):
    """Inference-mode BatchNormalization: an affine map of its input."""

    splits_activation = False

    def __init__(self, layer):
        super().__init__(layer)
        self.kernel, self.split = None, None

    def _all_variables(self):
        return [getattr(self.layer, "gamma", None), getattr(self.layer, "beta", None)]

    def record(self, inputs):
        layer = self.layer
        x = ops.cast(inputs, "float32") if keras.backend.standardize_dtype(inputs.dtype) in ("float16", "bfloat16") else inputs
        shape = [1] * len(x.shape)
        axis = layer.axis % len(x.shape)
        shape[axis] = x.shape[axis]
        mean = ops.reshape(ops.cast(layer.moving_mean, x.dtype), shape)
        var = ops.reshape(ops.cast(layer.moving_variance, x.dtype), shape)
        return (x - mean) / ops.sqrt(var + ops.convert_to_tensor(layer.epsilon, dtype=x.dtype))

    def small_grads(self, rec, delta):
        axis = self.layer.axis % len(rec.shape)
        keep = 1 + axis  # delta has the extra leading k axis
        reduce = [i for i in range(2, len(delta.shape)) if i != keep]
        out = {}
        d = ops.cast(delta, rec.dtype)
        gamma, beta = getattr(self.layer, "gamma", None), getattr(self.layer, "beta", None)
        if gamma is not None and gamma.trainable:
            out[id(gamma)] = ops.sum(d * rec[None], axis=reduce)
        if beta is not None and beta.trainable:
            out[id(beta)] = ops.sum(d, axis=reduce)
        return out


class EmbeddingRule(Rule):
    """``Embedding``: rows are token ids (a one-hot row each, never formed).

    Repeated tokens within one example add up in its gradient, so squares
    are taken after summing them: ``s_t = sum_t' [id_t = id_t'] delta_t'``
    (a same-token mask per example, ``T x T``), then scatter-added by id.
    """

    splits_activation = False
    diagonal_input = True

    def __init__(self, layer):
        super().__init__(layer)
        self.kernel = layer.embeddings if layer.embeddings.trainable else None
        self.split = 1
        self.vocabulary = int(layer.input_dim)

    def _all_variables(self):
        return [self.layer.embeddings]

    def record(self, inputs):
        return ops.cast(inputs, "int32")

    def rows(self, rec):
        return ops.reshape(rec, (ops.shape(rec)[0], -1))

    def cast_rows(self, rows, dtype):
        return rows  # ids stay integers

    def delta_rows(self, delta):
        s = ops.shape(delta)
        return ops.reshape(delta, (s[0], s[1], -1, s[-1]))

    def small_grads(self, rec, delta):
        return {}

    def _scatter(self, values, ids):
        """``sum over rows with id v`` of `values` ``(N, T, n)``: (vocab, n)."""
        n = int(values.shape[-1])
        return ops.segment_sum(ops.reshape(values, (-1, n)), ops.reshape(ids, (-1,)), num_segments=self.vocabulary)

    @staticmethod
    def _same(ids, dtype):
        return ops.cast(ops.equal(ids[:, :, None], ids[:, None, :]), dtype)

    def input_factor(self, ids, approximation, rw=None):
        n, t = int(ids.shape[0]), int(ids.shape[1])
        dtype = self.kernel.dtype
        if rw is not None:
            rw = ops.cast(rw, dtype)
            if approximation == "reduce":
                # diag sum_n abar abar^T R_n with abar_v = c_nv / R_n, c_nv the
                # weighted count of token v in example n, R_n its total: each
                # of the example's tokens adds rw_nt c_nv / R_n^2 * R_n.
                total = ops.sum(rw, axis=1, keepdims=True)
                inv = ops.where(total > 0, 1.0 / ops.where(total > 0, total, ops.ones_like(total)), ops.zeros_like(total))
                counts = ops.einsum("ntu,nu->nt", self._same(ids, dtype), rw)
                return self._scatter((rw * counts * inv)[:, :, None], ids)[:, 0], ops.sum(total)
            return self._scatter(rw[:, :, None], ids)[:, 0], ops.sum(rw)
        if approximation == "reduce":
            # diag of mean_n abar abar^T: sum_n (c_nv / T)^2, with c_nv the
            # count of token v in example n (= the mask's row sums there).
            counts = ops.sum(self._same(ids, dtype), axis=-1)
            return self._scatter((counts / float(t * t))[:, :, None], ids)[:, 0], n
        ones = ops.ones((n, t, 1), dtype=dtype)
        return self._scatter(ones, ids)[:, 0], n * t

    def _summed(self, ids, d):
        """``s_jnt = sum_t' [id_nt = id_nt'] d_jnt'``: each example's
        gradient row of token id_nt."""
        return ops.einsum("ntu,knuj->kntj", self._same(ids, d.dtype), d)

    def squared_gradients(self, ids, d):
        return self._scatter(ops.sum(d * self._summed(ids, d), axis=0), ids)

    def square_single(self, ids, s):
        return self._scatter(s[:, None, :], ids[:, :1])

    def rotate(self, ids, QA):
        if QA is not None:
            raise ValueError("An Embedding's K-FAC input factor is diagonal: its basis is the identity (QA=None).")
        return ids

    def weighted_squares(self, ids, d, W):
        W = ops.take(ops.cast(W, d.dtype), ops.reshape(ids, (-1,)), axis=0)
        contrib = ops.sum(d * self._summed(ids, d), axis=0)
        return ops.sum(ops.reshape(contrib, ops.shape(W)) * W)

    def weighted_single(self, ids, s, W):
        return ops.sum(s * ops.take(ops.cast(W, s.dtype), ids[:, 0], axis=0))

    def per_example(self, ids, d):
        n, t, j = int(d.shape[0]), int(d.shape[1]), int(d.shape[-1])
        keys = ops.reshape(ops.arange(n, dtype="int32")[:, None] * self.vocabulary + ids, (-1,))
        g = ops.segment_sum(ops.reshape(d, (n * t, j)), keys, num_segments=n * self.vocabulary)
        return ops.reshape(g, (n, self.vocabulary, j))


class LayerNormRule(Rule):
    """``LayerNormalization``: ``gamma * x_hat + beta`` with ``x_hat`` the
    normalised input (recomputed by Keras' own op without the affine part,
    so ``rms_scaling`` and the epsilon are honoured)."""

    splits_activation = False

    def __init__(self, layer):
        super().__init__(layer)
        self.kernel, self.split = None, None

    def _all_variables(self):
        return [getattr(self.layer, "gamma", None), getattr(self.layer, "beta", None)]

    def record(self, inputs):
        layer = self.layer
        return ops.layer_normalization(inputs, None, None, layer.axis, layer.epsilon, rms_scaling=layer.rms_scaling)

    def small_grads(self, rec, delta):
        axes = [a % len(rec.shape) for a in self.layer.axis]
        # delta has a leading k axis: example axes 1.. of rec are 2.. here
        reduce = [i for i in range(2, len(delta.shape)) if i - 1 not in axes]
        d = ops.cast(delta, rec.dtype)
        out = {}
        gamma, beta = getattr(self.layer, "gamma", None), getattr(self.layer, "beta", None)
        if gamma is not None and gamma.trainable:
            out[id(gamma)] = ops.sum(d * rec[None], axis=reduce)
        if beta is not None and beta.trainable:
            out[id(beta)] = ops.sum(d, axis=reduce)
        return out


class DepthwiseConvRule(ConvRule):
    """``DepthwiseConv1D/2D``: each input channel c is convolved with its own
    ``depth_multiplier`` filters, so example n's kernel gradient is ``g[k,
    c, m] = sum_t patch_nt[k, c] delta_nt[c, m]`` (k the window offset):
    exact per-example gradients from the layer's input patches and output
    gradients, never a vectorised backward pass through the network. Its
    curvature block is diagonal (documented; no Kronecker factors)."""

    def __init__(self, layer):
        super().__init__(layer)
        self.kernel, self.split = None, None
        self.depthwise = layer.kernel if layer.kernel.trainable else None

    def _depthwise_grads(self, rec, delta, kernel_shape):
        """``(k, N) + kernel_shape`` from the layer's input and deltas
        ``(k, N, ..., C * M)`` at its depthwise output."""
        a = self.rows(rec)  # (N, T, K * C): window offsets major, channels minor
        channels, mult = int(kernel_shape[-2]), int(kernel_shape[-1])
        a = ops.reshape(a, tuple(ops.shape(a)[:2]) + (-1, channels))
        d = ops.cast(self._channels_last(delta, 2), a.dtype)
        d = ops.reshape(d, (int(d.shape[0]), int(d.shape[1]), -1, channels, mult))
        g = ops.einsum("ntkc,jntcm->jnkcm", a, d)
        return ops.reshape(g, tuple(g.shape[:2]) + tuple(kernel_shape))

    def small_grads(self, rec, delta):
        out = {}
        if self.depthwise is not None:
            out[id(self.depthwise)] = self._depthwise_grads(rec, delta, tuple(self.depthwise.shape))
        out.update(Rule.small_grads(self, rec, delta))  # the bias
        return out


class SeparableConvRule(DepthwiseConvRule):
    """``SeparableConv1D/2D``: a depthwise convolution, then a 1x1
    (pointwise) one. The pointwise kernel's per-example gradient is ``sum_t
    h_nt delta_nt^T`` with h the depthwise output (recomputed from the
    recorded input); the depthwise kernel's follows from the deltas pulled
    back through the pointwise kernel. Diagonal blocks for both."""

    def __init__(self, layer):
        Rule.__init__(self, layer)
        self.kernel, self.split = None, None
        dw, pw = layer.depthwise_kernel, layer.pointwise_kernel
        self.depthwise = dw if dw.trainable else None
        self.pointwise = pw if pw.trainable else None

    def _all_variables(self):
        layer = self.layer
        return [layer.depthwise_kernel, layer.pointwise_kernel, getattr(layer, "bias", None)]

    def record_call(self, inputs, args, kwargs):
        layer = self.layer
        hidden = ops.depthwise_conv(inputs, layer.depthwise_kernel, strides=layer.strides, padding=layer.padding,
                                    data_format=layer.data_format, dilation_rate=layer.dilation_rate)
        return inputs, self._channels_last(hidden, 1), ops.convert_to_tensor(layer.pointwise_kernel)

    def small_grads(self, rec, delta):
        inputs, hidden, pointwise = rec
        d = ops.cast(self._channels_last(delta, 2), hidden.dtype)  # (k, N, ..., F)
        k, n, f = int(d.shape[0]), int(d.shape[1]), int(d.shape[-1])
        rows = ops.reshape(d, (k, n, -1, f))
        h = ops.reshape(hidden, (n, -1, int(hidden.shape[-1])))
        w = ops.reshape(ops.cast(pointwise, d.dtype), (-1, f))  # (C * M, F)
        out = {}
        if self.pointwise is not None:
            g = ops.einsum("ntc,jntf->jncf", h, rows)
            out[id(self.pointwise)] = ops.reshape(g, (k, n) + tuple(self.pointwise.shape))
        if self.depthwise is not None:
            back = ops.einsum("jntf,cf->jntc", rows, w)  # deltas at the depthwise output
            back = ops.reshape(back, (k, n) + tuple(int(s) for s in hidden.shape[1:]))
            if self.layer.data_format != "channels_last":
                back = ops.moveaxis(back, -1, 2)
            out[id(self.depthwise)] = self._depthwise_grads(inputs, back, tuple(self.depthwise.shape))
        bias = getattr(self.layer, "bias", None)
        if bias is not None and bias.trainable:
            out[id(bias)] = ops.sum(rows, axis=2)
        return out


_DEPTHWISE = tuple(getattr(keras.layers, n) for n in ("DepthwiseConv1D", "DepthwiseConv2D") if hasattr(keras.layers, n))
_SEPARABLE = tuple(getattr(keras.layers, n) for n in ("SeparableConv1D", "SeparableConv2D") if hasattr(keras.layers, n))


def rule_for(layer, training=False):
    """The rule covering `layer`, or None."""
    if not layer.trainable or not layer.trainable_variables:
        return None
    if getattr(layer, "quantization_mode", None) is not None or getattr(layer, "lora_enabled", False):
        return None  # the kernel is computed (quantised, or kernel + lora_a lora_b)
    # Subclasses that override call() may compute something else: uncovered.
    if isinstance(layer, keras.layers.Dense) and type(layer).call is keras.layers.Dense.call:
        return DenseRule(layer)
    if isinstance(layer, _CONV) and getattr(layer, "groups", 1) == 1 and type(layer).call in _CONV_CALLS:
        return ConvRule(layer)
    if isinstance(layer, keras.layers.EinsumDense) and type(layer).call is keras.layers.EinsumDense.call:
        shape = keras_internals.built_input_shapes(layer)
        rank = len(next(iter(shape.values()))) if shape else None
        if rank is not None and EinsumDenseRule.roles(layer, rank) is not None:
            return EinsumDenseRule(layer)
        return None
    if isinstance(layer, _DEPTHWISE) and type(layer).call in {c.call for c in _DEPTHWISE}:
        return DepthwiseConvRule(layer)
    if isinstance(layer, _SEPARABLE) and type(layer).call in {c.call for c in _SEPARABLE}:
        return SeparableConvRule(layer)
    if isinstance(layer, keras.layers.Embedding) and type(layer).call is keras.layers.Embedding.call:
        return EmbeddingRule(layer)
    if isinstance(layer, keras.layers.LayerNormalization) and type(layer).call is keras.layers.LayerNormalization.call:
        return LayerNormRule(layer)
    if isinstance(layer, keras.layers.BatchNormalization) and not training and not getattr(layer, "renorm", False):
        return BatchNormRule(layer)
    for more in MORE_RULES:
        rule = more(layer)
        if rule is not None:
            return rule
    return None


# Lookups for rules written in other modules, asked after the ones above:
# ``tables.py`` (its rules build on these) adds its own when imported, as
# ``keras_geosam.curvature`` does.
MORE_RULES = []


def kernel_views(model, for_preconditioner=False):
    """The K-FAC view of every covered kernel of `model`: ``{id(variable):
    (split, diagonal_input)}``, ``split`` the number of the kernel's leading
    axes that make the rows (the axes contracted with the layer's input),
    ``diagonal_input`` True where the input factor is diagonal (Embedding);
    the other variables of covered layers (biases, scales) map to None.
    LLQR's U and the K-FAC metric both read their blocks from here;
    `for_preconditioner` adds the tables of Embedding subclasses the metric
    has no rule for (see below)."""
    views = {}
    for rule in rules_for(model):
        for v in rule.variables:  # biases, scales: diagonal blocks by design
            views.setdefault(id(v), None)
        if rule.kernel is not None:
            views[id(rule.kernel)] = (rule.split, rule.diagonal_input)
    if for_preconditioner:
        # A learned U needs only the layout of a lookup table: Embedding
        # subclasses whose metric block is diagonal (keras-hub's
        # ReversibleEmbedding, which ties the table to the output
        # projection, tables.py) still get a diagonal-input block.
        for layer in leaf_layers(model):
            table = getattr(layer, "embeddings", None) if isinstance(layer, keras.layers.Embedding) else None
            if table is not None and table.trainable and views.get(id(table)) is None:
                views[id(table)] = (1, True)
    return views


_WARNED = set()


def warn_diagonal_fallback(entries, what):
    """One warning per variable path (per process) for each ``(path,
    shape)`` of two or more axes that gets a diagonal block in `what` for
    want of a K-FAC rule for its layer (1-D tensors are diagonal blocks by
    design)."""
    # A tensor with one axis longer than 1 (a ViT's (1, 1, d) class token) is a vector.
    new = [(p, tuple(shape)) for p, shape in entries if sum(int(d) > 1 for d in shape) >= 2 and (what, p) not in _WARNED]
    if not new:
        return
    _WARNED.update((what, p) for p, _ in new)
    names = ", ".join(f"{p} {shape}" for p, shape in new)
    warn_at_caller(
        f"{what}: no K-FAC rule covers {names} (a layer type or call the rules in "
        "keras_geosam/curvature/layers.py do not know); each gets a diagonal block."
    )


def _squared_gradients(a, d):
    """``sum_jn (sum_t a_nt d_jnt^T)^2`` (element-wise square), shape (m, n):
    one matrix product for T = 1, example chunks otherwise."""
    if int(a.shape[1]) == 1:
        return ops.einsum("nm,nj->mj", ops.square(a[:, 0]), ops.sum(ops.square(d[:, :, 0]), axis=0))
    k, n = int(d.shape[0]), int(a.shape[0])
    m, j = int(a.shape[-1]), int(d.shape[-1])
    step = max(1, MAX_ELEMENTS // max(k * m * j, 1))
    total = None
    for start in range(0, n, step):
        g = ops.einsum("ntm,kntj->knmj", a[start : start + step], d[:, start : start + step])
        part = ops.sum(ops.square(g), axis=(0, 1))
        total = part if total is None else total + part
    return total


def leaf_layers(model):
    """Every layer of `model` that holds no other layers (nested models and
    containers such as MultiHeadAttention are walked into)."""
    return [layer for layer in keras_internals.flatten_layers(model) if not keras_internals.flatten_layers(layer)]


# Every Keras convolution (their kernel gradients are what XLA:CPU runs
# slowly inside compiled loops).
CONVOLUTIONS = tuple(
    getattr(keras.layers, name) for name in (
        "Conv1D", "Conv2D", "Conv3D", "Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose",
        "DepthwiseConv1D", "DepthwiseConv2D", "SeparableConv1D", "SeparableConv2D",
    ) if hasattr(keras.layers, name)
)


def is_convolutional(model):
    """Whether `model` is a convolutional network: a convolution with
    trainable weights and no attention layer (a ViT, whose one convolution
    cuts the patches, is not)."""
    layers = keras_internals.flatten_layers(model)
    if any(isinstance(layer, keras.layers.MultiHeadAttention) for layer in layers):
        return False
    return any(isinstance(layer, CONVOLUTIONS) and layer.trainable_variables for layer in leaf_layers(model))


def rules_for(model, training=False):
    """Rules for every covered layer of `model` (nested models included)."""
    out = []
    for layer in leaf_layers(model):
        rule = rule_for(layer, training)
        if rule is not None and rule.variables:
            out.append(rule)
    return out


_TAKES_TRAINING = weakref.WeakKeyDictionary()


def takes_training(layer):
    """Whether ``layer.call`` takes ``training``: a stateless call may pass
    it only then. Keras' own rule, read from the signature once per layer
    (an eager torch step would otherwise inspect it every step)."""
    try:
        return _TAKES_TRAINING[layer]
    except KeyError:
        answer = _TAKES_TRAINING[layer] = "training" in inspect.signature(layer.call).parameters
        return answer
