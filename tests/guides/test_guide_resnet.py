"""The guide ``guides/llqr_sam_resnet.py`` end to end in its ``--smoke`` mode
(a tiny pre-activation ResNet on random 32x32 images, two epochs, a resume
for a third), and the facts it claims, checked from outside: the TensorBoard
event files, the ``.keras`` checkpoints reloaded here, and the optimizer
state in them.

Run once per backend (``KERAS_BACKEND=jax|tensorflow|torch``).
"""

import glob
import importlib.util
import json
import math
import os

import keras
import numpy as np
import pytest

import keras_geosam as kg  # noqa: F401  (registers what load_model needs)
from locations import GUIDES

GUIDE = os.path.join(GUIDES, "llqr_sam_resnet.py")
SHARPNESS_KEYS = ("riemannian_sharpness", "riemannian_sharpness_stderr", "riemannian_sharpness_normalized",
                  "hessian_trace", "hessian_trace_stderr")


@pytest.fixture(scope="module")
def guide():
    spec = importlib.util.spec_from_file_location("llqr_sam_resnet_guide", GUIDE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run(guide, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("resnet_guide"))
    facts = guide.main(["--smoke", "--output", out])
    with open(os.path.join(out, "facts.json")) as f:
        assert json.load(f)["backend"] == facts["backend"] == keras.backend.backend()
    with np.load(os.path.join(out, "state.npz")) as f:
        state = dict(f)
    return out, facts, state


def _scalars(log_dir):
    """{tag: {step: value}} from every TensorBoard event file under log_dir/train."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    files = sorted(glob.glob(os.path.join(log_dir, "train", "events.out.tfevents.*")))
    assert files, f"no TensorBoard event file under {log_dir}/train"
    out = {}
    for path in files:
        for event in EventFileLoader(path).Load():
            for v in event.summary.value:
                kind = v.WhichOneof("value")
                value = float(tensor_util.make_ndarray(v.tensor)) if kind == "tensor" else float(v.simple_value)
                out.setdefault(v.tag, {})[event.step] = value
    return out


def _load(path):
    assert os.path.exists(path), path
    return keras.saving.load_model(path)


def _np(x):
    return keras.ops.convert_to_numpy(x)


def test_tensorboard_holds_the_sharpness_scalars(run):
    out, facts, _ = run
    scalars = _scalars(os.path.join(out, "logs"))
    epochs = facts["epochs"]
    for key in SHARPNESS_KEYS + ("loss", "sharpness_gap"):
        assert "epoch_" + key in scalars, sorted(scalars)
        # both runs (before and after the resume) wrote one value per epoch
        assert sorted(scalars["epoch_" + key]) == list(range(epochs + 1))
    # The logger runs on epoch index 1 (every 2 epochs): there the event
    # file holds exactly what History recorded; elsewhere NaN.
    for key in SHARPNESS_KEYS:
        logged = scalars["epoch_" + key]
        assert logged[1] == pytest.approx(facts["history"][key][1], rel=1e-6)
        assert math.isfinite(logged[1]) and math.isnan(logged[0]) and math.isnan(logged[2])
    assert scalars["epoch_riemannian_sharpness"][1] > 0
    assert scalars["epoch_hessian_trace_stderr"][1] >= 0


def test_checkpoint_reloads_as_the_trained_model(run):
    out, facts, state = run
    epochs = facts["epochs"]
    ckpts = sorted(glob.glob(os.path.join(out, "checkpoints", "*.keras")))
    assert [os.path.basename(c) for c in ckpts] == [f"epoch_{e:02d}.keras" for e in range(1, epochs + 2)]
    trained = _load(ckpts[epochs - 1])
    np.testing.assert_allclose(trained.predict(state["probe"], verbose=0), state["pred_trained"], rtol=0, atol=1e-6)
    assert facts["reload_prediction_max_abs_diff"] <= 1e-6
    # the checkpoint written after the resumed epoch is the resumed model
    resumed = _load(ckpts[epochs])
    np.testing.assert_allclose(resumed.predict(state["probe"], verbose=0), state["pred_resumed"], rtol=0, atol=1e-6)
    # and training did change the function between the two
    assert np.max(np.abs(state["pred_resumed"] - state["pred_trained"])) > 1e-6


def test_optimizer_state_survives_the_checkpoint(run):
    out, facts, state = run
    epochs, steps = facts["epochs"], facts["steps_per_epoch"]
    model = _load(os.path.join(out, "checkpoints", f"epoch_{epochs:02d}.keras"))
    opt = model.optimizer
    assert type(opt).__name__ == "LLQRSAM" and opt.structure == "kfac"
    # reloaded attached: a plain keras.Model would refuse the two-pass optimizer
    assert getattr(model, "_geosam_attached", False)
    assert int(_np(opt.iterations)) == epochs * steps == facts["iterations"]
    refreshes = int(_np(opt.refreshes))
    assert refreshes == facts["refreshes"] > 0
    # refresh_every divides the steps: one refresh per period, step 0 included
    assert refreshes == -(-epochs * steps // opt.refresh_every)
    u_saved = [state[f"u_trained_{i}"] for i in range(facts["reload_u_count"])]
    u_loaded = [_np(v) for v in opt.preconditioner.variables]
    assert len(u_loaded) == len(u_saved) > 0
    for a, b in zip(u_loaded, u_saved):
        np.testing.assert_array_equal(a, b)
    # U did move away from its initial value (identity factors, unit diagonals),
    # so the comparison above is not identity against identity.
    assert facts["u_distance_from_init"] > 0


def test_resumed_training_continues_the_count(run):
    _, facts, _ = run
    steps = facts["steps_per_epoch"]
    assert facts["reload_iterations"] == facts["iterations"]
    assert facts["reload_refreshes"] == facts["refreshes"]
    assert facts["resumed_iterations"] == facts["iterations"] + steps
    # smoke mode's refresh period divides the epoch: the resumed epoch starts
    # with a refresh, as the uninterrupted run would.
    assert facts["resumed_refreshes"] == facts["refreshes"] + 1
    # the two-pass step's own statistics: the reloaded model trained attached
    assert math.isfinite(facts["resumed_history"]["sharpness_gap"][0])
    assert facts["epochs"] == 2


def test_losses_are_finite(run):
    _, facts, _ = run
    losses = facts["history"]["loss"] + facts["resumed_history"]["loss"]
    assert len(losses) == facts["epochs"] + 1
    assert all(math.isfinite(v) for v in losses)
    assert all(math.isfinite(v) for v in facts["history"]["val_loss"] + facts["resumed_history"]["val_loss"])


def test_keras_cv_model_without_keras_cv_names_the_install(guide, tmp_path):
    try:
        import keras_cv  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("keras-cv is installed")
    with pytest.raises(SystemExit, match="pip install keras-cv tensorflow-datasets"):
        guide.main(["--smoke", "--model", "keras-cv", "--output", str(tmp_path)])


def test_keras_cv_model_when_installed(guide, tmp_path):
    pytest.importorskip("keras_cv")
    facts = guide.main(["--smoke", "--model", "keras-cv", "--output", str(tmp_path)])
    assert facts["reload_prediction_max_abs_diff"] <= 1e-6 and facts["reload_u_max_abs_diff"] == 0
    assert facts["resumed_iterations"] == facts["iterations"] + facts["steps_per_epoch"]
    assert facts["refreshes"] > 0 and all(math.isfinite(v) for v in facts["history"]["loss"])
