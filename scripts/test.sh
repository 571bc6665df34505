#!/usr/bin/env bash
# The README test command. Two pytest sessions, because Triton reads TRITON_INTERPRET when kernels
# are defined: the op tests run the Triton kernels on CPU under the interpreter, the rest without it.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
TRITON_INTERPRET=1 python3 -m pytest tests/ops -n 2 -q "$@"
python3 -m pytest tests --ignore=tests/ops -n 2 -q "$@"
