#!/usr/bin/env bash
# tokenmill against vLLM on one multi-GPU machine: tensor and expert parallelism.
#   OUT=/tmp/out bash benchmarks/device/multi_gpu.sh GPUS      (GPUS: 2, 4 or 8)
#
#   2  Llama-3.1-8B dummy, TP=2: offline 1,024/256 (1,000 prompts) and batch-1 decode
#      (32 in, 256 out); Mixtral-8x7B-shaped dummy, TP=2 with --enable-expert-parallel,
#      served (random 1,024/256, 500 prompts, 64 at a time); tests/gpu/test_parallel_gpu.py
#   4  Llama-3.1-70B dummy, TP=4: offline 1,024/256 (1,000 prompts); Mixtral EP over 4
#   8  Llama-3.1-70B dummy, TP=8: the same; Mixtral EP over 8
#
# Each benchmark runs tokenmill, then vLLM with the same flags, one after the other on the
# same GPUs. Needs vLLM 0.24 on PATH and M8 (Llama-3.1-8B's config.json and tokenizer), as
# run.sh sets them up from the peer-vllm bundle (sourced here when present). The 70B and
# Mixtral configs are written here by hand, with M8's tokenizer (Mixtral-shaped: its layers
# and experts, Llama-3.1's vocabulary of 128,256 so the one tokenizer serves both).
# Results: $OUT/summary.log (key lines), $OUT/*.json (each run's --output-json /
# --result-filename), $OUT/compare_*.txt (tokenmill bench compare), $OUT/logs/.
set -uo pipefail
cd "$(dirname "$0")/../.."
GPUS="${1:?usage: multi_gpu.sh 2|4|8}"
OUT="${OUT:-/tmp/tm_out}"; mkdir -p "$OUT/logs"
SUM="$OUT/summary.log"
if [ -f .carry/peer-vllm/tools/device_setup.sh ]; then
  source .carry/peer-vllm/tools/device_setup.sh .carry/peer-vllm/parts > "$OUT/logs/setup.log" 2>&1
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
TM=(python3 -m tokenmill.entrypoints.cli.main)
MODELS="$OUT/models"; mkdir -p "$MODELS"
say() { echo "$*" | tee -a "$SUM"; }
run() {  # run NAME CMD...: log to $OUT/logs/NAME.log, key lines to the summary
  local name=$1; shift
  local t=$(date +%s)
  timeout -k 10 "${TIMEOUT_S:-3600}" "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  say "RUN $name rc=$rc wall=$(( $(date +%s) - t ))s"
  grep -aE "Throughput:|Avg latency|Parallel layout|KV cache|passed|failed|Error|Mean TTFT|Median TTFT|Median TPOT|Output token throughput" \
    "$OUT/logs/$name.log" | grep -v warnings.warn | tail -12 | sed 's/^/  | /' | tee -a "$SUM"
}

write_config() {  # write_config NAME PYTHON-DICT: a model folder with M8's tokenizer
  local dir="$MODELS/$1"; mkdir -p "$dir"
  cp "$M8"/tokenizer* "$M8"/generation_config.json "$dir"/ 2>/dev/null
  python3 -c "import json,sys; json.dump($2, open(sys.argv[1], 'w'), indent=1)" "$dir/config.json"
  echo "$dir"
}
ROPE="{'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0, 'original_max_position_embeddings': 8192, 'rope_type': 'llama3'}"
M70=$(write_config llama31-70b-dummy "{'architectures': ['LlamaForCausalLM'], 'model_type': 'llama', 'hidden_size': 8192, 'intermediate_size': 28672, 'num_hidden_layers': 80, 'num_attention_heads': 64, 'num_key_value_heads': 8, 'vocab_size': 128256, 'max_position_embeddings': 131072, 'rms_norm_eps': 1e-5, 'rope_theta': 500000.0, 'rope_scaling': $ROPE, 'bos_token_id': 128000, 'eos_token_id': [128001, 128008, 128009], 'hidden_act': 'silu', 'tie_word_embeddings': False, 'torch_dtype': 'bfloat16'}")
MIX=$(write_config mixtral-8x7b-dummy "{'architectures': ['MixtralForCausalLM'], 'model_type': 'mixtral', 'hidden_size': 4096, 'intermediate_size': 14336, 'num_hidden_layers': 32, 'num_attention_heads': 32, 'num_key_value_heads': 8, 'num_local_experts': 8, 'num_experts_per_tok': 2, 'vocab_size': 128256, 'max_position_embeddings': 32768, 'rms_norm_eps': 1e-5, 'rope_theta': 1000000.0, 'sliding_window': None, 'bos_token_id': 128000, 'eos_token_id': 128001, 'hidden_act': 'silu', 'tie_word_embeddings': False, 'torch_dtype': 'bfloat16'}")

offline() {  # offline NAME MODEL TP: bench throughput 1,024/256, tokenmill then vLLM
  local args=(--model "$2" --load-format dummy --tensor-parallel-size "$3" --dataset-name random
              --random-input-len 1024 --random-output-len 256 --num-prompts 1000 --max-model-len 4096)
  run "tm_$1" "${TM[@]}" bench throughput "${args[@]}" --output-json "$OUT/tm_$1.json"
  run "vllm_$1" vllm bench throughput "${args[@]}" --output-json "$OUT/vllm_$1.json"
  "${TM[@]}" bench compare "$OUT/tm_$1.json" "$OUT/vllm_$1.json" > "$OUT/compare_$1.txt" 2>&1
}

batch1() {  # batch1 NAME MODEL TP: bench latency, batch 1, 32 in / 256 out
  local args=(--model "$2" --load-format dummy --tensor-parallel-size "$3" --input-len 32
              --output-len 256 --batch-size 1 --num-iters-warmup 3 --num-iters 10 --max-model-len 4096)
  run "tm_$1" "${TM[@]}" bench latency "${args[@]}" --output-json "$OUT/tm_$1.json"
  run "vllm_$1" vllm bench latency "${args[@]}" --output-json "$OUT/vllm_$1.json"
}

wait_health() {
  for _ in $(seq 1 900); do
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)" 2>/dev/null && return 0
    sleep 2
  done
  return 1
}

served() {  # served NAME MODEL TP EXTRA...: serve, bench serve random 1,024/256 c=64, stop
  local name=$1 model=$2 tp=$3; shift 3
  local flags=(--load-format dummy --tensor-parallel-size "$tp" --max-model-len 4096 --port 8000 "$@")
  local engine
  for engine in tm vllm; do
    if [ "$engine" = tm ]; then "${TM[@]}" serve "$model" "${flags[@]}" > "$OUT/logs/${engine}_${name}_server.log" 2>&1 &
    else vllm serve "$model" "${flags[@]}" > "$OUT/logs/${engine}_${name}_server.log" 2>&1 &
    fi
    local pid=$!
    if wait_health; then
      run "${engine}_$name" "${TM[@]}" bench serve --base-url http://127.0.0.1:8000 --model "$model" \
        --dataset-name random --random-input-len 1024 --random-output-len 256 --num-prompts 500 \
        --max-concurrency 64 --ignore-eos --seed 0 --percentile-metrics ttft,tpot,itl,e2el \
        --label "$engine" --save-result --result-filename "$OUT/${engine}_$name.json"
    else
      say "RUN ${engine}_$name: the server did not start (see logs/${engine}_${name}_server.log)"
    fi
    kill -INT "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
  done
  "${TM[@]}" bench compare "$OUT/tm_$name.json" "$OUT/vllm_$name.json" > "$OUT/compare_$name.txt" 2>&1
}

say "multi_gpu.sh $GPUS on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $(nvidia-smi -L | wc -l)"
case "$GPUS" in
  2)
    run gputests python3 -m pytest -q tests/gpu/test_parallel_gpu.py
    offline llama8b_tp2 "$M8" 2
    batch1 llama8b_tp2_batch1 "$M8" 2
    served mixtral_ep2 "$MIX" 2 --enable-expert-parallel
    ;;
  4|8)
    offline "llama70b_tp$GPUS" "$M70" "$GPUS"
    served "mixtral_ep$GPUS" "$MIX" "$GPUS" --enable-expert-parallel
    ;;
  *) echo "GPUS must be 2, 4 or 8" >&2; exit 2 ;;
esac
for f in "$OUT"/compare_*.txt; do [ -f "$f" ] && { echo "== $f"; cat "$f"; } >> "$SUM"; done
