"""keras_geosam: geometry-aware sharpness minimisation and Fisher-geometric
sharpness metrics for every Keras 3 backend."""

from keras_geosam import backend
from keras_geosam import curvature

__version__ = "0.1.0"
