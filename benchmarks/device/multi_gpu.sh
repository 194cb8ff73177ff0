#!/usr/bin/env bash
# tokenmill against vLLM on one multi-GPU machine: tensor and expert parallelism.
#   OUT=/tmp/out bash benchmarks/device/multi_gpu.sh TARGET...
#
# A TARGET is a machine size (every case for it) or one case:
#   2  llama8b_tp2 llama8b_tp2_batch1 mixtral_ep2 gputests
#   4  llama70b_tp4 mixtral_ep4
#   8  llama70b_tp8 mixtral_ep8
#   llama8b_tp2         Llama-3.1-8B dummy, TP=2: offline 1,024/256 (1,000 prompts)
#   llama8b_tp2_batch1  the same, batch-1 decode (32 in, 256 out)
#   llama70b_tpN        Llama-3.1-70B dummy (config written here), TP=N: offline 1,024/256
#   mixtral_epN         Mixtral-8x7B-shaped dummy, TP=N with --enable-expert-parallel, served
#                       (random 1,024/256, 500 prompts, 64 at a time)
#   gputests            tests/gpu/test_parallel_gpu.py (2 GPUs)
#
# Each benchmark runs tokenmill, then vLLM with the same flags, one after the other on the
# same GPUs; ENGINES="tm" or "vllm" runs one side only (run.sh's mgpu_* and vllm_mgpu_*
# stages). Needs vLLM 0.24 on PATH and M8 (Llama-3.1-8B's config.json and tokenizer), as
# run.sh sets them up from the peer-vllm bundle (sourced here when present). The 70B and
# Mixtral configs are written here by hand, with M8's tokenizer (Mixtral-shaped: its layers
# and experts, Llama-3.1's vocabulary of 128,256 so the one tokenizer serves both).
# Results: $OUT/summary.log (key lines), $OUT/*.json (each run's --output-json /
# --result-filename), $OUT/compare_*.txt (tokenmill bench compare, when both sides ran),
# $OUT/logs/.
set -uo pipefail
cd "$(dirname "$0")/../.."
[ $# -gt 0 ] || { echo "usage: multi_gpu.sh 2|4|8|CASE..." >&2; exit 2; }
ENGINES="${ENGINES:-tm vllm}"
OUT="${OUT:-/tmp/tm_out}"; mkdir -p "$OUT/logs"
SUM="$OUT/summary.log"
if [ -f .carry/peer-vllm/tools/device_setup.sh ] && ! command -v vllm >/dev/null; then
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

compare() {  # compare NAME: tokenmill bench compare, when both engines ran
  [ -f "$OUT/tm_$1.json" ] && [ -f "$OUT/vllm_$1.json" ] &&
    "${TM[@]}" bench compare "$OUT/tm_$1.json" "$OUT/vllm_$1.json" > "$OUT/compare_$1.txt" 2>&1
}

offline() {  # offline NAME MODEL TP: bench throughput 1,024/256
  local args=(--model "$2" --load-format dummy --tensor-parallel-size "$3" --dataset-name random
              --random-input-len 1024 --random-output-len 256 --num-prompts 1000 --max-model-len 4096)
  case " $ENGINES " in *" tm "*) run "tm_$1" "${TM[@]}" bench throughput "${args[@]}" --output-json "$OUT/tm_$1.json" ;; esac
  case " $ENGINES " in *" vllm "*) run "vllm_$1" vllm bench throughput "${args[@]}" --output-json "$OUT/vllm_$1.json" ;; esac
  compare "$1"
}

batch1() {  # batch1 NAME MODEL TP: bench latency, batch 1, 32 in / 256 out
  local args=(--model "$2" --load-format dummy --tensor-parallel-size "$3" --input-len 32
              --output-len 256 --batch-size 1 --num-iters-warmup 3 --num-iters 10 --max-model-len 4096)
  case " $ENGINES " in *" tm "*) run "tm_$1" "${TM[@]}" bench latency "${args[@]}" --output-json "$OUT/tm_$1.json" ;; esac
  case " $ENGINES " in *" vllm "*) run "vllm_$1" vllm bench latency "${args[@]}" --output-json "$OUT/vllm_$1.json" ;; esac
}

wait_health() {  # wait_health PID: until /health answers, or the server exits
  for _ in $(seq 1 900); do
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)" 2>/dev/null && return 0
    kill -0 "$1" 2>/dev/null || return 1
    sleep 2
  done
  return 1
}

served() {  # served NAME MODEL TP EXTRA...: serve, bench serve random 1,024/256 c=64, stop
  local name=$1 model=$2 tp=$3; shift 3
  local flags=(--load-format dummy --tensor-parallel-size "$tp" --max-model-len 4096 --port 8000 "$@")
  local engine
  for engine in $ENGINES; do
    if [ "$engine" = tm ]; then setsid "${TM[@]}" serve "$model" "${flags[@]}" > "$OUT/logs/${engine}_${name}_server.log" 2>&1 &
    else setsid vllm serve "$model" "${flags[@]}" > "$OUT/logs/${engine}_${name}_server.log" 2>&1 &
    fi
    local pid=$!
    if wait_health "$pid"; then
      run "${engine}_$name" "${TM[@]}" bench serve --base-url http://127.0.0.1:8000 --model "$model" \
        --dataset-name random --random-input-len 1024 --random-output-len 256 --num-prompts 500 \
        --max-concurrency 64 --ignore-eos --seed 0 --percentile-metrics ttft,tpot,itl,e2el \
        --label "$engine" --save-result --result-filename "$OUT/${engine}_$name.json"
    else
      say "RUN ${engine}_$name: the server did not start (see logs/${engine}_${name}_server.log)"
      tail -5 "$OUT/logs/${engine}_${name}_server.log" | sed 's/^/  | /' | tee -a "$SUM"
    fi
    # The server and its rank processes: SIGINT to the group, SIGKILL after 30 s.
    kill -INT -- -"$pid" 2>/dev/null
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -9 -- -"$pid" 2>/dev/null; wait "$pid" 2>/dev/null; sleep 2
  done
  compare "$name"
}

run_case() {
  case "$1" in
    2) for c in gputests llama8b_tp2 llama8b_tp2_batch1 mixtral_ep2; do run_case $c; done ;;
    4|8) run_case "llama70b_tp$1"; run_case "mixtral_ep$1" ;;
    gputests) run gputests python3 -m pytest -q tests/gpu/test_parallel_gpu.py -p no:cacheprovider ;;
    llama8b_tp2) offline llama8b_tp2 "$M8" 2 ;;
    llama8b_tp2_batch1) batch1 llama8b_tp2_batch1 "$M8" 2 ;;
    llama70b_tp[0-9]*) offline "$1" "$M70" "${1#llama70b_tp}" ;;
    mixtral_ep[0-9]*) served "$1" "$MIX" "${1#mixtral_ep}" --enable-expert-parallel ;;
    *) say "unknown target $1 (2, 4, 8, or a case: see the header)"; return 2 ;;
  esac
}

say "multi_gpu.sh $* ($ENGINES) on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $(nvidia-smi -L | wc -l)"
for target in "$@"; do run_case "$target"; done
for f in "$OUT"/compare_*.txt; do [ -f "$f" ] && { echo "== $f"; cat "$f"; } >> "$SUM"; done
