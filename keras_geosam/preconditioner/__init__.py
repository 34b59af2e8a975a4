"""The learned structured preconditioner U of LLQR: blocks and their refresh."""

from keras_geosam.preconditioner.objective import objective
from keras_geosam.preconditioner.objective import objective_gradient
from keras_geosam.preconditioner.objective import refresh
from keras_geosam.preconditioner.structures import STRUCTURES
from keras_geosam.preconditioner.structures import Block
from keras_geosam.preconditioner.structures import make_blocks
from keras_geosam.preconditioner.structures import precondition

__all__ = [
    "Block",
    "STRUCTURES",
    "make_blocks",
    "objective",
    "objective_gradient",
    "precondition",
    "refresh",
]
