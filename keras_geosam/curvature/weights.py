"""Which loss terms count, and how much: sample weights and Keras masks.

A model's outputs have a shape ``(N,) + positions + (C,)``: no positions for
a classifier of whole examples, ``(T,)`` for a sequence model's per-token
logits. Each position of each example is a loss term ("token"). The loss
every curvature routine differentiates is the weighted mean over tokens::

    L = sum_{n,t} w_nt l_nt / sum_{n,t} w_nt

with ``w`` the product of the user's ``sample_weight`` (``(N,)``, one weight
per example, or one per token) and the mask Keras attaches to the model's
output (``Embedding(mask_zero=True)`` and the layers that propagate it), so
padded tokens do not count. Without either, ``w = 1``: the mean over all
tokens, which is Keras' own loss. With a mask alone it is also Keras'
loss; with explicit weights Keras' default reduction divides by the number
of entries instead of the weights' sum (the two agree for 0/1 weights
whose zeros are padding only when a mask supplies them).

"Per example" means per sequence wherever a function returns one value per
example (``per_example_gradients``, the empirical Fisher's per-example
gradients): example n's loss is ``L_n = sum_t w_nt l_nt / sum_t w_nt``, and
``L = sum_n (W_n / W) L_n`` with ``W_n = sum_t w_nt``. Curvature sums
(Fisher diagonals, K-FAC factors, GGN traces) run over tokens.

``resolve`` validates what the user passed and returns the weights as a
float NumPy array shaped like the per-token losses (``(N,)`` or ``(N,) +
positions``), or None when every token counts once (the unweighted
computation, unchanged).

Several outputs (``losses.JointSpec``) may take a weight per output, as
``fit`` does: a list in output order or a dict by output name, each entry
``(N,)`` or ``(N,) + positions`` of its output (None or a missing name: that
output unweighted). Each output's loss is then its own weighted mean, and
the total Keras' weighted sum of them::

    L = sum_i lambda_i sum_{n,t} w_nti l_nti / sum_{n,t} w_nti

``resolve`` returns them as one ``(N, T)`` array over the T loss terms of
all outputs side by side, each output's columns normalised to sum to its
term count ``T_i`` (``sw_nti = T_i w_nti / sum w_i``, already final: the
scale of one output's weights says nothing). An example's share of the
data is then the mean over outputs of its terms' mean weight
(``JointSpec.example_share``; the shares sum to one, and equal the single
weight's share when every output has the same weights).
"""

import numpy as np
from keras import ops

from keras_geosam import keras_internals
from keras_geosam import backend
from keras_geosam.curvature.data import DEFAULT_BATCH_SIZE
from keras_geosam.curvature.data import batches
from keras_geosam.curvature.data import input_arrays
from keras_geosam.curvature.data import rows_of
from keras_geosam.curvature.losses import JointSpec


def first_example(fns, x):
    """``(output shape without the example axis, emits a mask, has
    regularisation losses)`` of the model on `x`: one forward on its first
    example, once per input shape, traced for its shapes only
    (``backend.for_shapes``)."""
    key = _input_key(x)
    cache = fns.__dict__.setdefault("_output_shapes", {})
    if key not in cache:
        seen = []

        def forward(params, nt, x1):
            y_pred, losses = fns.outputs(params, nt, x1)
            seen.append((tuple(int(d) for d in ops.shape(y_pred)[1:]), output_mask(y_pred) is not None, bool(losses)))
            return y_pred

        backend.for_shapes(forward, fns.params(), fns.non_trainable(), rows_of(x, 0, 1))
        cache[key] = seen[-1]
    return cache[key]


def output_shape(fns, x):
    """Shape of the model's outputs for `x` (from :func:`first_example`,
    the example axis set to ``len(x)``)."""
    n = int(ops.shape(input_arrays(x)[0])[0])
    return (n,) + first_example(fns, x)[0]


def _input_key(x):
    return tuple(tuple(int(d) for d in ops.shape(t)[1:]) for t in input_arrays(x))


def emits_mask(fns, x):
    """Whether the model attaches a Keras mask to its outputs for `x`."""
    return first_example(fns, x)[1]


def output_mask(y_pred):
    """The mask Keras attached to `y_pred` (None without one).

    Keras keeps it as the ``_keras_mask`` attribute of the output tensor
    (or in a table by id where a tensor takes no attributes); no public API
    reads it. Checked against keras 3.12-3.15."""
    return keras_internals.keras_mask(y_pred)


def positions(shape):
    """The positions part of an output shape ``(N,) + positions + (C,)``."""
    return tuple(shape[1:-1])


def check_label_shape(fns, x, y):
    """Raises unless `y` fits the model's outputs on `x`: sparse labels
    ``(N,) + positions`` (a trailing 1 allowed), dense ones ``(N,) +
    positions + (C,)``."""
    if y is None or fns.spec.likelihood is None:
        return
    out = output_shape(fns, x)
    parts = getattr(fns.spec, "parts", None)
    if parts is None:
        _check_label_shape(fns.spec, out, y)
        return
    # Several outputs (losses.JointSpec): each label against its output.
    for (key, spec, _), shape, yi in zip(parts, fns.spec.output_shapes, fns.spec.labels(y)):
        _check_label_shape(spec, (out[0],) + shape, yi, f" of output {key!r}")


def _check_label_shape(spec, out, y, where=""):
    got = tuple(int(d) for d in ops.shape(y))
    pos = positions(out)
    if spec.classifier and spec.sparse:
        ok = got[1:] == pos or got[1:] == pos + (1,)
        want = f"{(got[0],) + pos}"
    else:
        # A (N,) target for one output unit is taken as Keras takes it.
        ok = got[1:] == out[1:] or (out[-1] == 1 and got[1:] == out[1:-1])
        want = f"{(got[0],) + tuple(out[1:])}"
    if not ok:
        what = "sequence length" if pos or len(got) > 2 else "shape"
        raise ValueError(
            f"Labels y{where} of shape {got} do not fit the model's outputs {out} (labels should be {want}): "
            f"x and y differ in {what}."
        )


def resolve(fns, x, y, sample_weight, batch_size):
    """The per-token weights for ``(x, y)`` (module doc): a float64 NumPy
    array shaped like the per-token losses, or None when every token counts
    once. The model's mask is computed by forward passes over `x` in
    `batch_size` pieces, only when the model emits one."""
    out = output_shape(fns, x)
    n, pos = out[0], positions(out)
    weights = None
    if per_output(sample_weight):
        return _per_output(fns, sample_weight, n)
    if sample_weight is not None:
        weights = _check_sample_weight(sample_weight, n, pos)
    if emits_mask(fns, x):
        kernel = fns.kernel(fns.output_mask_body)
        parts = [np.asarray(ops.convert_to_numpy(kernel(fns.params(), fns.non_trainable(), xb)), "float64")
                 for xb, _, _ in batches(x, None, batch_size)]
        mask = np.concatenate(parts, axis=0).reshape((n,) + pos)
        weights = mask if weights is None else weights * mask
    if weights is not None and not weights.sum() > 0:
        raise ValueError("Every loss term has weight zero (sample_weight and the model's mask): nothing to differentiate.")
    return weights


def per_output(sample_weight):
    """Whether `sample_weight` holds a weight per output (a dict, or a list
    or tuple of arrays) rather than one weight per example."""
    return isinstance(sample_weight, dict) or (
        isinstance(sample_weight, (list, tuple)) and any(w is None or hasattr(w, "shape") for w in sample_weight))


def is_per_term(fns, weights):
    """Whether resolved `weights` (or a batch of them) are per output's loss
    terms: ``(N, T)`` for a model whose outputs are laid side by side."""
    return weights is not None and isinstance(fns.spec, JointSpec) and len(weights.shape) == 2


def normalise(fns, weights):
    """Resolved `weights` as each batch's kernels take them: summing to one
    (per-term weights are final already)."""
    if weights is None or is_per_term(fns, weights):
        return weights
    return weights / weights.sum()


def _per_output(fns, sample_weight, n):
    spec = fns.spec
    keys = [k for k, _, _ in getattr(spec, "parts", [])]
    if not keys:
        raise ValueError(
            "sample_weight per output (a list or dict of arrays) needs a model with several outputs, each "
            "compiled with its own loss; this model has one output: pass one (N,) weight per example.")
    if isinstance(sample_weight, dict):
        unknown = sorted(set(sample_weight) - set(keys), key=str)
        if unknown:
            raise ValueError(f"sample_weight names the output(s) {unknown}; the model's are {keys}.")
        given = [sample_weight.get(k) for k in keys]
    else:
        if len(sample_weight) != len(keys):
            raise ValueError(f"sample_weight holds {len(sample_weight)} arrays for a model with {len(keys)} outputs "
                             f"({keys}): give one per output (None for an unweighted one), or a dict by name.")
        given = list(sample_weight)
    columns = []
    for key, w, shape in zip(keys, given, spec.output_shapes):
        pos = tuple(shape[:-1])
        w = np.ones((n,) + pos) if w is None else _check_sample_weight(w, n, pos, f" of output {key!r}")
        w = w.reshape(n, -1)
        if not w.sum() > 0:
            raise ValueError(f"Every loss term of output {key!r} has weight zero in sample_weight: its loss, a "
                             "weighted mean, is undefined. Drop the output's loss or give it some weight.")
        columns.append(w * (w.shape[1] / w.sum()))
    return np.concatenate(columns, axis=1)


def _check_sample_weight(sample_weight, n, pos, where=""):
    if not hasattr(sample_weight, "shape"):
        sample_weight = np.asarray(sample_weight)
    w = np.asarray(ops.convert_to_numpy(sample_weight), dtype="float64")
    shape = tuple(w.shape)
    if shape == (n,) and pos:
        w = np.broadcast_to(w.reshape((n,) + (1,) * len(pos)), (n,) + pos)
    elif shape != (n,) + pos:
        allowed = f"({n},)" + (f" or {(n,) + pos}" if pos else "")
        raise ValueError(
            f"sample_weight{where} of shape {shape} does not fit the data: one weight per example {allowed}"
            + (" (one per token)" if pos else "") + "."
        )
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError(f"sample_weight{where} must be finite and >= 0.")
    return np.array(w, dtype="float64")


def example_weights(weights):
    """``W_n``: each example's total weight (``(N,)``)."""
    return weights.reshape(weights.shape[0], -1).sum(axis=1)


def batch_slices(weights, n, batch_size, dtype):
    """The slices of `weights` matching ``data.batches(x, y,
    batch_size)``, as tensors of `dtype` (None for each batch without
    weights)."""
    size = DEFAULT_BATCH_SIZE if batch_size is None else int(batch_size)
    for start in range(0, n, size):
        stop = min(start + size, n)
        yield None if weights is None else backend.distribute_batch(weights[start:stop].astype(dtype))
