"""The optimizers the commands train with, by name.

A name is a base (``sgd``: SGD with momentum 0.9; ``adam``; ``adamw``) or a
two-pass method (``sam``, ``asam``, ``fsam``, ``fishersam``, ``llqr``,
``llqr-kfac``, ``llqrsam``, ``llqrsam-kfac``) on the SGD base, or on
another base written after ``@``: ``sam@adamw``, ``llqrsam-kfac@adam``.
Every entry is a factory ``f(learning_rate)`` that returns a fresh
optimizer: the learning rate is the base's.
"""

import collections.abc


def _sgd(lr):
    import keras

    return keras.optimizers.SGD(lr, momentum=0.9)


def _adam(lr):
    import keras

    return keras.optimizers.Adam(lr)


def _adamw(lr):
    import keras

    return keras.optimizers.AdamW(lr)


BASES = {"sgd": _sgd, "adam": _adam, "adamw": _adamw}

# Two-pass methods: (class in keras_geosam.optimizers, its arguments), with
# the spec's suggested radius for small image classifiers. LLQR refreshes
# every 100 steps here (the reference's 1000 would mean one refresh every
# ~24 digits epochs).
TWO_PASS = {
    "sam": ("SAM", dict(rho=0.05)),
    "asam": ("SAM", dict(rho=0.5, adaptive=True)),
    "fsam": ("FSAM", dict(rho=0.05)),
    "fishersam": ("FisherSAM", dict(rho=0.05)),
    "llqr": ("LLQR", dict(refresh_every=100)),
    "llqr-kfac": ("LLQR", dict(structure="kfac", refresh_every=100)),
    "llqrsam": ("LLQRSAM", dict(rho=0.1, refresh_every=100)),
    "llqrsam-kfac": ("LLQRSAM", dict(rho=0.1, structure="kfac", refresh_every=100)),
}
SEPARATOR = "@"


def _two_pass(name, base):
    cls, kwargs = TWO_PASS[name]

    def make(lr):
        from keras_geosam import optimizers

        return getattr(optimizers, cls)(BASES[base](lr), **kwargs)

    make.__name__ = f"{name}{SEPARATOR}{base}"
    return make


def parse(name):
    """``(method, base)`` of an optimizer name: ``"sam@adam"`` gives
    ``("sam", "adam")``, ``"sam"`` gives ``("sam", "sgd")`` and ``"adamw"``
    gives ``(None, "adamw")``.

    Raises:
        KeyError: an unknown method or base, with the known names.

    Example:

    >>> parse("llqrsam-kfac@adamw"), parse("sgd")
    (('llqrsam-kfac', 'adamw'), (None, 'sgd'))
    """
    method, sep, base = str(name).partition(SEPARATOR)
    if not sep and method in BASES:
        return None, method
    base = base if sep else "sgd"
    if method not in TWO_PASS or base not in BASES:
        raise KeyError(
            f"unknown optimizer {name!r}: choose a base ({', '.join(BASES)}) or a two-pass method "
            f"({', '.join(TWO_PASS)}), optionally on a base as METHOD{SEPARATOR}BASE (e.g. sam{SEPARATOR}adamw)."
        )
    return method, base


class _Registry(collections.abc.Mapping):
    """Maps every optimizer name, ``METHOD@BASE`` included, to its factory;
    iterating lists the plain names (bases and methods on SGD)."""

    def __getitem__(self, name):
        method, base = parse(name)
        return BASES[base] if method is None else _two_pass(method, base)

    def __contains__(self, name):
        try:
            parse(name)
        except KeyError:
            return False
        return True

    def __iter__(self):
        return iter((*BASES, *TWO_PASS))

    def __len__(self):
        return len(BASES) + len(TWO_PASS)

    def __repr__(self):
        return f"OPTIMIZERS({', '.join(self)}; METHOD{SEPARATOR}BASE for another base)"


OPTIMIZERS = _Registry()


def names_help():
    """One line listing the names, for ``--help``."""
    return (f"bases {', '.join(BASES)}; two-pass methods {', '.join(TWO_PASS)} (on SGD with momentum 0.9, "
            f"or on another base as METHOD{SEPARATOR}BASE, e.g. sam{SEPARATOR}adamw)")
