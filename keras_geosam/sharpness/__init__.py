"""Sharpness measures: Euclidean (Hessian trace, top eigenvalue) and
Riemannian (Fisher-geometric), plus the Fisher diagonal and the gradient
noise / Fisher alignment test. Stochastic results are :class:`Estimate`s."""

from keras_geosam.sharpness.alignment import Alignment
from keras_geosam.sharpness.alignment import gradient_noise_alignment
from keras_geosam.sharpness.eigen import hessian_max_eigenvalue
from keras_geosam.sharpness.eigen import lanczos_top
from keras_geosam.sharpness.estimate import Estimate
from keras_geosam.sharpness.fisher import fisher_diagonal
from keras_geosam.sharpness.hutchinson import hessian_trace
from keras_geosam.sharpness.kfac import kfac_factors
from keras_geosam.sharpness.riemannian import dense_fisher
from keras_geosam.sharpness.riemannian import is_piecewise_linear
from keras_geosam.sharpness.riemannian import riemannian_sharpness

__all__ = [
    "Alignment",
    "Estimate",
    "dense_fisher",
    "fisher_diagonal",
    "gradient_noise_alignment",
    "hessian_max_eigenvalue",
    "hessian_trace",
    "is_piecewise_linear",
    "kfac_factors",
    "lanczos_top",
    "riemannian_sharpness",
]
