"""Integration tests: end-to-end training, the main job and datasets.

Run once per backend, each in its own process:

    KERAS_BACKEND=jax|tensorflow|torch python -m pytest integration_tests -q

The whole suite is sized for ~3 minutes per backend on 2 CPU cores (the
guides' small modes, minutes each, only with KERAS_GEOSAM_SMALL_GUIDES=1).
Each test
records what it measured (accuracy, seconds) with the ``report`` fixture; the
lines are printed in pytest's terminal summary, so they show without ``-s``.
"""

import os

# Tiny models: intra-op thread pools only add synchronisation overhead, and on
# a busy or oversubscribed CI runner torch's OpenMP spin-waiting made one
# digits fit ~10x slower. Overridable from the environment. Must be set
# before torch (through keras) is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import pytest  # noqa: E402

_REPORT = []


# The guides' default (small) modes take minutes each per backend; CI runs
# the guides in their smoke modes (tests/test_guide_*.py) and these only
# when asked: KERAS_GEOSAM_SMALL_GUIDES=1 bash scripts/test.sh
SMALL_GUIDES = os.environ.get("KERAS_GEOSAM_SMALL_GUIDES", "") not in ("", "0")


def pytest_configure(config):
    config.addinivalue_line("markers", "small_guide: runs a guide in its small mode (KERAS_GEOSAM_SMALL_GUIDES=1)")


def pytest_collection_modifyitems(config, items):
    if SMALL_GUIDES:
        return
    skip = pytest.mark.skip(reason="a guide's small mode: set KERAS_GEOSAM_SMALL_GUIDES=1 to run it")
    for item in items:
        if item.get_closest_marker("small_guide"):
            item.add_marker(skip)


def pytest_report_header(config):
    return f"keras {keras.__version__}, backend {keras.backend.backend()}"


def pytest_runtest_logreport(report):
    # Measurements travel as user_properties, so they reach the summary
    # from pytest-xdist's worker processes too.
    if report.when == "call":
        _REPORT.extend(value for key, value in report.user_properties if key == "measurement")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _REPORT:
        terminalreporter.section(f"integration measurements (backend {keras.backend.backend()})")
        for line in _REPORT:
            terminalreporter.write_line(line)


@pytest.fixture
def report(request):
    """``report(text)``: prints now (visible with -s) and in the summary."""

    def add(text):
        line = f"[{keras.backend.backend()}] {request.node.name}: {text}"
        print(line)
        request.node.user_properties.append(("measurement", line))

    return add


@pytest.fixture(scope="session")
def digits():
    """``(x_train, y_train), (x_test, y_test), num_classes`` for digits."""
    from keras_geosam import datasets

    return datasets.load("digits", seed=0)


def build_mlp(input_dim, num_classes, width=128, seed=0):
    """Dense(width, relu) x2 -> num_classes logits, as a kg.Sequential."""
    import keras_geosam as kg

    keras.utils.set_random_seed(seed)
    return kg.Sequential(
        [
            keras.Input((input_dim,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(num_classes),
        ]
    )


@pytest.fixture
def mlp():
    return build_mlp
