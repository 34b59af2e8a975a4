"""Running a benchmark once per Keras backend, each in its own process
(Keras cannot switch backends inside one)."""

import json
import os
import subprocess
import sys
import tempfile
import time

BACKENDS = ("jax", "tensorflow", "torch")


def run_each_backend(script, args, backends=BACKENDS):
    """Runs ``python script --json PATH *args`` under each backend in turn.

    The child's stdout goes to this process's stderr (its own tables and
    progress); its JSON comes back. Returns ``(results, failed)``: the loaded
    JSON of each backend that exited 0, in order, and the names of those
    that did not.
    """
    results, failed = [], []
    for b in backends:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            path = f.name
        cmd = [sys.executable, os.path.abspath(script), "--json", path] + list(args)
        env = dict(os.environ, KERAS_BACKEND=b, TF_CPP_MIN_LOG_LEVEL="2")
        print(f"=== {b} ===", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, stdout=sys.stderr)
        print(f"=== {b}: {time.perf_counter() - t0:.0f} s, exit {proc.returncode} ===", file=sys.stderr, flush=True)
        if proc.returncode == 0:
            with open(path) as f:
                results.append(json.load(f))
        else:
            failed.append(b)
        os.unlink(path)
    return results, failed
