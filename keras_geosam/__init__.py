"""keras_geosam: geometry-aware sharpness minimisation and Fisher-geometric
sharpness metrics for every Keras 3 backend."""

from keras_geosam import backend
from keras_geosam import callbacks
from keras_geosam import curvature
from keras_geosam import datasets
from keras_geosam import estimators
from keras_geosam import optimizers
from keras_geosam import reparam
from keras_geosam import sharpness
from keras_geosam.training import Model
from keras_geosam.training import Sequential
from keras_geosam.training import attach

__version__ = "0.1.0"
