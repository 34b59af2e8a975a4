"""Training with a two-pass optimizer: ``kg.Model``, ``kg.Sequential``,
``kg.attach`` (``models.py``) and the model-level step they run
(``step.py``)."""

from keras_geosam.training.models import Model, Sequential, attach

__all__ = ["Model", "Sequential", "attach"]
