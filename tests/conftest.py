"""Shared fixtures. The suite runs once per backend, each in its own process:

    KERAS_BACKEND=jax|tensorflow|torch python -m pytest tests
"""

import gc
import os

# Must precede any jax import (Keras' JAX backend and the test reference both
# use jax); without it float64 silently becomes float32 under JAX.
os.environ["JAX_ENABLE_X64"] = "1"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# XLA:CPU compiling at LLVM -O0: the suite's small programs spend most of
# their time compiling (a quarter less CPU on JAX's dense-matrix tests);
# IEEE semantics are the same at every level. Benchmarks do not set it.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cross_backend: spawns the other Keras backends in subprocesses"
    )


def pytest_report_header(config):
    return f"keras {keras.__version__}, backend {keras.backend.backend()}"


@pytest.fixture
def float64():
    """Keras layers created inside the test hold float64 weights.

    The global dtype policy is fixed when the first layer is created, so it
    is set alongside floatx."""
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        yield "float64"
    finally:
        keras.config.set_floatx("float32")
        keras.config.set_dtype_policy("float32")


@pytest.fixture(autouse=True, scope="module")
def release_compiled_code():
    """Frees every compiled function after each test module.

    Each executable XLA compiles on CPU holds a few memory mappings until
    its function is freed, and a process may hold at most
    ``vm.max_map_count`` (65530 by default). A JAX xdist worker that ran most
    of the suite reached 58k mappings, and XLA then aborted inside a compile
    (the mmap it needed failed). Dropping JAX's caches between modules keeps
    a worker far below the limit. JAX only: on TensorFlow a clear_session
    and collection after a module took up to 140 s, and its graphs and torch's
    compiled code go with the models that hold them."""
    yield
    if keras.backend.backend() == "jax":
        import jax

        jax.clear_caches()
        gc.collect()


@pytest.fixture(autouse=True)
def seeds():
    """Seeds Python, NumPy and the backend RNG before every test."""
    keras.utils.set_random_seed(1234)
    yield 1234


@pytest.fixture
def rng():
    return np.random.default_rng(20240607)


@pytest.fixture(params=["branch", "branch_free"])
def step_branching(request, monkeypatch):
    """The two ways a torch step can skip a non-finite update: a host-side
    branch (CPU) or both branches and a select (accelerators, no sync).
    Other backends have one way; their "branch_free" case is skipped."""
    if request.param == "branch_free":
        if keras.backend.backend() != "torch":
            pytest.skip("a torch-only variant of the step")
        from keras_geosam.backend import torch as torch_backend

        monkeypatch.setattr(torch_backend, "BRANCH_FREE", True)
    return request.param


@pytest.fixture
def solver_calls(monkeypatch):
    """The factors in each call of the eigensolver's first-try kernel (a
    list, one entry per call), counted while the test runs."""
    from keras_geosam.curvature.operators import eigh

    calls = []
    kernel = eigh._device_solve_kernel

    def counted(matrices, **kwargs):
        calls.append(len(matrices))
        return kernel(matrices, **kwargs)

    monkeypatch.setattr(eigh, "_device_solve_kernel", counted)
    return calls
