"""Every private Keras name the package uses (all behind
``keras_geosam/keras_internals.py``) still exists in the installed Keras: an
upgrade that drops one fails here, naming it, instead of deep in a step."""

import keras

from keras_geosam import keras_internals


def test_every_private_keras_name_still_exists():
    checks = keras_internals.checked_names()
    assert len(checks) >= 16
    missing = [name for name, exists in checks if exists is False]
    assert not missing, (
        f"Keras {keras.__version__} lacks {missing} (checked against {keras_internals.KERAS_VERSION_CHECKED}); "
        "see keras_geosam/keras_internals.py for what each is used for."
    )


def test_no_module_outside_the_door_names_keras_src_or_a_private_keras_attribute():
    import os
    import re

    root = os.path.dirname(keras_internals.__file__)
    private = re.compile(r"keras\.src|_getframe|\._(symbolic_build|maybe_symbolic_build|losses_override|loss_tracker|"
                         r"trainable_variables|call_has_training_arg|distribute_strategy|jax_state|flatten_layers|"
                         r"inbound_nodes|outbound_nodes|iterations|fn_kwargs|build_shapes_dict|layout_map|layout|tracker|"
                         r"stateful_handle_non_finite_grads|compute_loss|remat_mode)\b|\"_(distribute_strategy|jax_state|layout|tracker|"
                         r"build_shapes_dict|fn_kwargs|inbound_nodes|layout_map|maybe_symbolic_build)\"")
    found = []
    for folder, _, files in os.walk(root):
        for f in files:
            path = os.path.join(folder, f)
            if not f.endswith(".py") or path == keras_internals.__file__:
                continue
            for i, line in enumerate(open(path), 1):
                code = line.split("#")[0]
                if private.search(code) and not code.strip().startswith(('"', "'")) and "``" not in code:
                    found.append(f"{os.path.relpath(path, root)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)
