#!/usr/bin/env bash
# Run the whole keras_geosam test suite on every Keras backend.
#
#   bash scripts/test.sh                      # dev venv at .venv (created if missing)
#   BACKENDS="jax torch" bash scripts/test.sh # only these backends
#   PYTEST_ARGS="-x -k curvature" bash scripts/test.sh
#   SKIP_INSTALL=1 bash scripts/test.sh       # existing venv: skip the `pip install -e` refresh
#   VENV=/tmp/v bash scripts/test.sh          # another venv (created if missing)
#
# Each backend runs in its own pytest process (Keras cannot switch backends
# inside a process): first `tests/`, then `integration_tests/`. Every backend
# runs even if an earlier one fails; the exit status is non-zero if any run
# failed. For integration_tests only, pytest exit code 5 ("no tests collected")
# counts as success.
#
# Environment:
#   VENV          virtual environment (default .venv, relative to the repo root)
#   PYTHON        interpreter used to create a missing venv (default python3)
#   TORCH_REQ     torch requirement installed before the package (default torch==2.13.0,
#                 a CPU build on this machine; an unpinned torch pulls a multi-GB CUDA build)
#   SKIP_INSTALL  1: do not refresh the editable install of an existing venv
#   BACKENDS      space-separated subset of "tensorflow jax torch"
#   PYTEST_ARGS   extra arguments for every pytest run (split like shell words, quotes honoured)
#   WORKERS       pytest-xdist worker processes per run (default auto: one per core;
#                 0 runs in the pytest process itself). Files are not split between
#                 workers (--dist loadfile): module fixtures are built once.
#   STAGE_LIMIT   seconds one pytest run may take before it is stopped (default 2400): a
#                 hung run (pytest-xdist waits forever once a worker process dies; a
#                 test stuck inside a C++ kernel never sees pytest-timeout's signal)
#                 fails its stage with exit 124 instead of eating the whole CI budget
#   TOTAL_LIMIT   seconds the whole script may take (default 5200, inside CI's 5400):
#                 each stage gets at most what is left, so a hung stage still leaves a
#                 summary that names it; a stage with no time left is not started
#   JAX_COMPILATION_CACHE_DIR  JAX's persistent compilation cache (default: a fresh
#                 temporary folder for this run, removed at its end)
#   KERAS_GEOSAM_SMALL_GUIDES  1: integration_tests also run the guides' small modes
#                 (minutes each per backend; CI runs the guides' smoke modes only)
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_REQ="${TORCH_REQ:-torch==2.13.0}"
SKIP_INSTALL="${SKIP_INSTALL:-0}"
BACKENDS="${BACKENDS:-tensorflow jax torch}"
WORKERS="${WORKERS:-auto}"
STAGE_LIMIT="${STAGE_LIMIT:-2400}"
TOTAL_LIMIT="${TOTAL_LIMIT:-5200}"
# Split PYTEST_ARGS like a shell would (quotes honoured, nothing executed):
# PYTEST_ARGS='-k "not slow" -x'
PYTEST_EXTRA=()
if [[ -n "${PYTEST_ARGS:-}" ]]; then
    _split=$(xargs printf '%s\n' <<< "$PYTEST_ARGS") ||
        { echo "scripts/test.sh: cannot parse PYTEST_ARGS=$PYTEST_ARGS" >&2; exit 2; }
    mapfile -t PYTEST_EXTRA <<< "$_split"
fi
for backend in $BACKENDS; do
    case "$backend" in
        tensorflow|jax|torch) ;;
        *) echo "scripts/test.sh: unknown backend '$backend' (want tensorflow, jax or torch)" >&2; exit 2 ;;
    esac
done

export TF_CPP_MIN_LOG_LEVEL=2
# JAX_ENABLE_X64 is deliberately not set here: tests that need float64 set it themselves.

# pytest swallows Ctrl-C and exits 2; stop the whole script instead of moving on.
trap 'echo; echo "interrupted"; exit 130' INT TERM

T_ALL=$(date +%s)
stage_start() { T_STAGE=$(date +%s); echo; echo ">>> $*"; }
stage_end() { echo "<<< $* ($(( $(date +%s) - T_STAGE ))s)"; }
die() { echo "scripts/test.sh: $*" >&2; exit 1; }

PY="$VENV/bin/python"

# ---------------------------------------------------------------- environment
if [[ ! -x "$PY" ]]; then
    stage_start "create venv $VENV ($("$PYTHON" -V 2>&1))"
    "$PYTHON" -m venv "$VENV" || die "could not create venv at $VENV"
    stage_end "venv created"
    FRESH=1
else
    FRESH=0
fi

if [[ "$FRESH" == 1 || "$SKIP_INSTALL" != 1 ]]; then
    # torch first, pinned, so the package's torch range is already satisfied
    # by the CPU build and pip never resolves a CUDA one.
    if [[ "$FRESH" == 1 ]] || ! "$PY" -m pip show -q torch >/dev/null 2>&1; then
        stage_start "pip install $TORCH_REQ"
        "$PY" -m pip install -q "$TORCH_REQ" || die "pip install $TORCH_REQ failed"
        stage_end "torch installed"
    fi
    stage_start "pip install -e .[all,test]"
    "$PY" -m pip install -q -e ".[all,test]" || die "pip install -e .[all,test] failed"
    stage_end "package installed"
else
    echo "SKIP_INSTALL=1: using $VENV as is"
fi

"$PY" - <<'PYEOF' || die "environment check failed"
import importlib.metadata as md, sys
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "-"
names = ["keras", "tensorflow-cpu", "jax", "torch", "numpy", "pytest"]
print("python", sys.version.split()[0], "|", ", ".join(f"{n} {version(n)}" for n in names))
PYEOF

# ---------------------------------------------------------------- test runs
# JAX: one persistent compilation cache for this run, shared by its pytest
# workers and stages. The suite's small programs repeat across test files
# (jax.clear_caches() runs after every module, see tests/conftest.py), and
# reading an executable back is cheaper than compiling it again: 13% off the
# JAX time of a 3-file sample. It starts empty, so no result depends on an
# earlier run, and compile-counting tests still see every compilation (JAX
# emits its compile event for a cache hit too). An exported
# JAX_COMPILATION_CACHE_DIR is used as is and kept.
if [[ -z "${JAX_COMPILATION_CACHE_DIR:-}" && " $BACKENDS " == *" jax "* ]]; then
    JAX_COMPILATION_CACHE_DIR="$(mktemp -d "${TMPDIR:-/tmp}/keras-geosam-jax-cache.XXXXXX")"
    export JAX_COMPILATION_CACHE_DIR
    trap 'rm -rf "$JAX_COMPILATION_CACHE_DIR"' EXIT
fi
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0}"
export JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="${JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES:--1}"

declare -A RC_UNIT RC_INTEG T_BACKEND
FAILED=0

run_pytest() {  # run_pytest BACKEND DIR -> sets LAST_RC
    local backend=$1 dir=$2
    stage_start "$dir [KERAS_BACKEND=$backend]"
    local parallel=()
    [[ "$WORKERS" != 0 ]] && parallel=(-n "$WORKERS" --dist loadfile)
    local left=$(( TOTAL_LIMIT - ($(date +%s) - T_ALL) ))
    local limit=$(( left < STAGE_LIMIT ? left : STAGE_LIMIT ))
    if (( left < 60 )); then
        echo "scripts/test.sh: $dir [$backend] not started: ${left}s left of TOTAL_LIMIT=${TOTAL_LIMIT}s"
        LAST_RC=124
        stage_end "$dir [$backend] exit $LAST_RC"
        return
    fi
    KERAS_BACKEND="$backend" timeout -k 30 "$limit" \
        "$PY" -m pytest "$dir" -q --durations=15 "${parallel[@]}" "${PYTEST_EXTRA[@]}"
    LAST_RC=$?
    (( LAST_RC == 124 || LAST_RC == 137 )) && echo "scripts/test.sh: $dir [$backend] stopped after ${limit}s (STAGE_LIMIT=${STAGE_LIMIT}s, TOTAL_LIMIT=${TOTAL_LIMIT}s)"
    stage_end "$dir [$backend] exit $LAST_RC"
}

for backend in $BACKENDS; do
    t0=$(date +%s)

    run_pytest "$backend" tests
    RC_UNIT[$backend]=$LAST_RC
    (( LAST_RC != 0 )) && FAILED=1

    if [[ -d integration_tests ]]; then
        run_pytest "$backend" integration_tests
        RC_INTEG[$backend]=$LAST_RC
        (( LAST_RC != 0 && LAST_RC != 5 )) && FAILED=1
    else
        RC_INTEG[$backend]=absent
    fi
    T_BACKEND[$backend]=$(( $(date +%s) - t0 ))
done

# ---------------------------------------------------------------- summary
describe() {  # describe RC KIND
    case "$1" in
        0) echo "passed" ;;
        5) [[ $2 == integ ]] && echo "no tests (ok)" || echo "FAILED (no tests collected, exit 5)" ;;
        absent) echo "no directory (ok)" ;;
        124|137) echo "FAILED (over its time limit)" ;;
        *) echo "FAILED (exit $1)" ;;
    esac
}
echo
echo ">>> summary ($(( $(date +%s) - T_ALL ))s total)"
for backend in $BACKENDS; do
    printf '%-10s tests: %-36s integration_tests: %-20s %4ss\n' "$backend" \
        "$(describe "${RC_UNIT[$backend]}" unit)" \
        "$(describe "${RC_INTEG[$backend]}" integ)" "${T_BACKEND[$backend]}"
done
if (( FAILED )); then echo "RESULT: FAILED"; exit 1; fi
echo "RESULT: OK"
