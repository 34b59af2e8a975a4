"""What the command line and the study share (``keras_geosam.experiments``):
the optimizer registry, label noise, probe data, run validity and the
training budget."""

import math

import keras
import numpy as np
import pytest

from keras_geosam.experiments import data
from keras_geosam.experiments import validity
from keras_geosam.experiments.budget import fit_within_budget
from keras_geosam.experiments.models import build_mlp
from keras_geosam.experiments.optimizers import OPTIMIZERS
from keras_geosam.experiments.optimizers import parse


@pytest.mark.parametrize("name, method, base, cls", [
    ("sgd", None, "sgd", "SGD"), ("adam", None, "adam", "Adam"), ("adamw", None, "adamw", "AdamW"),
    ("sam", "sam", "sgd", "SAM"), ("sam@adamw", "sam", "adamw", "SAM"),
    ("llqrsam-kfac@adam", "llqrsam-kfac", "adam", "LLQRSAM"), ("fishersam@adam", "fishersam", "adam", "FisherSAM"),
])
def test_registry_names_methods_on_any_base(name, method, base, cls):
    assert parse(name) == (method, base) and name in OPTIMIZERS
    opt = OPTIMIZERS[name](0.01)
    assert type(opt).__name__ == cls
    inner = getattr(opt, "base_optimizer", opt)
    assert type(inner).__name__ == {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}[base]
    assert float(keras.ops.convert_to_numpy(inner.learning_rate)) == pytest.approx(0.01)


@pytest.mark.parametrize("name", ["rmsprop", "sam@rmsprop", "adam@sgd", "sam@", "@adam"])
def test_registry_refuses_unknown_names(name):
    assert name not in OPTIMIZERS
    with pytest.raises(KeyError, match="METHOD@BASE"):
        OPTIMIZERS[name]


@pytest.mark.parametrize("fraction", [0.0, 0.4, 0.8, 1.0])
def test_label_noise_changes_exactly_the_stated_fraction(fraction):
    y = np.random.default_rng(0).integers(0, 10, size=1000).astype("int32")
    noisy, changed = data.symmetric_label_noise(y, fraction, 10, seed=1)
    assert changed == fraction and np.mean(noisy != y) == fraction
    assert noisy.min() >= 0 and noisy.max() < 10 and noisy.dtype == y.dtype
    assert np.array_equal(y, np.random.default_rng(0).integers(0, 10, size=1000))  # input untouched
    if fraction == 1.0:  # symmetric: every other class about equally often
        moved = (noisy - y) % 10
        counts = np.bincount(moved, minlength=10)
        assert counts[0] == 0 and counts[1:].min() > 70
    with pytest.raises(ValueError, match="label noise"):
        data.symmetric_label_noise(y, 1.5, 10)


def test_probe_subset_takes_the_first_examples_of_the_chosen_set():
    train = (np.arange(10.0)[:, None], np.arange(10))
    test = (-np.arange(5.0)[:, None], -np.arange(5))
    assert data.probe_subset(train, test, 3)[1].tolist() == [0, 1, 2]
    assert data.probe_subset(train, test, 30, "test")[1].tolist() == [0, -1, -2, -3, -4]
    with pytest.raises(ValueError, match="probe data"):
        data.probe_subset(train, test, 3, "validation")


def test_run_validity():
    assert validity.check_run(0.2, 0.9, 10) == (True, "")
    ok, why = validity.check_run(2.3, 0.1, 10)
    assert not ok and why.startswith("collapsed: train acc 0.10 < 0.20")
    assert validity.check_run(0.5, 0.19, 10, min_train_acc=0.1)[0]
    assert validity.check_run(math.inf, 0.9, 10) == (False, "diverged: train loss inf")
    assert validity.check_run(0.1, 0.9, 10, weights_finite=False) == (False, "diverged: non-finite weights")
    assert validity.min_train_accuracy(2) == 1.0 and validity.min_train_accuracy(100) == 0.02


def _digits_model():
    from keras_geosam import datasets

    (x, y), _, classes = datasets.load("digits")
    model = build_mlp(x.shape[1], classes, seed=0, width=16)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, x[:300], y[:300]


@pytest.mark.parametrize("batch_size", [16, 128])
def test_a_step_budget_is_the_same_number_of_optimizer_steps_for_every_batch_size(batch_size):
    model, x, y = _digits_model()
    _, budget = fit_within_budget(model, x, y, batch_size, steps=25)
    assert budget["steps"] == 25 and budget["converged"] == ""
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 25
    assert budget["epochs"] == math.ceil(25 / math.ceil(300 / batch_size))


def test_a_target_train_loss_stops_early_or_records_not_converged():
    model, x, y = _digits_model()
    history, budget = fit_within_budget(model, x, y, 32, epochs=30, target_train_loss=1.5)
    assert budget["converged"] == 1 and history.history["loss"][-1] <= 1.5
    assert budget["epochs"] == len(history.history["loss"]) < 30
    model, x, y = _digits_model()
    history, budget = fit_within_budget(model, x, y, 32, steps=3, target_train_loss=1e-6)
    assert budget["converged"] == 0 and budget["steps"] == 3
    with pytest.raises(ValueError, match="steps"):
        fit_within_budget(model, x, y, 32)


def test_results_file_drops_torn_and_incomplete_rows_and_refuses_other_columns(tmp_path):
    from keras_geosam.experiments.results import ResultsFile

    path = tmp_path / "r.csv"
    fields = ["key", "value", "complete"]
    rf = ResultsFile(path, fields=fields, is_complete=lambda r: r["complete"] == "1", text_fields=("key",))
    rf.append({"key": "007", "value": np.float64(0.1), "complete": 1})
    rf.append({"key": "b", "value": 2, "complete": 0})  # a run that did not finish its row
    with open(path, "a") as f:
        f.write("c,3")  # killed mid-write
    again = ResultsFile(path, fields=fields, is_complete=lambda r: r["complete"] == "1", text_fields=("key",))
    assert again.rows == [{"key": "007", "value": 0.1, "complete": 1}]  # text kept as text, 0.1 read back exactly
    assert path.read_text().splitlines() == ["key,value,complete", "007,0.1,1"]
    with pytest.raises(ValueError, match="other columns"):
        again.append({"key": "d", "other": 1})
    with pytest.raises(ValueError, match="other columns"):
        ResultsFile(path, fields=["key", "value"])
    assert ResultsFile(path, fresh=True).rows == [] and not path.exists()


@pytest.mark.parametrize("name", ["adamw", "sam@adamw", "llqrsam-kfac@adam"])
def test_a_run_trains_with_any_registry_optimizer_for_its_step_budget(name):
    from keras_geosam import datasets
    from keras_geosam.experiments.run import initialised_mlp
    from keras_geosam.experiments.run import train_run

    (x, y), _, classes = datasets.load("digits")
    model, loss = initialised_mlp(x.shape[1], classes, seed=0, width=8)
    before = [np.array(w) for w in model.get_weights()]
    _, budget = train_run(model, loss, name, 1e-3, x[:128], y[:128], 32, steps=6)
    assert budget["steps"] == 6 and budget["seconds"] > 0
    after = model.get_weights()
    assert all(np.all(np.isfinite(w)) for w in after)
    assert any(not np.array_equal(a, b) for a, b in zip(before, after))
    again, _ = initialised_mlp(x.shape[1], classes, seed=0, width=8)  # the pool re-initialises
    assert again is model and all(np.array_equal(a, b) for a, b in zip(before, again.get_weights()))
