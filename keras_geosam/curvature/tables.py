"""Rules for lookup tables other than ``Embedding`` (``layers.py`` has the
rest): Keras' ``ReversibleEmbedding`` (keras-hub's GPT-2, Gemma, ... tie
their vocabulary to it) and keras-hub's ``PositionEmbedding``.

Both give their tables a diagonal block (the exact diagonal of the GGN /
Fisher, from inputs and output gradients), not a K-FAC block, and both
replace the per-example map that uncovered variables take: for a GPT-2
that map held ``N x vocabulary x width`` floats per output factor.

- ``ReversibleEmbedding``: one table used twice, as a lookup (``x =
  E[id]``) and, with ``reverse=True``, as the output projection (``logits =
  h E^T``; untied: ``h R`` with its own ``R``). One example's gradient is
  ``G = sum_t e_{id_t} delta_t^T + sum_t c_t h_t^T``, ``c_t`` the gradient
  of the logits. The lookup part is sparse, the projection part is not, so
  a tied table's squares are formed as ``V x d`` products, a few examples
  at a time (no cheaper exact route: the squares of a sum over positions
  mix every position pair). The sum of the two uses is not a Kronecker
  product, hence the diagonal block; LLQR's U still gives the table a
  diagonal-input K-FAC block (``kernel_views``). Soft-capped logits
  (``logit_soft_cap``) are not covered.
- ``PositionEmbedding``: a lookup of the positions (``start_index`` or the
  given ``positions``), the ``Embedding`` rule with positions for ids.

keras-hub is optional: its classes are looked up only where it is already
imported (a model holding its layers has imported it).
"""

import sys

import keras
from keras import ops

from keras_geosam.curvature.layers import MAX_ELEMENTS
from keras_geosam.curvature.layers import MORE_RULES
from keras_geosam.curvature.layers import EmbeddingRule
from keras_geosam.curvature.layers import Rule


def _hub_layer(name):
    hub = sys.modules.get("keras_hub")
    return getattr(getattr(hub, "layers", None), name, None)


def table_rule_for(layer):
    """The rule for one of the tables above, or None. A subclass that
    overrides ``call`` may compute something else: not covered."""
    for reversible in {getattr(keras.layers, "ReversibleEmbedding", None), _hub_layer("ReversibleEmbedding")} - {None}:
        if isinstance(layer, reversible) and type(layer).call is reversible.call:
            return ReversibleEmbeddingRule(layer) if getattr(layer, "logit_soft_cap", None) is None else None
    position = _hub_layer("PositionEmbedding")
    if position is not None and isinstance(layer, position) and type(layer).call is position.call:
        return PositionEmbeddingRule(layer)
    return None


class _TableRule(EmbeddingRule):
    """A lookup table with a diagonal metric block (no ``kernel``)."""

    def __init__(self, layer):
        Rule.__init__(self, layer)
        self.kernel, self.split = None, None

    def _pairs(self, ids, d):
        """Per-example gradients ``(k, N, V, n)`` of lookups of `ids` ``(N,
        T)`` with output gradients `d` ``(k, N, T, n)``."""
        k, n, t, j = (int(s) for s in d.shape)
        ids = ops.tile(ops.reshape(ids, (n, t)), (k, 1))
        keys = ops.reshape(ops.arange(k * n, dtype="int32")[:, None] * self.vocabulary + ids, (-1,))
        g = ops.segment_sum(ops.reshape(d, (k * n * t, j)), keys, num_segments=k * n * self.vocabulary)
        return ops.reshape(g, (k, n, self.vocabulary, j))


class PositionEmbeddingRule(_TableRule):
    def __init__(self, layer):
        super().__init__(layer)
        self.vocabulary = int(layer.sequence_length)

    def _all_variables(self):
        return [self.layer.position_embeddings]

    def record_call(self, inputs, args, kwargs):
        start = kwargs.get("start_index", args[0] if args else 0)
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        if len(inputs.shape) != 3:
            raise ValueError(
                f"PositionEmbedding {self.layer.name!r}: curvature needs (batch, positions, features) inputs, "
                f"got shape {tuple(inputs.shape)}."
            )
        n, t = ops.shape(inputs)[0], ops.shape(inputs)[1]
        if positions is None:
            ids = ops.arange(t, dtype="int32") + ops.cast(start, "int32")
        else:
            ids = ops.cast(positions, "int32")
        return ops.broadcast_to(ids, (n, t))

    def small_grads(self, rec, delta):
        return {id(self.layer.position_embeddings): self._pairs(rec, self.delta_rows(delta))}

    def squared_small_grads(self, recs, deltas):
        ids = ops.concatenate(recs, axis=1) if len(recs) > 1 else recs[0]
        d = [self.delta_rows(x) for x in deltas]
        d = ops.concatenate(d, axis=2) if len(d) > 1 else d[0]
        return {id(self.layer.position_embeddings): self.squared_gradients(ids, d)}


class ReversibleEmbeddingRule(_TableRule):
    def __init__(self, layer):
        super().__init__(layer)
        self.vocabulary = int(layer.input_dim)

    @property
    def tied(self):
        return bool(self.layer.tie_weights)

    def _all_variables(self):
        return [self.layer.embeddings, None if self.tied else getattr(self.layer, "reverse_embeddings", None)]

    def _trainable(self, name):
        v = getattr(self.layer, name, None)
        return v if v is not None and v.trainable else None

    def record_call(self, inputs, args, kwargs):
        if kwargs.get("reverse", args[0] if args else False):
            # hidden states: squares are summed in the table's dtype
            return ops.cast(inputs, self.layer.embeddings.dtype)
        return ops.cast(inputs, "int32")

    @staticmethod
    def _is_lookup(rec):
        return "int" in keras.backend.standardize_dtype(rec.dtype)

    def small_grads(self, rec, delta):
        d = self.delta_rows(delta)
        if self._is_lookup(rec):
            table = self._trainable("embeddings")
            return {} if table is None else {id(table): self._pairs(self.rows(rec), d)}
        h = ops.reshape(rec, (ops.shape(rec)[0], -1, ops.shape(rec)[-1]))
        if self.tied:
            table = self._trainable("embeddings")
            return {} if table is None else {id(table): ops.einsum("kntv,nti->knvi", d, h)}
        reverse = self._trainable("reverse_embeddings")
        return {} if reverse is None else {id(reverse): ops.einsum("nti,kntv->kniv", h, d)}

    def squared_small_grads(self, recs, deltas):
        lookups = [(self.rows(r), self.delta_rows(d)) for r, d in zip(recs, deltas) if self._is_lookup(r)]
        reverses = [(ops.reshape(r, (ops.shape(r)[0], -1, ops.shape(r)[-1])), self.delta_rows(d))
                    for r, d in zip(recs, deltas) if not self._is_lookup(r)]
        ids, dl = _joined(lookups)
        h, c = _joined(reverses)
        table, out = self._trainable("embeddings"), {}
        if self.tied and h is not None:
            if table is not None:
                out[id(table)] = self._dense_squares(h, c, ids, dl)
            return out
        if table is not None and ids is not None:
            out[id(table)] = self.squared_gradients(ids, dl)
        reverse = self._trainable("reverse_embeddings")
        if reverse is not None and h is not None:
            out[id(reverse)] = ops.transpose(self._dense_squares(h, c))
        return out

    def _dense_squares(self, h, c, ids=None, dl=None):
        """``sum_jn G_jn^2`` (V, d) for ``G_jn = P_jn + S_jn``: ``P_jn = c_jn^T
        h_n`` the projection's gradient, formed in full a few examples at a
        time (a chunk near one table), and ``S_jn`` the lookups' (rows at
        the example's ids only). ``G^2 = P^2 + S o (S + 2 P)`` row by row,
        so the lookups add a scatter of their ``T`` rows, with ``P`` read at
        their ids: ``c`` at those vocabulary columns times ``h``."""
        k, n = int(c.shape[0]), int(c.shape[1])
        V, d = self.vocabulary, int(h.shape[-1])
        pairs = k * n
        cap = max(1, MAX_ELEMENTS // (V * d))
        step = max(s for s in range(1, min(cap, pairs) + 1) if pairs % s == 0)
        cs = ops.reshape(c, (pairs,) + tuple(c.shape[2:]))
        hs = ops.tile(h, (k, 1, 1))  # pair j*n + i reads example i

        # A loop the compilers keep as one (XLA would otherwise schedule the
        # unrolled V x d products side by side: 5x a step's peak at GPT-2 size).
        def body(p, total):
            if step == 1:  # no sum to run over the table (an eager backend pays for each pass)
                return total + ops.square(ops.einsum("tv,ti->vi", ops.take(cs, p, axis=0), ops.take(hs, p, axis=0)))
            start = p * step
            cc = ops.slice(cs, (start, 0, 0), (step,) + tuple(cs.shape[1:]))
            hh = ops.slice(hs, (start, 0, 0), (step,) + tuple(hs.shape[1:]))
            return total + ops.sum(ops.square(ops.einsum("ntv,nti->nvi", cc, hh)), axis=0)

        total = ops.fori_loop(0, pairs // step, body, ops.zeros((V, d), dtype=c.dtype))
        if ids is None:
            return total
        t_c, t_l = int(c.shape[2]), int(ids.shape[1])
        at_ids = ops.take_along_axis(c, ops.broadcast_to(ids[None, :, None, :], (k, n, t_c, t_l)), axis=3)
        p_rows = ops.einsum("knut,nui->knti", at_ids, h)  # P_jn at each lookup's id
        # Repeated ids: s_t sums the example's rows of that id (EmbeddingRule).
        return total + self._scatter(ops.sum(dl * (self._summed(ids, dl) + 2.0 * p_rows), axis=0), ids)


def _joined(calls):
    """Rows and output gradients of several calls as one call's (positions
    concatenated): each example's gradient sums over all of them."""
    if not calls:
        return None, None
    rows, deltas = zip(*calls)
    return (ops.concatenate(rows, axis=1) if len(rows) > 1 else rows[0],
            ops.concatenate(deltas, axis=2) if len(deltas) > 1 else deltas[0])


MORE_RULES.append(table_rule_for)
