#!/usr/bin/env bash
# GPU checks for a CUDA machine (none exists where this was written; it has never run on one).
#   1. the kernel tests compiled for the GPU (no Triton interpreter),
#   2. the engine on the triton and flash backends with real decode and varlen CUDA graphs vs generate()
#      (tests/kernels/test_attention_backends.py), async batching on a real stream (tests/workers/test_async_batching.py),
#      then the test suite without the Ray tests,
#   3. the throughput benchmark on every workload, on a random-weight model of Qwen3-0.6B's shape
#      (the default model's file is not needed on the GPU machine).
# Each step runs under `timeout`; the limits add up to 7.5 minutes. Every step runs even if an
# earlier one failed; a summary is printed at the end and the exit status is 1 if any step failed.
# Usage: bench/gpu_check.sh            (PYTHON=/path/to/python to choose the interpreter)
set -u -o pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
unset TRITON_INTERPRET  # compile the Triton kernels for the GPU
LOG_DIR=${LOG_DIR:-$(mktemp -d /tmp/cbserve_gpu_check.XXXXXX)}
declare -a SUMMARY=()
FAILED=0

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: torch sees no CUDA device; nothing to check" >&2
    exit 2
fi
"$PYTHON" - <<'EOF'
import torch
print(f"gpu_check: torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
from cbserve.kernels import flash_attn_adapter, triton_attention
print(f"gpu_check: triton available: {triton_attention.TRITON_AVAILABLE}")
print(f"gpu_check: flash-attn: {flash_attn_adapter.flash_unavailable_reason() or 'available'}")
EOF

# step NAME LIMIT_SECONDS CMD...: run CMD under timeout, log to $LOG_DIR/NAME.log, record the outcome.
step() {
    local name=$1 limit=$2
    shift 2
    local log="$LOG_DIR/$name.log" start=$SECONDS rc
    echo "=== $name (limit ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$log"
    rc=$?
    local outcome="ok"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        outcome="TIMEOUT"
    elif [ "$rc" -ne 0 ]; then
        outcome="FAILED (rc=$rc)"
    fi
    [ "$outcome" = "ok" ] || FAILED=1
    SUMMARY+=("$(printf '%-12s %-16s %4ds  %s' "$name" "$outcome" $((SECONDS - start)) "$(tail -n 1 "$log")")")
}

step kernels 90 env CBSERVE_TEST_DEVICE=cuda "$PYTHON" -m pytest -q tests/kernels/test_paged_attention.py
step backends 120 env CBSERVE_TEST_DEVICE=cuda "$PYTHON" -m pytest -q tests/kernels/test_attention_backends.py tests/workers/test_async_batching.py
step tests 150 env CBSERVE_TEST_DEVICE=cuda "$PYTHON" -m pytest -q -m "not ray" tests
step throughput 90 "$PYTHON" bench/throughput.py --workload all --random-shape qwen3-0.6b --device cuda --requests 64

echo
echo "=== gpu_check summary (logs in $LOG_DIR)"
for line in "${SUMMARY[@]}"; do
    echo "$line"
done
exit "$FAILED"
