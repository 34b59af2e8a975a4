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


def start_on_other_backends(script, folder, *args, x64=True, backends=("tensorflow", "torch"), env=None):
    """Runs ``workers/<script> *args OUT.npz`` once per backend, each in its
    own process (Keras cannot switch backends in one), while the caller
    computes its own side. Returns ``collect(timeout)``: waits, fails with
    the worker's log if one failed, and gives ``{backend: {name: array}}``.
    `x64=False` drops ``JAX_ENABLE_X64`` from the workers' environment;
    `env` adds variables to it."""
    import subprocess

    import numpy as np

    procs = {}
    for backend in backends:
        environment = dict(os.environ, **(env or {}), KERAS_BACKEND=backend)
        if not x64:
            environment.pop("JAX_ENABLE_X64", None)
        out = os.path.join(str(folder), f"{backend}.npz")
        procs[backend] = (subprocess.Popen([sys.executable, worker_script(script), *map(str, args), out], env=environment, cwd=REPO,
                                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT), out)

    def collect(timeout=300):
        results = {}
        for backend, (proc, out) in procs.items():
            log = proc.communicate(timeout=timeout)[0].decode(errors="replace")
            assert proc.returncode == 0, f"{backend} worker failed:\n{log[-4000:]}"
            with np.load(out) as f:
                results[backend] = {k: f[k] for k in f.files}
        return results

    return collect
