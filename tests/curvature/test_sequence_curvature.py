"""Curvature and sharpness of attention models and token-level outputs,
against explicit float64 matrices.

Two tiny Transformers (1 layer, d=8, 2 heads, sequence 4, vocabulary 7):
the classifier of ``reference/transformer_classifier.py`` (pooled, one output per
sequence) and the language model of ``reference/tiny_transformer.py`` (``(N, T, C)``
logits, padding masked by ``Embedding(mask_zero=True)``, causal attention).
Every operator's ``matmat`` (through ``LinearOperator.to_dense``) and the
probe-free parts are compared with matrices built by ``jax.hessian`` /
``jax.jacfwd`` of networks written by hand, the loss being the weighted
mean over the tokens that count (``keras_geosam.curvature.weights``).

Tolerance: 1e-9 relative where Keras computes every op of these models in
float64 on this backend, 5e-6 where it computes one in float32 (softmax,
layer normalisation or einsum, probed as ``test_transformer_steps`` does).
"""

import warnings

import keras
import numpy as np
import pytest
from keras import ops

import keras_geosam as kg
from reference import curvature as ref
from reference import transformer_classifier as classifier
from reference import tiny_transformer as tt
from keras_geosam import curvature as kc
from keras_geosam import sharpness as ks

BACKEND = keras.backend.backend()


def _unflatten_block(V, shapes):
    out, start = [], 0
    for shape in shapes:
        size = int(np.prod(shape))
        out.append(V[:, start : start + size].reshape((V.shape[0],) + tuple(shape)))
        start += size
    return out


def _tol():
    return 5e-6 if classifier._lossy() else 1e-9


def _lm(sample_weight=None, classes=tt.V, n=6):
    model = tt.build(classes=classes)
    x, y = tt.data(n=n, classes=classes)
    return model, x, y, tt.Reference(model, x, y, sample_weight=sample_weight)


def _classifier():
    model = classifier.build()
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = classifier.data()
    forward = lambda p, ids: classifier.forward([p[name] for name in classifier.ORDER], ids)
    return model, x, y, tt.Reference(model, x, y, logits_fn=forward, weights=np.ones(len(x)))


CASES = {
    "classifier": lambda: _classifier() + (None,),
    "lm_padding": lambda: _lm() + (None,),
    "lm_padding_and_weights": lambda: (lambda sw: _lm(sw) + (sw,))(np.random.default_rng(3).uniform(0.5, 2.0, (6, tt.T))),
}


@pytest.fixture(params=sorted(CASES))
def case(request, float64):
    model, x, y, R, sw = CASES[request.param]()
    return request.param, model, x, y, R, sw


def test_operators_equal_their_dense_matrices(case):
    name, model, x, y, R, sw = case
    tol = _tol()
    kw = dict(sample_weight=sw)
    loss, grads = kc.loss_and_gradient(model, x, y, **kw)
    assert ref.rel_err(float(loss), float(R.loss())) <= tol
    if name == "lm_padding":  # the mask alone: Keras' own loss is the same weighted mean
        assert ref.rel_err(float(loss), float(model.evaluate(x, y, verbose=0))) <= tol
    assert ref.rel_err(ref.flatten(grads), R.gradient()) <= tol
    H, G = R.hessian(), R.ggn()
    # Each operator's matmat on a block of random vectors (one linearisation
    # for all of them) against its explicit matrix. Two vectors: any error
    # matrix E has V E != 0 for random V (almost surely), and TensorFlow's
    # traced graph holds one second backward pass per vector.
    V = np.random.default_rng(6).normal(size=(2, R.theta.shape[0]))
    block = [ops.convert_to_tensor(b) for b in _unflatten_block(V, R.shapes)]

    def products(op):
        return np.concatenate([ref.to_numpy(t).reshape(len(V), -1) for t in op.matmat(block)], axis=1)

    assert ref.rel_err(products(kc.Hessian(model, x, y, **kw)), V @ H) <= tol
    assert ref.rel_err(products(kc.GGN(model, x, **kw)), V @ G) <= tol
    assert ref.rel_err(kc.GGN(model, x, **kw).to_dense(), G) <= tol
    assert ref.rel_err(products(kc.GGNResidual(model, x, y, **kw)), V @ (H - G)) <= tol
    emp = R.empirical()
    assert ref.rel_err(products(kc.GGN(model, x, y, kind="empirical", **kw)), V @ emp) <= tol
    assert ref.rel_err(kc.GGN(model, x, y, kind="empirical", **kw).to_dense(), emp) <= tol
    labels = tt.mc_labels(R.probs(), seed=4, num_samples=3)
    mc = R.ggn_mc(labels, 3)
    assert ref.rel_err(products(kc.GGN(model, x, kind="mc", num_samples=3, seed=4, **kw)), V @ mc) <= tol
    assert ref.rel_err(kc.GGN(model, x, kind="mc", num_samples=3, seed=4, **kw).to_dense(), mc) <= tol
    assert ref.rel_err(ref.flatten(kc.GGN(model, x, **kw).diagonal()), np.diag(G)) <= tol
    v = [np.random.default_rng(5).normal(size=s) for s in R.shapes]
    assert ref.rel_err(ref.flatten(kc.hvp(model, x, y, v, **kw)), H @ ref.flatten(v)) <= tol
    assert ref.rel_err(ref.flatten(kc.ggnvp(model, x, y, v, **kw)), G @ ref.flatten(v)) <= tol
    # per example (sequence): a loop over each one's own weighted mean loss
    assert ref.rel_err(ref.flatten_rows(kc.per_example_gradients(model, x, y, **kw)), R.sequence_gradients()) <= tol
    # The same from the backend's vectorised map (vmap / pfor), the path of
    # layers without a per-example rule: TensorFlow's pfor corrupted the heap
    # on attention, so there it loops over the examples.
    fns = kc.model_functions(model)
    weights = kc.weights.resolve(fns, x, y, sw, None)  # sample_weight times the model's mask
    weights = None if weights is None else ops.convert_to_tensor(weights.astype(keras.config.floatx()))
    xt, yt = ops.convert_to_tensor(x), ops.convert_to_tensor(y)
    mapped = fns.kernel("per_example_grads")(fns.params(), fns.non_trainable(), xt, yt, weights)
    assert ref.rel_err(ref.flatten_rows(mapped), R.sequence_gradients()) <= tol


@pytest.mark.parametrize("metric", ["diagonal", "kfac"])
def test_the_exact_part_under_each_metric_equals_its_dense_formula(case, metric):
    name, model, x, y, R, sw = case
    tol = _tol()
    M = ks.fisher_metric(model, x, structure=metric, sample_weight=sw)
    G, H = R.ggn(), R.hessian()
    if metric == "diagonal":
        assert ref.rel_err(ref.flatten(M.diagonal()), np.diag(G)) <= tol
    elif name.startswith("lm"):
        A, B = R.head_factors()
        head = M.blocks[[v.path for v in model.trainable_variables].index("head/kernel")]
        assert ref.rel_err(ref.to_numpy(head.A), A) <= tol and ref.rel_err(ref.to_numpy(head.B), B) <= tol
    Minv = M.inverse(1e-3, relative=True)
    # The key bias's Fisher is zero in exact arithmetic (softmax ignores a
    # shift shared by every key) and rounding noise here: the inverse
    # excludes that block instead of inverting the noise.
    key_bias = [v.path for v in model.trainable_variables].index("attention/key/bias")
    assert not np.any(ref.to_numpy(Minv.blocks[key_bias].diagonal()[0]))
    exact, parts = kc.GGN(model, x, sample_weight=sw).trace_with(Minv)
    Mi = Minv.to_dense()
    assert ref.rel_err(exact, np.trace(Mi @ G)) <= 10 * tol
    est = ks.riemannian_sharpness(model, x, y, structure=metric, num_probes=8, rtol=None, seed=2, sample_weight=sw)
    assert ref.rel_err(est.info["exact_part"], np.trace(Mi @ G)) <= 10 * tol
    assert est.info["exact_part_stderr"] == 0.0 and est.info["residual_exact"] is False
    assert est.info["residual"] == pytest.approx(est.value - est.info["exact_part"], rel=1e-12)
    # Direction counts of the metric on attention: nonzero and zero Fisher
    # add up to the parameters, nonzero covers the dense metric's rank (it
    # also keeps directions at rounding level that each block's own cutoff
    # keeps: 1 of 425 diagonal, 22 of 453 K-FAC here), and the damped
    # inverse leaves out only the rounding-level key-bias block.
    info = est.info
    assert info["num_nonzero_fisher"] + info["num_zero_fisher"] == info["num_params"] == G.shape[0]
    eig = np.linalg.eigvalsh(ref.to_numpy(M.to_dense()))
    assert int(np.sum(eig > 1e-9 * eig.max())) <= info["num_nonzero_fisher"] < G.shape[0]
    assert info["num_excluded"] == int(np.prod(model.trainable_variables[key_bias].shape))
    # the probed residual is unbiased: within 4 standard errors of tr(M^-1 (H - G))
    truth = np.trace(Mi @ (H - G))
    assert abs(est.info["residual"] - truth) <= 4 * est.info["residual_stderr"] + 1e-6 * abs(truth)
    trace = ks.hessian_trace(model, x, y, num_probes=8, rtol=None, seed=2, sample_weight=sw)
    assert ref.rel_err(trace.info["exact_part"], np.trace(G)) <= tol
    assert abs(trace.value - np.trace(H)) <= 4 * trace.stderr + tol * abs(np.trace(H))


def test_sample_weights_of_one_per_example_weight_whole_sequences(float64):
    model, x, y, _ = _lm()
    sw = np.array([1.0, 2.0, 0.0, 1.0, 3.0, 1.0])
    R = tt.Reference(model, x, y, sample_weight=sw)
    loss, grads = kc.loss_and_gradient(model, x, y, sample_weight=sw)
    assert ref.rel_err(float(loss), float(R.loss())) <= _tol()
    per = ref.flatten_rows(kc.per_example_gradients(model, x, y, sample_weight=sw))
    assert np.all(per[2] == 0.0)  # a sequence of weight zero counts for nothing
    assert ref.rel_err(per, R.sequence_gradients()) <= _tol()


def test_streamed_batches_give_the_same_weighted_quantities(float64):
    model, x, y, R = _lm(np.random.default_rng(3).uniform(0.5, 2.0, (6, tt.T)))
    sw = np.random.default_rng(3).uniform(0.5, 2.0, (6, tt.T))
    whole = kc.GGN(model, x, sample_weight=sw).diagonal()
    streamed = kc.GGN(model, x, sample_weight=sw, batch_size=4).diagonal()
    assert ref.rel_err(ref.flatten(streamed), ref.flatten(whole)) <= _tol()
    v = [np.random.default_rng(5).normal(size=s) for s in R.shapes]
    a = kc.hvp(model, x, y, v, sample_weight=sw)
    b = kc.hvp(model, x, y, v, sample_weight=sw, batch_size=4)
    assert ref.rel_err(ref.flatten(b), ref.flatten(a)) <= _tol()
    la, _ = kc.loss_and_gradient(model, x, y, sample_weight=sw)
    lb, _ = kc.loss_and_gradient(model, x, y, sample_weight=sw, batch_size=4)
    assert ref.rel_err(float(lb), float(la)) <= _tol()


def test_a_sampled_exact_part_is_unbiased_with_an_honest_stderr():
    """C = 100 > max_exact_classes: the GGN part is the mean of sampled
    labels' parts. Over 12 seeds it centres on the exact part (forced by a
    higher threshold), and the z-scores spread like a standard normal."""
    model, x, y, _ = _lm(classes=100, n=8)
    M = ks.fisher_metric(model, x, structure="kfac", max_exact_classes=1000).inverse(1e-3, relative=True)
    G = kc.GGN(model, x)
    exact, se, _, info = G.trace_estimate(M, max_exact_classes=1000)
    assert se == 0.0 and not info["exact_part_sampled"]
    values, z = [], []
    for seed in range(12):
        value, stderr, parts, info = G.trace_estimate(M, num_samples=8, seed=seed)
        assert info["exact_part_sampled"] and "100 classes" in info["exact_part_note"]
        assert stderr > 0 and sum(parts) == pytest.approx(value, rel=1e-9)
        values.append(value)
        z.append((value - exact) / stderr)
    mean_se = np.std(values, ddof=1) / np.sqrt(len(values))
    assert abs(np.mean(values) - exact) <= 3.5 * mean_se
    assert 0.4 <= np.std(z, ddof=1) <= 1.8, z
    # The sharpness functions sample above the threshold and say so.
    est = ks.hessian_trace(model, x, y, num_probes=4, rtol=None)
    assert est.info["exact_part_sampled"] and est.info["exact_part_stderr"] > 0
    assert est.stderr == pytest.approx(np.hypot(est.info["exact_part_stderr"], est.info["residual_stderr"]))
    sr = ks.riemannian_sharpness(model, x, y, structure="kfac", num_probes=4, rtol=None)
    assert sr.info["metric_fisher"].startswith("mc: 8 labels per token")


def test_the_same_seed_gives_the_same_estimates_and_labels_again():
    model, x, y, _ = _lm()
    kw = dict(num_probes=6, rtol=None, seed=7)
    a = ks.riemannian_sharpness(model, x, y, structure="kfac", **kw)
    b = ks.riemannian_sharpness(model, x, y, structure="kfac", **kw)
    np.testing.assert_array_equal(a.samples, b.samples)
    assert a.value == b.value


# --------------------------------------------------------- bad input ----
FUNCTIONS = ["Hessian", "fisher_diagonal", "hessian_max_eigenvalue", "hessian_trace", "hvp", "loss_and_gradient",
             "per_example_gradients", "riemannian_sharpness"]


def _functions(model, x, y, sw=None):
    v = [np.zeros(s) for s in tt.shapes(model)]
    kw = dict(sample_weight=sw)
    return {
        "loss_and_gradient": lambda: kc.loss_and_gradient(model, x, y, **kw),
        "hvp": lambda: kc.hvp(model, x, y, v, **kw),
        "per_example_gradients": lambda: kc.per_example_gradients(model, x, y, **kw),
        "Hessian": lambda: kc.Hessian(model, x, y, **kw),
        "hessian_trace": lambda: ks.hessian_trace(model, x, y, num_probes=2, rtol=None, **kw),
        "riemannian_sharpness": lambda: ks.riemannian_sharpness(model, x, y, structure="kfac", num_probes=2, rtol=None, **kw),
        "fisher_diagonal": lambda: ks.fisher_diagonal(model, x, y, kind="empirical", **kw),
        "hessian_max_eigenvalue": lambda: ks.hessian_max_eigenvalue(model, x, y, max_iter=2, **kw),
    }


@pytest.mark.parametrize("name", FUNCTIONS)
def test_token_level_bad_input_gets_a_clear_error(name):
    model, x, y, _ = _lm()
    with pytest.raises(ValueError, match="sequence length"):
        _functions(model, x, y[:, :-1])[name]()
    with pytest.raises(ValueError, match="sample_weight of shape"):
        _functions(model, x, y, np.ones((6, tt.T + 1)))[name]()
    with pytest.raises(ValueError, match="differ in length"):
        _functions(model, x, y, np.ones(5))[name]()
    bad = y.copy()
    bad[1, 2] = tt.V
    with pytest.raises(ValueError, match=r"Labels must lie in \[0, 7\)"):
        _functions(model, x, bad)[name]()
    with pytest.raises(ValueError, match="finite and >= 0"):
        _functions(model, x, y, -np.ones(6))[name]()


def _relu_classifier(activation):
    rng = np.random.default_rng(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation=activation), keras.layers.Dense(3)])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = rng.normal(size=(64, 4)).astype("float32")
    return model, x, rng.integers(0, 3, size=64).astype("int32")


@pytest.mark.parametrize("path", ["exact", "probed"])  # relu: no probe is drawn; tanh: the residual is probed
@pytest.mark.parametrize("fn", ["hessian_trace", "riemannian_sharpness", "riemannian_sharpness_kfac"])
def test_the_probe_free_path_validates_like_the_probed_one(fn, path):
    """Regressions of a red team's finding: the exact path once returned a
    number for x and y of different lengths and for out-of-range labels."""
    model, x, y = _relu_classifier("relu" if path == "exact" else "tanh")
    call = {
        "hessian_trace": lambda x, y: ks.hessian_trace(model, x, y, num_probes=2, rtol=None),
        "riemannian_sharpness": lambda x, y: ks.riemannian_sharpness(model, x, y, num_probes=2, rtol=None),
        "riemannian_sharpness_kfac": lambda x, y: ks.riemannian_sharpness(model, x, y, structure="kfac", num_probes=2, rtol=None),
    }[fn]
    est = call(x, y)
    assert (est.num_samples == 0) == (path == "exact")
    with pytest.raises(ValueError, match="differ in length"):
        call(x[:32], y)
    with pytest.raises(ValueError, match="differ in length"):
        call(x, y[:32])
    bad = y.copy()
    bad[3] = 7
    with pytest.raises(ValueError, match=r"Labels must lie in \[0, 3\)"):
        call(x, bad)


@pytest.mark.parametrize("fn", ["hessian_trace", "riemannian_sharpness", "fisher_diagonal", "gradient_noise_alignment", "logger"])
def test_a_tf_data_dataset_is_refused_by_name(fn):
    import tensorflow as tf

    model, x, y = _relu_classifier("tanh")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    call = {
        "hessian_trace": lambda: ks.hessian_trace(model, ds, y),
        "riemannian_sharpness": lambda: ks.riemannian_sharpness(model, ds, y),
        "fisher_diagonal": lambda: ks.fisher_diagonal(model, ds),
        "gradient_noise_alignment": lambda: ks.gradient_noise_alignment(model, ds, y, batch_size=4),
        "logger": lambda: kg.callbacks.SharpnessLogger(ds, y),
    }[fn]
    with pytest.raises(ValueError, match="tf.data.Dataset"):
        call()
    with pytest.raises(ValueError, match="generator"):
        {"logger": lambda: kg.callbacks.SharpnessLogger(iter([x]), y)}.get(fn, lambda: ks.hessian_trace(model, (e for e in x), y))()


# ------------------------------------------------------ reading S_R ----
def test_a_residual_that_outweighs_the_ggn_part_is_said_once_and_logged_in_parts():
    """At initialisation the LM's residual under the K-FAC metric outweighs
    its GGN part: the estimate keeps both with their standard errors, one
    warning says which and what to do, and the logger writes both parts."""
    model, x, y, _ = _lm()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est = ks.riemannian_sharpness(model, x, y, structure="kfac", num_probes=10, rtol=0.05, max_probes=20)
    said = [str(w.message) for w in caught if "This means" in str(w.message)]
    info = est.info
    assert abs(info["residual"]) > abs(info["exact_part"]) or not info["rtol_reached"]
    assert len(said) == 1 and "What to do" in said[0] and "damping" in said[0]
    assert said[0] == info["residual_warning"]
    assert "outweighs the GGN part" in said[0] or "stays above rtol" in said[0]
    assert not any("Hutchinson: relative standard error" in str(w.message) for w in caught)
    logger = kg.callbacks.SharpnessLogger(x, y, metrics=("riemannian_sharpness_kfac", "hessian_trace"), num_probes=4, rtol=None)
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y, epochs=2, verbose=0, callbacks=[logger])
    for name in ("riemannian_sharpness_kfac", "hessian_trace"):
        for part in ("_ggn", "_ggn_stderr", "_residual", "_residual_stderr"):
            assert len(history.history[name + part]) == 2 and np.all(np.isfinite(history.history[name + part]))
        total = np.array(history.history[name])
        parts = np.array(history.history[name + "_ggn"]) + np.array(history.history[name + "_residual"])
        np.testing.assert_allclose(parts, total, rtol=1e-9)
    once = [w for w in caught if "riemannian_sharpness_kfac" in str(w.message) and "said once per fit" in str(w.message)]
    assert len(once) <= 1
