"""Per-example curvature statistics: one forward, one batched backward.

(Products are ``ops.einsum``: Keras 3.15's ``ops.matmul`` computes float64
in float32 on torch.)

Each covered layer (``layers.py``) is instrumented for the duration of one
forward pass: its input is recorded and a zero tensor (a "probe") is added
to its pre-activation output. The gradient with respect to that probe is
``delta``, the gradient of the pre-activation. A batched vector-Jacobian
product pushes k output cotangents per example (the columns of a square
root of the output-space curvature, ``ModelFunctions.output_factors``)
back through the one recorded forward pass, so ``delta`` arrives for every
column at once. From input rows ``a`` and ``delta`` rows come, by
reductions on the device:

- the diagonal of the GGN / Fisher of any kind: ``sum_jn g_jn^2`` with
  ``g_jn = sum_t a_nt delta_jnt^T`` (for ``T = 1`` the identity
  ``g^2 = a^2 (delta^2)^T`` gives it as one matrix product);
- K-FAC factors ``A = sum a a^T`` (over examples and positions) and
  ``B = sum delta delta^T``;
- exact quadratic forms ``sum_jn g_jn^T W g_jn`` for a weight ``W`` diagonal
  in a Kronecker eigenbasis (``tr(M^-1 GGN)`` under a K-FAC metric).

Variables of layers without a rule get their per-example gradients from the
backend's vectorised map, still reduced on the device. Memory is
``O(batch x layer)``: class columns and examples are processed in chunks
bounded by ``max_elements``.
"""

import contextlib

import keras
import numpy as np
from keras import ops

from keras_geosam.curvature.kernels import KernelCache
from keras_geosam import backend
from keras_geosam.curvature import memory
from keras_geosam.curvature.layers import KFAC_APPROXIMATIONS
from keras_geosam.curvature.layers import MAX_ELEMENTS
from keras_geosam.curvature.layers import rules_for


class Capture:
    """Per-example statistics of one model's covered layers (see module doc)."""

    def __init__(self, fns):
        self.fns = fns
        self.rules = rules_for(fns.model, fns.training)
        covered = {id(v) for r in self.rules for v in r.variables}
        self.position = {id(v): i for i, v in enumerate(fns.variables)}
        self.uncovered = [i for i, v in enumerate(fns.variables) if id(v) not in covered]
        self.kfac_rules = [r for r in self.rules if r.kernel is not None]
        self._call_shapes = {}
        self._kernels = KernelCache()
        self._memory_checked = set()

    def _kernel(self, body, **static):
        return self._kernels.get(body, **static)

    # -------------------------------------------------- instrumentation ----
    @contextlib.contextmanager
    def _instrumented(self, state):
        patched = []
        try:
            self._patch(state, patched)
            yield
        finally:
            for layer in patched:
                object.__delattr__(layer, "call")

    def _patch(self, state, patched):
        for i, rule in enumerate(self.rules):
            layer, original = rule.layer, rule.layer.call

            def call(inputs, *args, _i=i, _rule=rule, _layer=layer, _orig=original, **kwargs):
                activation = getattr(_layer, "activation", None) if _rule.splits_activation else None
                if activation is not None:
                    object.__setattr__(_layer, "activation", None)
                try:
                    z = _orig(inputs, *args, **kwargs)
                finally:
                    if activation is not None:
                        object.__setattr__(_layer, "activation", activation)
                calls = state["records"][_i]
                calls.append(_rule.record_call(inputs, args, kwargs))
                state["shapes"][_i].append(tuple(z.shape))
                probes = state["probes"]
                if probes is not None:
                    z = z + ops.cast(probes[state["slot"][(_i, len(calls) - 1)]], z.dtype)
                return activation(z) if activation is not None else z

            object.__setattr__(layer, "call", call)
            patched.append(layer)

    def _forward(self, probes, params, nt, x, slot, output):
        state = {"records": [[] for _ in self.rules], "shapes": [[] for _ in self.rules], "probes": probes, "slot": slot}
        with self._instrumented(state):
            if output == "logits":
                z = self.fns.logits(params, nt, x)
            else:
                z = self.fns.outputs(params, nt, x)[0]
        return z, state["records"]

    def call_shapes(self, x):
        """Pre-activation shape of every call of every covered layer for a
        batch shaped like `x` (found once per shape by a forward traced for
        its shapes only, ``backend.for_shapes``)."""
        key = tuple(tuple(t.shape) for t in keras.tree.flatten(x))
        if key not in self._call_shapes:
            state = {"records": [[] for _ in self.rules], "shapes": [[] for _ in self.rules], "probes": None, "slot": {}}
            def forward(params, nt, x):
                with self._instrumented(state):
                    return self.fns.outputs(params, nt, x)[0]

            backend.for_shapes(forward, self.fns.params(), self.fns.non_trainable(), x)
            self._call_shapes[key] = [list(s) for s in state["shapes"]]
        return self._call_shapes[key]

    # --------------------------------------------------------- kernels ----
    def statistics(self, params, nt, x, y, key, offset, kind, num_samples, kernel_diag=None, other_diag=True, factors=False, bases=None, approximation="expand", sw=None, gram=()):
        """Sums over one batch, on the device.

        Args:
            kind, num_samples, key, offset: the output factors
                (``ModelFunctions.output_factors``).
            kernel_diag: K-FAC rules (indices into ``kfac_rules``; None: all)
                whose kernels get the squared-gradient sum.
            other_diag: the same for every other variable (biases, scales,
                uncovered variables).
            factors: K-FAC factor sums ``A`` (with row counts) and ``B``.
            gram: K-FAC rules (indices into ``kfac_rules``) whose input
                factor comes as its rows ``R`` (``R^T R`` the sum; in
                ``"R"``, ``"A"`` holding None there): layers wider than the
                rows they see.
            bases: ``{kfac rule index: (QA, QB, W)}``: the kernel's
                ``sum_jn g^T W g`` with ``W`` diagonal in the basis QA kron QB
                (``QA`` None: the identity, for a diagonal input factor).
            approximation: K-FAC for layers shared over positions,
                ``"expand"`` or ``"reduce"`` (``layers.py``).
            sw: normalised per-token weights of the batch
                (``weights.py``), or None. They scale each token's output
                factors by ``sqrt(w)``, and weight the K-FAC input rows: a
                layer whose rows are the output's positions takes each
                token's weight, any other its example's.

        Returns:
            ``{"diag": {variable index: tensor}, "quad": {variable index:
            scalar}, "A", "B", "rows": lists over ``kfac_rules``}``.
        """
        if kernel_diag is None:
            kernel_diag = range(len(self.kfac_rules))
        bases = dict(bases or {})
        quad = tuple(sorted(bases))
        if approximation not in KFAC_APPROXIMATIONS:
            raise ValueError(f"The K-FAC approximation must be one of {KFAC_APPROXIMATIONS}, got {approximation!r}.")
        static = dict(kind=kind, num_samples=int(num_samples))
        out = {"diag": {}, "A": [], "B": [], "rows": [], "quad": {}, "R": {}}
        if self.rules:
            kernel = self._kernel(self.body_statistics, kernel_diag=tuple(sorted(kernel_diag)), other_diag=bool(other_diag),
                factors=bool(factors), quad=quad, shapes=_freeze(self.call_shapes(x)), gram=tuple(sorted(gram)),
                approximation=approximation if factors else "expand", **static,
            )
            out = kernel(params, nt, x, y, key, offset, [bases[q] for q in quad], sw)
        if other_diag and self.uncovered:
            n = ops.shape(keras.tree.flatten(x)[0])[0]  # None inside a trace of unknown batch size: not checked
            if isinstance(n, (int, np.integer)) and (n, "uncovered") not in self._memory_checked:
                variables = [self.fns.variables[i] for i in self.uncovered]
                itemsize = np.dtype(keras.backend.standardize_dtype(variables[0].dtype)).itemsize
                memory.check_per_example_gradients(variables, n, "The curvature of layers without a rule", itemsize)
                self._memory_checked.add((n, "uncovered"))
            extra = self._kernel(self.body_uncovered, **static)(params, nt, x, y, key, offset, sw)
            out["diag"] = {**out["diag"], **extra}
        return out

    def per_example_gradients(self, params, nt, x, y, sw=None):
        """Per-example gradients of each example's own (weighted) mean loss
        over its positions, ``{variable index: (N,) + shape}``, for covered
        variables only (see ``uncovered``)."""
        return self._kernel(self.body_per_example, shapes=_freeze(self.call_shapes(x)))(params, nt, x, y, sw)

    # Bodies of the compiled kernels (ModelFunctions compiles them).
    def _pullback(self, params, nt, x, shapes, output):
        slot, zeros = {}, []
        dtype = self.fns.variables[0].dtype
        for i, calls in enumerate(shapes):
            for c, s in enumerate(calls):
                slot[(i, c)] = len(zeros)
                zeros.append(ops.zeros(s, dtype=dtype))
        z, records, pull = backend.vjp_batched(
            lambda pr: self._forward(pr, params, nt, x, slot, output), zeros, has_aux=True
        )
        return z, records, pull, slot

    def _rows(self, records):
        out = []
        for rule, calls in zip(self.rules, records):
            if rule.kernel is None:
                out.append(None)
                continue
            # In the weights' dtype: under a mixed policy layers see float16 /
            # bfloat16 inputs, but curvature statistics are sums of squares
            # that need float32 (and torch's einsum does not promote).
            rows = [rule.cast_rows(rule.rows(r), rule.kernel.dtype) for r in calls]
            out.append(rows[0] if len(rows) == 1 else ops.concatenate(rows, axis=1))
        return out

    def _deltas(self, rule, i, records, deltas, slot):
        calls = len(records[i])
        d = [ops.cast(rule.delta_rows(deltas[slot[(i, c)]]), rule.kernel.dtype) for c in range(calls)]
        return d[0] if calls == 1 else ops.concatenate(d, axis=2)

    def body_statistics(self, params, nt, x, y, key, offset, bases, sw, *, kind, num_samples, kernel_diag, other_diag, factors, quad, shapes, approximation, gram):
        z, records, pull, slot = self._pullback(params, nt, x, shapes, "logits")
        k = self.fns.num_factor_columns(kind, tuple(int(d) for d in z.shape), num_samples)
        per_column = sum(int(np.prod(s)) for calls in shapes for s in calls)
        # The factors of a chunk are built with it: the exact kind's T*C
        # columns of a sequence model never exist all at once.
        chunk = max(1, min(k, MAX_ELEMENTS // max(per_column, int(np.prod(z.shape)), 1)))
        rows = self._rows(records)
        kfac_index = {i: j for j, i in enumerate(i for i, r in enumerate(self.rules) if r.kernel is not None)}
        out = {"diag": {}, "A": [], "B": [], "rows": [], "quad": {}, "R": {}}
        if factors:
            for j, (rule, a) in enumerate((r, a) for r, a in zip(self.rules, rows) if a is not None):
                # Weights per output's terms: the input side takes each
                # example's share (weights.py), the output side each term's.
                share = None if sw is None else self.fns.example_share(sw, rule.kernel.dtype)
                rw = _row_weights(share, a, rule.kernel.dtype)
                if j in gram:
                    R, count = rule.input_rows(a, approximation, rw)
                    out["R"][j] = R
                    out["A"].append(None)
                else:
                    A, count = rule.input_factor(a, approximation, rw)
                    out["A"].append(A)
                out["rows"].append(ops.convert_to_tensor(count, dtype=rule.kernel.dtype))
        rotated = {}
        for q, (QA, QB, W) in zip(quad, bases):
            i = [i for i, j in kfac_index.items() if j == q][0]
            rotated[i] = (self.rules[i].rotate(rows[i], QA), QB, W)
        # One position per example (T = 1): g_jn^2 = a_n^2 (delta_jn^2)^T, so
        # sum_j delta_jn^2 (N x n) is accumulated over the column chunks and
        # met with a^2 once at the end (one m x n product, not one per chunk).
        def chunk_sums(start, count, acc):
            acc = {name: dict(part) for name, part in acc.items()}
            cot = self.fns.output_factors(kind, z, y, key, offset, num_samples, sw, columns=(start, count))
            deltas = pull(cot)
            for i, rule in enumerate(self.rules):
                if other_diag:
                    calls = [deltas[slot[(i, c)]] for c in range(len(records[i]))]
                    for vid, sq in rule.squared_small_grads(records[i], calls).items():
                        _add(acc["diag"], self.position[vid], sq)
                if rows[i] is None:
                    continue
                d = self._deltas(rule, i, records, deltas, slot)
                kpos = self.position[id(rule.kernel)]
                single = int(rows[i].shape[1]) == 1
                if kfac_index[i] in kernel_diag:
                    if single:
                        _add(acc["dsq"], i, ops.sum(ops.square(d[:, :, 0]), axis=0))
                    else:
                        _add(acc["diag"], kpos, ops.reshape(rule.squared_gradients(rows[i], d), rule.kernel.shape))
                if factors:
                    # "reduce": each example's output gradients summed over positions
                    dr = ops.sum(d, axis=2, keepdims=True) if approximation == "reduce" else d
                    _add(acc["B"], i, ops.einsum("kntj,kntl->jl", dr, dr))
                if i in rotated:
                    ar, QB, W = rotated[i]
                    dr = ops.einsum("kntj,jl->kntl", d, ops.cast(QB, d.dtype))
                    if single:
                        _add(acc["dsq_rot"], i, ops.sum(ops.square(dr[:, :, 0]), axis=0))
                    else:
                        _add(acc["quad"], kpos, rule.weighted_squares(ar, dr, W))
            return acc

        acc = chunk_sums(0, chunk, {"diag": {}, "quad": {}, "dsq": {}, "dsq_rot": {}, "B": {}})
        full = k // chunk
        if backend.loop_pullbacks and full > 2:
            # The loop's carry has the first chunk's structure.
            acc = ops.fori_loop(1, full, lambda j, a: chunk_sums(j * chunk, chunk, a), acc)
        else:
            for j in range(1, full):
                acc = chunk_sums(j * chunk, chunk, acc)
        if k % chunk:
            acc = chunk_sums(full * chunk, k % chunk, acc)
        out["diag"], out["quad"], dsq, dsq_rot = acc["diag"], acc["quad"], acc["dsq"], acc["dsq_rot"]
        B = [acc["B"].get(i) for i in range(len(self.rules))]
        for i, s in dsq.items():
            rule = self.rules[i]
            _add(out["diag"], self.position[id(rule.kernel)], ops.reshape(rule.square_single(rows[i], s), rule.kernel.shape))
        for i, s in dsq_rot.items():
            ar, _, W = rotated[i]
            kpos = self.position[id(self.rules[i].kernel)]
            _add(out["quad"], kpos, self.rules[i].weighted_single(ar, s, W))
        if factors:
            out["B"] = [b for b, a in zip(B, rows) if a is not None]
        return out

    def _factor_grads(self, params, nt, x, y, key, offset, kind, num_samples, idx, sw=None):
        """Per-example gradients ``J_n^T c_jn`` of the variables `idx`, by the
        backend's vectorised map: ``(k, grads_of)``, ``grads_of(j)`` a list
        like `idx` of ``(N,) + shape`` tensors for each of the k output
        factors (made one j at a time: an eager backend then holds one j's
        ``N x table`` gradients, not all k of them)."""
        fns = self.fns
        cot = fns.output_factors(kind, fns.logits(params, nt, x), y, key, offset, num_samples, sw)

        def f(sub, xi, ci):
            full = list(params)
            for i, p in zip(idx, sub):
                full[i] = p
            return ops.sum(ops.cast(ci, params[0].dtype) * fns.logits(full, nt, xi))

        return int(cot.shape[0]), lambda j: backend.per_example_grads(f, [params[i] for i in idx], x, cot[j])

    def body_uncovered(self, params, nt, x, y, key, offset, sw, *, kind, num_samples):
        # Variables of layers without a rule.
        out = {}
        k, grads_of = self._factor_grads(params, nt, x, y, key, offset, kind, num_samples, self.uncovered, sw)
        for j in range(k):
            for i, g in zip(self.uncovered, grads_of(j)):
                _add(out, i, ops.sum(ops.square(g), axis=0))
        return out

    def factor_gradients(self, params, nt, x, y, key, offset, kind, num_samples, sw=None):
        """``J_n^T c_jn`` for every output factor j and example n: a list like
        the variables of ``(k, N) + shape`` tensors (small models: dense
        matrices are built from them)."""
        return self._kernel(self.body_factor_gradients, kind=kind, num_samples=int(num_samples))(params, nt, x, y, key, offset, sw)

    def body_factor_gradients(self, params, nt, x, y, key, offset, sw, *, kind, num_samples):
        everything = list(range(len(params)))
        k, grads_of = self._factor_grads(params, nt, x, y, key, offset, kind, num_samples, everything, sw)
        rows = [grads_of(j) for j in range(k)]
        return [ops.stack(parts) for parts in zip(*rows)]

    def body_per_example(self, params, nt, x, y, sw, *, shapes):
        z, records, pull, slot = self._pullback(params, nt, x, shapes, "outputs")
        spec = self.fns.spec

        def losses(zs):
            # Each example's own mean over its positions (weighted by sw).
            if self.fns.per_term(sw):  # per output's terms, over the example's share
                values = spec.per_term(y, zs[0])
                share = self.fns.example_share(sw, values.dtype)
                safe = ops.where(share > 0, share, ops.ones_like(share))
                return ops.sum(values * ops.cast(sw, values.dtype) / safe[:, None])
            values = spec.per_example(y, zs[0])
            if len(values.shape) == 1:
                return ops.sum(values) if sw is None else ops.sum(values * ops.cast(ops.greater(sw, 0), values.dtype))
            flat = ops.reshape(values, (ops.shape(values)[0], -1))
            if sw is None:
                return ops.sum(flat) / float(int(flat.shape[1]))
            w = ops.reshape(ops.cast(sw, values.dtype), ops.shape(flat))
            total = ops.sum(w, axis=1, keepdims=True)
            return ops.sum(flat * w / ops.where(total > 0, total, ops.ones_like(total)))

        _, (r,) = backend.value_and_grad(losses, [ops.stop_gradient(z)])
        deltas = pull(r[None])
        rows = self._rows(records)
        out = {}
        for i, rule in enumerate(self.rules):
            for c, rec in enumerate(records[i]):
                for vid, g in rule.small_grads(rec, deltas[slot[(i, c)]]).items():
                    _add(out, self.position[vid], g[0])
            if rows[i] is not None:
                d = self._deltas(rule, i, records, deltas, slot)[0]
                g = rule.per_example(rows[i], d)
                out[self.position[id(rule.kernel)]] = ops.reshape(g, (ops.shape(g)[0],) + tuple(rule.kernel.shape))
        return out


def _row_weights(sw, a, dtype):
    """Weights of a layer's input rows ``a`` ``(N, T_in, ...)`` for its
    K-FAC input factor: each token's where the rows are the output's
    positions, else the example's total spread over its rows; None without
    weights."""
    if sw is None:
        return None
    n, t_in = int(a.shape[0]), int(a.shape[1])
    w = ops.reshape(ops.cast(sw, dtype), (n, -1))
    if int(w.shape[1]) == t_in:
        return w
    return ops.broadcast_to(ops.sum(w, axis=1, keepdims=True) / float(t_in), (n, t_in))


def _add(store, key, value):
    store[key] = value if key not in store else store[key] + value


def _freeze(shapes):
    return tuple(tuple(tuple(s) for s in calls) for calls in shapes)
