"""Independent references the tests compare the package with, none of them
going through keras_geosam: ``curvature`` (explicit float64 Hessians,
Fisher matrices and per-example quantities), ``two_pass`` (hand-written
NumPy models and two-pass steps), ``transformer_classifier`` and
``tiny_transformer`` (Transformers written again in ``jax.numpy``), and
``dtypes`` (which Keras ops drop to float32 on this backend)."""
