"""Keras callbacks that log sharpness during training."""

from keras_geosam.callbacks.sharpness_logger import SharpnessLogger

__all__ = ["SharpnessLogger"]
