"""keras-hub models end to end: a BERT-style encoder classifier, a GPT-2
causal language model (per-token outputs) and a ViT, built from constructor
arguments (no preset download), attached, trained with LLQR+SAM (K-FAC U,
refreshed in the step) and SAM, saved to ``.keras``, reloaded and trained
on: equal to the uninterrupted run. Skipped where keras-hub does not import
(``pip install keras-geosam[hub]``).
"""

import keras
import numpy as np
import pytest

import keras_geosam as kg

keras_hub = pytest.importorskip("keras_hub")

BACKEND = keras.backend.backend()


def _bert(rng):
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=40, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=16, dropout=0.0, max_sequence_length=6,
    )
    model = keras_hub.models.BertTextClassifier(backbone, num_classes=3, preprocessor=None, dropout=0.0)
    x = {"token_ids": rng.integers(0, 40, size=(16, 6)), "segment_ids": np.zeros((16, 6), "int32"),
         "padding_mask": np.ones((16, 6), "int32")}
    return model, x, rng.integers(0, 3, size=16)


def _gpt2(rng):
    # A small vocabulary: the exact Fisher has one backward column per
    # position and class.
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=12, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=16, dropout=0.0, max_sequence_length=6,
    )
    model = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    tokens = rng.integers(0, 12, size=(16, 7))
    return model, {"token_ids": tokens[:, :-1], "padding_mask": np.ones((16, 6), "int32")}, tokens[:, 1:]


def _vit(rng):
    backbone = keras_hub.models.ViTBackbone(
        image_shape=(8, 8, 3), patch_size=4, num_layers=1, num_heads=2, hidden_dim=8, mlp_dim=16,
    )
    model = keras_hub.models.ViTImageClassifier(backbone, num_classes=3, preprocessor=None)
    return model, rng.normal(size=(16, 8, 8, 3)).astype("float32"), rng.integers(0, 3, size=16)


MODELS = {"bert": _bert, "gpt2": _gpt2, "vit": _vit}


def _optimizer(name):
    base = keras.optimizers.AdamW(1e-3, weight_decay=1e-2)
    if name == "sam":
        return kg.optimizers.SAM(base, rho=0.05)
    return kg.optimizers.LLQRSAM(base, rho=0.05, structure="kfac", refresh_every=3, refresh_steps=3)


def _build(name, optimizer, compiled):
    keras.utils.set_random_seed(0)
    model, x, y = MODELS[name](np.random.default_rng(0))
    model = kg.attach(model)
    model.compile(optimizer=_optimizer(optimizer), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  run_eagerly=not compiled)
    return model, x, y


def _state(model):
    return [np.asarray(keras.ops.convert_to_numpy(v)) for v in model.weights + model.optimizer.variables]


# LLQR+SAM holds every kind of state (U, its refresh count, the base's
# slots). Compiling a keras-hub model's two-pass step with the refresh takes
# a minute or more on JAX and TensorFlow on 2 CPU cores (and running it
# eagerly there is slower still), so there the GPT-2 causal LM (per-token
# outputs, a tied embedding) runs LLQR+SAM and BERT and the ViT run SAM;
# torch, eager anyway, runs LLQR+SAM on all three.
TORCH = BACKEND == "torch"
CASES = [("gpt2", "llqrsam", True), ("bert", "llqrsam" if TORCH else "sam", True), ("vit", "llqrsam" if TORCH else "sam", True)]
if TORCH:
    CASES.append(("gpt2", "sam", True))


@pytest.mark.parametrize("name,optimizer,compiled", CASES)
def test_fit_save_reload_continue_equals_an_uninterrupted_run(name, optimizer, compiled, tmp_path):
    fit = dict(batch_size=8, shuffle=False, verbose=0)
    model, x, y = _build(name, optimizer, compiled)
    start = model.get_weights()
    h = model.fit(x, y, epochs=2, **fit)  # 4 steps: refreshes at steps 0 and 3
    assert np.all(np.isfinite(h.history["loss"]))
    path = str(tmp_path / f"{name}.keras")
    model.save(path)
    restored = keras.models.load_model(path)
    assert type(restored.optimizer) is type(model.optimizer)
    assert [v.path for v in restored.optimizer.variables] == [v.path for v in model.optimizer.variables]
    for a, b in zip(_state(restored), _state(model)):
        np.testing.assert_array_equal(a, b)
    restored.fit(x, y, epochs=2, **fit)  # steps 4-7: a refresh at step 6
    model.fit(x, y, epochs=2, **fit)  # the uninterrupted run
    for a, b in zip(_state(restored), _state(model)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert max(np.max(np.abs(a - b)) for a, b in zip(model.get_weights(), start)) > 1e-4  # it trained
    if optimizer == "llqrsam":
        assert int(keras.ops.convert_to_numpy(restored.optimizer.refreshes)) == 3
        blocks = {d["path"]: d for d in restored.optimizer.preconditioner.operator().describe()}
        # attention kernels viewed as d_model x (heads*head_dim) / (heads*head_dim) x d_model
        attention = [d for p, d in blocks.items() if "attention" in p and p.endswith("kernel")]
        assert attention and all(d["block"] == "KFAC" and d["view"] == (8, 8) for d in attention)


# ------------------------------------------------------------ sharpness ----
@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_curvature_function_and_estimator_runs_on_keras_hub_models(name):
    """Each estimator on each keras-hub model returns finite numbers with
    their standard errors, the GPT-2 LM weighted by its padding mask; the
    probe-free parts agree with each other (the Fisher diagonal's sum is
    tr GGN, the GGN part of tr H)."""
    import warnings

    from keras_geosam import curvature as kc
    from keras_geosam import sharpness as ks

    keras.utils.set_random_seed(0)
    model, x, y = MODELS[name](np.random.default_rng(0))
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = {k: v[:8] for k, v in x.items()} if isinstance(x, dict) else x[:8]
    y = y[:8]
    sw = None
    if name == "gpt2":
        # 3 of the 6 positions: the exact Fisher takes one backward column
        # per position and class.
        x = {k: v[:, :3].copy() for k, v in x.items()}
        y = y[:, :3]
        x["padding_mask"][3, 2:] = 0
        sw = x["padding_mask"].astype("float32")
    kw = dict(sample_weight=sw)
    probed = dict(num_probes=3, rtol=None, **kw)
    v = [np.ones(w.shape, "float32") for w in model.trainable_weights]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # residual diagnoses and diagonal-fallback notices
        results = {
            "hvp": kc.hvp(model, x, y, v, **kw),
            "ggnvp": kc.ggnvp(model, x, y, v, **kw),
            "per_example": kc.per_example_gradients(model, x, y, **kw),
            "fisher_exact": ks.fisher_diagonal(model, x, y, **kw),
            "fisher_mc": ks.fisher_diagonal(model, x, y, kind="mc", **kw),
            "fisher_empirical": ks.fisher_diagonal(model, x, y, kind="empirical", **kw),
            "kfac": list(ks.kfac_factors(model, x, **kw).values()),
        }
        estimates = {
            "hessian_trace": ks.hessian_trace(model, x, y, **probed),
            "sr_diagonal": ks.riemannian_sharpness(model, x, y, structure="diagonal", **probed),
            "sr_kfac": ks.riemannian_sharpness(model, x, y, structure="kfac", **probed),
            "lambda_max": ks.hessian_max_eigenvalue(model, x, y, max_iter=3, **kw),
            "riemannian_lambda_max": ks.riemannian_max_eigenvalue(model, x, y, structure="kfac", max_iter=3, **kw),
        }
        alignment = ks.gradient_noise_alignment(model, x, y, batch_size=4, num_batches=3, **kw)
    for key, arrays in results.items():
        flat = [np.asarray(keras.ops.convert_to_numpy(a)) for item in arrays for a in (item if isinstance(item, tuple) else (item,))]
        assert flat and all(np.all(np.isfinite(a)) for a in flat), key
    for key, est in estimates.items():
        assert np.isfinite(est.value) and np.isfinite(est.stderr), key
    assert np.isfinite(alignment.cosine) and np.isfinite(alignment.alpha)
    trace = estimates["hessian_trace"]
    tr_ggn = sum(float(np.sum(f)) for f in results["fisher_exact"])
    assert trace.info["exact_part"] == pytest.approx(tr_ggn, rel=1e-4)
    if name == "gpt2":
        assert len(results["per_example"][0]) == 8


def test_refreshes_take_the_models_named_inputs():
    """``PreconditionerRefresh`` and ``refresh_now`` take the GPT-2 LM's own
    dict inputs (``token_ids``, ``padding_mask``), as ``fit`` does: a
    callback refresh on one batch gives the U (and, after the step, the
    weights) of the in-step refresh on that batch (float32 rounding: the
    callback shuffles the batch's rows)."""
    results = {}
    for source in ("step", "callback"):
        keras.utils.set_random_seed(0)
        model, x, y = _gpt2(np.random.default_rng(0))
        x, y = {k: v[:8] for k, v in x.items()}, y[:8]
        model = kg.attach(model)
        opt = kg.optimizers.LLQRSAM(keras.optimizers.AdamW(1e-3), rho=0.05, structure="kfac", refresh_every=1000,
                                    refresh_steps=3, refresh_source=source)
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        callbacks = [kg.callbacks.PreconditionerRefresh(x, y, batch_size=8)] if source == "callback" else []
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
        assert int(keras.ops.convert_to_numpy(opt.refreshes)) == 1
        results[source] = [np.asarray(keras.ops.convert_to_numpy(v)) for v in opt.preconditioner.variables + model.weights]
    for a, b in zip(results["step"], results["callback"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    u = [np.asarray(keras.ops.convert_to_numpy(v)) for v in opt.preconditioner.variables]
    opt.refresh_now(model, x, y)  # the model's dict inputs, directly
    assert int(keras.ops.convert_to_numpy(opt.refreshes)) == 2
    assert max(np.max(np.abs(a - np.asarray(keras.ops.convert_to_numpy(b))))
               for a, b in zip(u, opt.preconditioner.variables)) > 1e-6
