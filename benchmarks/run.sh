#!/bin/sh
# Run every benchmark script in this folder (bench_*.py), one after the other; each prints its
# own markdown table.  A failing benchmark does not stop the others; the exit status is
# non-zero if any failed.
#
#   benchmarks/run.sh                               every bench_*.py, default sizes
#   BENCH=transport benchmarks/run.sh --mib 64      only bench_transport.py, with these options
#
# Options are passed only when BENCH picks one script: the scripts do not share options.
# Scripts that need a service read it from the environment (bench_bus.py: LOCALAI_TEST_DSN).
set -u
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python3}
if [ -z "${BENCH:-}" ] && [ $# -gt 0 ]; then
    echo "usage: run.sh (no options), or BENCH=<name> run.sh [options of bench_<name>.py]" >&2
    exit 2
fi
status=0
for script in "$here"/bench_${BENCH:-*}.py; do
    if [ ! -e "$script" ]; then
        echo "no benchmark matches $script" >&2
        exit 2
    fi
    echo "## $(basename "$script")"
    echo
    if ! "$python" "$script" "$@"; then
        echo "$(basename "$script") failed" >&2
        status=1
    fi
    echo
done
exit $status
