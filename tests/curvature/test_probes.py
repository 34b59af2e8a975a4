"""Device probes (keras_geosam.curvature.probes) against an independent NumPy hash.

``reference.py`` implements the same counter-based hash with NumPy uint32
arithmetic. Equality is exact (bit for bit): the device version runs in
int32 with wrap-around on every backend, eagerly and compiled. Because
every backend is compared with the same NumPy reference, one seed gives
the same probes (and Monte-Carlo labels) on jax, tensorflow and torch.
"""

import numpy as np
import pytest
from keras import ops

from reference import curvature as ref
from keras_geosam import backend
from keras_geosam.curvature import probes

SHAPES = [(3, 4), (5,), (2, 2, 3)]


def np_list(ts):
    return [np.asarray(ops.convert_to_numpy(t)) for t in ts]


@pytest.mark.parametrize("seed", [0, 7, 2**40 + 3, -5])
@pytest.mark.parametrize("stream", ["hutchinson", "lanczos", "sketch"])
def test_rademacher_equals_the_numpy_hash(seed, stream):
    got = np_list(probes.rademacher(seed, 3, 6, SHAPES, "float32", stream))
    want = ref.hash_rademacher(seed, 3, 6, SHAPES, stream)
    for g, w in zip(got, want):
        assert g.dtype == np.float32
        np.testing.assert_array_equal(g, w)


def test_tensors_unpacked_in_several_runs_equal_the_numpy_hash(monkeypatch):
    # Runs of at most 13 entries: runs start and end inside a 32-bit word,
    # and a tensor larger than a run is a run of its own.
    shapes = [(2, 3), (7,), (40,), (1,), (3, 3), (2, 2, 2), (29,)]
    monkeypatch.setattr(probes, "_GROUP_ELEMENTS", 13)
    runs = probes._groups([int(np.prod(s)) for s in shapes])
    assert runs == [[0, 1], [2], [3, 4], [5], [6]]
    got = np_list(probes.rademacher(9, 2, 5, shapes, "float32", "sketch"))
    for g, w in zip(got, ref.hash_rademacher(9, 2, 5, shapes, "sketch")):
        np.testing.assert_array_equal(g, w)


def test_a_probe_does_not_depend_on_how_many_are_drawn_together():
    block = np_list(probes.rademacher(11, 0, 8, SHAPES, "float32"))
    for i in (0, 5, 7):
        one = np_list(probes.rademacher(11, i, 1, SHAPES, "float32"))
        for b, o in zip(block, one):
            np.testing.assert_array_equal(b[i], o[0])


def test_probes_in_float64_and_compiled():
    got = np_list(probes.rademacher(4, 0, 3, SHAPES, "float64"))
    assert all(g.dtype == np.float64 for g in got)
    compiled = backend.compile(lambda: probes.rademacher(4, 0, 3, SHAPES, "float64"))
    for a, b, w in zip(got, np_list(compiled()), ref.hash_rademacher(4, 0, 3, SHAPES)):
        np.testing.assert_array_equal(a, w)
        np.testing.assert_array_equal(b, w)


def test_uniform_equals_the_numpy_hash_and_is_in_unit_interval():
    rows, cols = np.arange(100, 164), np.arange(5)
    got = np.asarray(ops.convert_to_numpy(probes.uniform(9, rows, cols, "float32")))
    np.testing.assert_array_equal(got, ref.hash_uniform(9, rows, cols))
    assert got.min() >= 0.0 and got.max() < 1.0


def test_streams_and_seeds_differ_and_look_random():
    n = 200_000
    a = np_list(probes.rademacher(0, 0, 2, [(n,)], "float32"))[0]
    b = np_list(probes.rademacher(1, 0, 1, [(n,)], "float32"))[0]
    c = np_list(probes.rademacher(0, 0, 1, [(n,)], "float32", "lanczos"))[0]
    bound = 5 / np.sqrt(n)  # five standard deviations of a mean of n signs
    assert abs(a.mean()) < bound
    for x, y in ((a[0], a[1]), (a[0], b[0]), (a[0], c[0])):
        assert abs(np.mean(x * y)) < bound
    # neighbouring coordinates and the top bit's neighbours are not correlated
    assert abs(np.mean(a[0][1:] * a[0][:-1])) < bound
    u = np.asarray(ops.convert_to_numpy(probes.uniform(3, np.arange(n), np.arange(1))))[:, 0]
    assert abs(u.mean() - 0.5) < 5 * np.sqrt(1 / 12 / n)
    hist = np.histogram(u, bins=10, range=(0, 1))[0]
    assert np.all(np.abs(hist - n / 10) < 5 * np.sqrt(n / 10))


def test_sample_labels_are_the_hash_labels():
    from keras_geosam.curvature import sample_labels

    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(4), size=30)
    got = sample_labels(probs, 3, seed=5).reshape(3, 30)
    np.testing.assert_array_equal(got, ref.hash_labels(probs, 3, 5))
    # an offset continues the example numbering
    tail = sample_labels(probs[10:], 3, seed=5, offset=10).reshape(3, 20)
    np.testing.assert_array_equal(tail, got[:, 10:])
    # labels follow the probabilities
    many = sample_labels(np.tile([[0.1, 0.6, 0.3]], (20000, 1)), 1, seed=1)
    freq = np.bincount(many, minlength=3) / many.size
    np.testing.assert_allclose(freq, [0.1, 0.6, 0.3], atol=0.015)
    with pytest.raises(ValueError, match="num_samples"):
        sample_labels(probs, 0, seed=0)
