"""LLQR's learned structured preconditioner U: its layout on the curvature
operator classes, its objective and refresh, and its state."""

from keras_geosam.preconditioner.learned import DIVERGENCES
from keras_geosam.preconditioner.learned import OPTIONS
from keras_geosam.preconditioner.learned import REFRESH_SOURCES
from keras_geosam.preconditioner.learned import LearnedPreconditioner
from keras_geosam.preconditioner.objective import clip_by_groups
from keras_geosam.preconditioner.objective import objective
from keras_geosam.preconditioner.objective import objective_gradient
from keras_geosam.preconditioner.objective import refresh
from keras_geosam.preconditioner.structures import STRUCTURES
from keras_geosam.preconditioner.structures import clip_groups
from keras_geosam.preconditioner.structures import layout
from keras_geosam.preconditioner.structures import operator
from keras_geosam.preconditioner.structures import param_specs

__all__ = [
    "DIVERGENCES",
    "OPTIONS",
    "REFRESH_SOURCES",
    "STRUCTURES",
    "LearnedPreconditioner",
    "clip_by_groups",
    "clip_groups",
    "layout",
    "objective",
    "objective_gradient",
    "operator",
    "param_specs",
    "refresh",
]
