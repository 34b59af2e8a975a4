"""keras_geosam.datasets: offline datasets load; downloadable ones fail clearly.

Nothing here downloads: the network is switched off for the process-wide
socket module while a cache miss is tried, so the test is the same online and
offline and cannot hang on a retry.
"""

import os
import socket
import time

import numpy as np
import pytest

from keras_geosam import datasets


def _keras_cache_file(fname):
    """Where keras.datasets looks for `fname` (keras fixes KERAS_HOME at import)."""
    try:
        from keras.src.backend.config import keras_home

        home = keras_home()
    except ImportError:  # pragma: no cover - private path moved
        home = os.environ.get("KERAS_HOME", os.path.join(os.path.expanduser("~"), ".keras"))
    return os.path.join(os.path.expanduser(home), "datasets", fname)


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("network disabled by the integration test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


@pytest.mark.parametrize("name,shape", [("digits", (64,)), ("mnist1d", (40,))])
def test_offline_datasets(name, shape):
    (x_tr, y_tr), (x_te, y_te), classes = datasets.load(name)
    assert classes == 10
    assert x_tr.shape[1:] == shape and x_te.shape[1:] == shape
    assert x_tr.dtype == np.float32 and y_tr.dtype == np.int32
    assert len(x_tr) == len(y_tr) and len(x_te) == len(y_te)
    assert set(np.unique(y_tr)) == set(range(10))
    # Deterministic by seed.
    (x2, _), _, _ = datasets.load(name)
    np.testing.assert_array_equal(x_tr, x2)


def test_mnist_cached_or_clear_error(no_network, report):
    path = _keras_cache_file("mnist.npz")
    t0 = time.perf_counter()
    if os.path.exists(path):
        (x_tr, y_tr), (x_te, y_te), classes = datasets.load("mnist")
        report(f"cached at {path}: loaded in {time.perf_counter() - t0:.1f}s")
        assert x_tr.shape == (60000, 28, 28, 1) and x_te.shape == (10000, 28, 28, 1)
        assert x_tr.dtype == np.float32 and 0.0 <= x_tr.min() and x_tr.max() <= 1.0
        assert y_tr.dtype == np.int32 and classes == 10
        return
    with pytest.raises(RuntimeError, match="not cached") as info:
        datasets.load("mnist")
    seconds = time.perf_counter() - t0
    message = str(info.value)
    report(f"not cached ({path}); RuntimeError after {seconds:.2f}s: {message}")
    assert seconds < 10
    assert "mnist" in message and "digits" in message and "mnist1d" in message
    assert not os.path.exists(path), "a failed download left a file in the cache"


def test_unknown_dataset():
    with pytest.raises(ValueError, match="digits"):
        datasets.load("no-such-dataset")
