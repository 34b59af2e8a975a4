"""
Title: Measuring the sharpness of your own model
Author: keras_geosam authors
Date created: 2026/12/01
Last modified: 2026/12/01
Description: Curvature operators, estimators and their uncertainty, damping,
    the piecewise-linear degeneracy, and invariance under rescaling.
Accelerator: None

Run it with any Keras backend (about 30 s on 2 CPU cores):

    KERAS_BACKEND=jax python guides/sharpness_tour.py

It prints each step and writes the numbers as JSON at `--output`
(default `geosam_output/sharpness_tour.json`). `--full` uses all 1,797
digits and wider networks.
"""

"""
## Setup

Two small classifiers on scikit-learn's digits (no download): a ReLU MLP,
which is *layerwise linear* (every per-layer block of its Hessian equals the
Gauss-Newton matrix's), and a tanh MLP, which is not.
"""

import argparse
import json
import os
import warnings

import keras
import numpy as np

import keras_geosam as kg
from keras_geosam import curvature as kc
from keras_geosam import estimators
from keras_geosam import sharpness


def digits(full):
    from sklearn.datasets import load_digits

    d = load_digits()
    x, y = (d.data / 16.0).astype("float32"), d.target.astype("int32")
    n = len(x) if full else 600
    return x[:n], y[:n]


def trained_mlp(activation, x, y, width, epochs, seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((x.shape[1],)),
        keras.layers.Dense(width, activation=activation),
        keras.layers.Dense(width, activation=activation),
        keras.layers.Dense(10),
    ])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=32, epochs=epochs, verbose=0)
    return model


def main(argv=None):
    p = argparse.ArgumentParser(description="A tour of keras_geosam's sharpness measures.")
    p.add_argument("--full", action="store_true", help="all digits, width 128, more epochs")
    p.add_argument("--output", default=os.path.join("geosam_output", "sharpness_tour.json"))
    args = p.parse_args(argv)
    out = {"backend": keras.backend.backend()}
    x, y = digits(args.full)
    width, epochs = (128, 20) if args.full else (32, 8)
    relu = trained_mlp("relu", x, y, width, epochs)
    smooth = trained_mlp("tanh", x, y, width, epochs)
    xp, yp = x[:256], y[:256]  # measure on the data the models fit

    """
    ## 1. Curvature products are linear operators

    `kc.Hessian`, `kc.GGN` (the Gauss-Newton matrix, equal to the Fisher for
    softmax cross-entropy) and `kc.GGNResidual` (H - GGN) act on lists shaped
    like `model.trainable_variables`. They compose with `@`, `+` and `-`, and
    `matmat` takes a block of vectors (one linearisation of the model for
    all of them).
    """
    H = kc.Hessian(smooth, xp, yp)
    G = kc.GGN(smooth, xp)
    R = kc.GGNResidual(smooth, xp, yp)
    rng = np.random.default_rng(0)
    v = [rng.normal(size=s).astype("float32") for s in H.shapes]
    hv, sum_v = H @ v, (G + R) @ v
    gap = max(float(np.max(np.abs(keras.ops.convert_to_numpy(a - b)))) for a, b in zip(hv, sum_v))
    scale = max(float(np.max(np.abs(keras.ops.convert_to_numpy(a)))) for a in hv)
    print(f"1. H v = (GGN + (H - GGN)) v: largest difference {gap:.2e} (entries up to {scale:.2e})")
    out["operator_identity_max_abs"] = gap

    """
    ## 2. Estimates travel with their uncertainty

    Every estimator takes any operator and returns an `Estimate`: `value`,
    `stderr`, `num_samples`, `per_layer`, `samples` and `info`. Hutchinson's
    trace of H needs probes; the GGN's trace is exact (`G.trace_with()`), so
    `hessian_trace` computes tr GGN exactly and probes only the residual.
    """
    plain = estimators.hutchinson(H, num_probes=30)
    exact_ggn, _ = G.trace_with()
    split = sharpness.hessian_trace(smooth, xp, yp)
    print(f"2. tr H by 30 Hutchinson probes: {plain.format()}")
    print(f"   tr H split: tr GGN = {exact_ggn:.4g} (exact) + residual {split.info['residual']:.3g} "
          f"-> {split.format()} with {split.num_samples} probes")
    out.update(trace_hutchinson=[plain.value, plain.stderr], trace_split=[split.value, split.stderr],
               trace_ggn=exact_ggn)

    """
    ## 3. Riemannian sharpness: exact part plus residual

    `S_R = tr(M^-1 H) = tr(M^-1 GGN) + tr(M^-1 (H - GGN))` for a Fisher metric M
    (diagonal or K-FAC). On the ReLU network the residual vanishes exactly, so
    S_R is exact: stderr 0, the same for every seed. On the tanh network only
    the residual is estimated, until its standard error is 5% of the value.
    """
    for name, model in (("relu", relu), ("tanh", smooth)):
        for metric in ("diagonal", "kfac"):
            est = sharpness.riemannian_sharpness(model, xp, yp, structure=metric)
            print(f"3. {name} {metric:8s} S_R = {est.format()}  exact part {est.info['exact_part']:.4g}, "
                  f"residual exact: {est.info['residual_exact']}, probes {est.num_samples}")
            out[f"sr_{name}_{metric}"] = [est.value, est.stderr, est.info["exact_part"]]

    """
    ## 4. Damping is explicit and relative

    Each block of M (one variable's diagonal, or one Kronecker block) is
    inverted as `M_b + damping * mean eigenvalue(M_b) I`. `damping=0` is a
    pseudo-inverse that excludes parameters with zero Fisher (dead units) and
    counts them in `info["num_excluded"]`.
    """
    for damping in (0.0, 1e-3, 1e-1):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            est = sharpness.riemannian_sharpness(relu, xp, yp, damping=damping)
        print(f"4. relu diagonal S_R, damping {damping:g}: {est.format()}  "
              f"(excluded {est.info['num_excluded']} of {est.info['num_params']})")
        out[f"sr_relu_damping_{damping:g}"] = est.value

    """
    ## 5. The piecewise-linear degeneracy

    A ReLU network without normalisation is linear in every single
    parameter, so diag H = diag F and the *undamped diagonal* S_R simply
    counts the parameters with nonzero Fisher, whatever the minimum.
    keras_geosam warns and reports the count; read `info["normalized"]`, use
    damping, or the K-FAC metric.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est = sharpness.riemannian_sharpness(relu, xp, yp, damping=0.0)
    warned = any("piecewise linear" in str(w.message) for w in caught)
    count = est.info["num_nonzero_fisher"]
    print(f"5. undamped diagonal S_R = {est.value:.6g}, parameters with nonzero Fisher = {count}, warned: {warned}")
    out.update(degenerate_value=est.value, nonzero_fisher=count, warned=warned)

    """
    ## 6. Invariance under a function-preserving rescaling

    `kg.reparam.rescale(model, layer, alpha)` multiplies a layer's outputs by
    alpha and the next layer's inputs by 1/alpha: the function is unchanged.
    The Euclidean tr H and lambda_max change a lot; S_R (relative damping is
    per layer, so it rescales with the layer) and the Riemannian lambda_max
    do not.
    """
    before = {
        "trace": sharpness.hessian_trace(relu, xp, yp).value,
        "lambda_max": sharpness.hessian_max_eigenvalue(relu, xp, yp).value,
        "sr_kfac": sharpness.riemannian_sharpness(relu, xp, yp, structure="kfac").value,
        "riemannian_lambda_max": sharpness.riemannian_max_eigenvalue(relu, xp, yp, structure="kfac").value,
    }
    kg.reparam.rescale(relu, relu.layers[0], 10.0)
    after = {
        "trace": sharpness.hessian_trace(relu, xp, yp).value,
        "lambda_max": sharpness.hessian_max_eigenvalue(relu, xp, yp).value,
        "sr_kfac": sharpness.riemannian_sharpness(relu, xp, yp, structure="kfac").value,
        "riemannian_lambda_max": sharpness.riemannian_max_eigenvalue(relu, xp, yp, structure="kfac").value,
    }
    for key in before:
        print(f"6. {key:22s} before {before[key]:.6g}  after x10 rescaling {after[key]:.6g}  "
              f"ratio {after[key] / before[key]:.4f}")
    out.update(invariance_before=before, invariance_after=after)

    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)
    print(f"numbers: {args.output}")
    return out


if __name__ == "__main__":
    main()
