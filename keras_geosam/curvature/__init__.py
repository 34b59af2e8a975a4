"""Curvature products on any backend, never materialising a matrix.

- ``curvature/operators/``: the linear operators (``Hessian``, ``GGN``,
  ``Fisher``, ``GGNResidual``) and the structured blocks (``Diagonal``,
  ``KFAC``, ``EKFAC``, ``BlockDiagonal``, ...).
- ``curvature/products.py``: the functional API (``hvp``, ``ggnvp``,
  ``jvp``, ``vjp``, per-example gradients, predictive probabilities), each a
  call of an operator or of the model's compiled functions.
- ``curvature/functional.py``: a model as pure functions of its weights.
"""

from keras_geosam.curvature import tables  # noqa: F401 (adds the tables' rules to layers.rule_for)
from keras_geosam.curvature.functional import ModelFunctions, model_functions
from keras_geosam.curvature.losses import LossSpec, resolve_loss
from keras_geosam.curvature.operators import (
    EKFAC, GGN, KFAC, BlockDiagonal, Dense, Diagonal, DiagonalInputEKFAC, DiagonalInputKFAC, Fisher, GGNResidual,
    Hessian, LinearOperator,
)
from keras_geosam.curvature.products import (
    ggnvp, hvp, jvp, loss_and_gradient, per_example_gradients, predict_probs, sample_labels, sampled_label_gradients,
    vjp,
)

__all__ = [
    "BlockDiagonal", "Dense", "Diagonal", "DiagonalInputEKFAC", "DiagonalInputKFAC", "EKFAC", "Fisher", "GGN",
    "GGNResidual", "Hessian", "KFAC", "LinearOperator", "LossSpec", "ModelFunctions", "ggnvp", "hvp", "jvp",
    "loss_and_gradient", "model_functions", "per_example_gradients", "predict_probs", "resolve_loss",
    "sample_labels", "sampled_label_gradients", "vjp",
]
