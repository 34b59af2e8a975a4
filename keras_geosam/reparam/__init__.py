"""Function-preserving reparametrisations, for invariance checks
(``rescale.py``)."""

from keras_geosam.reparam.rescale import rescale

__all__ = ["rescale"]
