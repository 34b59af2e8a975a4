"""No hidden host round trips: they decide speed on a GPU or TPU.

- JAX: a compiled train step of every two-pass optimizer (an LLQR refresh
  included) runs under ``jax.transfer_guard("disallow")`` with its state and
  batch already on the device, and the estimators process every data batch
  but the first under it. (On CPU JAX guards host-to-device transfers only:
  a read-back is never caught there, and inside ``jit`` it cannot be
  written at all.)
- TensorFlow: the train step is traced once into a graph, run with XLA
  (``jit_compile=True``), where no host callback can exist.
- torch: ``.item()``, ``.tolist()``, ``.numpy()`` and ``bool()`` of a tensor
  raise inside the train step (each would synchronise with the device),
  with the branch-free skip of non-finite steps that an accelerator gets.
  LLQR's "is a refresh due" test reads the step counter only around due
  steps (host-side bounds on it), so its steps in between are checked.
"""

import contextlib

import keras
import numpy as np
import pytest

import keras_geosam as kg

BACKEND = keras.backend.backend()


def _optimizers(every=2):
    sgd = lambda: keras.optimizers.SGD(0.1, momentum=0.9)
    return {
        "SAM": lambda: kg.optimizers.SAM(sgd(), rho=0.1),
        "ASAM": lambda: kg.optimizers.SAM(sgd(), rho=0.1, adaptive=True),
        "FSAM": lambda: kg.optimizers.FSAM(sgd(), rho=0.1),
        "FisherSAM": lambda: kg.optimizers.FisherSAM(sgd(), rho=0.1),
        "LLQR": lambda: kg.optimizers.LLQR(sgd(), structure="kfac", refresh_every=every, refresh_steps=3),
        "LLQRSAM_diagonal": lambda: kg.optimizers.LLQRSAM(sgd(), structure="diagonal", refresh_every=every, refresh_steps=3),
        "LLQRSAM_kfac": lambda: kg.optimizers.LLQRSAM(sgd(), structure="kfac", refresh_every=every, refresh_steps=3),
    }


def _data(n=16):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 6)).astype("float32"), rng.integers(0, 3, size=n).astype("int32")


def _model(optimizer, **compile_kwargs):
    model = kg.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.BatchNormalization(),
        keras.layers.Dense(3),
    ])
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), **compile_kwargs)
    return model


@contextlib.contextmanager
def _torch_no_sync():
    """Every tensor-to-host read raises while active."""
    import torch

    names = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def forbid(name):
        def read(self, *args, **kwargs):
            raise AssertionError(f"Tensor.{name}() inside the train step: a host synchronisation.")

        return read

    try:
        for n in names:
            setattr(torch.Tensor, n, forbid(n))
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


@pytest.mark.parametrize("name", sorted(_optimizers()))
def test_train_step_makes_no_host_transfer(name, monkeypatch):
    x, y = _data()
    model = _model(_optimizers()[name]())
    model.train_on_batch(x, y)  # builds, compiles, step 0 refreshes U
    if BACKEND == "jax":
        import jax

        batch = (jax.device_put(x), jax.device_put(y), None)
        for _ in range(2):  # step 1: no refresh; step 2: a refresh is due
            state = model._get_jax_state(
                trainable_variables=True, non_trainable_variables=True,
                optimizer_variables=True, metrics_variables=True,
            )
            with jax.transfer_guard("disallow"):
                logs, state = model.train_function(state, iter([batch]))
                jax.block_until_ready(state)
            # Hand the new state back as Keras' train_on_batch does.
            model._jax_state = dict(zip(
                ("trainable_variables", "non_trainable_variables", "optimizer_variables", "metrics_variables"), state,
            ))
            model._jax_state_synced = False
            model.jax_state_sync()
        assert np.all(np.isfinite(np.asarray(logs["loss"])))
    elif BACKEND == "torch":
        import torch

        from keras_geosam.backend import torch as torch_backend

        monkeypatch.setattr(torch_backend, "BRANCH_FREE", True)  # as on a GPU
        model.make_train_function()
        batch = (torch.as_tensor(x), torch.as_tensor(y).long())
        if "LLQR" in name:
            # The counter is read at a due step and the one after (which may
            # still be at the due count, had the due step been skipped):
            # with refresh_every=4 steps 0, 1, 4, 5 read it; steps 2, 3, 6
            # and 7 cannot be due and must not touch the host.
            model = _model(_optimizers(every=4)[name]())
            model.make_train_function()
            for step in range(8):
                with _torch_no_sync() if step % 4 >= 2 else contextlib.nullcontext():
                    model.train_function([batch])
        else:
            with _torch_no_sync():
                for _ in range(2):
                    model.train_function([batch])
    else:
        model = _model(_optimizers()[name](), jit_compile=True)
        model.train_on_batch(x, y)  # traced into XLA: a host callback would not compile
        for _ in range(2):
            logs = model.train_on_batch(x, y, return_dict=True)
        assert np.isfinite(logs["loss"])
    if "LLQR" in name:
        assert int(keras.ops.convert_to_numpy(model.optimizer.preconditioner.refreshes)) >= 2


@pytest.mark.skipif(BACKEND != "jax", reason="jax.transfer_guard")
@pytest.mark.parametrize("device_data", [False, True], ids=["numpy", "device"])
def test_estimators_make_no_implicit_transfer_per_batch(monkeypatch, device_data):
    """Every data batch after the first is processed under
    ``jax.transfer_guard("disallow")``: the batch, its example offset and
    its weight reach the device by explicit placement, so the loop over the
    data never stalls on an implicit host transfer. (Per call, outside that
    loop, eager ops may still send a few Python constants.)"""
    import jax

    from keras_geosam.curvature import data
    from keras_geosam.curvature import products
    from keras_geosam.curvature.operators import model as operator_module

    plain = data.batches
    guarded = []

    def batches(*args, **kwargs):
        for i, item in enumerate(plain(*args, **kwargs)):
            if i == 0:
                yield item
                continue
            guarded.append(i)
            with jax.transfer_guard("disallow"):
                yield item

    monkeypatch.setattr(products, "batches", batches)  # the functional API's loops
    monkeypatch.setattr(operator_module, "batches", batches)  # the operators' loops
    x, y = _data(40)
    model = _model(keras.optimizers.SGD(0.1))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    if device_data:
        x, y = jax.device_put(x), jax.device_put(y)
    kg.sharpness.hessian_trace(model, x, y, batch_size=8, num_probes=4, rtol=None)
    kg.sharpness.riemannian_sharpness(model, x, y, structure="kfac", batch_size=8, num_probes=4, rtol=None)
    kg.sharpness.riemannian_sharpness(model, x, y, structure="diagonal", batch_size=8, num_probes=4, rtol=None)
    kg.sharpness.fisher_diagonal(model, x, y, batch_size=8)
    kg.sharpness.fisher_diagonal(model, x, y, kind="mc", batch_size=8)
    assert len(guarded) >= 5 * 4  # four guarded batches per pass over the data
    # The guard does fire on CPU for an implicit host-to-device transfer.
    with jax.transfer_guard("disallow"), pytest.raises(Exception, match="(?i)disallowed"):
        jax.jit(lambda a, k: a + k)(jax.numpy.ones(2), 3)
