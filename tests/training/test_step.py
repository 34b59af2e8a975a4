"""The two-pass train step (``keras_geosam/training/step.py``) compiles once.

A model trained with LLQR+SAM is compiled by its first step and never
again: on JAX the step is one program and U's refresh (due at steps 0 and 3
here) is a second one, run between steps, both compiled at step 0; on
TensorFlow the step's graph, refresh branch included, is traced once.
Counted over the first four steps (three without a refresh, one with),
through ``fit`` and through ``train_on_batch`` (each call of which re-reads
the state from the variables). torch runs the step eagerly: nothing
compiles, nothing to count.
"""

import keras
import numpy as np
import pytest

import keras_geosam as kg

BACKEND = keras.backend.backend()
eager = pytest.mark.skipif(BACKEND == "torch", reason="torch runs the step eagerly: it compiles nothing")

_COMPILED = [0]  # XLA compilations in this process (JAX)


def _count(event, seconds, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILED[0] += 1


if BACKEND == "jax":
    import jax

    jax.monitoring.register_event_duration_secs_listener(_count)


class _Counting(kg.Sequential):
    """Counts runs of ``train_step``'s Python body: traces on JAX and TF."""

    traces = 0

    def train_step(self, *args):
        self.traces += 1
        return super().train_step(*args)


def _compilations(model):
    return _COMPILED[0] if BACKEND == "jax" else model.traces


def _model(structure):
    keras.utils.set_random_seed(0)
    model = _Counting([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
    opt = kg.optimizers.LLQRSAM(keras.optimizers.AdamW(1e-2), rho=0.05, structure=structure, refresh_every=3,
                                refresh_steps=3)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class _PerStep(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.counts = []

    def on_train_batch_end(self, batch, logs=None):
        self.counts.append(_compilations(self.model))


@eager
@pytest.mark.parametrize("structure", ["diagonal", "kfac"])
def test_the_first_step_compiles_everything_the_next_two_compile_nothing(structure):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 6)).astype("float32"), rng.integers(0, 3, 16)

    before = _compilations(model := _model(structure))
    per_step = _PerStep()
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[per_step])
    assert int(keras.ops.convert_to_numpy(model.optimizer.refreshes)) == 2  # steps 0 and 3
    assert per_step.counts[0] > before
    assert per_step.counts[1:] == [per_step.counts[0]] * 3, per_step.counts
    if BACKEND == "tensorflow":
        assert model.traces == 1

    # train_on_batch, as a user trying a model does: the same.
    model = _model(structure)
    counts = []
    for start in range(0, 16, 4):
        model.train_on_batch(x[start:start + 4], y[start:start + 4])
        counts.append(_compilations(model))
    assert int(keras.ops.convert_to_numpy(model.optimizer.refreshes)) == 2
    assert counts[1:] == [counts[0]] * 3, counts


def _sam_model(grad_cosine, width=64):
    keras.utils.set_random_seed(0)
    model = kg.Sequential([keras.Input((width,)), keras.layers.Dense(width, activation="tanh"), keras.layers.Dense(3)])
    opt = kg.optimizers.SAM(keras.optimizers.AdamW(1e-2), rho=0.1, grad_cosine=grad_cosine)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_without_grad_cosine_the_step_lets_go_of_the_centre_gradient():
    """``grad_cosine=False``: the same weights and statistics but the cosine,
    which leaves the logs; the setting survives ``get_config``; on JAX the
    compiled step's temporaries are one copy of the weights smaller
    (XLA's own buffer assignment: g_c no longer lives through the
    perturbed pass)."""
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(16, 64)).astype("float32"), rng.integers(0, 3, 16)
    runs = {}
    for flag in (True, False):
        model = _sam_model(flag)
        h = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
        runs[flag] = (model, h)
    (with_cos, h_cos), (without, h) = runs[True], runs[False]
    assert "grad_cosine" in h_cos and "grad_cosine" not in h
    for key in ("loss", "sharpness_gap", "grad_norm"):
        np.testing.assert_allclose(h[key], h_cos[key], rtol=1e-6, err_msg=key)
    for a, b in zip(without.get_weights(), with_cos.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    config = without.optimizer.get_config()
    assert config["grad_cosine"] is False
    assert kg.optimizers.SAM.from_config(config).keeps_centre_gradients is False
    assert kg.optimizers.FSAM(keras.optimizers.SGD(0.1), grad_cosine=False).keeps_centre_gradients  # its average
    with pytest.raises(ValueError, match="grad_cosine"):
        kg.optimizers.SAM(keras.optimizers.SGD(0.1), grad_cosine="no")
    if BACKEND == "jax":
        import jax

        temps = {}
        for flag, (model, _) in runs.items():
            state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                         optimizer_variables=True, metrics_variables=True)
            step = jax.jit(model.train_step, donate_argnums=0)
            temps[flag] = step.lower(state, (x[:8], y[:8])).compile().memory_analysis().temp_size_in_bytes
        weights = 4 * model.count_params()
        assert temps[True] - temps[False] >= 0.9 * weights, (temps, weights)


@pytest.mark.parametrize("name", ["sam", "llqr", "fsam"])
def test_the_update_gets_the_centre_gradient_only_if_it_reads_it(name, monkeypatch):
    """On TensorFlow and torch the update (``apply_two_pass``) gets g_c only
    when it reads it (FSAM's average; LLQR's single pass, where it is g_p):
    SAM's update gets g_p alone, so eager torch frees g_c, kept for the
    cosine, before the update's temporaries exist. JAX's step is one
    program whose buffers XLA frees itself (its accounting is checked in
    the test above)."""
    if BACKEND == "jax":
        pytest.skip("JAX's update is inside one compiled program: XLA frees g_c itself")
    base = keras.optimizers.AdamW(1e-2)
    opt = {"sam": lambda: kg.optimizers.SAM(base, rho=0.1),
           "llqr": lambda: kg.optimizers.LLQR(base, refresh_every=2),
           "fsam": lambda: kg.optimizers.FSAM(base, rho=0.1)}[name]()
    keras.utils.set_random_seed(0)
    model = kg.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), run_eagerly=True)
    seen = []
    apply = type(opt).apply_two_pass

    def spy(self, centre, perturbed, variables):
        seen.append((centre is None, centre is perturbed))
        return apply(self, centre, perturbed, variables)

    monkeypatch.setattr(type(opt), "apply_two_pass", spy)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 8)).astype("float32"), rng.integers(0, 3, 8)
    h = model.fit(x, y, batch_size=4, epochs=1, verbose=0).history
    assert len(seen) == 2 and np.isfinite(h["loss"][0])
    want = {"sam": (True, False), "llqr": (False, True), "fsam": (False, False)}[name]
    assert seen == [want] * 2, seen
