"""K-FAC input factors built from fewer rows than they are wide (``A = R^T
R``, r < m): the eigendecomposition from the r x r Gram matrix, against the
direct one and against explicit Kronecker matrices in float64."""

import keras
import numpy as np
import pytest

from keras_geosam import curvature as kc
from keras_geosam import sharpness as ks

from reference import curvature as ref


def _rows(rng, r=5, m=9, dup=True):
    R = rng.normal(size=(r, m))
    if dup:
        R[-1] = R[0]  # rank r - 1: a zero eigenvalue of the Gram matrix too
    return R


def _explicit(A, B, damping, power, rcond=None):
    """(A kron B + lambda I)^-power with lambda relative to the mean
    eigenvalue, eigenvalues at or below rcond * max dropped."""
    w, Q = np.linalg.eigh(np.kron(A, B))
    lam = damping * w.mean()
    shifted = w + lam
    rcond = max(A.shape[0], B.shape[0]) * np.finfo("float64").eps if rcond is None else rcond
    keep = shifted > rcond * shifted.max()
    f = np.where(keep, np.where(keep, shifted, 1.0) ** -power, 0.0)
    return (Q * f) @ Q.T


@pytest.mark.parametrize("damping", [1e-3, 0.0])
@pytest.mark.parametrize("power", [1, 0.5])
def test_gram_inverse_equals_the_direct_one_and_the_explicit_matrix(float64, rng, damping, power):
    R = _rows(rng)
    Bf = rng.normal(size=(4, 4))
    B = Bf @ Bf.T + 0.1 * np.eye(4)
    shape = (9, 4)
    gram = kc.KFAC.from_rows(R, B, shape)
    direct = kc.KFAC(R.T @ R, B, shape)
    assert gram.gram and not direct.gram
    name = "inverse" if power == 1 else "inverse_sqrt"
    g = getattr(gram, name)(damping, relative=True)
    d = getattr(direct, name)(damping, relative=True)
    assert g.null is not None and tuple(g.QA.shape) == (9, 5)
    want = _explicit(R.T @ R, B, damping, power)
    assert ref.rel_err(g.to_dense(), want) <= 1e-9
    assert ref.rel_err(d.to_dense(), want) <= 1e-9
    assert ref.rel_err(ref.flatten(g.diagonal()), np.diag(want)) <= 1e-9
    assert float(g.trace()) == pytest.approx(np.trace(want), rel=1e-9)
    # the operator itself and its top eigenvalue
    assert ref.rel_err(gram.to_dense(), np.kron(R.T @ R, B)) <= 1e-12
    assert float(gram.top_eigenvalue()) == pytest.approx(np.linalg.eigvalsh(np.kron(R.T @ R, B)).max(), rel=1e-9)
    assert float(g.top_eigenvalue()) == pytest.approx(np.linalg.eigvalsh(want).max(), rel=1e-9)


def test_the_gram_eigenvectors_span_the_factor_and_are_orthonormal(float64, rng):
    R = _rows(rng)
    la, qa, _, _ = kc.KFAC.from_rows(R, np.eye(2), (9, 2)).eigh()
    la, qa = ref.to_numpy(la), ref.to_numpy(qa)
    A = R.T @ R
    used = np.linalg.norm(qa, axis=0) > 0
    assert used.sum() == np.linalg.matrix_rank(A) == 4
    np.testing.assert_allclose(qa[:, used].T @ qa[:, used], np.eye(4), atol=1e-10)
    np.testing.assert_allclose((qa * la) @ qa.T, A, atol=1e-10)
    np.testing.assert_allclose(np.sort(la[used]), np.sort(np.linalg.eigvalsh(A))[-4:], rtol=1e-10)


def test_a_wide_dense_layer_gets_a_gram_block_with_the_same_sharpness(float64, rng):
    """24 examples into a 60-wide layer: K-FAC keeps the rows, and the exact
    part of S_R, the metric's inverse and the excluded-parameter counts are
    those of the direct eigendecomposition."""
    model = keras.Sequential([keras.Input((60,)), keras.layers.Dense(40, activation="tanh"), keras.layers.Dense(5)])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    for v in model.trainable_variables:
        v.assign(0.3 * rng.normal(size=v.shape))
    x = rng.normal(size=(24, 60))
    x[:, :5] = 0.0  # inputs that never vary: an exact null space
    y = rng.integers(0, 5, 24)
    G = kc.GGN(model, x)
    K = G.kfac()
    assert [getattr(b, "gram", False) for b in K.blocks] == [True, False, True, False]
    direct = kc.BlockDiagonal([kc.KFAC(b.A, b.B, b.shapes[0]) if isinstance(b, kc.KFAC) else b for b in K.blocks])
    for damping in (1e-3, 0.0):
        a, b = K.inverse(damping, relative=True), direct.inverse(damping, relative=True)
        assert ref.rel_err(a.to_dense(), b.to_dense()) <= 1e-8
        assert G.trace_with(a)[0] == pytest.approx(G.trace_with(b)[0], rel=1e-8)
    est = ks.riemannian_sharpness(model, x, y, structure="kfac", damping=0.0, num_probes=2, rtol=None)
    Minv = direct.inverse(0.0, relative=True).to_dense()
    assert est.info["num_excluded"] == int(np.sum(np.abs(np.linalg.eigvalsh(Minv)) < 1e-300 + 1e-12 * np.abs(Minv).max()))
    assert est.info["exact_part"] == pytest.approx(G.trace_with(direct.inverse(0.0, relative=True))[0], rel=1e-8)
