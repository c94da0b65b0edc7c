#!/usr/bin/env bash
# GuideLLM against `make serve` (issue 17): a sweep of request rates with synthetic prompts, the
# request shapes GuideLLM sends to a vLLM server (streaming with
# stream_options.continuous_usage_stats, ignore_eos, stop: null, max_tokens), with the served
# model's own tokenizer (its local folder) for the synthetic data. Not a test: a benchmark.
#
#   make serve                                   # terminal 1: serves the default model on :8000
#   bash bench/guidellm.sh                       # terminal 2 (installs guidellm in its own venv once)
#   TARGET=http://127.0.0.1:8000 ENDPOINT=/v1/chat/completions MAX_SECONDS=60 bash bench/guidellm.sh
#
# Writes bench/results/guidellm.json (GuideLLM's report) and prints GuideLLM's summary tables.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TARGET=${TARGET:-http://127.0.0.1:8000}
MODEL=${MODEL:-SmolLM2-135M-Instruct}
ENDPOINT=${ENDPOINT:-/v1/completions}          # GuideLLM's request type: /v1/completions or /v1/chat/completions
DATA=${DATA:-prompt_tokens=256,output_tokens=128}
MAX_SECONDS=${MAX_SECONDS:-30}
PROFILE=${PROFILE:-kind=sweep}                 # e.g. kind=synchronous, kind=concurrent,streams=8
OUT=${OUT:-bench/results/guidellm.json}

# GuideLLM in its own virtual environment: its pins (click, multidict) differ from the project's.
GL_VENV=${GL_VENV:-/tmp/cbserve-guidellm-venv}
if ! "$GL_VENV/bin/python" -c "import guidellm" 2>/dev/null; then
    python3 -m venv "$GL_VENV"
    "$GL_VENV/bin/python" -m pip install -q "guidellm>=0.8"
fi
# The tokenizer GuideLLM sizes synthetic prompts with: the served default model's local folder.
PROCESSOR=${PROCESSOR:-$("$PY" -c "import cbserve; print(cbserve.models.checkpoint_folder())")}
curl -sf "$TARGET/health" >/dev/null || { echo "nothing serves $TARGET: start it with 'make serve'" >&2; exit 1; }

mkdir -p "$(dirname "$OUT")"
# GuideLLM >= 0.8's CLI (`guidellm run`, each part as kind=...,key=value).
"$GL_VENV/bin/python" -m guidellm run \
    --backend "kind=openai_http,target=$TARGET,model=$MODEL,request_format=$ENDPOINT" \
    --tokenizer "kind=huggingface_auto,model=$PROCESSOR" \
    --data "kind=synthetic_text,$DATA" \
    --profile "$PROFILE" \
    --constraint "kind=max_duration,seconds=$MAX_SECONDS" \
    --output "kind=json,path=$OUT" --output "kind=console"
