"""Argument validation: the one style of every public function and
constructor.

Each check returns the value in its canonical Python type, or raises
``ValueError`` naming the argument, the rule and the bad value, as Keras
does. ``allow_none`` lets ``None`` through unchanged (a documented default
such as "no tolerance").
"""

import functools
import inspect
import numbers
import os
import sys
import warnings

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _own_dirs():
    # Keras' directory only once Keras is imported (the study's parser runs
    # without it): before that no frame can be Keras'.
    keras = sys.modules.get("keras")
    extra = () if keras is None else (os.path.dirname(os.path.abspath(keras.__file__)) + os.sep,)
    return (_PACKAGE_DIR,) + extra


def warn_at_caller(message, category=UserWarning):
    """``warnings.warn`` pointed at the user's line: the first frame
    outside keras_geosam and Keras (a ``model.fit(...)`` call for a warning
    raised by a callback), whatever the depth it is raised at."""
    own = _own_dirs()
    frame, level = inspect.currentframe().f_back, 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(own):
        frame, level = frame.f_back, level + 1
    del frame  # frames hold their locals alive
    warnings.warn(message, category, stacklevel=level)


def check_number(name, value, minimum=0.0, strict=False, below=None, allow_none=False):
    """`value` as a finite float >= `minimum` (> if `strict`; < `below`).

    Booleans are refused; strings that spell a number are taken, as
    ``float`` does (a hyperparameter read from a config file)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}.")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}.") from None
    if v != v or v in (float("inf"), float("-inf")) or (minimum is not None and (v < minimum or (strict and v == minimum))):
        relation = ">" if strict else ">="
        bound = "" if minimum is None else f" and {relation} {minimum}"
        raise ValueError(f"{name} must be finite{bound}, got {value!r}.")
    if below is not None and v >= below:
        raise ValueError(f"{name} must be < {below}, got {value!r}.")
    return v


def check_int(name, value, minimum=1, allow_none=False):
    """`value` as an int >= `minimum`: Python and NumPy integers only (a
    float such as 1.5 or 2.0, or a bool, is refused, not truncated)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    return int(value)


def check_choice(name, value, choices):
    """`value` if it is one of `choices`."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}.")
    return value


def renamed_arguments(**old_to_new):
    """Decorator: keyword ``old`` still works as a deprecated alias of
    ``new`` (a ``DeprecationWarning`` names both); passing both is a
    ``TypeError``, as a duplicate keyword is. Positions do not change, so
    positional calls are unaffected."""

    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            for old, new in old_to_new.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{fn.__name__}() got both {new!r} and its deprecated alias {old!r}.")
                    warn_at_caller(f"{fn.__name__}({old}=...) is deprecated; use {new}=... (same meaning).",
                                   DeprecationWarning)
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        call.renamed_arguments = dict(old_to_new)
        return call

    return wrap


def check_rematerialisation(model, user):
    """Raises if `model` has layers built under ``keras.RematScope`` and the
    backend is not JAX: torch recomputes such a layer in the backward pass
    outside the StatelessScope that holds the weights being differentiated
    (its gradient reaches the variables instead: a wrong number), and
    TensorFlow's remat refuses keyword arguments in graph mode."""
    import keras

    from keras_geosam import keras_internals

    remat = keras_internals.rematerialised_layers(model)
    if remat and keras.backend.backend() != "jax":
        more = ", ..." if len(remat) > 5 else ""
        raise ValueError(
            f"{model.name}: layers built under keras.RematScope ({', '.join(remat[:5])}{more}) are supported by "
            f"{user} on JAX only; on {keras.backend.backend()} build the model outside RematScope."
        )
