"""Sharpness measures: Euclidean (Hessian trace, top eigenvalue) and
Riemannian (Fisher-geometric), plus the Fisher diagonal and the gradient
noise / Fisher alignment test. Each is a short composition of curvature
operators (``keras_geosam.curvature``) and estimators
(``keras_geosam.estimators``); results are :class:`Estimate`s."""

from keras_geosam.estimators.estimate import Estimate
from keras_geosam.sharpness.alignment import Alignment
from keras_geosam.sharpness.alignment import gradient_noise_alignment
from keras_geosam.sharpness.eigen import hessian_max_eigenvalue
from keras_geosam.sharpness.eigen import riemannian_max_eigenvalue
from keras_geosam.sharpness.fisher import dense_fisher
from keras_geosam.sharpness.fisher import fisher_diagonal
from keras_geosam.sharpness.kfac import kfac_factors
from keras_geosam.sharpness.linearity import is_layerwise_linear
from keras_geosam.sharpness.linearity import is_piecewise_linear
from keras_geosam.sharpness.metric import fisher_metric
from keras_geosam.sharpness.riemannian import riemannian_sharpness
from keras_geosam.sharpness.trace import hessian_trace

__all__ = [
    "Alignment",
    "Estimate",
    "dense_fisher",
    "fisher_diagonal",
    "fisher_metric",
    "gradient_noise_alignment",
    "hessian_max_eigenvalue",
    "hessian_trace",
    "is_layerwise_linear",
    "is_piecewise_linear",
    "kfac_factors",
    "riemannian_max_eigenvalue",
    "riemannian_sharpness",
]
