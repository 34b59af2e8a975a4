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
- ``BatchNormalization`` in inference mode: ``gamma`` and ``beta`` from the
  normalised input (no K-FAC block).

The trainable variables of any other layer are "uncovered": their
per-example gradients come from the backend's vectorised map instead.
"""

import string

import keras
import numpy as np
from keras import ops

_CONV = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)
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
        shape = getattr(layer, "_build_shapes_dict", None) or {}
        rank = len(next(iter(shape.values()))) if shape else None
        if rank is not None and EinsumDenseRule.roles(layer, rank) is not None:
            return EinsumDenseRule(layer)
        return None
    if isinstance(layer, keras.layers.BatchNormalization) and not training and not getattr(layer, "renorm", False):
        return BatchNormRule(layer)
    return None


def leaf_layers(model):
    """Every layer of `model` that holds no other layers (nested models and
    containers such as MultiHeadAttention are walked into)."""
    return [layer for layer in model._flatten_layers(include_self=False) if not list(layer._flatten_layers(include_self=False))]


# Every Keras convolution (their kernel gradients are what XLA:CPU runs
# slowly inside compiled loops).
CONVOLUTIONS = tuple(
    getattr(keras.layers, name) for name in (
        "Conv1D", "Conv2D", "Conv3D", "Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose",
        "DepthwiseConv1D", "DepthwiseConv2D", "SeparableConv1D", "SeparableConv2D",
    ) if hasattr(keras.layers, name)
)


def has_trainable_convolutions(model):
    """Whether `model` has a convolution layer with trainable weights."""
    return any(isinstance(layer, CONVOLUTIONS) and layer.trainable_variables for layer in leaf_layers(model))


def rules_for(model, training=False):
    """Rules for every covered layer of `model` (nested models included)."""
    out = []
    for layer in leaf_layers(model):
        rule = rule_for(layer, training)
        if rule is not None and rule.variables:
            out.append(rule)
    return out
