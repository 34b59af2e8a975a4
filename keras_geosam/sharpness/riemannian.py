"""Riemannian (Fisher-geometric) sharpness S_R = tr(G^{-1} H).

Three metrics G:

- ``"diagonal"`` (the paper's estimator): G ~ D = diag(Fisher). Estimated by
  the *symmetric* Hutchinson form ``z^T D^{-1/2} H D^{-1/2} z``: same
  expectation as ``z^T D^{-1} H z``, but each probe is unchanged by any
  positive per-parameter rescaling (Dinh et al.'s), so the estimate is
  reparametrisation-invariant probe by probe.
- ``"kfac"``: Dense/Conv kernels get K-FAC blocks ``A (x) S`` (inverse square
  root ``A^{-1/2} (x) S^{-1/2}``, one HVP per probe); every other variable a
  diagonal block.
- ``"exact"``: dense Fisher and Hessian for small models; pseudo-inverse
  (``damping=0``) or ``(G + lambda I)^{-1}``.

Caveat for piecewise-linear networks (ReLU/LeakyReLU, no normalisation,
softmax cross-entropy): the network is linear in every single parameter, so
``diag H = diag F_exact`` and the undamped diagonal S_R has expectation equal
to the number of parameters with nonzero Fisher, whatever the minimum. The
result reports that count (``info["num_nonzero_fisher"]``) and the value per
counted parameter (``info["normalized"]``), and a warning is issued.
"""

import warnings

import keras
import numpy as np

from keras_geosam.curvature.functional import model_functions
from keras_geosam.curvature.functional import progbar
from keras_geosam.curvature.losses import require_classifier
from keras_geosam.sharpness import _common
from keras_geosam.sharpness import kfac as _kfac
from keras_geosam.sharpness.estimate import Estimate
from keras_geosam.sharpness.estimate import from_samples
from keras_geosam.sharpness.fisher import check_kind
from keras_geosam.sharpness.fisher import fisher_diagonal
from keras_geosam.sharpness.fisher import label_passes

METRICS = ("diagonal", "kfac", "exact")
_HOMOGENEOUS = ("relu", "leaky_relu", "linear")


def is_piecewise_linear(model):
    """True when every layer is piecewise linear in each single parameter:
    ReLU/LeakyReLU/linear activations, no normalisation or other nonlinearity.
    Softmax outputs are allowed (they belong to the loss)."""
    linear_types = (
        keras.layers.Dense, keras.layers.Conv1D, keras.layers.Conv2D,
        keras.layers.Flatten, keras.layers.Reshape, keras.layers.Dropout,
        keras.layers.MaxPooling1D, keras.layers.MaxPooling2D,
        keras.layers.AveragePooling1D, keras.layers.AveragePooling2D,
        keras.layers.GlobalAveragePooling1D, keras.layers.GlobalAveragePooling2D,
        keras.layers.GlobalMaxPooling1D, keras.layers.GlobalMaxPooling2D,
        keras.layers.LeakyReLU, keras.layers.InputLayer,
        keras.layers.Add, keras.layers.Concatenate,
    )
    layers = list(model._flatten_layers(include_self=False))
    for i, layer in enumerate(layers):
        if isinstance(layer, keras.layers.ReLU):
            # max_value / threshold make it not piecewise linear *through 0*,
            # but it stays piecewise linear in every single parameter.
            continue
        if isinstance(layer, keras.layers.Softmax) and i == len(layers) - 1:
            continue  # belongs to the loss
        if isinstance(layer, keras.layers.Activation):
            name = getattr(layer.activation, "__name__", "")
            if name not in _HOMOGENEOUS and not (name == "softmax" and i == len(layers) - 1):
                return False
            continue
        if not isinstance(layer, linear_types):
            if isinstance(layer, (keras.Model, keras.layers.Layer)) and list(layer._flatten_layers(include_self=False)):
                continue  # containers: their children are checked
            return False
        act = getattr(layer, "activation", None)
        if act is not None:
            name = getattr(act, "__name__", "")
            if name not in _HOMOGENEOUS and not (name == "softmax" and i == len(layers) - 1):
                return False
    return True


def riemannian_sharpness(
    model,
    x,
    y,
    metric="diagonal",
    fisher="exact",
    damping=None,
    num_probes=20,
    num_samples=1,
    seed=0,
    batch_size=_common.DEFAULT_BATCH_SIZE,
    max_params=4000,
    rcond=None,
    loss=None,
    verbose=0,
):
    """Riemannian sharpness ``S_R = tr(G^{-1} H)`` at the model's weights.

    Args:
        model: a built classifier (categorical cross-entropy on logits or
            softmax outputs).
        x, y: data (streamed in `batch_size` pieces; `y` is needed for H).
        metric: ``"diagonal"`` | ``"kfac"`` | ``"exact"`` (module doc).
        fisher: Fisher kind behind G: ``"exact"`` | ``"mc"`` | ``"empirical"``.
        damping: relative damping. Diagonal: ``D + damping * mean(D_nonzero)``
            (default 0: parameters with zero Fisher are excluded and counted);
            kfac: each factor gets ``damping * mean eigenvalue`` (default
            1e-3), while variables without a K-FAC block (biases, other
            layers) keep the undamped diagonal block with zero-Fisher
            coordinates excluded (``info["diagonal_fallback_damping"]``);
            exact: ``G + damping * mean eig(G) I`` (default 0: the
            pseudo-inverse). The absolute value used is reported in `info`.
        num_probes: Rademacher probes (diagonal and kfac).
        num_samples: labels per example for ``fisher="mc"``.
        seed: seeds label draws and probes (NumPy; same on every backend).
        max_params: refuse ``metric="exact"`` above this many parameters.
        rcond: ``metric="exact"`` pseudo-inverse cutoff relative to the
            largest Fisher eigenvalue (default: ten machine epsilons of the
            model's dtype, at least dim * float64 epsilon).

    Returns:
        An :class:`Estimate` with ``info`` describing the metric, damping and
        excluded parameters.
    """
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}.")
    check_kind(fisher)
    num_probes = _common.check_positive_int("num_probes", num_probes)
    if damping is not None and not damping >= 0:
        raise ValueError(f"damping must be >= 0, got {damping!r}.")
    fns = model_functions(model, loss, training=False)
    require_classifier(fns.spec, "riemannian_sharpness")
    if metric == "exact":
        return _exact(model, fns, x, y, fisher, damping or 0.0, num_samples, seed, batch_size, max_params, loss, rcond)

    variables = fns.variables
    paths = fns.paths
    shapes = [tuple(v.shape) for v in variables]
    D = fisher_diagonal(model, x, y, kind=fisher, num_samples=num_samples, seed=seed, batch_size=batch_size, loss=loss)
    flat = np.concatenate([d.ravel() for d in D])
    nonzero = flat > 0
    num_nonzero = int(nonzero.sum())
    if num_nonzero == 0:
        raise ValueError("The Fisher diagonal is zero everywhere: S_R is undefined.")
    scale = float(flat[nonzero].mean())
    diag_damping = 0.0 if (damping is None or metric == "kfac") else float(damping)
    lam = diag_damping * scale
    inv_sqrt = [np.where((d + lam) > 0, 1.0 / np.sqrt(np.where((d + lam) > 0, d + lam, 1.0)), 0.0) for d in D]
    info = _common.data_info(x, batch_size)
    info.update(
        metric=metric,
        fisher=fisher,
        num_params=int(flat.size),
        num_nonzero_fisher=num_nonzero,
        fisher_scale=scale,
    )

    transforms = [lambda z, s=s: s * z for s in inv_sqrt]
    if metric == "kfac":
        kdamp = 1e-3 if damping is None else float(damping)
        factors = _kfac.kfac_factors(model, x, y, kind=fisher, num_samples=num_samples, seed=seed, batch_size=batch_size, loss=loss)
        used = {}
        for j, path in enumerate(paths):
            if path in factors:
                A, S = factors[path]
                Ai, la = _kfac.inverse_sqrt(A, kdamp)
                Si, ls = _kfac.inverse_sqrt(S, kdamp)
                used[path] = (la, ls)
                shape = shapes[j]
                transforms[j] = lambda z, Ai=Ai, Si=Si, shape=shape: (Ai @ z.reshape(-1, shape[-1]) @ Si).reshape(shape)
        info.update(
            damping=kdamp,
            kfac_damping_abs={p: {"A": a, "S": s} for p, (a, s) in used.items()},
            kfac_layers=list(used),
            diagonal_fallback=[p for p in paths if p not in used],
            # Variables without a K-FAC block (biases, other layers) get the
            # undamped diagonal block, zero-Fisher coordinates excluded.
            diagonal_fallback_damping=0.0,
        )
        excluded = int(sum((inv_sqrt[j] == 0).sum() for j, p in enumerate(paths) if p not in used))
    else:
        info.update(damping=diag_damping, damping_abs=lam)
        excluded = int(sum((s == 0).sum() for s in inv_sqrt))
    info["num_excluded"] = excluded
    info["inverse"] = "pseudo-inverse (zero-Fisher parameters excluded)" if (metric == "diagonal" and lam == 0) else "damped inverse"

    rng = np.random.default_rng(seed)
    matvec = _common.hessian_matvec(model, x, y, loss, batch_size)

    def probe(i):
        z = _common.rademacher(rng, shapes)
        return [t(zz) for t, zz in zip(transforms, z)]

    bar = progbar(num_probes, verbose, "probe")
    samples, per_layer = _common.quadratic_probes(matvec, probe, num_probes, paths, bar)
    est = from_samples(samples, per_layer, info)
    counted = info["num_params"] - excluded
    est.info["normalized"] = est.value / max(counted, 1)
    pl = is_piecewise_linear(model)
    est.info["piecewise_linear"] = pl
    if pl and metric == "diagonal" and lam == 0:
        warnings.warn(
            f"{model.name} is piecewise linear in each parameter (ReLU-type "
            f"activations, no normalisation), so diag H equals the exact "
            f"Fisher diagonal and the undamped diagonal S_R has expectation "
            f"equal to the number of parameters with nonzero Fisher "
            f"({num_nonzero} of {info['num_params']}), whatever the minimum. "
            f"Compare info['normalized'], use damping>0, metric='kfac' or "
            f"metric='exact' for an informative value.",
            UserWarning,
            stacklevel=2,
        )
    return est


def _dense_hessian(model, x, y, loss, batch_size, dim, shapes):
    matvec = _common.hessian_matvec(model, x, y, loss, batch_size)
    H = np.zeros((dim, dim))
    sizes = [int(np.prod(s)) for s in shapes]
    for i in range(dim):
        e = np.zeros(dim)
        e[i] = 1.0
        parts = np.split(e, np.cumsum(sizes)[:-1])
        H[:, i] = np.concatenate([c.ravel() for c in matvec([p.reshape(s) for p, s in zip(parts, shapes)])])
    return (H + H.T) / 2


def dense_fisher(model, x, y=None, kind="exact", num_samples=1, seed=0, batch_size=_common.DEFAULT_BATCH_SIZE, loss=None):
    """The full Fisher matrix (float64 NumPy, P x P) for small models."""
    from keras import ops

    from keras_geosam.curvature.functional import batches
    from keras_geosam.curvature.functional import num_examples

    fns = model_functions(model, loss, training=False)
    require_classifier(fns.spec, "dense_fisher")
    rng = np.random.default_rng(seed)
    n = num_examples(x)
    dim = sum(int(np.prod(v.shape)) for v in fns.variables)
    G = np.zeros((dim, dim))
    for xb, yb, nb in batches(x, y, batch_size):
        for kernel_name, labels, weights in label_passes(fns, kind, xb, yb, num_samples, rng):
            grads = fns.kernel(kernel_name)(fns.params(), fns.non_trainable(), xb, ops.convert_to_tensor(labels))
            J = np.concatenate([np.asarray(ops.convert_to_numpy(g), "float64").reshape(nb, -1) for g in grads], axis=1)
            G += (J * weights[:, None]).T @ J
    return G / n


def _exact(model, fns, x, y, fisher, damping, num_samples, seed, batch_size, max_params, loss, rcond):
    shapes = [tuple(v.shape) for v in fns.variables]
    dim = sum(int(np.prod(s)) for s in shapes)
    if dim > max_params:
        raise ValueError(
            f'metric="exact" materialises {dim}x{dim} matrices; the model has '
            f"{dim} parameters > max_params={max_params}. Use metric='diagonal' "
            f"or 'kfac', or raise max_params."
        )
    G = dense_fisher(model, x, y, fisher, num_samples, seed, batch_size, loss)
    H = _dense_hessian(model, x, y, loss, batch_size, dim, shapes)
    evals, evecs = np.linalg.eigh(G)
    lam = damping * max(float(np.mean(np.clip(evals, 0, None))), 0.0)
    shifted = evals + lam
    # Relative cutoff at the precision the gradients were computed in: below
    # it an eigenvalue of G is rounding noise, and inverting it is meaningless.
    if rcond is None:
        rcond = max(dim * float(np.finfo("float64").eps), 10 * float(np.finfo(fns.variables[0].dtype).eps))
    tol = max(shifted.max(), 0.0) * rcond
    keep = shifted > tol
    inv = np.where(keep, 1.0 / np.where(keep, shifted, 1.0), 0.0)
    Ginv = (evecs * inv) @ evecs.T
    M = Ginv @ H
    value = float(np.trace(M))
    sizes = np.cumsum([0] + [int(np.prod(s)) for s in shapes])
    per_layer = {p: float(np.trace(M[a:b, a:b])) for p, a, b in zip(fns.paths, sizes[:-1], sizes[1:])}
    info = _common.data_info(x, batch_size)
    info.update(
        metric="exact",
        fisher=fisher,
        num_params=dim,
        fisher_rank=int(keep.sum()),
        damping=damping,
        damping_abs=lam,
        rcond=rcond,
        inverse=("pseudo-inverse (eigenvalues below rcond * max dropped)" if lam == 0 else "damped inverse"),
    )
    return Estimate(value=value, stderr=0.0, num_samples=info["num_examples"], per_layer=per_layer, info=info)
