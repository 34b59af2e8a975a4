"""Value types for the commands' parsers, and CSV cells read back."""

import argparse


def _number(cast, ok, rule):
    """An argparse type: `text` cast by `cast` and accepted by `ok`."""

    def parse(text):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if cast is int else 'a number'}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {value}")
        return value

    return parse


positive_int = _number(int, lambda v: v >= 1, ">= 1")
nonneg_int = _number(int, lambda v: v >= 0, ">= 0")
positive_float = _number(float, lambda v: v > 0, "> 0")
nonneg_float = _number(float, lambda v: v >= 0, ">= 0")
fraction = _number(float, lambda v: 0 <= v <= 1, "in [0, 1]")
open_fraction = _number(float, lambda v: 0 < v < 1, "in (0, 1)")


def positive_ints(text):
    """An argparse type: comma-separated integers >= 1."""
    return [positive_int(t.strip()) for t in text.split(",") if t.strip()] or positive_int("")


def from_csv(text):
    """A CSV cell as int, float or the text itself (empty stays empty)."""
    if text in ("", None):
        return text
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text
