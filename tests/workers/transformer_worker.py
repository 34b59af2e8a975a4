"""Subprocess worker of optimizers/test_transformer_steps.py: two LLQR+SAM (K-FAC U,
refreshed in the step) and two SAM steps of the tiny Transformer from
identical float32 weights, on the active backend. ``python
transformer_worker.py out.npz`` writes the resulting weights and U."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the reference


def compute():
    import keras
    import numpy as np

    import keras_geosam as kg
    from reference.transformer_classifier import ADAM_EPSILON, N, build, data

    out = {}
    x, y = data()
    for name, make in (
        ("llqrsam", lambda: kg.optimizers.LLQRSAM(keras.optimizers.SGD(0.1, momentum=0.9), rho=0.3, structure="kfac",
                                                  refresh_every=2, refresh_steps=10)),
        ("sam", lambda: kg.optimizers.SAM(keras.optimizers.Adam(0.01, epsilon=ADAM_EPSILON), rho=0.3)),
    ):
        model = build()
        opt = make()
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=N, epochs=1, shuffle=False, verbose=0)
        for v in model.trainable_variables:
            out[f"{name}/{v.path}"] = np.asarray(keras.ops.convert_to_numpy(v.value))
        for v in getattr(getattr(opt, "preconditioner", None), "variables", []):
            out[f"{name}/U/{v.name}"] = np.asarray(keras.ops.convert_to_numpy(v.value))
    return out


if __name__ == "__main__":
    import numpy as np

    np.savez(sys.argv[1], **compute())
