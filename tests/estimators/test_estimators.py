"""Trace and eigenvalue estimators on explicit operators.

Every estimator takes any LinearOperator; here the operators are explicit
float64 matrices (``curvature.Dense``) over a list of two tensors, so the
exact answers are ``np.trace`` and ``np.linalg.eigh``. Hutchinson is checked
probe by probe against ``z^T A z`` with the reference hash probes
(``reference.py``); Hutch++ is exact on operators of rank below its sketch;
Lanczos matches eigh to its stated tolerance, with and without the stored
basis. Tolerances: 1e-10 for float64 arithmetic identities, 3 standard errors
for statistical checks.
"""

import math
import warnings

import numpy as np
import pytest
from keras import ops

from reference import curvature as ref
from keras_geosam.curvature import Dense
from keras_geosam.curvature import Diagonal
from keras_geosam.estimators import Estimate
from keras_geosam.estimators import deflated_hutchinson
from keras_geosam.estimators import hutchinson
from keras_geosam.estimators import hutchpp
from keras_geosam.estimators import lanczos

SHAPES = [(3, 4), (6,)]
DIM = 18
EXACT = 1e-10


def dense(matrix):
    return Dense(ops.convert_to_tensor(np.asarray(matrix, np.float64), "float64"), SHAPES)


def random_symmetric(seed, spectrum=None):
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.normal(size=(DIM, DIM)))
    w = rng.normal(size=DIM) if spectrum is None else np.asarray(spectrum, float)
    return (q * w) @ q.T


def test_hutchinson_probe_by_probe():
    A = random_symmetric(0)
    est = hutchinson(dense(A), num_probes=12, seed=3, paths=["a", "b"])
    zs = ref.hash_probes(3, SHAPES, 12)
    want = np.array([ref.flatten(z) @ A @ ref.flatten(z) for z in zs])
    np.testing.assert_allclose(est.samples, want, rtol=EXACT, atol=EXACT)
    assert est.value == pytest.approx(want.mean(), rel=EXACT)
    assert est.stderr == pytest.approx(want.std(ddof=1) / math.sqrt(12), rel=EXACT)
    assert est.num_samples == 12
    # per tensor: the diagonal blocks' shares
    a = np.mean([ref.flatten(z)[:12] @ (A @ ref.flatten(z))[:12] for z in zs])
    assert est.per_layer["a"] == pytest.approx(a, rel=EXACT)
    assert est.per_layer["a"] + est.per_layer["b"] == pytest.approx(est.value, rel=EXACT)
    # another seed, other probes; the shift only moves the value
    assert not np.allclose(hutchinson(dense(A), num_probes=12, seed=4).samples, est.samples)
    shifted = hutchinson(dense(A), num_probes=12, seed=3, shift=10.0)
    assert shifted.value == pytest.approx(est.value + 10.0, rel=EXACT)
    assert shifted.stderr == pytest.approx(est.stderr, rel=EXACT)


def test_hutchinson_is_unbiased_within_its_stderr():
    A = random_symmetric(1)
    est = hutchinson(dense(A), num_probes=400, seed=0)
    assert abs(est.value - np.trace(A)) <= 3 * est.stderr
    assert est.stderr < 0.5 * np.abs(np.linalg.eigvalsh(A)).sum()  # not vacuous


def test_hutchinson_rtol_stops_early_or_warns():
    # Rademacher probes give a diagonal operator's trace exactly: one round.
    d = Diagonal([ops.convert_to_tensor(np.arange(1.0, 13.0).reshape(3, 4)), ops.convert_to_tensor(np.ones(6))])
    est = hutchinson(d, num_probes=4, rtol=1e-3, max_probes=100)
    assert est.num_samples == 4 and est.stderr == 0.0
    assert est.value == pytest.approx(78.0 + 6.0, rel=EXACT)
    # A noisy operator, a loose tolerance: stops at the first round that meets it.
    A = random_symmetric(2, spectrum=np.linspace(1.0, 2.0, DIM))
    est = hutchinson(dense(A), num_probes=5, rtol=0.2, max_probes=100)
    assert est.num_samples < 100 and est.stderr <= 0.2 * abs(est.value)
    # An unreachable one, the futility stop off: max_probes, with a warning.
    B = random_symmetric(3)
    with pytest.warns(RuntimeWarning, match="max_probes"):
        est = hutchinson(dense(B), num_probes=5, rtol=1e-6, max_probes=23, min_probes=23)
    assert est.num_samples == 23 and "futility" not in est.info
    with pytest.raises(ValueError, match="rtol"):
        hutchinson(dense(B), rtol=0.0)
    with pytest.raises(ValueError, match="num_probes"):
        hutchinson(dense(B), num_probes=0)


def test_hutchinson_stops_when_rtol_is_out_of_reach():
    """z^T A z for A = [[t, a], [a, t]] and Rademacher z is 2t + 2a z1 z2:
    the trace 2t plus +-2a, a per-probe standard deviation of 2a (known
    variance). Reaching rtol = 0.05 on trace 2 takes (2a / 0.1)^2 probes:
    400 for a = 1, above max_probes = 200, so it stops at the first round
    past min_probes; for a = 0.1 (4 probes) rtol is met."""
    wide = Dense(np.array([[1.0, 1.0], [1.0, 1.0]]), [(2,)])
    with pytest.warns(RuntimeWarning, match="futility") as caught:
        est = hutchinson(wide, num_probes=5, rtol=0.05, max_probes=200, seed=1)
    assert est.num_samples == 10  # rounds of 5: the first check past min_probes=10
    assert est.info["futility"]["probes"] == 10
    projected = est.info["futility"]["projected"]
    # The projection is n (stderr / (rtol |mean|))^2 from the drawn probes,
    # near the exact 400 (a sample standard deviation of +-2 values).
    s = est.samples
    assert projected == pytest.approx(10 * (s.std(ddof=1) / math.sqrt(10) / (0.05 * abs(s.mean()))) ** 2, rel=1e-9)
    assert 200 < projected < 1000
    said = [str(w.message) for w in caught if "futility" in str(w.message)]
    assert len(said) == 1 and f"about {projected:.3g} probes" in said[0]
    # min_probes >= max_probes: today's behaviour, probe for probe.
    with pytest.warns(RuntimeWarning, match="max_probes"):
        full = hutchinson(wide, num_probes=5, rtol=0.05, max_probes=200, seed=1, min_probes=200)
    assert full.num_samples == 200 and "futility" not in full.info
    np.testing.assert_array_equal(full.samples[:10], est.samples)
    # Within reach: no stop, rtol met.
    narrow = Dense(np.array([[1.0, 0.1], [0.1, 1.0]]), [(2,)])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        est = hutchinson(narrow, num_probes=5, rtol=0.05, max_probes=200, seed=1)
    assert "futility" not in est.info and est.stderr <= 0.05 * abs(est.value)
    with pytest.raises(ValueError, match="min_probes"):
        hutchinson(wide, min_probes=0)


def test_hutchpp_is_exact_on_low_rank_operators():
    spectrum = np.zeros(DIM)
    spectrum[:3] = [50.0, -20.0, 7.0]
    A = random_symmetric(4, spectrum)
    est = hutchpp(dense(A), num_matvecs=12, seed=1)  # sketch of rank 4 > 3
    assert est.value == pytest.approx(np.trace(A), rel=1e-9, abs=1e-9)
    assert est.stderr < 1e-9
    assert est.info["num_matvecs"] == 12


def test_hutchpp_beats_hutchinson_on_a_decaying_spectrum():
    A = random_symmetric(5, 100.0 * 0.5 ** np.arange(DIM))
    errs_pp, errs_h = [], []
    for seed in range(10):
        errs_pp.append(abs(hutchpp(dense(A), num_matvecs=12, seed=seed).value - np.trace(A)))
        errs_h.append(abs(hutchinson(dense(A), num_probes=12, seed=seed).value - np.trace(A)))
    assert np.mean(errs_pp) < 0.35 * np.mean(errs_h)
    with pytest.raises(ValueError, match="num_matvecs"):
        hutchpp(dense(A), num_matvecs=3)


def test_deflated_hutchinson_is_unbiased_with_an_honest_stderr_where_two_directions_dominate():
    """Eigenvalues 100 and -80 plus 16 of size ~1: a probe's standard
    deviation is ~180, so Hutchinson's first round (4 probes) misses rtol and
    the deflated estimator sketches 4 directions, takes their trace exactly
    and probes the rest (sd ~6) within 60 products. Over 30 seeds: the mean
    is within 3.5 standard errors of the trace, the z-scores spread like a
    standard normal (sd in [0.5, 1.6]), and the stderr is under a fifth of
    Hutchinson's at the same 60 products."""
    rng = np.random.default_rng(7)
    A = random_symmetric(6, np.r_[100.0, -80.0, rng.normal(size=DIM - 2)])
    truth = np.trace(A)
    values, z, se, plain = [], [], [], []
    for seed in range(30):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # an unmet rtol is reported, not the point here
            est = deflated_hutchinson(dense(A), num_probes=4, rtol=0.02, max_probes=60, seed=seed)
            plain.append(hutchinson(dense(A), num_probes=60, seed=seed).stderr)
        d = est.info["deflation"]
        assert d["rank"] == 4 and d["products"] <= 60 and est.info["estimator"].startswith("deflated")
        assert est.value == pytest.approx(d["exact_on_subspace"] + d["rest"], rel=1e-12)
        assert sum(est.per_layer.values()) == pytest.approx(est.value, rel=1e-9)
        values.append(est.value)
        se.append(est.stderr)
        z.append((est.value - truth) / est.stderr)
    assert abs(np.mean(values) - truth) <= 3.5 * np.std(values, ddof=1) / math.sqrt(len(values))
    assert 0.5 <= np.std(z, ddof=1) <= 1.6, z
    assert np.mean(se) <= 0.2 * np.mean(plain)


def test_deflated_hutchinson_is_hutchinson_until_a_round_misses_rtol():
    """No rtol, a first round that meets it, or no budget for a sketch:
    Hutchinson's own estimate, probe for probe, with the reason recorded."""
    A = random_symmetric(3)
    for kwargs in (dict(rtol=None), dict(rtol=0.05, max_probes=10)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # an unmet rtol, the same from both
            est = deflated_hutchinson(dense(A), num_probes=4, seed=2, **kwargs)
            ref_est = hutchinson(dense(A), num_probes=4, seed=2, **kwargs)
        np.testing.assert_array_equal(est.samples, ref_est.samples)
        assert est.info["deflation"].startswith("not asked" if kwargs["rtol"] is None else "no budget")
    exact = Diagonal([np.arange(12.0).reshape(3, 4), np.ones(6)])  # every probe gives the trace
    est = deflated_hutchinson(exact, num_probes=4, rtol=0.05, seed=2)
    assert est.value == pytest.approx(72.0) and est.info["deflation"].startswith("not needed")
    with pytest.raises(ValueError, match="rank"):
        deflated_hutchinson(dense(A), rank=0)


@pytest.mark.parametrize("max_memory", [1 << 30, 1])
def test_lanczos_top_eigenvalue(max_memory):
    A = random_symmetric(6, np.concatenate([[9.0, 8.5], np.linspace(-3.0, 3.0, DIM - 2)]))
    w, v = np.linalg.eigh(A)
    est = lanczos(dense(A), max_iter=DIM, tol=1e-8, seed=0, max_memory=max_memory)
    assert est.value == pytest.approx(w[-1], rel=1e-6)
    assert est.info["converged"]
    assert est.info["reorthogonalized"] == (max_memory > 1)
    if max_memory > 1:
        vec = ref.flatten(est.info["eigenvector"])
        assert abs(vec @ v[:, -1]) / np.linalg.norm(vec) > 1 - 1e-6
        assert est.info["basis_bytes"] <= DIM * DIM * 8
    else:
        assert est.info["eigenvector"] is None
        assert est.info["basis_bytes"] == 3 * DIM * 8
    with pytest.raises(ValueError, match="max_iter"):
        lanczos(dense(A), max_iter=0)
    with pytest.raises(ValueError, match="tol"):
        lanczos(dense(A), tol=0.0)


def test_lanczos_stops_on_the_ritz_residual():
    A = random_symmetric(7, np.concatenate([[100.0], np.linspace(0.0, 1.0, DIM - 1)]))
    est = lanczos(dense(A), max_iter=DIM, tol=1e-3)
    assert est.num_samples < DIM
    assert est.stderr <= 1e-3 * abs(est.value)
    assert abs(est.value - 100.0) <= est.stderr + 1e-9


def test_estimate_format_and_noise_flag():
    e = Estimate(value=0.5, stderr=0.4, num_samples=10)
    assert e.within_noise and "(~0)" in e.format() and "within 2 stderr of zero" in repr(e)
    f = Estimate(value=12.0, stderr=0.5, num_samples=10)
    assert not f.within_noise and f.format(3) == "12 ± 0.5" and float(f) == 12.0
    assert f.relative_stderr == pytest.approx(0.5 / 12.0)
    exact = Estimate(value=3.0, stderr=0.0, num_samples=0)
    assert "(~0)" not in exact.format()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        repr(exact)


def test_a_form_under_a_symmetric_per_tensor_metric_takes_one_product_with_it():
    """``hutchinson(S @ A @ S)`` with S a symmetric operator acting on each
    tensor alone (orthogonal Kronecker eigenbases on the matrix, a diagonal
    on the vector: a metric's inverse square root) multiplies by S once per
    probe, ``(S z)^T A (S z)``, with the same samples and per-tensor shares
    as ``z^T (S A S z)`` from explicit matrices; a non-symmetric S (K-FAC
    factors as LLQR learns them) keeps both products."""
    from keras_geosam.curvature import EKFAC, KFAC, BlockDiagonal

    rng = np.random.default_rng(5)
    qa, _ = np.linalg.qr(rng.normal(size=(3, 3)))
    qg, _ = np.linalg.qr(rng.normal(size=(4, 4)))
    s = rng.random((3, 4)) + 0.5
    d = rng.random(6) + 0.5
    S = BlockDiagonal([EKFAC(qa, qg, s, (3, 4), orthogonal=True), Diagonal([d])])
    S_dense = np.zeros((DIM, DIM))
    S_dense[:12, :12] = np.kron(qa, qg) @ np.diag(s.ravel()) @ np.kron(qa, qg).T
    S_dense[12:, 12:] = np.diag(d)
    A = random_symmetric(6)
    calls = []
    matmat = S.matmat
    S.matmat = lambda v: (calls.append(1), matmat(v))[1]
    est = hutchinson(S @ dense(A) @ S, num_probes=7, seed=2, paths=["a", "b"])
    assert len(calls) == 1  # one block of 7 probes, one product with S
    M = S_dense @ A @ S_dense
    zs = [ref.flatten(z) for z in ref.hash_probes(2, SHAPES, 7)]
    np.testing.assert_allclose(est.samples, [z @ M @ z for z in zs], rtol=1e-10, atol=1e-10)
    share = np.mean([z[:12] @ (M @ z)[:12] for z in zs])
    assert est.per_layer["a"] == pytest.approx(share, rel=1e-10)
    K = BlockDiagonal([KFAC(rng.normal(size=(3, 3)), rng.normal(size=(4, 4)), (3, 4)), Diagonal([d])])
    assert not K.symmetric_per_tensor and S.symmetric_per_tensor
    calls.clear()
    K_matmat = K.matmat
    K.matmat = lambda v: (calls.append(1), K_matmat(v))[1]
    hutchinson(K @ dense(A) @ K, num_probes=7, seed=2)
    assert len(calls) == 2
