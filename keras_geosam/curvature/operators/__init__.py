"""Linear operators over lists of variable-shaped tensors (see ``base.py``).

Structured: ``Diagonal``, ``KFAC``, ``EKFAC`` (and their Embedding forms
``DiagonalInputKFAC``, ``DiagonalInputEKFAC``), ``BlockDiagonal``, ``Dense``.
Of a model's mean loss: ``Hessian``, ``GGN`` (= ``Fisher``; kinds exact, mc,
empirical), ``GGNResidual`` (H - GGN). Compose them with ``@``, ``+``,
``-`` and scalars; every estimator in ``keras_geosam.estimators`` takes any
of them.
"""

from keras_geosam.curvature.operators.base import LinearOperator
from keras_geosam.curvature.operators.base import Product
from keras_geosam.curvature.operators.base import Scaled
from keras_geosam.curvature.operators.base import Sum
from keras_geosam.curvature.operators.model import GGN
from keras_geosam.curvature.operators.model import Fisher
from keras_geosam.curvature.operators.model import GGNResidual
from keras_geosam.curvature.operators.model import Hessian
from keras_geosam.curvature.operators.model import ModelOperator
from keras_geosam.curvature.operators.structured import EKFAC
from keras_geosam.curvature.operators.structured import KFAC
from keras_geosam.curvature.operators.structured import BlockDiagonal
from keras_geosam.curvature.operators.structured import Dense
from keras_geosam.curvature.operators.structured import Diagonal
from keras_geosam.curvature.operators.structured import DiagonalInputEKFAC
from keras_geosam.curvature.operators.structured import DiagonalInputKFAC

__all__ = [
    "BlockDiagonal", "Dense", "Diagonal", "DiagonalInputEKFAC", "DiagonalInputKFAC", "EKFAC", "Fisher", "GGN",
    "GGNResidual", "Hessian", "KFAC", "LinearOperator", "ModelOperator", "Product", "Scaled", "Sum",
]
