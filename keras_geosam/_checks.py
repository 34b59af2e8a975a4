"""Argument checks shared by the optimizers and the preconditioner."""


def check_number(name, value, minimum=0.0, strict=False, below=None):
    """`value` as a finite float >= `minimum` (> if `strict`; < `below`)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}.") from None
    if v != v or v in (float("inf"), float("-inf")) or v < minimum or (strict and v == minimum):
        relation = ">" if strict else ">="
        raise ValueError(f"{name} must be finite and {relation} {minimum}, got {value!r}.")
    if below is not None and v >= below:
        raise ValueError(f"{name} must be < {below}, got {value!r}.")
    return v


def check_int(name, value, minimum=1):
    """`value` as an int >= `minimum` (bools refused; NumPy integers taken)."""
    import numpy as np

    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    return int(value)
