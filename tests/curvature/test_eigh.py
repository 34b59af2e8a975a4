"""Every eigendecomposition ends in a number or a clear error.

Solver failures are injected where they happen in the wild: the device's
solver raising (torch: "linalg.eigh: The algorithm failed to converge") or
returning NaN (JAX), and NumPy's LAPACK raising ``LinAlgError``. The
fallbacks must reproduce ``np.linalg.eigh`` (float64, 1e-10 relative on
the reconstruction; float32 blocks 1e-5), and when everything fails the
error names the variable and the block's condition number.
"""

import warnings

import keras
import numpy as np
import pytest
from keras import ops

import keras_geosam as kg
from keras_geosam import backend
from keras_geosam.curvature.operators import eigh as eigh_module
from keras_geosam.curvature.operators.eigh import EigenDecompositionError
from keras_geosam.curvature.operators.eigh import symmetric_eigh


def _spd(n, seed=0):
    a = np.random.default_rng(seed).normal(size=(n, n))
    return a @ a.T + 0.1 * np.eye(n)


def _reconstruct(w, v):
    w, v = (np.asarray(ops.convert_to_numpy(t), "float64") for t in (w, v))
    return (v * w) @ v.T


def _fail(*args, **kwargs):
    raise RuntimeError("linalg.eigh: The algorithm failed to converge because the input matrix is ill-conditioned")


_ORIGINAL = backend.eigh


@pytest.fixture
def float64():
    old = keras.config.floatx()
    keras.config.set_floatx("float64")
    yield
    keras.config.set_floatx(old)


def test_a_healthy_block_is_the_solver_s_answer():
    m = _spd(6)
    w, v = symmetric_eigh(ops.convert_to_tensor(m, "float32"))
    assert np.allclose(_reconstruct(w, v), m, rtol=1e-5, atol=1e-4)
    # Only the symmetric part counts.
    skew = np.triu(np.ones((6, 6)), 1)
    w2, _ = symmetric_eigh(ops.convert_to_tensor(m + skew - skew.T, "float32"))
    assert np.allclose(ops.convert_to_numpy(w2), ops.convert_to_numpy(w), rtol=1e-5)


@pytest.mark.parametrize("failure", ["raises", "nan"])
def test_a_failing_device_solver_falls_back(monkeypatch, failure, float64):
    m = _spd(7, 1)
    calls = []

    def flaky(x):
        calls.append(1)
        if failure == "raises":
            raise RuntimeError("linalg.eigh: The algorithm failed to converge")
        w, v = _ORIGINAL(x)
        # JAX's way of failing: NaN, on the first (unjittered) try only.
        return (w * float("nan"), v) if len(calls) == 1 else (w, v)

    monkeypatch.setattr(backend, "eigh", flaky)
    w, v = symmetric_eigh(ops.convert_to_tensor(m, "float64"))
    assert keras.backend.standardize_dtype(w.dtype) == "float64"
    assert np.abs(_reconstruct(w, v) - m).max() < 1e-10 * np.abs(m).max()
    ref_w = np.linalg.eigvalsh(m)
    assert np.allclose(np.asarray(ops.convert_to_numpy(w)), ref_w, rtol=1e-10, atol=1e-12)
    # "raises": the jittered device try fails too, then the host solves it.
    assert len(calls) == 2


def test_when_every_solver_fails_the_error_names_the_variable_and_condition(monkeypatch):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = rng.integers(0, 3, size=16)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    M = kg.sharpness.fisher_metric(model, x, structure="kfac")
    monkeypatch.setattr(backend, "eigh", _fail)

    def lapack(*args, **kwargs):
        raise np.linalg.LinAlgError("Eigenvalues did not converge")

    monkeypatch.setattr(eigh_module.np.linalg, "eigh", lapack)
    with pytest.raises(EigenDecompositionError, match=r"dense(_\d+)?/kernel.*K-FAC .* factor \(\d+ x \d+\).*condition number"):
        M.inverse(1e-3, relative=True)
    assert issubclass(EigenDecompositionError, ValueError)


def test_a_non_finite_block_is_named_not_decomposed(monkeypatch):
    m = _spd(4)
    m[1, 2] = m[2, 1] = np.nan
    monkeypatch.setattr(backend, "eigh", lambda x: (_ for _ in ()).throw(RuntimeError("LAPACK")))
    with pytest.raises(EigenDecompositionError, match="2 NaN or Inf entries"):
        symmetric_eigh(ops.convert_to_tensor(m, "float32"), "the test block")


def test_riemannian_sharpness_is_unchanged_when_the_device_solver_fails(monkeypatch):
    """The whole user path (K-FAC metric, its inverse square root, S_R)
    gives the same number through the host fallback."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(24, 4)).astype("float32")
    y = rng.integers(0, 3, size=24)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(3)])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    kw = dict(structure="kfac", num_probes=4, rtol=None, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        healthy = kg.sharpness.riemannian_sharpness(model, x, y, **kw)
        monkeypatch.setattr(backend, "eigh", _fail)
        fallback = kg.sharpness.riemannian_sharpness(model, x, y, **kw)
    assert fallback.value == pytest.approx(healthy.value, rel=1e-4)


def test_inside_a_compiled_function_the_device_solver_runs():
    m = _spd(5, 3).astype("float32")
    w, v = backend.compile(lambda a: symmetric_eigh(a))(ops.convert_to_tensor(m))
    assert np.allclose(_reconstruct(w, v), m, rtol=1e-4, atol=1e-4)


def test_a_numpy_block_is_solved_on_the_host_in_float64(monkeypatch):
    monkeypatch.setattr(backend, "eigh", _fail)  # never reached
    m = _spd(5, 4)
    w, v = symmetric_eigh(m)
    assert isinstance(w, np.ndarray) and w.dtype == np.float64
    assert np.abs((v * w) @ v.T - m).max() < 1e-12 * np.abs(m).max()


def test_a_rounding_level_kfac_block_inverts_to_zero_not_nan():
    """float32 K-FAC factors of ~1e-13 and ~1e-29 (MobileNetV3's
    squeeze-excite convolutions): their eigenvalue products underflow to
    denormals, whose inverse overflowed to Inf, and the block mask turned
    Inf * 0 into NaN. The tiny block must come out zero and the normal one
    equal the explicit damped inverse of ``kron(A, B)``."""
    tiny = kg.curvature.KFAC(ops.convert_to_tensor(1e-13 * _spd(4, 5), "float32"),
                             ops.convert_to_tensor(1e-29 * _spd(3, 6), "float32"), (4, 3))
    A, B = _spd(2, 7), _spd(3, 8)
    normal = kg.curvature.KFAC(ops.convert_to_tensor(A, "float32"), ops.convert_to_tensor(B, "float32"), (2, 3))
    M = kg.curvature.BlockDiagonal([tiny, normal])
    for inverse in (M.inverse(1e-3, relative=True), M.inverse_sqrt(1e-3, relative=True)):
        out = [np.asarray(ops.convert_to_numpy(t), "float64") for t in inverse.matvec([np.ones((4, 3), "float32"),
                                                                                          np.ones((2, 3), "float32")])]
        assert np.all(np.isfinite(out[0])) and np.all(out[0] == 0)
        assert np.all(np.isfinite(out[1]))
    kron = np.kron(A, B)
    lam = 1e-3 * np.linalg.eigvalsh(kron).mean()
    expected = np.linalg.solve(kron + lam * np.eye(6), np.ones(6))
    got = np.asarray(ops.convert_to_numpy(M.inverse(1e-3, relative=True).matvec(
        [np.ones((4, 3), "float32"), np.ones((2, 3), "float32")])[1]), "float64").ravel()
    assert np.abs(got - expected).max() < 1e-4 * np.abs(expected).max()


@pytest.mark.parametrize("failure", ["raises", "nan"])
def test_many_blocks_are_solved_in_one_call_and_a_failing_one_alone(monkeypatch, failure, float64, solver_calls):
    """``symmetric_eighs`` tries every block in one call; the 4 x 4 block's
    device solves all fail, so it alone ends on the host, and the others
    are their own solver's answer (also when a raise stopped the call)."""
    blocks = [_spd(3, 5), _spd(4, 6), _spd(3, 7)]
    solo = [_ORIGINAL(ops.convert_to_tensor(m, "float64")) for m in blocks]

    def flaky(x):
        if int(x.shape[-1]) == 4:
            if failure == "raises":
                raise RuntimeError("linalg.eigh: The algorithm failed to converge")
            w, v = _ORIGINAL(x)
            return w * float("nan"), v
        return _ORIGINAL(x)

    calls = solver_calls
    monkeypatch.setattr(backend, "eigh", flaky)
    found = eigh_module.symmetric_eighs([ops.convert_to_tensor(m, "float64") for m in blocks], ["a", "b", "c"])
    assert calls[0] == 3  # all three in the first call
    # After a raise, each block has its own try: the healthy ones succeed.
    assert calls[1:] == ([] if failure == "nan" else [1, 1, 1])
    for m, (w, v), (w0, _) in zip(blocks, found, solo):
        assert np.abs(_reconstruct(w, v) - m).max() < 1e-10 * np.abs(m).max()
        assert np.allclose(ops.convert_to_numpy(w), np.linalg.eigvalsh(m), rtol=1e-10, atol=1e-12)
    for i in (0, 2):  # TensorFlow's eager solver is NumPy's, its traced one its own
        np.testing.assert_allclose(ops.convert_to_numpy(found[i][0]), ops.convert_to_numpy(solo[i][0]), rtol=1e-12)
