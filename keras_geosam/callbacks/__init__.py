"""Keras callbacks that log sharpness during training."""

from keras_geosam.callbacks.preconditioner_refresh import PreconditionerRefresh
from keras_geosam.callbacks.refresh_monitor import RefreshMonitor
from keras_geosam.callbacks.sharpness_logger import SharpnessLogger

__all__ = ["PreconditionerRefresh", "RefreshMonitor", "SharpnessLogger"]
