"""Where things are, for tests in any folder: the repository, the guides and
the subprocess workers (``workers/``, run as scripts or imported)."""

import importlib
import os
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
GUIDES = os.path.join(REPO, "guides")
WORKERS = os.path.join(TESTS, "workers")


def worker_script(name):
    """The path of ``workers/<name>``, to run as a script."""
    return os.path.join(WORKERS, name)


def import_worker(name):
    """A worker module imported in this process (its ``compute()`` and
    friends run here too)."""
    if WORKERS not in sys.path:
        sys.path.insert(0, WORKERS)
    return importlib.import_module(name)
