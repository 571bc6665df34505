#!/usr/bin/env bash
# The GPU exactness suite in parts, each meant for one 10-minute call on a GPU machine
# (CONTRIBUTING.md, "GPU exactness tests"; sized from the timings recorded there):
#
#   scripts/gpu_tests.sh [PART ...]      no PART: every part, in this order
#
#   ops               the kernels against their twins on CUDA, opcheck
#   runner            the captured runner: AR and speculative rounds against target-only decoding
#   generation        `generate` against target-only decoding, both families, every policy
#   batched-qwen35    batched graphs (B = 2, 3, 4) against transformers' batched greedy, one
#   batched-layout    family or checkpoint layout a part: each compiles and captures once per
#   batched-next      batch size and policy, so together they pass the 10 minutes
#   batched-sampling  batched sampling, seeded
#   generation-fla    `generation` again with fla-core importable; stops if it is not
#
# Every part but generation-fla hides fla-core (HYBRIDSPEC_HIDE_FLA=1, tests/conftest.py), so the
# two generation parts cover transformers' prefill with and without fla's kernels. -rfEsxXp names each
# passed test, so a part stopped by a time limit still says which tests passed; not -rA, whose
# PASSES sections repeat every passed test's captured logs (1.1 MB for the batched file). Extra pytest
# arguments go in PYTEST_ARGS (e.g. PYTEST_ARGS="-n 4" where pytest-xdist is installed).
set -uo pipefail
cd "$(dirname "$0")/.."

ALL=(ops runner generation batched-qwen35 batched-layout batched-next batched-sampling generation-fla)
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=("${ALL[@]}")

run() {  # run PART FLA(hide|show) pytest-arguments...
    local part=$1 hide=0
    [ "$2" = hide ] && hide=1
    shift 2
    echo "== $part (HYBRIDSPEC_HIDE_FLA=$hide): pytest -m gpu $*"
    HYBRIDSPEC_HIDE_FLA=$hide python3 -m pytest -q -m gpu -rfEsxXp -p no:cacheprovider ${PYTEST_ARGS:-} "$@"
}

failed=()
for part in "${PARTS[@]}"; do
    case $part in
        ops) run ops hide tests/ops ;;
        runner) run runner hide tests/runner/test_runner_gpu.py ;;
        generation) run generation hide tests/generation/test_gpu.py ;;
        batched-qwen35) run "$part" hide tests/generation/test_batched_gpu.py -k qwen35_causal_lm ;;
        batched-layout) run "$part" hide tests/generation/test_batched_gpu.py -k qwen35_checkpoint_layout ;;
        batched-next) run "$part" hide tests/generation/test_batched_gpu.py -k qwen3_next ;;
        batched-sampling) run "$part" hide tests/generation/test_batched_gpu.py -k sampling ;;
        generation-fla)
            # a bare `pip` on a GPU image can belong to another interpreter: install with `python3 -m pip`
            if ! python3 -c "import fla" 2>/dev/null; then
                echo "== generation-fla: fla-core is not importable by python3 (python3 -m pip install --no-deps <fla_core wheel>)"
                failed+=("$part")
                continue
            fi
            run "$part" show tests/generation/test_gpu.py ;;
        *) echo "unknown part '$part'; parts: ${ALL[*]}" >&2; exit 2 ;;
    esac
    rc=$?
    [ $rc -ne 0 ] && failed+=("$part (rc $rc)")
done

if [ ${#failed[@]} -ne 0 ]; then
    echo "failed: ${failed[*]}"
    exit 1
fi
echo "all parts passed: ${PARTS[*]}"
