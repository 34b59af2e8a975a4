"""Estimators that take any curvature operator: traces (Hutchinson, Hutch++,
deflated Hutchinson) and the top eigenvalue (Lanczos). Results are
:class:`Estimate`s."""

from keras_geosam.estimators.eigen import lanczos
from keras_geosam.estimators.estimate import Estimate
from keras_geosam.estimators.trace import deflated_hutchinson
from keras_geosam.estimators.trace import hutchinson
from keras_geosam.estimators.trace import hutchpp

__all__ = ["Estimate", "deflated_hutchinson", "hutchinson", "hutchpp", "lanczos"]
