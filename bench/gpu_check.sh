#!/usr/bin/env bash
# GPU checks for a CUDA machine:
#   1. kernels: the paged attention kernel tests compiled for the GPU (no Triton interpreter),
#   2. backends: the engine on the triton and flash backends with real decode and varlen CUDA graphs vs
#      generate() (tests/kernels/test_attention_backends.py), async batching on a real stream
#      (tests/workers/test_async_batching.py),
#   3. features: chunked prefill, preemption, prefix hits, LoRA, speculation, seeded sampling and
#      embeddings on the GPU vs generate() / peft on the GPU (tests/workers/test_cuda_features.py),
#   4. throughput: the benchmark on every workload, on a random-weight model of Qwen3-0.6B's shape (no
#      model files needed): cbserve's defaults on CUDA (CUDA graphs and async batching), cbserve eager
#      and synchronous, beside transformers' continuous batching.
# cbserve is imported from this checkout (PYTHONPATH), so nothing needs installing but its
# dependencies. Each step runs under `timeout`; the limits add up to 8 minutes. Every step runs even
# if an earlier one failed; a summary is printed at the end and the exit status is 1 if any step failed.
# Usage: bench/gpu_check.sh   (PYTHON=/path/to/python to choose the interpreter, LOG_DIR=... for the logs,
#                              STEPS="features throughput" to run some steps only)
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

PYTHON=${PYTHON:-python}
unset TRITON_INTERPRET  # compile the Triton kernels for the GPU
LOG_DIR=${LOG_DIR:-$(mktemp -d /tmp/cbserve_gpu_check.XXXXXX)}
mkdir -p "$LOG_DIR"
STEPS=${STEPS:-kernels backends features throughput}
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
    [[ " $STEPS " == *" $name "* ]] || return 0
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

PYTEST=("$PYTHON" -m pytest -q -p no:cacheprovider -rs)
step kernels 80 env CBSERVE_TEST_DEVICE=cuda "${PYTEST[@]}" tests/kernels/test_paged_attention.py
step backends 100 "${PYTEST[@]}" tests/kernels/test_attention_backends.py tests/workers/test_async_batching.py
step features 100 "${PYTEST[@]}" tests/workers/test_cuda_features.py
step throughput 200 "$PYTHON" bench/throughput.py --workload all --random-shape qwen3-0.6b --device cuda \
    --requests 64 --engines cbserve,cbserve:eager,hf_cb \
    --cbserve-variant eager='{"use_cuda_graph": false, "use_async_batching": false}' \
    --json "$LOG_DIR/throughput.json"

echo
echo "=== gpu_check summary (logs in $LOG_DIR)"
for line in "${SUMMARY[@]}"; do
    echo "$line"
done
exit "$FAILED"
