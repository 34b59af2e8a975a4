"""Compiled kernels, each built once: the one cache behind the model's
per-batch functions, the layer captures, probes and the estimators."""

import functools

from keras_geosam import backend


class KernelCache:
    """``backend.compile`` of pure functions, built once per function (a
    bound method counts as its object and method), static keyword options
    and an optional extra key (e.g. input shapes)."""

    def __init__(self):
        self._compiled = {}

    def get(self, body, key=(), **static):
        """`body` compiled with its `static` keyword arguments bound."""
        cache_key = (body, key) + tuple(sorted(static.items()))  # not the name: two lambdas share one
        if cache_key not in self._compiled:
            self._compiled[cache_key] = backend.compile(functools.partial(body, **static) if static else body)
        return self._compiled[cache_key]
