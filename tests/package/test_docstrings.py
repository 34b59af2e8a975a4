"""Every public callable documents Args, Returns, Raises and a runnable Example.

Public means reachable from ``keras_geosam.__all__``: the top-level callables
(``kg.Model``, ``kg.Sequential``, ``kg.attach``) and, for every public
submodule listed there, the callables in its ``__all__`` (or, where it has
none, the public callables it defines). The list is computed, not written
down, so a new public name without an Example fails here.

Each object's examples run under ``doctest`` on the active backend, one test
per object, in the globals of the module that defines it plus ``np``,
``keras`` and ``kg`` (``import keras_geosam as kg``), the names Keras' own
docstrings take as imported; ELLIPSIS and NORMALIZE_WHITESPACE are on. Run
once per backend:

    KERAS_BACKEND=jax|tensorflow|torch python -m pytest tests/package/test_docstrings.py
"""

import doctest
import inspect
import io
import re
import textwrap

import keras
import numpy as np
import pytest

import keras_geosam as kg

# The per-backend autodiff layer: internal plumbing (thin wrappers over the
# active backend's AD, described in its module docstring), not user API.
INTERNAL_MODULES = {"backend"}

# Callables with their own argument checks do raise; these raise nothing of
# their own (only what a model or Keras raises), so they need no Raises
# section. Checked below: none of them may contain a `raise` statement.
NO_RAISES = {
    "kg.estimators.Estimate",
    "kg.sharpness.Alignment",
    "kg.curvature.LossSpec",
    "kg.sharpness.is_layerwise_linear",
    "kg.sharpness.is_piecewise_linear",
    "kg.preconditioner.clip_groups",
}

# Docstrings in files that other work owns at the moment; strict, so each
# entry must be removed once its docstring is complete.
PENDING = set()

# What the public contract (shared API.md) names must be among them.
CONTRACT = {
    "kg.Model", "kg.Sequential", "kg.attach",
    "kg.optimizers.SAM", "kg.optimizers.FSAM", "kg.optimizers.FisherSAM",
    "kg.optimizers.LLQR", "kg.optimizers.LLQRSAM",
    "kg.curvature.hvp", "kg.curvature.ggnvp", "kg.curvature.per_example_gradients",
    "kg.sharpness.hessian_trace", "kg.sharpness.hessian_max_eigenvalue",
    "kg.sharpness.fisher_diagonal", "kg.sharpness.riemannian_sharpness",
    "kg.sharpness.gradient_noise_alignment", "kg.reparam.rescale",
    "kg.callbacks.SharpnessLogger",
}

OPTIONFLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
SECTION = re.compile(r"^\s*(Args|Attributes|Returns|Raises|Examples?):\s*$", re.MULTILINE)


def _submodule(name):
    """``kg.<name>``, or None when the package lists a module that does not
    exist (yet): importing the package is tested elsewhere."""
    try:
        return getattr(kg, name)
    except ModuleNotFoundError as e:
        if e.name == f"keras_geosam.{name}":
            return None
        raise


def public_callables():
    """``[(qualified name, object)]``, each object once: under its first
    name, or the first that matches its ``__name__`` (GGN, not Fisher)."""
    found, seen = [], {}

    def add(name, obj):
        if id(obj) not in seen:
            seen[id(obj)] = len(found)
            found.append((name, obj))
        else:
            # An alias (Fisher = GGN) gives way to the object's own name.
            first = found[seen[id(obj)]][0]
            own = getattr(obj, "__name__", None)
            if first.rsplit(".", 1)[-1] != own and name.rsplit(".", 1)[-1] == own:
                found[seen[id(obj)]] = (name, obj)

    top = getattr(kg, "__all__", None) or [n for n in dir(kg) if not n.startswith("_")]
    modules = []
    for name in top:
        obj = _submodule(name)
        if inspect.ismodule(obj):
            if name not in INTERNAL_MODULES:
                modules.append((name, obj))
        elif callable(obj):
            add(f"kg.{name}", obj)
    for name, module in modules:
        exported = getattr(module, "__all__", None)
        if exported is None:
            exported = [
                n for n, o in vars(module).items()
                if not n.startswith("_") and getattr(o, "__module__", None) == module.__name__
            ]
        for n in exported:
            obj = getattr(module, n)
            if callable(obj) and not inspect.ismodule(obj):
                add(f"kg.{name}.{n}", obj)
    return found


CALLABLES = public_callables()


def _params():
    pending = pytest.mark.xfail(strict=True, reason="docstring pending in a file owned elsewhere")
    return [pytest.param(name, obj, id=name, marks=[pending] if name in PENDING else []) for name, obj in CALLABLES]


def _takes_arguments(obj):
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return True
    return any(p.name not in ("self", "cls") for p in sig.parameters.values())


def _own_source(obj):
    """The source of a function, or of a whole class body."""
    try:
        return textwrap.dedent(inspect.getsource(obj))
    except (OSError, TypeError):
        return ""


def missing_sections(name, obj):
    """Sections the docstring of `obj` lacks, as a list of names."""
    doc = inspect.getdoc(obj) or ""
    sections = set(SECTION.findall(doc))
    missing = []
    # A class may document its constructor's arguments as Attributes
    # (dataclasses), as Keras does.
    args = {"Args", "Attributes"} if inspect.isclass(obj) else {"Args"}
    if _takes_arguments(obj) and not sections & args:
        missing.append("Args")
    if not inspect.isclass(obj) and "Returns" not in sections:
        missing.append("Returns")
    if name not in NO_RAISES and "Raises" not in sections:
        missing.append("Raises")
    if not sections & {"Example", "Examples"} or ">>>" not in doc:
        missing.append("Example")
    return missing


def run_examples(name, obj):
    """Runs the doctest examples of `obj`'s own docstring; returns
    ``(number of examples, number failed, report)``."""
    # The defining module's globals, as plain doctest gives them, plus the
    # names Keras-style examples take as imported.
    module = inspect.getmodule(obj)
    globs = dict(vars(module)) if module is not None else {}
    globs.update(np=np, keras=keras, kg=kg)
    tests = doctest.DocTestFinder(recurse=False, exclude_empty=True).find(obj, name, globs=globs)
    runner = doctest.DocTestRunner(optionflags=OPTIONFLAGS)
    out = io.StringIO()
    for test in tests:
        runner.run(test, out=out.write)
    return runner.tries, runner.failures, out.getvalue()


def test_the_contract_is_enumerated():
    names = {n for n, _ in CALLABLES}
    assert CONTRACT <= names, sorted(CONTRACT - names)
    assert PENDING <= names, sorted(PENDING - names)
    assert NO_RAISES <= names, sorted(NO_RAISES - names)


@pytest.mark.parametrize("name", sorted(NO_RAISES))
def test_no_raises_entries_raise_nothing_of_their_own(name):
    obj = dict(CALLABLES)[name]
    assert not re.search(r"^\s*raise\b", _own_source(obj), re.MULTILINE), (
        f"{name} raises: document it under Raises and drop it from NO_RAISES."
    )


@pytest.mark.parametrize("name, obj", _params())
def test_docstring(name, obj):
    missing = missing_sections(name, obj)
    assert not missing, f"{name}: the docstring lacks {', '.join(missing)}."
    attempted, failed, report = run_examples(name, obj)
    assert attempted, f"{name}: no >>> examples."
    assert not failed, f"{name}: {failed} of {attempted} examples failed:\n{report}"


def test_the_checks_catch_bad_docstrings():
    """A missing section and a wrong expected output are both reported."""

    def broken(a):
        """Adds one.

        Args:
            a: a number.

        Example:

        >>> round(1.5 + 1, 1)
        3.0
        """
        return a + 1

    assert missing_sections("broken", broken) == ["Returns", "Raises"]
    attempted, failed, report = run_examples("broken", broken)
    assert (attempted, failed) == (1, 1) and "Expected" in report
