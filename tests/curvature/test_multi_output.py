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


def _columns(model, view):
    """Where a view's parameters sit in the full model's: ``(index, P)``."""
    full = list(model.trainable_variables)
    sizes = [int(np.prod(v.shape)) for v in full]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    at = {id(v): i for i, v in enumerate(full)}
    index = np.concatenate([np.arange(starts[at[id(v)]], starts[at[id(v)] + 1]) for v in view.trainable_variables])
    return index, int(starts[-1])


def _embed(model, view, M):
    """A view's (P_v x P_v) matrix in the full model's parameter space."""
    index, size = _columns(model, view)
    out = np.zeros((size, size))
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
    kg.sharpness.hessian_trace(model, x, labels, sample_weight=w, num_probes=2, rtol=None)  # one per example
    bad = {"3 arrays for a model with 2 outputs": [w, w, w], r"names the output\(s\) \['head'\]": {"head": w},
           r"output 'aux' has weight zero": [w, 0 * w], r"sample_weight of output 'cls' of shape \(10, 2\)": [np.ones((N, 2)), w],
           r"sample_weight of output 'aux' must be finite": {"aux": -w}, "differ in length": [w, w[:-1]]}
    for message, per_output in bad.items():
        with pytest.raises(ValueError, match=message):
            kg.sharpness.hessian_trace(model, x, labels, sample_weight=per_output, num_probes=2, rtol=None)
    single = keras.Model(model.inputs, model.outputs[0])
    single.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match="this model has one output: pass one"):
        kg.curvature.GGN(single, x, sample_weight=[w])
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


# ------------------------------------------- sample weights per output ----
def _per_output_weights():
    rng = np.random.default_rng(5)
    return {"cls": rng.uniform(0.2, 2.0, N), "aux": rng.uniform(0.2, 2.0, N)}


def _shares(w):
    """Each output's normalised weights, and each example's share: their
    mean over the outputs (``curvature/weights.py``)."""
    sw = {k: v / v.sum() for k, v in w.items()}
    return sw, (sw["cls"] + sw["aux"]) / 2


def _flat_rows(grads):
    return np.concatenate([ref.to_numpy(g).reshape(N, -1) for g in grads], axis=1)


@pytest.mark.parametrize("aux,as_dict", [("bce", True), ("mse", False)])
def test_per_output_sample_weights_give_the_weighted_sums_of_each_output_s(aux, as_dict):
    """``sample_weight`` per output (a dict, or a list in output order)
    makes each output's loss its own weighted mean: the loss, Hessian, GGN
    and residual equal the loss-weighted sums of the single-output views'
    with their own weights; the empirical Fisher and the per-example
    gradients follow the hand-written rule from the views' unweighted
    per-example gradients; the same weights for both outputs give the one
    (N,) weight's numbers; swapped weights give others (teeth)."""
    model, views, x, y = _build(aux, as_dict)
    xs = {"a": x[0], "b": x[1]} if as_dict else x
    labels = _labels(y, as_dict)
    w = _per_output_weights()
    given = dict(w) if as_dict else [w["cls"], w["aux"]]
    value, _ = kg.curvature.loss_and_gradient(model, xs, labels, sample_weight=given)
    expected = sum(WEIGHTS[k] * float(ref.to_numpy(kg.curvature.loss_and_gradient(v, x, y[k], sample_weight=w[k])[0]))
                   for k, v in views.items())
    assert float(ref.to_numpy(value)) == pytest.approx(expected, rel=1e-9)

    def summed(op):
        return sum(WEIGHTS[k] * _embed(model, v, op(v, k).to_dense()) for k, v in views.items())

    H = kg.curvature.Hessian(model, xs, labels, sample_weight=given).to_dense()
    G = kg.curvature.GGN(model, xs, sample_weight=given).to_dense()
    assert ref.rel_err(H, summed(lambda v, k: kg.curvature.Hessian(v, x, y[k], sample_weight=w[k]))) < TOL
    assert ref.rel_err(G, summed(lambda v, k: kg.curvature.GGN(v, x, sample_weight=w[k]))) < TOL
    R = kg.curvature.GGNResidual(model, xs, labels, sample_weight=given).to_dense()
    assert np.linalg.norm(R - (H - G)) < TOL * np.linalg.norm(H)
    # Empirical Fisher: sum_n g_n g_n^T / W_n with g_n = sum_k lambda_k
    # sw_nk grad l_nk, W_n the example's share; per-example gradients g_n / W_n.
    sw, share = _shares(w)
    per = {k: _flat_rows(kg.curvature.per_example_gradients(v, x, y[k])) for k, v in views.items()}
    g = sum(WEIGHTS[k] * sw[k][:, None] * _spread(model, views[k], per[k]) for k in views)
    F = kg.curvature.GGN(model, xs, labels, kind="empirical", sample_weight=given).to_dense()
    assert ref.rel_err(F, np.einsum("np,nq,n->pq", g, g, 1 / share)) < TOL
    mine = _flat_rows(kg.curvature.per_example_gradients(model, xs, labels, sample_weight=given))
    assert ref.rel_err(mine, g / share[:, None]) < TOL
    # The backend's per-example map (layers without a rule) follows the rule too.
    from keras_geosam.curvature import weights as token_weights
    from keras_geosam.curvature.functional import model_functions

    fns = model_functions(model)
    sw_terms = token_weights.resolve(fns, xs, labels, given, None)
    tensor = lambda t: keras.tree.map_structure(keras.ops.convert_to_tensor, t)  # noqa: E731
    mapped = fns.kernel(fns.per_example_grads_body)(fns.params(), fns.non_trainable(), tensor(xs), tensor(labels),
                                                    keras.ops.convert_to_tensor(sw_terms))
    assert ref.rel_err(_flat_rows(mapped), g / share[:, None]) < TOL
    # One weight for both outputs is the (N,) weight; swapped weights differ.
    same = [w["cls"], w["cls"]]
    assert ref.rel_err(kg.curvature.GGN(model, xs, sample_weight=same).to_dense(),
                       kg.curvature.GGN(model, xs, sample_weight=w["cls"]).to_dense()) < 1e-12
    swapped = {"cls": w["aux"], "aux": w["cls"]} if as_dict else [w["aux"], w["cls"]]
    swapped = kg.curvature.GGN(model, xs, sample_weight=swapped).to_dense()
    assert ref.rel_err(swapped, G) > 1e-2


def _spread(model, view, rows):
    """A view's per-example rows ``(N, P_v)`` in the full model's columns."""
    index, size = _columns(model, view)
    out = np.zeros((rows.shape[0], size))
    out[:, index] = rows
    return out


def test_per_output_sample_weights_in_kfac_the_fisher_diagonal_and_the_mc_fisher():
    """K-FAC with weights per output: each output's side B is the
    loss-weighted sum of the views' (each with its own weights), the input
    side A the view's with the examples' shares as weights (the stated
    rule: a layer's input rows serve every output). The Fisher diagonal is
    the weighted sum of the views', and the MC Fisher is unbiased."""
    model, views, x, y = _build("bce")
    w = _per_output_weights()
    given = [w["cls"], w["aux"]]
    _, share = _shares(w)
    blocks = kg.curvature.GGN(model, x, sample_weight=given).kfac().blocks
    of_view = {k: kg.curvature.GGN(v, x, sample_weight=w[k]).kfac().blocks for k, v in views.items()}
    of_share = {k: kg.curvature.GGN(v, x, sample_weight=share).kfac().blocks for k, v in views.items()}
    # variables: shared kernel, bias; cls kernel, bias; aux kernel, bias
    shared_B = sum(WEIGHTS[k] * ref.to_numpy(of_view[k][0].B) for k in views)
    assert ref.rel_err(ref.to_numpy(blocks[0].A), ref.to_numpy(of_share["cls"][0].A)) < TOL
    assert ref.rel_err(ref.to_numpy(blocks[0].B), shared_B) < TOL
    for j, k in ((2, "cls"), (4, "aux")):
        assert ref.rel_err(ref.to_numpy(blocks[j].A), ref.to_numpy(of_share[k][2].A)) < TOL
        assert ref.rel_err(ref.to_numpy(blocks[j].B), WEIGHTS[k] * ref.to_numpy(of_view[k][2].B)) < TOL
    diag = ref.flatten(kg.sharpness.fisher_diagonal(model, x, sample_weight=given))
    diag_sum = sum(WEIGHTS[k] * np.diag(_embed(model, v, np.diag(ref.flatten(kg.sharpness.fisher_diagonal(
        v, x, sample_weight=w[k]))))) for k, v in views.items())
    assert ref.rel_err(diag, diag_sum) < TOL
    many = ref.flatten(kg.curvature.GGN(model, x, kind="mc", num_samples=4000, seed=2, sample_weight=given).diagonal())
    assert ref.rel_err(many, np.diag(kg.curvature.GGN(model, x, sample_weight=given).to_dense())) < 0.05


def test_per_output_sample_weights_train_and_log():
    """``fit`` with weights per output through LLQR+SAM (K-FAC), a
    SharpnessLogger whose probe data carry weights per output, and the
    gradient-noise alignment (minibatches of every output's labels and
    weights): the loss falls and every value is finite."""
    model, _, x, y = _build("mse")
    model = kg.attach(model)
    model.compile(optimizer=kg.optimizers.LLQRSAM(keras.optimizers.SGD(0.05), structure="kfac", refresh_every=2,
                                                  refresh_steps=3, rho=0.05),
                  loss=model.loss, loss_weights=[WEIGHTS["cls"], WEIGHTS["aux"]])
    w = _per_output_weights()
    labels, given = [y["cls"], y["aux"]], [w["cls"], w["aux"]]
    logger = kg.callbacks.SharpnessLogger(x, labels, sample_weight=given, every_n_epochs=1, num_probes=4, rtol=None,
                                          metrics=("hessian_trace", "riemannian_sharpness_kfac"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        history = model.fit(x, labels, sample_weight=given, batch_size=5, epochs=3, verbose=0, callbacks=[logger]).history
    assert history["loss"][-1] < history["loss"][0]
    assert np.all(np.isfinite(history["riemannian_sharpness_kfac"])) and np.all(np.isfinite(history["hessian_trace"]))
    alignment = kg.sharpness.gradient_noise_alignment(model, x, labels, sample_weight=given, batch_size=4, num_batches=3)
    assert 0 < alignment.cosine <= 1 and np.all(np.isfinite(alignment.noise_variance))


def test_per_token_weights_of_a_sequence_output_among_several():
    """One output per token (a sequence head, ``(N, T, C)``) beside a pooled
    one: its per-output weight may be per token ``(N, T)``. The loss, GGN and
    Hessian equal the weighted sums of the views', the sequence view with
    the same per-token weights (the single-output per-token path), the
    pooled view with its ``(N,)`` weights."""
    keras.utils.set_random_seed(4)
    T = 4
    seq = keras.Input((T, 3), name="seq")
    h = keras.layers.Dense(4, activation="tanh")(seq)
    tokens = keras.layers.Dense(3, name="tokens")(h)
    pooled = keras.layers.Dense(2, name="pooled")(keras.layers.GlobalAveragePooling1D()(h))
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = keras.Model(seq, [tokens, pooled])
    model.compile(loss=[sce, "mse"], loss_weights=[1.0, 0.3])
    views = {"tokens": keras.Model(seq, tokens), "pooled": keras.Model(seq, pooled)}
    views["tokens"].compile(loss=sce)
    views["pooled"].compile(loss="mse")
    rng = np.random.default_rng(2)
    x = rng.normal(size=(N, T, 3))
    y = {"tokens": rng.integers(0, 3, size=(N, T)), "pooled": rng.normal(size=(N, 2))}
    w = {"tokens": rng.uniform(0.0, 2.0, size=(N, T)), "pooled": rng.uniform(0.2, 2.0, size=N)}
    lam = {"tokens": 1.0, "pooled": 0.3}
    labels = [y["tokens"], y["pooled"]]
    value, _ = kg.curvature.loss_and_gradient(model, x, labels, sample_weight=w)
    expected = sum(lam[k] * float(ref.to_numpy(kg.curvature.loss_and_gradient(v, x, y[k], sample_weight=w[k])[0]))
                   for k, v in views.items())
    assert float(ref.to_numpy(value)) == pytest.approx(expected, rel=1e-9)
    for op in (lambda m, lab, sw: kg.curvature.GGN(m, x, sample_weight=sw),
               lambda m, lab, sw: kg.curvature.Hessian(m, x, lab, sample_weight=sw)):
        full = op(model, labels, w).to_dense()
        summed = sum(lam[k] * _embed(model, v, op(v, y[k], w[k]).to_dense()) for k, v in views.items())
        assert ref.rel_err(full, summed) < TOL
    # teeth: the per-token weights matter (their mean over tokens is another matrix)
    flat = {"tokens": w["tokens"].mean(axis=1), "pooled": w["pooled"]}
    assert ref.rel_err(kg.curvature.GGN(model, x, sample_weight=flat).to_dense(),
                       kg.curvature.GGN(model, x, sample_weight=w).to_dense()) > 1e-3
