"""The likelihoods behind the losses curvature routines take (spec: sharpness.md, section 7).

A likelihood says how a loss term depends on the outputs ``z`` the
Gauss-Newton matrix linearises, so every Fisher quantity can be written
once for all of them:

- :class:`Categorical`: (sparse) categorical cross-entropy on logits, or on
  softmax probabilities (``z = log p``). Per token ``Q = diag p - p p^T``.
- :class:`Gaussian`: Keras' mean squared error over ``d`` outputs, the
  negative log-likelihood of a Gaussian of variance ``d / 2`` (up to a
  constant): ``Q = 2/d I``, whatever the targets.
- :class:`Bernoulli`: binary cross-entropy, the mean over ``d`` independent
  outputs (one for a binary classifier, several for multi-label), on logits
  or on sigmoid probabilities (``z = logit p``): ``Q = diag(p (1 - p)) / d``.

``Q`` is each loss term's Hessian in ``z`` (Keras' mean over the last axis
included; the mean over examples or the token weights are applied by the
caller), so ``J^T Q J`` is the GGN of the compiled loss and the exact Fisher.
For every member it holds whatever the targets (label smoothing included),
which is what makes ``H = GGN + sum_k r_k grad^2 z_k`` exact.

Each member gives ``Q``'s product and quadratic form, its square-root
factors one column at a time (the exact GGN), and factors drawn from the
model's own predictive distribution with ``E[c c^T] = Q`` (the Monte-Carlo
Fisher). The draws come from a counter-based hash of (key, row, column), the
same on every backend.
"""

import math

import keras
from keras import ops


class Likelihood:
    """One family: how the loss reads the outputs and their curvature.

    Args:
        from_logits: whether the model's outputs are the natural outputs
            ``z`` (logits) rather than probabilities. Ignored by
            :class:`Gaussian`.
    """

    name = None

    def __init__(self, from_logits=True):
        self.from_logits = bool(from_logits)

    # The activation that turns z into the probabilities the loss may read.
    probability_link = None

    @property
    def link(self):
        """The output activation the loss reads as probabilities (it
        belongs to the loss, not the network), or None (logits, or no
        probabilities)."""
        return None if self.from_logits else self.probability_link

    def __repr__(self):
        return f"{type(self).__name__}(from_logits={self.from_logits})"

    def __eq__(self, other):
        return type(self) is type(other) and self.from_logits == other.from_logits

    def __hash__(self):
        return hash((type(self).__name__, self.from_logits))

    # Outputs ---------------------------------------------------------
    def natural(self, y_pred):
        """The outputs ``z`` the Gauss-Newton matrix linearises."""
        return y_pred

    def outputs(self, z):
        """Inverse of :meth:`natural` (up to its clip): what the loss takes."""
        return z

    # Curvature -------------------------------------------------------
    def hessian_product(self, z, w):
        """``Q(z) w`` for every token (last axis: outputs)."""
        return self.hessian_at(z)(w)

    def hessian_at(self, z):
        """``w -> Q(z) w``, with what depends on `z` alone computed once
        (LLQR's refresh applies it at every inner step)."""
        raise NotImplementedError

    def quadratic(self, z, dz):
        """``dz^T Q(z) dz`` for every token: shape ``z.shape[:-1]``."""
        return ops.sum(dz * self.hessian_product(z, dz), axis=-1)

    def exact_factors(self, z, onehot):
        """Columns of a square root of ``Q``: ``z`` ``(k, N, C)`` (the token
        each column belongs to), `onehot` ``(k, 1, C)`` (the column's output
        j). ``sum_j c_j c_j^T = Q``."""
        raise NotImplementedError

    def sampled_factors(self, z, uniform, rows, draws):
        """``(S, M, C)`` factors drawn from the model, ``E[c c^T] = Q``.

        `z`: ``(M, C)``, one row per token; `rows`: ``(M,)`` int32, each
        token's draw row; `draws`: ``(S,)`` int32 draw ids; `uniform(rows,
        cols)`: uniforms in [0, 1), ``(len(rows), len(cols))``, in the
        dtype the draw needs (at least float32).
        """
        raise NotImplementedError

    def _per_output_rows(self, rows, num_outputs):
        # One draw row per (token, output): independent outputs need their own.
        ids = ops.arange(0, num_outputs, dtype="int32")
        return ops.reshape(ops.add(ops.multiply(ops.cast(rows, "int32")[:, None], num_outputs), ids[None]), (-1,))


class Categorical(Likelihood):
    """Softmax cross-entropy: ``p = softmax(z)``, ``Q = diag p - p p^T``."""

    name = "categorical"

    probability_link = "softmax"

    def natural(self, y_pred):
        if self.from_logits:
            return y_pred
        # Clipped as Keras' own cross-entropy does, so log stays finite.
        return ops.log(ops.clip(y_pred, keras.config.epsilon(), 1.0))

    def outputs(self, z):
        return z if self.from_logits else ops.exp(z)

    @staticmethod
    def probs(z):
        return ops.exp(ops.log_softmax(z, axis=-1))

    def hessian_at(self, z):
        p = self.probs(z)
        return lambda w: p * w - p * ops.sum(p * w, axis=-1, keepdims=True)

    def quadratic(self, z, dz):
        p = self.probs(z)
        return ops.sum(p * ops.square(dz), axis=-1) - ops.square(ops.sum(p * dz, axis=-1))

    def exact_factors(self, z, onehot):
        # c_j = sqrt(p_j) (e_j - p).
        p = self.probs(z)
        pj = ops.sum(p * onehot, axis=-1, keepdims=True)
        return ops.sqrt(pj) * (onehot - p)

    def sampled_factors(self, z, uniform, rows, draws):
        # c = e_s - p, s drawn from p by the inverse CDF of one uniform.
        num_classes = int(z.shape[-1])
        p = self.probs(z)
        u = uniform(rows, draws)
        cdf = ops.cumsum(ops.cast(p, u.dtype), axis=-1)
        labels = ops.sum(ops.cast(ops.greater(u[:, :, None], cdf[:, None, :]), "int32"), axis=-1)
        labels = ops.minimum(labels, num_classes - 1)
        return ops.one_hot(ops.transpose(labels), num_classes, dtype=z.dtype) - p[None]


class Gaussian(Likelihood):
    """Keras' mean squared error over d outputs: ``Q = 2/d I``.

    ``(1/d) sum_k (f_k - y_k)^2`` is the negative log-likelihood of ``y ~
    N(f, d/2 I)`` up to a constant, so the Monte-Carlo Fisher draws targets
    from that Gaussian: ``c = 2/d (f - y) = sqrt(2/d) eps``, eps standard
    normal (Box-Muller from two uniforms per output).
    """

    name = "gaussian"

    def __init__(self, from_logits=True):
        super().__init__(True)

    def hessian_at(self, z):
        scale = 2.0 / int(z.shape[-1])
        return lambda w: w * scale

    def exact_factors(self, z, onehot):
        return ops.zeros_like(z) + onehot * float((2.0 / int(z.shape[-1])) ** 0.5)

    def sampled_factors(self, z, uniform, rows, draws):
        m, d = int(z.shape[0]), int(z.shape[-1])
        s = int(draws.shape[0])
        cols = ops.concatenate([ops.multiply(draws, 2), ops.add(ops.multiply(draws, 2), 1)], axis=0)
        u = ops.reshape(uniform(self._per_output_rows(rows, d), cols), (m, d, 2, s))
        # 1 - u lies in (0, 1]: the log is finite.
        radius = ops.sqrt(-2.0 * ops.log(1.0 - u[:, :, 0, :]))
        eps = radius * ops.cos((2.0 * math.pi) * u[:, :, 1, :])
        return ops.cast(ops.transpose(eps, (2, 0, 1)), z.dtype) * float((2.0 / d) ** 0.5)


class Bernoulli(Likelihood):
    """Binary cross-entropy, the mean over d independent outputs:
    ``p = sigmoid(z)``, ``Q = diag(p (1 - p)) / d``.

    The Monte-Carlo factors draw each output's target from its Bernoulli:
    ``c = (y - p) / sqrt(d)``. On probabilities, ``z = logit p`` (clipped as
    Keras' loss clips), which by the chain rule gives the Fisher in p,
    ``J_p^T diag(1 / (p (1 - p))) J_p / d``.
    """

    name = "bernoulli"

    probability_link = "sigmoid"

    def natural(self, y_pred):
        if self.from_logits:
            return y_pred
        eps = keras.config.epsilon()
        p = ops.clip(y_pred, eps, 1.0 - eps)
        return ops.log(p) - ops.log(1.0 - p)

    def outputs(self, z):
        return z if self.from_logits else ops.sigmoid(z)

    def hessian_at(self, z):
        p = ops.sigmoid(z)
        q = p * (1.0 - p) / float(int(z.shape[-1]))
        return lambda w: w * q

    def exact_factors(self, z, onehot):
        p = ops.sigmoid(z)
        return onehot * ops.sqrt(p * (1.0 - p) / float(int(z.shape[-1])))

    def sampled_factors(self, z, uniform, rows, draws):
        m, d = int(z.shape[0]), int(z.shape[-1])
        u = ops.reshape(uniform(self._per_output_rows(rows, d), draws), (m, d, -1))
        p = ops.sigmoid(z)
        target = ops.cast(ops.less(u, ops.cast(p, u.dtype)[:, :, None]), z.dtype)
        return (ops.transpose(target, (2, 0, 1)) - p[None]) / float(d**0.5)


class Joint(Likelihood):
    """Several outputs, each with its own likelihood, in one flat vector.

    A multi-output model's loss is Keras' weighted sum ``sum_i w_i L_i``,
    each ``L_i`` the mean of output i's loss terms, so its GGN is the
    weighted sum of each output's. The outputs of one example are laid side
    by side (``losses.JointSpec``): segment i holds ``T_i`` positions of
    ``C_i`` outputs, and its per-example curvature is ``w_i / T_i`` times
    its likelihood's ``Q`` at each position. Every method applies each
    member to its segment and scales it: ``Q`` is block-diagonal.

    Args:
        segments: a callable returning ``[(offset, positions, classes,
            likelihood, scale)]`` (known once the model has run).
    """

    name = "joint"

    def __init__(self, segments):
        super().__init__(True)
        self._segments = segments

    def __repr__(self):
        return "Joint(...)"

    def __eq__(self, other):
        return self is other

    def __hash__(self):
        return id(self)

    def _parts(self, z, lead):
        """Each segment's slice of the last axis of `z`, as ``lead + (T_i,
        C_i)``, with its member and scale."""
        for offset, positions, classes, member, scale in self._segments():
            part = z[..., offset:offset + positions * classes]
            yield ops.reshape(part, lead + (positions, classes)), member, scale

    def _join(self, parts, lead):
        return ops.concatenate([ops.reshape(p, lead + (-1,)) for p in parts], axis=-1)

    def hessian_at(self, z):
        lead = tuple(int(d) for d in z.shape[:-1])
        members = [(member.hessian_at(zs), scale) for zs, member, scale in self._parts(z, lead)]

        def apply(w):
            outs = [curvature(ws) * scale for (curvature, scale), (ws, _, _) in zip(members, self._parts(w, lead))]
            return self._join(outs, lead)

        return apply

    def quadratic(self, z, dz):
        lead = tuple(int(d) for d in z.shape[:-1])
        total = None
        for (zs, member, scale), (ds, _, _) in zip(self._parts(z, lead), self._parts(dz, lead)):
            q = ops.sum(member.quadratic(zs, ds), axis=-1) * scale
            total = q if total is None else total + q
        return total

    def exact_factors(self, z, onehot):
        lead = tuple(int(d) for d in z.shape[:-1])
        hot = tuple(int(d) for d in onehot.shape[:-1])
        outs = [member.exact_factors(zs, hs) * float(scale ** 0.5)
                for (zs, member, scale), (hs, _, _) in zip(self._parts(z, lead), self._parts(onehot, hot))]
        return self._join(outs, lead)

    def sampled_factors(self, z, uniform, rows, draws):
        m = int(z.shape[0])
        segments = self._segments()
        total_positions = sum(positions for _, positions, _, _, _ in segments)
        outs, base = [], 0
        for (zs, member, scale), (_, positions, _, _, _) in zip(self._parts(z, (m,)), segments):
            # A draw row per (example, output, position), none shared.
            ids = ops.arange(base, base + positions, dtype="int32")
            seg_rows = ops.reshape(ops.add(ops.multiply(ops.cast(rows, "int32")[:, None], total_positions), ids[None]), (-1,))
            c = member.sampled_factors(ops.reshape(zs, (m * positions, -1)), uniform, seg_rows, draws)
            outs.append(ops.reshape(c, (int(c.shape[0]), m, -1)) * float(scale ** 0.5))
            base += positions
        return ops.concatenate(outs, axis=-1)


FAMILIES = "categorical cross-entropy (sparse or one-hot), mean squared error (Gaussian), binary cross-entropy (Bernoulli)"
