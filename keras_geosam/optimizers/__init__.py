"""Two-pass (SAM-family) optimizers wrapping a base Keras optimizer."""

from keras_geosam.optimizers.base import TwoPassOptimizer
from keras_geosam.optimizers.fisher_sam import FisherSAM
from keras_geosam.optimizers.fsam import FSAM
from keras_geosam.optimizers.llqr import LLQR
from keras_geosam.optimizers.llqr_sam import LLQRSAM
from keras_geosam.optimizers.sam import SAM

__all__ = ["FSAM", "FisherSAM", "LLQR", "LLQRSAM", "SAM", "TwoPassOptimizer"]
