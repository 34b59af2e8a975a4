"""K-FAC factors of the Fisher for Dense and Conv layers.

For a kernel reshaped to 2-D ``(m, n)`` (Dense: ``(d_in, d_out)``; Conv:
``(kh*kw*c_in, c_out)``) the Fisher block is approximated by ``A (x) S``
("K-FAC expand": spatial positions and extra axes count as examples):

- ``A = mean over examples and positions of a a^T`` with ``a`` the layer's
  input (Conv: the input patch, ordered like the kernel's rows);
- ``S = 1/N sum_n sum_t delta delta^T`` with ``delta`` the gradient of
  ``-log p(label)`` with respect to the layer's pre-activation output, labels
  taken as the chosen Fisher kind prescribes (exact: every class weighted by
  its probability; mc: drawn from the model; empirical: the data).

Inputs are recorded and ``delta`` obtained by temporarily wrapping each
layer's ``call``: the activation is split off and a zero "probe" tensor is
added to the pre-activation, whose gradient is ``delta``. No weight or graph
is changed; the wrapper is removed on exit.
"""

import contextlib

import keras
import numpy as np
from keras import ops

from keras_geosam import backend
from keras_geosam.curvature.functional import batches
from keras_geosam.curvature.functional import model_functions
from keras_geosam.curvature.functional import num_examples
from keras_geosam.curvature.losses import require_classifier
from keras_geosam.sharpness import _common
from keras_geosam.sharpness.fisher import check_kind
from keras_geosam.sharpness.fisher import label_passes

_CONV = (keras.layers.Conv1D, keras.layers.Conv2D)


def supported_layers(model):
    """Trainable Dense/Conv1D/Conv2D layers whose kernel K-FAC can factor."""
    out = []
    for layer in model._flatten_layers(include_self=False):
        if type(layer) in (keras.layers.Dense, keras.layers.Conv1D, keras.layers.Conv2D) and layer.trainable:
            if layer.kernel.trainable and getattr(layer, "groups", 1) == 1:
                out.append(layer)
    return out


@contextlib.contextmanager
def _instrumented(layers, state):
    """Wraps each layer's call to record inputs and add state's probes."""
    originals = {}
    for i, layer in enumerate(layers):
        original = layer.call

        def call(inputs, *args, _i=i, _layer=layer, _orig=original, **kwargs):
            activation = _layer.activation
            object.__setattr__(_layer, "activation", None)
            try:
                z = _orig(inputs, *args, **kwargs)
            finally:
                object.__setattr__(_layer, "activation", activation)
            state["inputs"][_i] = inputs
            state["shapes"][_i] = tuple(ops.shape(z))
            probes = state.get("probes")
            if probes is not None:
                z = z + probes[_i]
            return activation(z) if activation is not None else z

        originals[i] = original
        object.__setattr__(layer, "call", call)
    try:
        yield
    finally:
        for i, layer in enumerate(layers):
            object.__delattr__(layer, "call")


def _patches(layer, a):
    """Input rows matching the kernel's reshaped rows: (examples*positions, m)."""
    a = np.asarray(a, dtype="float64")
    if not isinstance(layer, _CONV):
        return a.reshape(-1, a.shape[-1])
    if layer.data_format != "channels_last":
        a = np.moveaxis(a, 1, -1)
    spatial = a.shape[1:-1]
    ks, st, dl = layer.kernel_size, layer.strides, layer.dilation_rate
    pads = []
    for size, k, s, d in zip(spatial, ks, st, dl):
        eff = (k - 1) * d + 1
        if layer.padding == "same":
            out = -(-size // s)
            total = max((out - 1) * s + eff - size, 0)
            pads.append((total // 2, total - total // 2))
        elif layer.padding == "valid":
            pads.append((0, 0))
        else:
            raise ValueError(f"K-FAC does not support padding={layer.padding!r} on {layer.name}.")
    a = np.pad(a, [(0, 0)] + pads + [(0, 0)])
    outs = [(a.shape[1 + j] - ((k - 1) * d + 1)) // s + 1 for j, (k, s, d) in enumerate(zip(ks, st, dl))]
    pieces = []
    for offset in np.ndindex(*ks):  # row-major over (kh, kw), channels last
        index = [slice(None)]
        for j, (o, s, d) in enumerate(zip(offset, st, dl)):
            index.append(slice(o * d, o * d + (outs[j] - 1) * s + 1, s))
        pieces.append(a[tuple(index)])
    patches = np.concatenate(pieces, axis=-1)
    return patches.reshape(-1, patches.shape[-1])


def _deltas(layer, g):
    g = np.asarray(g, dtype="float64")
    if isinstance(layer, _CONV) and layer.data_format != "channels_last":
        g = np.moveaxis(g, 1, -1)
    return g.reshape(g.shape[0], -1, g.shape[-1])


def kfac_factors(model, x, y=None, kind="exact", num_samples=1, seed=0, batch_size=_common.DEFAULT_BATCH_SIZE, loss=None):
    """K-FAC factors ``{kernel path: (A, S)}`` (float64 NumPy) of the Fisher.

    Args mirror :func:`fisher_diagonal`. Returns a dict ordered like the
    model's layers; variables not in it need another (e.g. diagonal) block.
    """
    check_kind(kind)
    fns = model_functions(model, loss, training=False)
    require_classifier(fns.spec, "K-FAC factors")
    layers = supported_layers(model)
    if not layers:
        return {}
    rng = np.random.default_rng(seed)
    n = num_examples(x)
    state = {"inputs": {}, "shapes": {}, "probes": None}
    A = [0.0] * len(layers)
    S = [0.0] * len(layers)
    rows = [0] * len(layers)

    def summed_nll(probes, xb, labels_or_y, weights, empirical):
        state["probes"] = probes
        y_pred = model(xb, training=False)
        if empirical:
            per = fns.spec.per_example(labels_or_y, y_pred)
        else:
            logp = fns.spec.log_probs(y_pred)
            per = -ops.squeeze(ops.take_along_axis(logp, ops.expand_dims(labels_or_y, -1), axis=-1), -1)
        # sqrt(weight) inside, so delta delta^T carries the weight once.
        return ops.sum(per * ops.convert_to_tensor(np.sqrt(weights), dtype=per.dtype))

    with _instrumented(layers, state):
        for xb, yb, nb in batches(x, y, batch_size):
            state["probes"] = None
            model(xb, training=False)  # records inputs and output shapes
            for i, layer in enumerate(layers):
                p = _patches(layer, ops.convert_to_numpy(state["inputs"][i]))
                A[i] = A[i] + p.T @ p
                rows[i] += p.shape[0]
            zeros = [ops.zeros(state["shapes"][i], dtype=layer.compute_dtype) for i, layer in enumerate(layers)]
            for kernel_name, labels, weights in label_passes(fns, kind, xb, yb, num_samples, rng):
                empirical = kernel_name == "per_example_grads"
                lab = ops.convert_to_tensor(labels) if empirical else ops.convert_to_tensor(labels, "int32")
                _, deltas = backend.value_and_grad(summed_nll, zeros, xb, lab, weights, empirical)
                for i, layer in enumerate(layers):
                    d = _deltas(layer, ops.convert_to_numpy(deltas[i]))
                    S[i] = S[i] + np.einsum("nti,ntj->ij", d, d)
        state["probes"] = None
    return {
        layer.kernel.path: (A[i] / rows[i], S[i] / n) for i, layer in enumerate(layers)
    }


def inverse_sqrt(M, damping):
    """(M + damping * mean eigenvalue * I)^{-1/2} by eigendecomposition, and
    the absolute damping used. Eigenvalues <= 0 after damping are excluded
    (pseudo-inverse square root)."""
    evals, evecs = np.linalg.eigh((M + M.T) / 2)
    lam = damping * max(float(np.mean(np.clip(evals, 0, None))), 0.0)
    shifted = evals + lam
    tol = max(shifted.max(), 0.0) * M.shape[0] * np.finfo("float64").eps
    inv = np.where(shifted > tol, 1.0 / np.sqrt(np.where(shifted > tol, shifted, 1.0)), 0.0)
    return (evecs * inv) @ evecs.T, lam
