"""Multi-output models: the curvature of Keras' weighted sum of losses.

A functional model with two inputs and two heads on a shared hidden layer
(a 3-class head with sparse cross-entropy, a regression head with MSE, or
a multi-label head with binary cross-entropy), compiled with
``loss_weights``. Its Hessian, GGN (= exact Fisher) and K-FAC blocks must
equal the loss-weighted sums of those of single-output views of the same
layers (one head each), embedded in the full parameter space: each view is
the tested single-output code path, whose own references are
``test_operators.py`` and ``test_likelihoods.py``. Tolerance 1e-6 relative
(float64 models; Keras computes some ops in float32 on some backends).
"""

import warnings

import keras
import numpy as np
import pytest

import keras_geosam as kg
from reference import curvature as ref
from reference.dtypes import keras_dtype

N = 10
TOL = 1e-6
WEIGHTS = {"cls": 1.0, "aux": 0.3}


@pytest.fixture(scope="module", autouse=True)
def _module_float64():
    with keras_dtype("float64"):
        yield


def _build(aux="mse", as_dict=False):
    keras.utils.set_random_seed(3)
    a, b = keras.Input((4,), name="a"), keras.Input((2,), name="b")
    h = keras.layers.Dense(5, activation="tanh")(keras.layers.Concatenate()([a, b]))
    cls = keras.layers.Dense(3, name="cls")(h)
    width = 2 if aux == "mse" else 3
    out = keras.layers.Dense(width, name="aux")(h)
    aux_loss = "mse" if aux == "mse" else keras.losses.BinaryCrossentropy(from_logits=True)
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if as_dict:
        model = keras.Model({"a": a, "b": b}, {"cls": cls, "aux": out})
        model.compile(loss={"cls": sce, "aux": aux_loss}, loss_weights=dict(WEIGHTS))
    else:
        model = keras.Model([a, b], [cls, out])
        model.compile(loss=[sce, aux_loss], loss_weights=[WEIGHTS["cls"], WEIGHTS["aux"]])
    views = {}
    for name, head, loss in (("cls", cls, sce), ("aux", out, aux_loss)):
        view = keras.Model([a, b], head)
        view.compile(loss=loss)
        views[name] = view
    rng = np.random.default_rng(0)
    x = [rng.normal(size=(N, 4)), rng.normal(size=(N, 2))]
    y_aux = rng.normal(size=(N, 2)) if aux == "mse" else (rng.uniform(size=(N, 3)) < 0.5).astype("float64")
    y = {"cls": rng.integers(0, 3, size=N), "aux": y_aux}
    return model, views, x, y


def _embed(model, view, M):
    """A view's (P_v x P_v) matrix in the full model's parameter space."""
    full = list(model.trainable_variables)
    sizes = [int(np.prod(v.shape)) for v in full]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    at = {id(v): i for i, v in enumerate(full)}
    index = np.concatenate([np.arange(starts[at[id(v)]], starts[at[id(v)] + 1]) for v in view.trainable_variables])
    out = np.zeros((starts[-1], starts[-1]))
    out[np.ix_(index, index)] = M
    return out


def _labels(y, as_dict):
    return dict(y) if as_dict else [y["cls"], y["aux"]]


@pytest.mark.parametrize("aux", ["mse", "bce"])
@pytest.mark.parametrize("as_dict", [False, True])
def test_ggn_and_hessian_are_the_weighted_sums_of_each_output_s(aux, as_dict):
    model, views, x, y = _build(aux, as_dict)
    xs = {"a": x[0], "b": x[1]} if as_dict else x
    labels = _labels(y, as_dict)
    value, _ = kg.curvature.loss_and_gradient(model, xs, labels)
    keras_value = model.evaluate(xs, labels, verbose=0)
    keras_value = keras_value[0] if isinstance(keras_value, list) else keras_value
    assert float(keras.ops.convert_to_numpy(value)) == pytest.approx(float(keras_value), rel=1e-6)
    G = kg.curvature.GGN(model, xs, batch_size=4).to_dense()
    H = kg.curvature.Hessian(model, xs, labels, batch_size=4).to_dense()
    G_sum = sum(WEIGHTS[k] * _embed(model, v, kg.curvature.GGN(v, x).to_dense()) for k, v in views.items())
    H_sum = sum(WEIGHTS[k] * _embed(model, v, kg.curvature.Hessian(v, x, y[k]).to_dense()) for k, v in views.items())
    assert ref.rel_err(G, G_sum) < TOL and ref.rel_err(H, H_sum) < TOL
    # teeth: an unweighted sum is another matrix
    G_flat = sum(_embed(model, v, kg.curvature.GGN(v, x).to_dense()) for v in views.values())
    assert ref.rel_err(G_flat, G_sum) > 1e-2
    R = kg.curvature.GGNResidual(model, xs, labels).to_dense()
    assert np.linalg.norm(R - (H - G)) < TOL * np.linalg.norm(H)


@pytest.mark.parametrize("aux", ["mse", "bce"])
def test_fisher_diagonal_and_kfac_are_the_weighted_sums(aux):
    model, views, x, y = _build(aux)
    diag = ref.flatten(kg.sharpness.fisher_diagonal(model, x))
    M = kg.sharpness.fisher_metric(model, x, structure="kfac")
    P = diag.size
    dense = np.stack([ref.flatten(M.matvec(ref.unflatten(e, [tuple(v.shape) for v in model.trainable_variables])))
                      for e in np.eye(P)], axis=1)
    diag_sum, kfac_sum = np.zeros(P), np.zeros((P, P))
    for k, v in views.items():
        d = ref.flatten(kg.sharpness.fisher_diagonal(v, x))
        Mv = kg.sharpness.fisher_metric(v, x, structure="kfac")
        shapes = [tuple(t.shape) for t in v.trainable_variables]
        Dv = np.stack([ref.flatten(Mv.matvec(ref.unflatten(e, shapes))) for e in np.eye(d.size)], axis=1)
        diag_sum += WEIGHTS[k] * np.diag(_embed(model, v, np.diag(d)))
        kfac_sum += WEIGHTS[k] * _embed(model, v, Dv)
    assert ref.rel_err(diag, diag_sum) < TOL
    assert ref.rel_err(dense, kfac_sum) < TOL


def test_mc_fisher_of_two_outputs_is_unbiased():
    model, _, x, _ = _build("bce")
    exact = ref.flatten(kg.curvature.GGN(model, x).diagonal())
    many = ref.flatten(kg.curvature.GGN(model, x, kind="mc", num_samples=4000, seed=2).diagonal())
    assert ref.rel_err(many, exact) < 0.05


def test_a_two_output_model_trains_with_llqr_sam_and_logs_sharpness():
    model, _, x, y = _build("mse")
    model = kg.attach(model)
    model.compile(optimizer=kg.optimizers.LLQRSAM(keras.optimizers.SGD(0.05), structure="kfac", refresh_every=2,
                                                  refresh_steps=5, rho=0.05),
                  loss=model.loss, loss_weights=[WEIGHTS["cls"], WEIGHTS["aux"]])
    labels = [y["cls"], y["aux"]]
    logger = kg.callbacks.SharpnessLogger(x, labels, metrics=("hessian_trace", "riemannian_sharpness_kfac"),
                                          every_n_epochs=1, num_probes=4, rtol=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        history = model.fit(x, labels, batch_size=5, epochs=3, verbose=0, callbacks=[logger]).history
    assert history["loss"][-1] < history["loss"][0]
    assert np.all(np.isfinite(history["riemannian_sharpness_kfac"])) and np.all(np.isfinite(history["hessian_trace"]))


def test_multi_output_labels_and_losses_are_checked():
    model, _, x, y = _build("bce")
    with pytest.raises(ValueError, match=r"Labels y of output 'aux' of shape \(10, 2\)"):
        kg.curvature.GGN(model, x, [y["cls"], y["aux"][:, :2]], kind="empirical")
    with pytest.raises(ValueError, match=r"targets of output 'aux' must lie in \[0, 1\]"):
        kg.curvature.Hessian(model, x, [y["cls"], 2 * y["aux"]])
    with pytest.raises(ValueError, match="2 arrays or a dict"):
        kg.curvature.Hessian(model, x, y["cls"])
    labels, w = [y["cls"], y["aux"]], np.linspace(0.5, 1.5, N)
    for per_output in ([w, w], {"cls": w, "aux": w}):
        with pytest.raises(ValueError, match=r"sample_weight per output .* one \(N,\) weight per example"):
            kg.sharpness.hessian_trace(model, x, labels, sample_weight=per_output, num_probes=2, rtol=None)
    kg.sharpness.hessian_trace(model, x, labels, sample_weight=w, num_probes=2, rtol=None)  # one per example
    model.compile(loss=[keras.losses.SparseCategoricalCrossentropy(from_logits=True), "mae"])
    with pytest.raises(ValueError, match=r"mean_absolute_error \(aux\)"):
        kg.sharpness.riemannian_sharpness(model, x, [y["cls"], y["aux"]])


OPTIMIZERS = {
    "sam": lambda: kg.optimizers.SAM(keras.optimizers.SGD(0.05), rho=0.05),
    "asam": lambda: kg.optimizers.SAM(keras.optimizers.SGD(0.05), rho=0.05, adaptive=True),
    "fsam": lambda: kg.optimizers.FSAM(keras.optimizers.SGD(0.05), rho=0.05),
    "fisher_sam": lambda: kg.optimizers.FisherSAM(keras.optimizers.SGD(0.05), rho=0.05),
    "llqr_newton": lambda: kg.optimizers.LLQR(keras.optimizers.SGD(0.05), divergence="newton", refresh_every=2,
                                              refresh_steps=3),
    "llqrsam_diagonal": lambda: kg.optimizers.LLQRSAM(keras.optimizers.SGD(0.05), rho=0.05, refresh_every=2,
                                                      refresh_steps=3),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_trains_a_two_output_model(name):
    """Keras' weighted multi-output loss through each two-pass optimizer: a
    few epochs lower it, and the weights stay finite."""
    model, _, x, y = _build("bce")
    model = kg.attach(model)
    model.compile(optimizer=OPTIMIZERS[name](), loss=model.loss, loss_weights=[WEIGHTS["cls"], WEIGHTS["aux"]])
    history = model.fit(x, [y["cls"], y["aux"]], batch_size=5, epochs=4, verbose=0).history["loss"]
    assert np.all(np.isfinite(history)) and history[-1] < history[0], history
    assert all(np.all(np.isfinite(keras.ops.convert_to_numpy(v))) for v in model.trainable_variables)


@pytest.mark.parametrize("loss", ["mse", "sce"])
@pytest.mark.parametrize("form", ["float", "list", "dict"])
def test_loss_weights_of_a_single_output_scale_its_curvature(loss, form):
    """Keras scales a single-output loss by its ``loss_weights``: so do the
    loss, the Hessian, the GGN, the Fisher diagonal and K-FAC (2.5 times the
    unweighted model's, same weights). A recompile with other weights is
    seen (the cached functions are keyed by them)."""
    keras.utils.set_random_seed(5)
    width = 2 if loss == "mse" else 3
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh"),
                              keras.layers.Dense(width, name="out")])
    fn = "mse" if loss == "mse" else keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(N, 4))
    y = rng.normal(size=(N, 2)) if loss == "mse" else rng.integers(0, 3, size=N)

    def measures():
        value, _ = kg.curvature.loss_and_gradient(model, x, y)
        return (float(keras.ops.convert_to_numpy(value)), kg.curvature.Hessian(model, x, y).to_dense(),
                kg.curvature.GGN(model, x).to_dense(), ref.flatten(kg.sharpness.fisher_diagonal(model, x)),
                ref.flatten(kg.sharpness.fisher_metric(model, x, structure="kfac").diagonal()))

    model.compile(loss=fn)
    plain = measures()
    w = {"float": 2.5, "list": [2.5], "dict": {"out": 2.5}}[form]
    model.compile(loss=fn, loss_weights=w)
    weighted = measures()
    keras_value = model.evaluate(x, y, verbose=0)
    assert weighted[0] == pytest.approx(float(keras_value), rel=1e-6)
    assert weighted[0] == pytest.approx(2.5 * plain[0], rel=1e-6)
    for a, b in zip(weighted[1:], plain[1:]):
        assert ref.rel_err(a, 2.5 * b) < TOL
    model.compile(loss=fn, loss_weights=1.0)  # teeth: back to the plain numbers
    assert ref.rel_err(measures()[2], plain[2]) < TOL
