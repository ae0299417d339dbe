#!/usr/bin/env bash
# The prepared device check (make gpu-check): on one H100 or H200 within 8 minutes, the CUDA
# golden and conformance tests, then `pagedkv bench --device cuda --only device` (batch-1
# decode of 256 tokens timed by CUDA events, 8 and 32 requests against transformers, the mixed
# workload against transformers' generate_batch, nano-vllm's workload; each row with its
# fraction of the memory bound). Each part runs under its own time limit; a part that reaches
# it is cut and says so, and the parts after it still run.
#
#   scripts/gpu_check.sh [--tiny] OUT_DIR
#
# OUT_DIR receives gpu_check.log (everything printed), summary.txt (one line a part) and
# bench/results.json and results.md. --tiny runs the plumbing on the CPU in seconds: the test
# lists collected, not run, and the bench's device workload at its tiny sizes (--quick).
# PYTHON names the interpreter (default: .venv/bin/python where it exists, else python3). The
# exit status is 0 when every part passed, else 1 (2: a malformed command line).
set -u

tiny=0
if [ "${1:-}" = "--tiny" ]; then
    tiny=1
    shift
fi
if [ $# -ne 1 ]; then
    echo "usage: scripts/gpu_check.sh [--tiny] OUT_DIR" >&2
    exit 2
fi
out=$1
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 2
mkdir -p "$out/bench" || exit 2
out=$(cd "$out" && pwd)
log=$out/gpu_check.log
summary=$out/summary.txt
: >"$log"
: >"$summary"

# Each part's limit, seconds: together (with the start) under 8 minutes.
TESTS_S=${GPU_CHECK_TESTS_S:-100}
CONFORMANCE_S=${GPU_CHECK_CONFORMANCE_S:-90}
BENCH_S=${GPU_CHECK_BENCH_S:-240}
# Beyond its budget the bench gets this long to write its results before it is stopped.
BENCH_GRACE_S=30

if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONUNBUFFERED=1

say() { echo "gpu-check: $*" | tee -a "$log"; }

# pagedkv and its conformance plugin: installed, or from the source tree (a machine that
# cannot install: no index to fetch the build tools from).
plugin=()
if ! "$PYTHON" -c "import pagedkv, pagedkv_conformance" >/dev/null 2>&1; then
    mkdir -p build/gpu-check-path
    ln -sfn ../../conformance build/gpu-check-path/pagedkv_conformance
    export PYTHONPATH="$root/src:$root/build/gpu-check-path${PYTHONPATH:+:$PYTHONPATH}"
    # The plugin by name, unless an egg-info left in src/ still declares its entry point.
    if ! "$PYTHON" -c "from importlib.metadata import entry_points as e
raise SystemExit(not any(p.name == 'pagedkv_conformance' for p in e(group='pytest11')))"; then
        plugin=(-p pagedkv_conformance.plugin)
    fi
fi

status=0
# run_part NAME LIMIT_S COMMAND...: the command under its limit, its output into the log.
run_part() {
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    say "$name: starting (limit ${limit} s): $*"
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    local took=$((SECONDS - started))
    local verdict
    case $rc in
        0) verdict="passed" ;;
        124 | 137) verdict="CUT: reached its ${limit} s limit" ;;
        *) verdict="FAILED (exit status $rc)" ;;
    esac
    [ "$rc" -eq 0 ] || status=1
    echo "$name: $verdict in ${took} s" >>"$summary"
    say "$name: $verdict in ${took} s"
}

say "start $(date -u +%Y-%m-%dT%H:%M:%SZ), python $PYTHON, tiny=$tiny"
"$PYTHON" - <<'PY' 2>&1 | tee -a "$log"
import torch
import transformers

print(f"torch {torch.__version__}, transformers {transformers.__version__}")
if torch.cuda.is_available():
    print(f"CUDA {torch.version.cuda}: {torch.cuda.get_device_name(0)}")
else:
    print("CUDA: not available")
PY

collect=()
device=(--device cuda)
bench_mode=()
if [ "$tiny" -eq 1 ]; then
    collect=(--collect-only)
    device=(--device cpu --threads 2)
    bench_mode=(--quick)
fi

mapfile -t nodes < <(grep -v '^#' scripts/gpu_check_tests.txt | grep -v '^$')
run_part tests "$TESTS_S" "$PYTHON" -m pytest -q -rs "${plugin[@]}" "${collect[@]}" \
    -p no:cacheprovider "${nodes[@]}"
run_part conformance "$CONFORMANCE_S" "$PYTHON" -m pytest -q -rs "${plugin[@]}" \
    "${collect[@]}" -p no:cacheprovider --pyargs pagedkv_conformance -k cuda
run_part bench $((BENCH_S + BENCH_GRACE_S)) "$PYTHON" -m pagedkv.bench "${device[@]}" \
    "${bench_mode[@]}" --only device --budget-s "$BENCH_S" --no-plots --out "$out/bench"

say "done in ${SECONDS} s; summary:"
tee -a "$log" <"$summary"
exit $status
