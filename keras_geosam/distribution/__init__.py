"""Helpers for training under ``keras.distribution`` / ``tf.distribute``:
what the engines lack (``data_parallel.py``)."""

from keras_geosam.distribution.data_parallel import check_batches, layout_errors, save_model

__all__ = ["save_model", "check_batches", "layout_errors"]
