#!/usr/bin/env bash
# Runs tokenmill's GPU checks and benchmarks on the lent H200, next to vLLM's recipe.
#   bash benchmarks/device/run.sh STAGE [STAGE...]
# Needs the vLLM bundle (tools/peer-vllm prepare.sh) in .carry/peer-vllm/parts and its
# scripts in .carry/peer-vllm/tools: the bundle's wheels (fastapi, uvicorn, pyzmq, msgspec)
# are tokenmill's server dependencies there, and its model folders are the M8/M135 configs.
# Stages:
#   vision     a Qwen2.5-VL-7B-shaped dummy (make_vl_model.py) served by tokenmill, then vLLM:
#              128 chat requests of one random 1024x1024 image, 128 in / 128 out, 64 at a time
#              (bench serve --dataset-name random-mm); gputests_vision tests/gpu/test_vision_gpu.py
#              and test_vlm_families_gpu.py;
#              tm_vision / vllm_vision one engine (VISION_DIAG=1: tokenmill's step and front-end
#              timings); tm_vision_gemma3 / vllm_vision_gemma3 the same load on a
#              Gemma-3-4B-shaped dummy (make_vl_model.py --gemma3); vision_profile the front end's per-image work and the vision tower
#              (vision_profile.py)
#   gputests_quant  the int4 and GGUF dequantize-in-GEMM kernels on CUDA (tests/gpu/
#              test_quant_gemm_gpu.py, tests/kernels' quantized GEMM and GGUF block tests)
#   gputests_parallel  tests/gpu/test_parallel_gpu.py (TP, PP, EP on 2 GPUs against one)
#   mgpu_tp2_long mgpu_tp2_lat1 mgpu_70b_tp4 mgpu_70b_tp8 mgpu_ep2 mgpu_ep4 mgpu_ep8
#              several GPUs (multi_gpu.sh): Llama-3.1-8B TP=2 offline 1024/256 and batch-1
#              decode, Llama-3.1-70B TP=4/8 offline, Mixtral-8x7B-shaped EP served;
#              vllm_mgpu_* the same with vLLM's CLI (results and comparisons in $OUT/mgpu)
#   gguf_kernels  the Q4_K/Q6_K GEMV (and a sweep of its tiles) and the GGUF tile kernel against
#              cuBLAS at M8's shapes (gguf_kernel_bench.py; GGUF_ARGS passes its flags)
#   int4_kernels  the int4 GEMV, tensor-core and dequantize-then-cuBLAS paths against cuBLAS
#              bf16 at Llama-3.1-8B's shapes, M = 1 to 4,096, with a sweep of the GEMV's tiles
#              (int4_kernel_bench.py; INT4_ARGS replaces its arguments, "" for no sweep)
#   quant_lat quant_tp  4-bit weights beside vLLM (benchmarks/device/quant_bench.py): batch-1
#              decode of GPTQ, AWQ (random int4, dummy load) and a random Q4_K_M GGUF; offline
#              1024/256 of GPTQ and AWQ (QUANT_CASES picks the cases)
#   fp8        FP8 beside vLLM (benchmarks/device/fp8_bench.py): M8 with --quantization fp8,
#              batch-1 decode and offline 1024/256; KV capacity in tokens with and without
#              --kv-cache-dtype fp8 (FP8_CASES picks the cases); fp8_serve: served random
#              1024/256 c=64 with --quantization fp8 --kv-cache-dtype fp8, tokenmill then vLLM
#   fp8_gemm      FP8 products at Llama-3.1-8B's shapes (benchmarks/device/fp8_gemm_bench.py)
#   gputests_fp8  the FP8 GEMM, FP8-KV attention and FP8 engine tests on CUDA
#   gputests   pytest tests/gpu and the Triton/fused-kernel tests on CUDA; gputests_all also
#              the skinny-GEMM and sampler tests' CUDA cases; gputests_sampler
#              the sampler tests (their CUDA cases), the engine and skinny-GEMM GPU tests
#   attn       benchmarks/attention_bench.py (kernel timings); attn_rope the KV write with and
#              without RoPE fused in; attn_chunk[_uniform] prompt-chunk tile sweeps (CHUNK
#              tokens after 0..768 cached; _uniform as whole-step graphs launch them)
#   gputests_staging  the step-input staging tests on CUDA and the engine's GPU tests;
#              stagingtest the staging tests alone
#   gputests_engine  the engine's GPU tests, fused kernels, attention hook and sampler
#   gputests_decode the attention kernels' GPU tests and the engine's decode, graph and
#              prefix tests
#   gputests_skinny  the skinny GEMM's tests on CUDA (but the long Llama-shape sweep;
#              gputests_skinny_full with it)
#   base_lat1 base_lat32  the same on the tree in .carry/base (a base commit's git archive of
#              tokenmill/ and benchmarks/), to compare two commits on one machine
#   lat1 lat8 lat32 tokenmill bench latency, M8, 32 in / 256 out, batch 1 / 8 / 32; lat1@VAR=VALUE
#              (or lat32@..., several joined by +) the same with those variables set
#   tp_long tp_short tp_small   tokenmill bench throughput (as ANCHORS.md)
#   serve      tokenmill serve M8 + bench serve random 1024/256 c=64, then shared prefix
#   pstep      one prompt-only step: tokenmill bench latency, M8, 8 prompts of 1,024 tokens,
#              one output token (vllm_pstep: the same with vLLM's CLI)
#   vllm_*     the same stage run by vLLM's CLI (vllm_tp_long, vllm_lat1, ...)
#   tp_gptoss  tokenmill bench throughput of a gpt-oss-20b-shaped dummy (MXFP4 experts;
#              make_arch_models.py writes it, with $M8's tokenizer), 1,024/256, 1,000
#              prompts (vllm_tp_gptoss: the same with vLLM's CLI; tp_gptoss_grouped:
#              tokenmill with --kernel-config '{"moe_prompt_experts": "grouped_gemm"}')
#   gputests_arch  the GPU tests of attention sinks, chunked attention and the MXFP4 experts
#   stepbench  one decode step's GPU time (decode_step_bench.py)
#   ablation   the batch-1 decode graph with kernels left out (decode_ablation_bench.py);
#              ablation_sweep the same graph under other decode key tiles and split caps;
#              ablation_wide the short-context graph under the whole-context decode tile
#              and other wide tiles (CONTEXT tokens, default 160); ablation_dtiles the
#              graph of BATCH decodes (default 1) under other decode tiles, warps, stages;
#              ablation_onetile under products whose K-slices are one tile each
#   pgemm_curve  the products of one step (32 layers, cuBLAS and cuBLASLt) against M tokens
#   mixedcurve  a mixed step's graph time against its tokens (CURVE_CASES="D,ctx,chunk,cached ...")
#   mixedbench eager vs captured mixed (decode + prompt chunk) steps (mixed_step_bench.py);
#              mixedbench_shared: only the batches whose decodes share a prefix (cascade)
#   moe_mxfp4  the fused MoE kernel on gpt-oss-20b's MXFP4 experts, tile sweep
#   moe_gptoss the MXFP4 experts of gpt-oss-20b: the Triton kernel, the torch loop and the
#              grouped-GEMM path (no tile sweep)
#   moe_dsv3   the bf16 experts of a DeepSeek-V3 layer (32 of them, top-8): Triton, torch loop
#              and the grouped-GEMM path
#   skinny skinny_sweep moe   kernel benchmarks: skinny GEMM vs cuBLAS, fused MoE vs torch;
#              skinny_pdl / skinny_sweep_pdl the same with programmatic dependent launches
#   *_cublas   lat1/lat32/stepbench with --kernel-config '{"skinny_gemm": "off"}' (cuBLAS for
#              every product)
#   diag_default diag_vllm diag_pace512 ...   serving with per-request detail, /metrics and
#              step logs (LOADS="random prefix" picks the loads); diag_paceN paces prompt
#              tokens (--prefill-pacing-mode prompt), diag_default takes the server's defaults
#   attn_prefix attn_dtiles   decode attention with a shared prefix; decode tile sweep
#   attn_dtiles2 decode tile candidates (DTILES) at serving batches, long contexts and a
#              shared prefix; the split sweep under the tile DTILE
#   attn_serving decode attention at serving batches and contexts, tiles as chosen
#   attn_waves decode attention at serving batches (contexts 1,024..1,280): split counts
#              (SPLITS), the same as whole-step graphs launch it (256 rows), tile shapes
#   sprof_pace256 ...   the server's engine core under a closed loop: step times, GPU busy,
#              kernels and host functions per step (serving_profile.py);
#              sprof_stepN the same paced in step mode (N tokens a step, decodes included);
#              sprofdt_stepN that with the decode attention tile DTILE (KEYS:WARPS:STAGES)
#   spsweep    one engine core under the same closed loop, one timing window per admission
#              policy (SWEEP="PACING:QUEUE_LIMIT:MAX_NUM_SEQS[:STEP_TOKENS] ...";
#              serving_profile.py --sweep)
#   gputests_so  the engine's GPU tests of structured outputs and whole-step graphs
#   diag_stepN serving with per-request detail, --prefill-pacing-mode step --prefill-pacing-tokens N
#   diag_args  serving with per-request detail for a server given DIAG_ARGS (label DIAG_LABEL)
#   seqs_sweep the random load served with --max-num-seqs N for each N in SEQS (default 60)
#   sampler    the sampler's GPU time per call against the softmax route (sampler_bench.py)
#   gputests_topp_unit the top-p and sampler tests on CUDA
#   gputests_attn  the attention kernels' and the engine's GPU tests; gputests_k the GPU
#              tests that pytest's -k "$K" selects
#   cold_parallel[N] cold_serial[N]  tokenmill serve M8 with an empty Triton cache to /health,
#              start-up compiling in parallel (the default) or each kernel at first launch
#   warm_parallel[N] warm_serial[N]  the same with Triton's cache as earlier stages left it
#   gputests_compile  the parallel compile's GPU tests and engine tests around it
#   timeline_lat1 timeline_lat32  a decode step on the GPU's clock at batch 1 / 32 (32 in, 256
#              out): kernels, copies and the idle gaps between them, and what the first step
#              and the host before it do (step_timeline.py)
#   ncu_lat1   Nsight Compute sections of consecutive norm, product and decode-attention kernels
#              of a batch-1 decode (batch1_generate.py; each kernel replayed alone, so no overlap)
#   gputests_lora  the batched LoRA kernels on CUDA against the per-row reference, in CUDA
#              graphs, and LoRA generation against merged weights (tests/gpu/test_lora_gpu.py)
#   lora_serve tokenmill serve M8 without LoRA, then with 8 rank-16 adapters (--max-loras 8),
#              each under vLLM's client (tokenmill's without the bundle), random 1024/256 c=64
#              (LORA_PROMPTS, default 400);
#              with LoRA every request names one of the 8 adapters at random
#   tm_lora_serve  lora_serve's second half only (with the adapters)
#   lora_kernels  the batched LoRA products at M8's shapes beside cuBLAS (lora_kernel_bench.py)
#   vllm_lora_serve  vLLM serving the same 8 adapters under the same load; run
#              "lora_serve vllm_lora_serve" in one call to compare on one GPU
#   first_token  cProfile of a one-token generate (32-token prompt): the host's share of a
#              request's first step (first_token_profile.py)
#   kprof_gptoss kprof_mla  kernel_profile.py (kernel totals of 300 x 1,024/256) on the
#              gpt-oss-20b-shaped and the MLA model
#   mla_tp     a DeepSeek-V3-shaped MLA model (6 layers, 32 experts; mla_throughput.py):
#              tokenmill and vLLM bench throughput 1,024/256 x 1,000 and their KV capacity in
#              tokens ($OUT/mla_throughput.json); mla_tp_tm / mla_tp_vllm one engine each;
#              mla_tp_tm_grouped tokenmill with the grouped-GEMM prompt experts
#              vLLM needs the bundle prepared with KEEP_MOE=1 (its MoE kernels)
#   gputests_mla  the MLA kernels' and DeepSeek engine's GPU tests; mlabench the MLA decode
#              kernel's timings (benchmarks/mla_bench.py; mlabench_sweep with other tiles)
#   spec_prepare  the real SmolLM2 as a bf16 folder, the rewrite load and a 1B-shaped dummy
#              draft (spec_decode_bench.py prepare); then spec_ngram_tm / spec_ngram_vllm:
#              batch-1 ms/token of the rewrite load without and with n-gram speculation;
#              spec_verify_tm / spec_verify_vllm: M8 steps with and without speculation (and
#              tokenmill's forced k=4 verify step against a decode step); spec_report compares
#   gputests_spec  the speculative decoding GPU tests (tests/gpu/test_spec_decode_gpu.py)
#   timing_smoke  tokenmill.benchmarks.cuda_timing on a trivial graph (the kernel benchmarks' timer)
# Results: $OUT/summary.log, $OUT/results.jsonl, $OUT/tails.log, $OUT/logs.tar.gz
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/tm_out}"; mkdir -p "$OUT"
LOGS="$(mktemp -d /tmp/tmlogs.XXXX)"
SUM="$OUT/summary.log"
T0=$(date +%s)
BUDGET_S="${BUDGET_S:-570}"
say() { echo "$*" | tee -a "$SUM"; }
# PV_PARTS: the bundle parts gathered elsewhere (a bundle over the carry limit arrives one part
# per call, each copied out of the checkout first); skipped once this machine has unpacked one
source .carry/peer-vllm/tools/device_setup.sh "${PV_PARTS:-.carry/peer-vllm/parts}" > "$LOGS/setup.log" 2>&1
cat "$LOGS/setup.log" >> "$SUM"
# Without the bundle (a call carrying only part of it, or none: tokenmill-only stages), M8 is
# the folder in .carry/m8 and tokenmill's server dependencies come from the wheels in
# .carry/tmdeps (fastapi, uvicorn, pydantic, pyzmq, msgspec; the device image lacks them).
if [ -z "${M8:-}" ] && [ -f .carry/m8/config.json ]; then export M8="$PWD/.carry/m8"; fi
if ! python3 -c "import fastapi, msgspec, zmq" 2>/dev/null && ls .carry/tmdeps/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/tmdeps .carry/tmdeps/*.whl >> "$LOGS/setup.log" 2>&1 \
    && export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/tmdeps"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# tokenmill's pinned xgrammar and its apache-tvm-ffi (the bundle carries vLLM's older ones),
# for tokenmill's tests only.
XGP="$PYTHONPATH"
if ls .carry/tools/xgrammar-*.whl .carry/tools/apache_tvm_ffi-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/xg .carry/tools/xgrammar-*.whl .carry/tools/apache_tvm_ffi-*.whl >> "$LOGS/setup.log" 2>&1 && XGP="/tmp/xg:$PYTHONPATH"
fi
# Pure-Python packages tokenmill needs that the device image and the bundle lack (gguf),
# appended to the path so that the bundle's own versions win where both exist.
if ls .carry/tools/gguf-*.whl >/dev/null 2>&1; then
  # pycountry: gguf imports the bundle's mistral_common, which needs it
  python3 -m pip install -q --no-index --no-deps --target /tmp/tmx .carry/tools/gguf-*.whl $(ls .carry/tools/pycountry-*.whl 2>/dev/null) >> "$LOGS/setup.log" 2>&1 \
    && export PYTHONPATH="$PYTHONPATH:/tmp/tmx" && XGP="$XGP:/tmp/tmx"
fi
TM=(python3 -m tokenmill.entrypoints.cli.main)
CUBLAS='{"skinny_gemm": "off"}'  # --kernel-config: cuBLAS for every linear layer
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
stage() {  # stage NAME TIMEOUT CMD... (NAME gets $SFX, the STAGE@VARS label)
  local name=$1${SFX:-} to=$2; shift 2
  local l; l=$(left)
  if [ "$l" -lt 20 ]; then say "STAGE $name skipped (${l}s left)"; return 99; fi
  [ "$to" -gt "$l" ] && to=$l
  local t=$(date +%s.%N)
  timeout -k 10 "$to" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  local wall=$(python3 -c "print(round($(date +%s.%N)-$t,1))")
  say "STAGE $name rc=$rc wall=${wall}s (t=$(( $(date +%s) - T0 ))s)"
  grep -aE "^GGUF|^GRAPH|^VPROF|^BEAMSLEEP|^KVOFF|^QUANT|^FP8|^FIRST|^KPROF|^SPROF|Throughput:|Avg latency|passed|failed|error|Error|Traceback|KV cache|CUDA graphs|ready in|Loaded|Memory:|Mean TTFT|Median TTFT|Median TPOT|Mean TPOT|Output token throughput|Request throughput|^ATTN|^GEMV|^STEP|^PGEMM|^CURVE|^LM head|^PROFILE|^SAMPLER|^ABL|^TIMELINE|^MLA|^SPEC|preempt" "$LOGS/$name.log" \
    | grep -v "warnings.warn" | tail -${TAIL_LINES:-25} | sed 's/^/  | /' | tee -a "$SUM"
  { echo "===== $name rc=$rc"; tr '\r' '\n' < "$LOGS/$name.log" | grep -av "it/s\]$" | tail -60; } >> "$OUT/tails.log"
  return $rc
}
addjson() { [ -f "$2" ] && python3 -c "import json,sys; d=json.load(open(sys.argv[2])); d={k:v for k,v in d.items() if not isinstance(v,(list,dict)) or len(v)<=8}; print(json.dumps({'stage':sys.argv[1],'result':d}))" "$1${SFX:-}" "$2" >> "$OUT/results.jsonl" && case "$2" in "$LOGS"/*) rm -f "$2" ;; esac; }
wait_health() {
  local pid=$1 t=$(date +%s.%N)
  for _ in $(seq 1 600); do
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)" 2>/dev/null && { python3 -c "print(round($(date +%s.%N)-$t,1))"; return 0; }
    kill -0 "$pid" 2>/dev/null || { echo died; return 1; }
    sleep 0.5
  done; echo timeout; return 1
}
stop_server() {  # stop_server PID: SIGINT to its process group, SIGKILL after 15 s
  kill -INT -- -$1 2>/dev/null; for _ in $(seq 1 30); do kill -0 $1 2>/dev/null || break; sleep 0.5; done; kill -9 -- -$1 2>/dev/null; sleep 2
}
SERVE_ARGS=(--dataset-name random --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --ignore-eos --save-result --result-dir "$LOGS")
serve_pair() {  # serve_pair ENGINE(tm|vllm) extra server args...
  local eng=$1; shift
  local t=$(date +%s)
  if [ "$eng" = tm ]; then TOKENMILL_LOG_STEP_STATS=1 setsid "${TM[@]}" serve "$M8" --load-format dummy --port 8000 --disable-log-requests --served-model-name "$M8" "$@" > "$LOGS/${eng}_server.log" 2>&1 &
  else setsid vllm serve "$M8" --load-format dummy --port 8000 "$@" > "$LOGS/${eng}_server.log" 2>&1 & fi
  local pid=$!
  local ready; ready=$(wait_health $pid)
  say "STAGE ${eng}_server ready after ${ready}s"
  grep -aE "KV cache|CUDA graphs|Scheduler:|ready in|Memory:|Error|Traceback" "$LOGS/${eng}_server.log" | head -8 | sed 's/^/  | /' | tee -a "$SUM"
  echo "{\"stage\":\"${eng}_server\",\"ready_s\":\"$ready\"}" >> "$OUT/results.jsonl"
  local B=("${TM[@]}" bench serve); [ "$eng" = vllm ] && B=(vllm bench serve --backend vllm)
  stage ${eng}_serve_random 300 "${B[@]}" --model "$M8" --port 8000 "${SERVE_ARGS[@]}" --random-input-len 1024 --random-output-len 256 --num-prompts 500 --max-concurrency 64 --result-filename ${eng}_serve_random.json
  addjson ${eng}_serve_random "$LOGS/${eng}_serve_random.json"
  stage ${eng}_serve_prefix 200 "${B[@]}" --model "$M8" --port 8000 "${SERVE_ARGS[@]}" --random-prefix-len 2000 --random-input-len 256 --random-output-len 128 --num-prompts 500 --max-concurrency 64 --result-filename ${eng}_serve_prefix.json
  addjson ${eng}_serve_prefix "$LOGS/${eng}_serve_prefix.json"
  if [ "$eng" = tm ] && [ -n "${VCLIENT:-}" ]; then  # vLLM's own client against tokenmill
    local V=(vllm bench serve --backend vllm)
    stage tm_vclient_random 300 "${V[@]}" --model "$M8" --port 8000 "${SERVE_ARGS[@]}" --random-input-len 1024 --random-output-len 256 --num-prompts 500 --max-concurrency 64 --result-filename tm_vclient_random.json
    addjson tm_vclient_random "$LOGS/tm_vclient_random.json"
    stage tm_vclient_prefix 200 "${V[@]}" --model "$M8" --port 8000 "${SERVE_ARGS[@]}" --random-prefix-len 2000 --random-input-len 256 --random-output-len 128 --num-prompts 500 --max-concurrency 64 --result-filename tm_vclient_prefix.json
    addjson tm_vclient_prefix "$LOGS/tm_vclient_prefix.json"
  fi
  grep -aE "Engine steps|event loop lag" "$LOGS/${eng}_server.log" | tail -40 > "$OUT/${eng}_server_steps.log" 2>/dev/null
  stop_server $pid
}
# start_up STAGE [VAR=VALUE...]: tokenmill serve M8 with those variables set, timed to a healthy
# /health, stopped. A cold_* stage starts on an empty Triton cache (as on a fresh machine or
# after an upgrade); a warm_* stage on the cache earlier stages left.
start_up() {
  local label=$1; shift
  local dir="${TRITON_CACHE_DIR:-$HOME/.triton/cache}"
  [ "${label#cold_}" != "$label" ] && dir=$(mktemp -d /tmp/tritoncache.XXXX)
  env TRITON_CACHE_DIR="$dir" "$@" setsid "${TM[@]}" serve "$M8" --load-format dummy --port 8000 --served-model-name "$M8" > "$LOGS/$label.log" 2>&1 &
  local pid=$!
  local ready; ready=$(wait_health $pid)
  say "STAGE $label ready after ${ready}s (t=$(( $(date +%s) - T0 ))s; $*)"
  grep -aE "Compiled|ready in|CUDA graphs|Memory:|Error|Traceback" "$LOGS/$label.log" | sed 's/^/  | /' | tee -a "$SUM"
  echo "{\"stage\":\"$label\",\"ready_s\":\"$ready\"}" >> "$OUT/results.jsonl"
  stop_server $pid
  if [ "${label#cold_}" != "$label" ]; then rm -rf "$dir"; fi
}
# serve_diag LABEL [server args...]: tokenmill serve with vLLM's client on both serving loads;
# keeps per-request detail, /metrics before and after each load, the server's step log and,
# if .carry/tools has a py-spy wheel, a profile of the API server during the random load.
serve_diag() {
  local label=$1; shift
  # A server that would come up with too little time left for its first load is not
  # started (vLLM's takes 85-145 s to become healthy, tokenmill's 17-37 s).
  local need=150; [ "${label#vllm}" != "$label" ] && need=260
  if [ "$(left)" -lt "$need" ]; then say "STAGE ${label}_server skipped ($(left)s left, needs ${need}s)"; return 99; fi
  local D="$OUT/serve_diag"; mkdir -p "$D"
  if [ -z "${PYSPY:-}" ] && ls .carry/tools/py_spy-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .carry/tools/py_spy-*.whl >/dev/null 2>&1
    PYSPY=$(ls /tmp/pyspy/bin/py-spy 2>/dev/null)
  fi
  if [ "${label#vllm}" != "$label" ]; then setsid vllm serve "$M8" --load-format dummy --port 8000 "$@" > "$D/${label}_server.log" 2>&1 &
  else TOKENMILL_LOG_STEP_STATS=1 setsid "${TM[@]}" serve "$M8" --load-format dummy --port 8000 --disable-log-requests --disable-uvicorn-access-log --served-model-name "$M8" "$@" > "$D/${label}_server.log" 2>&1 &
  fi
  local pid=$!
  local ready; ready=$(wait_health $pid)
  say "STAGE ${label}_server ready after ${ready}s (args: $*)"
  local V=(vllm bench serve --backend vllm --model "$M8" --port 8000 "${SERVE_ARGS[@]}" --save-detailed --result-dir "$D" --max-concurrency 64 --num-prompts 500)
  for load in ${LOADS:-random prefix}; do
    local args=(--random-input-len 1024 --random-output-len 256); local to=300
    [ $load = prefix ] && { args=(--random-prefix-len 2000 --random-input-len 256 --random-output-len 128); to=200; }
    curl -s http://127.0.0.1:8000/metrics > "$D/${label}_${load}_metrics_before.txt"
    if [ -n "${PYSPY:-}" ]; then (sleep 15; timeout 30 "$PYSPY" record -p $pid -d 15 -r 200 -f raw -o "$D/${label}_${load}_pyspy.txt" > /dev/null 2>&1) & fi
    stage ${label}_${load} $to "${V[@]}" "${args[@]}" --result-filename ${label}_${load}.json
    addjson ${label}_${load} "$D/${label}_${load}.json"
    curl -s http://127.0.0.1:8000/metrics > "$D/${label}_${load}_metrics_after.txt"
  done
  stop_server $pid
}
# vision_pair ENGINE(tm|vllm) [qwen|gemma3]: a Qwen2.5-VL-7B-shaped (or Gemma-3-4B-shaped)
# dummy (benchmarks/device/make_vl_model.py)
# served by ENGINE, 128 chat requests of one random 1024x1024 JPEG and 128 text tokens each,
# 64 at a time, by the engine's own bench client (the same random-mm flags).
VL_MM=(--dataset-name random-mm --random-mm-base-items-per-request 1 --random-mm-num-mm-items-range-ratio 0 --random-mm-limit-mm-per-prompt '{"image": 1, "video": 0}' --random-mm-bucket-config '{(1024, 1024, 1): 1.0}')
vision_pair() {
  local eng=$1 kind=${2:-qwen} VL=/tmp/tm_vl7b label=${1}_vision make=() limits='{"image": 1, "video": 0}'
  if [ "$kind" = gemma3 ]; then VL=/tmp/tm_gemma3_4b label=${1}_vision_gemma3 make=(--gemma3) limits='{"image": 1}'; fi
  [ -f $VL/config.json ] || python3 benchmarks/device/make_vl_model.py "$M135" $VL "${make[@]}" >> "$LOGS/setup.log" 2>&1
  local args=(--load-format dummy --port 8000 --max-model-len 8192 --limit-mm-per-prompt "$limits")
  if [ "$eng" = tm ]; then TOKENMILL_LOG_STEP_STATS=${VISION_DIAG:-0} setsid "${TM[@]}" serve $VL "${args[@]}" --disable-log-requests --served-model-name $VL > "$LOGS/${eng}_vl_server.log" 2>&1 &
  else setsid vllm serve $VL "${args[@]}" > "$LOGS/${eng}_vl_server.log" 2>&1 & fi
  local pid=$!
  local ready; ready=$(wait_health $pid)
  say "STAGE ${eng}_vl_server ready after ${ready}s"
  grep -aE "KV cache|CUDA graphs|ready in|Memory:|Error|Traceback" "$LOGS/${eng}_vl_server.log" | head -8 | sed 's/^/  | /' | tee -a "$SUM"
  local B=("${TM[@]}" bench serve); [ "$eng" = vllm ] && B=(vllm bench serve)
  stage $label 400 "${B[@]}" --backend openai-chat --endpoint /v1/chat/completions --model $VL --port 8000 "${VL_MM[@]}" --random-input-len 128 --random-output-len 128 --num-prompts 128 --max-concurrency 64 --ignore-eos --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --save-result --result-dir "$LOGS" --result-filename $label.json
  addjson $label "$LOGS/$label.json"
  [ "$eng" = tm ] && [ "${VISION_DIAG:-0}" = 1 ] && grep -aE "Engine step|front end|event loop|Avg prompt" "$LOGS/${eng}_vl_server.log" | tail -30 | sed 's/^/  | /' | tee -a "$SUM"
  stop_server $pid
}

# serve_lora LABEL ENGINE(tm|vllm) LORA(0|1) [server args...]: one server under vLLM's client
# (tokenmill's where vLLM is not installed),
# random 1024/256 c=64; LORA=1: each request names one of the adapters in LORA_NAMES.
serve_lora() {
  local label=$1 eng=$2 lora=$3; shift 3
  local need=120; [ "$eng" = vllm ] && need=260
  if [ "$(left)" -lt "$need" ]; then say "STAGE ${label} skipped ($(left)s left, needs ${need}s)"; return 99; fi
  if [ "$eng" = vllm ]; then setsid vllm serve "$M8" --load-format dummy --port 8000 "$@" > "$LOGS/${label}_server.log" 2>&1 &
  else TOKENMILL_LOG_STEP_STATS=1 setsid "${TM[@]}" serve "$M8" --load-format dummy --port 8000 --disable-log-requests --served-model-name "$M8" "$@" > "$LOGS/${label}_server.log" 2>&1 &
  fi
  local pid=$!
  local ready; ready=$(wait_health $pid)
  say "STAGE ${label}_server ready after ${ready}s"
  grep -aE "KV cache|CUDA graphs|LoRA|ready in|Memory:|Error|Traceback" "$LOGS/${label}_server.log" | head -8 | sed 's/^/  | /' | tee -a "$SUM"
  local L=(); [ "$lora" = 1 ] && L=(--lora-modules "${LORA_NAMES[@]}")
  # vLLM's client where the bundle is installed, else tokenmill's (the same flags): a
  # tokenmill-only call compares tokenmill with and without adapters under one client.
  local C=(vllm bench serve --backend vllm); command -v vllm > /dev/null || C=("${TM[@]}" bench serve)
  stage "$label" 300 "${C[@]}" --model "$M8" --port 8000 "${SERVE_ARGS[@]}" --random-input-len 1024 --random-output-len 256 --num-prompts "${LORA_PROMPTS:-400}" --max-concurrency 64 ${L[@]+"${L[@]}"} --result-filename "$label.json"
  addjson "$label" "$LOGS/$label.json"
  [ "$eng" = tm ] && curl -s http://127.0.0.1:8000/metrics | grep -a "lora_requests_info" | head -2 | sed 's/^/  | /' | tee -a "$SUM"
  stop_server $pid
}
lora_adapters() {  # sets LORA_MODULES (name=path ...) and LORA_NAMES: 8 rank-16 adapters for M8
  read -ra LORA_MODULES <<< "$(python3 benchmarks/device/make_lora_adapters.py "$M8" /tmp/tm_lora --num 8 --rank 16)"
  LORA_NAMES=("${LORA_MODULES[@]%%=*}")
}
LORA_ARGS=(--enable-lora --max-loras 8 --max-lora-rank 16)
TPA=(--load-format dummy --dataset-name random)
# gpt-oss-20b's config with $M8's tokenizer, written once per machine.
gptoss_model() {
  MGPTOSS=/tmp/tm_arch_models/gpt-oss-20b-dummy
  [ -f "$MGPTOSS/config.json" ] || python3 benchmarks/device/make_arch_models.py /tmp/tm_arch_models --tokenizer-from "$M8" >> "$LOGS/setup.log" 2>&1
}
# The MLA model of mla_tp (DeepSeek-V3 shapes, 6 layers, 32 experts).
mla_model() {
  MMLA=$(python3 benchmarks/device/mla_throughput.py --model-only --out "$LOGS" 2>>"$LOGS/setup.log")
}
GPTOSS_TP=(--random-input-len 1024 --random-output-len 256 --num-prompts 1000)
run_stage() {  # run_stage NAME: one stage of the list below
  local st=$1
  case "$st" in
    gputests) PYTHONPATH="$XGP" stage gputests 480 python3 -m pytest -q -n 8 tests/gpu tests/kernels/test_fused_kernels.py -p no:cacheprovider --timeout 200 --durations=8 ;;
    gputests_all) PYTHONPATH="$XGP" stage gputests_all 330 python3 -m pytest -q tests/gpu tests/kernels/test_fused_kernels.py tests/kernels/test_skinny_gemm.py tests/worker/test_sampler.py tests/worker/test_sampler_logprobs.py tests/kernels/test_gumbel_sampling.py tests/kernels/test_top_p_select.py -p no:cacheprovider --timeout 200 --durations=5 ;;
    gputests_mixed) stage gputests_mixed 150 python3 -m pytest -q tests/gpu/test_engine_gpu.py -k "mixed_step_graphs or split_decode" -p no:cacheprovider --timeout 120 ;;
    gputests_k) PYTHONPATH="$XGP" stage gputests_k 300 python3 -m pytest -q tests/gpu -k "$K" -p no:cacheprovider --timeout 200 --durations=5 ;;
    gputests_attn) PYTHONPATH="$XGP" stage gputests_attn 300 python3 -m pytest -q tests/gpu/test_triton_attention_gpu.py tests/gpu/test_engine_gpu.py -p no:cacheprovider --timeout 200 --durations=5 ;;
    gputests_topp_unit) stage gputests_topp_unit 200 python3 -m pytest -q tests/kernels/test_top_p_select.py tests/worker/test_sampler.py tests/worker/test_sampler_logprobs.py -p no:cacheprovider --timeout 150 ;;
    gputests_sampler) PYTHONPATH="$XGP" stage gputests_sampler 240 python3 -m pytest -q tests/worker/test_sampler.py tests/worker/test_sampler_logprobs.py tests/kernels/test_gumbel_sampling.py tests/kernels/test_top_p_select.py tests/gpu/test_engine_gpu.py tests/gpu/test_skinny_gemm_gpu.py -p no:cacheprovider --timeout 150 ;;
    gputests_quick) stage gputests_quick 200 python3 -m pytest -q tests/gpu/test_engine_gpu.py tests/kernels/test_fused_kernels.py -p no:cacheprovider --timeout 150 ;;
    stagingtest) stage stagingtest 90 python3 -m pytest -q tests/worker/test_step_staging.py -p no:cacheprovider ;;
    gputests_staging) PYTHONPATH="$XGP" stage gputests_staging 300 python3 -m pytest -q tests/worker/test_step_staging.py tests/gpu/test_engine_gpu.py -p no:cacheprovider --timeout 200 --durations=5 ;;
    gputests_quant) PYTHONPATH="$XGP" stage gputests_quant 400 python3 -m pytest -q tests/gpu/test_quant_gemm_gpu.py tests/kernels/test_gguf_blocks.py -p no:cacheprovider --timeout 300 ;;
    gguf_kernels) TAIL_LINES=80 stage gguf_kernels 300 python3 benchmarks/device/gguf_kernel_bench.py ${GGUF_ARGS:-} ;;
    int4_kernels) stage int4_kernels 300 python3 benchmarks/device/int4_kernel_bench.py ${INT4_ARGS---sweep} ;;
    quant_lat) stage quant_lat 560 python3 benchmarks/device/quant_bench.py "$M8" /tmp/tm_quant --cases "${QUANT_CASES:-gptq_lat1,awq_lat1,gguf_lat1}" --engines "${QUANT_ENGINES:-tokenmill,vllm}" ;;
    fp8) stage fp8 590 python3 benchmarks/device/fp8_bench.py "$M8" /tmp/tm_fp8 --cases "${FP8_CASES:-lat1,tp,kvcap}" --engines "${FP8_ENGINES:-tokenmill,vllm}" ;;
    fp8_gemm) TAIL_LINES=120 stage fp8_gemm 240 python3 benchmarks/device/fp8_gemm_bench.py --shapes "${FP8_GEMM_SHAPES:-qkv,o_proj,gate_up,down}" --ms "${FP8_GEMM_MS:-1,4,16,32}" --prefill-ms "${FP8_GEMM_PMS-256,2048,8192}" ${FP8_GEMM_ARGS:-} ;;
    fp8_serve) LOADS=random serve_diag fp8kv --quantization fp8 --kv-cache-dtype fp8; LOADS=random serve_diag vllm_fp8kv --quantization fp8 --kv-cache-dtype fp8 ;;
    gputests_fp8) PYTHONPATH="$XGP" stage gputests_fp8 400 python3 -m pytest -q tests/gpu/test_fp8_gpu.py tests/kernels/test_fp8_gemm.py tests/kernels/test_skinny_gemm.py -p no:cacheprovider --timeout 300 ;;
    quant_tp) stage quant_tp 560 python3 benchmarks/device/quant_bench.py "$M8" /tmp/tm_quant --cases "${QUANT_CASES:-gptq_tp,awq_tp}" --engines "${QUANT_ENGINES:-tokenmill,vllm}" ;;
    vision) vision_pair tm; vision_pair vllm ;;
    tm_vision) vision_pair tm ;;
    vllm_vision) vision_pair vllm ;;
    tm_vision_gemma3) vision_pair tm gemma3 ;;
    vllm_vision_gemma3) vision_pair vllm gemma3 ;;
    vision_profile)
      [ -f /tmp/tm_vl7b/config.json ] || python3 benchmarks/device/make_vl_model.py "$M135" /tmp/tm_vl7b >> "$LOGS/setup.log" 2>&1
      TAIL_LINES=80 stage vision_profile 200 python3 benchmarks/device/vision_profile.py /tmp/tm_vl7b ;;
    gputests_vision) PYTHONPATH="$XGP" stage gputests_vision 300 python3 -m pytest -q tests/gpu/test_vision_gpu.py tests/gpu/test_vlm_families_gpu.py -p no:cacheprovider --timeout 250 ;;
    gputests_engine) PYTHONPATH="$XGP" stage gputests_engine 240 python3 -m pytest -q tests/gpu/test_engine_gpu.py tests/kernels/test_fused_kernels.py tests/model/test_attention_hook.py tests/worker/test_sampler.py tests/worker/test_sampler_logprobs.py -p no:cacheprovider --timeout 200 ;;
    attn)     stage attn 180 python3 benchmarks/attention_bench.py ;;
    attn_rope) stage attn_rope 120 python3 benchmarks/attention_bench.py --only cache --prefill-tokens 1,64,272,1024 ;;
    attn_chunk) stage attn_chunk 240 python3 benchmarks/attention_bench.py --only prefill --prefill-tokens 1024 --chunk-tokens "${CHUNK:-256}" --chunk-contexts 0,256,512,768 --sweep-tiles ;;
    attn_chunk_uniform) stage attn_chunk_uniform 240 python3 benchmarks/attention_bench.py --only prefill --uniform --prefill-tokens 1024 --chunk-tokens "${CHUNK:-256}" --chunk-contexts 0,256,512,768 --sweep-tiles ;;
    attn_prefix) stage attn_prefix 180 python3 benchmarks/attention_bench.py --only decode --decode-batches 64 --contexts 1280,2304 --shared-prefix 0,2000 --sweep-splits ;;
    attn_ptiles) stage attn_ptiles 300 python3 benchmarks/attention_bench.py --only prefill --prefill-tokens 512,1024 --prefill-batch 1,14 --chunk-tokens 512 --contexts 1024 --sweep-tiles --baseline ;;
    attn_waves)  # decode attention at serving batch sizes: split counts, padded rows, tiles
      stage attn_waves 200 python3 benchmarks/attention_bench.py --only decode --decode-batches 24,32,40,51,64,96,128 --contexts 1024 --context-spread 256 --sweep-splits --split-counts "${SPLITS:-1,2,3,4,5,6,8}"
      stage attn_waves_rows 120 python3 benchmarks/attention_bench.py --only decode --decode-batches 40,51,64 --contexts 1024 --context-spread 256 --decode-rows 256 --sweep-splits --split-counts "${SPLITS:-1,2,3,4,5,6,8}"
      stage attn_waves_tiles 150 python3 benchmarks/attention_bench.py --only decode --decode-batches 51 --contexts 1024 --context-spread 256 --sweep-decode-tiles ;;
    attn_serving) stage attn_serving 120 python3 benchmarks/attention_bench.py --only decode --decode-batches 1,8,16,24,32,40,48,56,64,72,80,96,112,128,160,192,256 --contexts 512,1024,2048 --context-spread 256 ;;
    attn_dtiles3)  # decode tile candidates (DTILES) over a fine batch grid at three contexts
      DT="${DTILES:-64:4:3,64:2:3,128:4:2,32:1:4}"
      for c in 512 1024 2048; do
        stage attn_dtiles3_$c 150 python3 benchmarks/attention_bench.py --only decode --decode-batches 8,16,24,32,40,48,56,64,72,80,96,112,128,160,192,256 --contexts $c --context-spread 256 --sweep-decode-tiles --decode-tiles "$DT"
      done
      stage attn_dtiles3_rows 100 python3 benchmarks/attention_bench.py --only decode --decode-batches 40,51,64 --contexts 1024 --context-spread 256 --decode-rows 256 --decode-tile "${DTILE:-64:2:3}" ;;
    attn_dtiles2)  # decode tile candidates (DTILES) over batches and contexts; splits under DTILE
      DT="${DTILES:-64:4:3,64:2:3,64:2:2,64:2:4,64:1:3,32:2:3,32:1:4,128:2:2,128:4:2}"
      stage attn_dtiles2_serving 200 python3 benchmarks/attention_bench.py --only decode --decode-batches 1,4,16,32,51,64,96,128,256 --contexts 1024 --context-spread 256 --sweep-decode-tiles --decode-tiles "$DT"
      stage attn_dtiles2_long 150 python3 benchmarks/attention_bench.py --only decode --decode-batches 1,8,32 --contexts 4096,16384 --sweep-decode-tiles --decode-tiles "$DT"
      stage attn_dtiles2_prefix 100 python3 benchmarks/attention_bench.py --only decode --decode-batches 64 --contexts 2304 --shared-prefix 2000 --sweep-decode-tiles --decode-tiles "$DT"
      stage attn_dtiles2_splits 150 python3 benchmarks/attention_bench.py --only decode --decode-batches 16,24,32,40,51,64,96,128 --contexts 1024 --context-spread 256 --decode-tile "${DTILE:-64:2:3}" --sweep-splits --split-counts 1,2,3,4,6 ;;
    attn_dtiles) stage attn_dtiles 300 python3 benchmarks/attention_bench.py --only decode --decode-batches 1,64,256 --contexts 2304,8192 --shared-prefix 0,2000 --sweep-decode-tiles ;;
    base_lat1|base_lat32)  # the latency run on the tree in .carry/base (git archive of a base commit)
      bs=1; [ "$st" = base_lat32 ] && bs=32
      say "STAGE $st runs $(PYTHONPATH="$PWD/.carry/base" python3 -P -c 'import tokenmill; print(tokenmill.__file__)')"
      stage "$st" 240 env PYTHONPATH="$PWD/.carry/base" python3 -P -m tokenmill.entrypoints.cli.main bench latency --model "$M8" --load-format dummy --input-len 32 --output-len 256 --batch-size $bs --num-iters-warmup 3 --num-iters 10 --output-json "$LOGS/$st.json"; addjson "$st" "$LOGS/$st.json" ;;
    spec_prepare) stage spec_prepare 150 python3 benchmarks/device/spec_decode_bench.py prepare ;;
    spec_ngram_tm|spec_ngram_vllm) stage "$st" 540 python3 benchmarks/device/spec_decode_bench.py ngram --engine "${st#spec_ngram_}" ;;
    spec_verify_tm|spec_verify_vllm) stage "$st" 560 python3 benchmarks/device/spec_decode_bench.py verify --engine "${st#spec_verify_}" ;;
    spec_report) TAIL_LINES=40 stage spec_report 30 python3 benchmarks/device/spec_decode_bench.py report ;;
    gputests_spec) PYTHONPATH="$XGP" stage gputests_spec 400 python3 -m pytest -q tests/gpu/test_spec_decode_gpu.py -p no:cacheprovider --timeout 300 --durations=5 ;;
    lat1|lat8|lat32)  # batch 1 / 8 / 32
      stage "$st" 240 "${TM[@]}" bench latency --model "$M8" --load-format dummy --input-len 32 --output-len 256 --batch-size "${st#lat}" --num-iters-warmup 3 --num-iters 10 --output-json "$LOGS/$st.json"; addjson "$st" "$LOGS/$st.json" ;;
    tp_long)  stage tp_long 400 "${TM[@]}" bench throughput --model "$M8" "${TPA[@]}" --random-input-len 1024 --random-output-len 256 --num-prompts 1000 --output-json "$LOGS/tp_long.json"; addjson tp_long "$LOGS/tp_long.json" ;;
    tp_short) stage tp_short 400 "${TM[@]}" bench throughput --model "$M8" "${TPA[@]}" --random-input-len 128 --random-output-len 512 --num-prompts 1000 --output-json "$LOGS/tp_short.json"; addjson tp_short "$LOGS/tp_short.json" ;;
    tp_small) stage tp_small 300 "${TM[@]}" bench throughput --model "$M135" "${TPA[@]}" --random-input-len 256 --random-output-len 256 --num-prompts 2000 --output-json "$LOGS/tp_small.json"; addjson tp_small "$LOGS/tp_small.json" ;;
    prof_small) stage prof_small 300 python3 benchmarks/device/profile_step.py "$M135" ;;
    prof_lat1) stage prof_lat1 200 python3 benchmarks/device/profile_step.py "$M8" 1 32 256 ;;
    mixedbench) stage mixedbench 300 python3 benchmarks/device/mixed_step_bench.py "$M8" ;;
    mixedkernels) stage mixedkernels 200 python3 benchmarks/device/mixed_step_bench.py "$M8" --kernels ;;
    mixedserving) stage mixedserving 200 python3 benchmarks/device/mixed_step_bench.py "$M8" --serving ;;
    mixedcurve) stage mixedcurve 240 python3 benchmarks/device/mixed_step_bench.py "$M8" --curve --cases "${CURVE_CASES:-}" ;;
    mixedbench_shared) stage mixedbench_shared 200 python3 benchmarks/device/mixed_step_bench.py "$M8" --shared-only ;;
    sampler) TAIL_LINES=40 stage sampler 150 python3 benchmarks/device/sampler_bench.py ;;
    ablation) stage ablation 240 python3 benchmarks/device/decode_ablation_bench.py "$M8" ;;
    ablation_onetile) TAIL_LINES=40 stage ablation_onetile 300 python3 benchmarks/device/decode_ablation_bench.py "$M8" "${CONTEXT:-160}" --sweep-one-tile ;;
    ablation_wide) TAIL_LINES=40 stage ablation_wide 300 python3 benchmarks/device/decode_ablation_bench.py "$M8" "${CONTEXT:-160}" --sweep-wide ;;
    ablation_dtiles) TAIL_LINES=40 stage ablation_dtiles 300 python3 benchmarks/device/decode_ablation_bench.py "$M8" "${CONTEXT:-160}" --sweep-decode-tiles --batch "${BATCH:-1}" ;;
    ablation_sweep) TAIL_LINES=40 stage ablation_sweep 300 python3 benchmarks/device/decode_ablation_bench.py "$M8" "${CONTEXT:-160}" --sweep ;;
    stepbench) stage stepbench 200 python3 benchmarks/device/decode_step_bench.py "$M8" ;;
    stepbench_cublas) stage stepbench_cublas 200 python3 benchmarks/device/decode_step_bench.py "$M8" --kernel-config "$CUBLAS" ;;
    gputests_decode) PYTHONPATH="$XGP" stage gputests_decode 240 python3 -m pytest -q tests/gpu/test_triton_attention_gpu.py tests/gpu/test_engine_gpu.py -k "attention_gpu or decode or cuda_graphs_equal or cascade or prefix" -p no:cacheprovider --timeout 200 --durations=5 ;;
    gputests_skinny_full) stage gputests_skinny_full 200 python3 -m pytest -q tests/gpu/test_skinny_gemm_gpu.py tests/kernels/test_skinny_gemm.py -p no:cacheprovider --timeout 150 ;;
    gputests_skinny) PYTHONPATH="$XGP" stage gputests_skinny 200 python3 -m pytest -q tests/gpu/test_skinny_gemm_gpu.py tests/kernels/test_skinny_gemm.py -p no:cacheprovider --timeout 150 -k "not test_llama_shapes_bf16" ;;
    lat1_cublas) stage lat1_cublas 240 "${TM[@]}" bench latency --model "$M8" --load-format dummy --kernel-config "$CUBLAS" --input-len 32 --output-len 256 --batch-size 1 --num-iters-warmup 3 --num-iters 10 --output-json "$LOGS/lat1_cublas.json"; addjson lat1_cublas "$LOGS/lat1_cublas.json" ;;
    lat32_cublas) stage lat32_cublas 240 "${TM[@]}" bench latency --model "$M8" --load-format dummy --kernel-config "$CUBLAS" --input-len 32 --output-len 256 --batch-size 32 --num-iters-warmup 3 --num-iters 10 --output-json "$LOGS/lat32_cublas.json"; addjson lat32_cublas "$LOGS/lat32_cublas.json" ;;
    skinny)   stage skinny 200 python3 benchmarks/skinny_gemm_bench.py ;;
    skinny_pdl) stage skinny_pdl 200 python3 benchmarks/skinny_gemm_bench.py --pdl --ms "${SWEEP_MS:-1,4,16}" --shapes qkv,o_proj,gate_up,down,lm_head ;;
    skinny_sweep_pdl) stage skinny_sweep_pdl 400 python3 benchmarks/skinny_gemm_bench.py --pdl --sweep --fma-only --ms "${SWEEP_MS:-1}" --shapes ${SWEEP_SHAPES:-qkv,o_proj,down,gate_up} --rounds 2 ;;
    skinny_sweep) stage skinny_sweep 400 python3 benchmarks/skinny_gemm_bench.py --sweep --ms "${SWEEP_MS:-1}" --shapes qkv,o_proj,gate_up,down --rounds 1 ;;
    moe)      stage moe 150 python3 benchmarks/moe_bench.py ;;
    moetest)  stage moetest 150 python3 -m pytest -q tests/gpu/test_fused_moe_gpu.py -p no:cacheprovider --timeout 120 ;;
    moe_gptoss) stage moe_gptoss 200 python3 benchmarks/moe_bench.py --mxfp4 --experts 32 --top-k 4 --hidden 2880 --intermediate 2880 --tokens 256,1024,2048,4096,8192,16384 ;;
    moe_dsv3) stage moe_dsv3 200 python3 benchmarks/moe_bench.py --experts 32 --top-k 8 --hidden 7168 --intermediate 2048 --tokens 64,256,512,1024,2048,4096,8192 ;;
    moe_sweep) stage moe_sweep 200 python3 benchmarks/moe_bench.py --sweep-tiles --tokens 64,256,512,1024,2048,4096 ;;
    moe_mxfp4) stage moe_mxfp4 480 python3 benchmarks/moe_bench.py --mxfp4 --experts 32 --top-k 4 --hidden 2880 --intermediate 2880 --sweep-tiles --tokens 1,8,64,256,1024,2048,4096,16384 ;;
    kprof_long) stage kprof_long 200 python3 benchmarks/device/kernel_profile.py "$M8" 300 1024 256 ;;
    kprof_prefill) stage kprof_prefill 200 python3 benchmarks/device/kernel_profile.py "$M8" 192 1024 1 ;;
    kprof_gptoss) gptoss_model; stage kprof_gptoss 240 python3 benchmarks/device/kernel_profile.py "$MGPTOSS" 300 1024 256 ;;
    kprof_mla) mla_model; stage kprof_mla 240 python3 benchmarks/device/kernel_profile.py "$MMLA" 300 1024 256 ;;
    kprof_lat1) stage kprof_lat1 200 python3 benchmarks/device/kernel_profile.py "$M8" 1 32 256 ;;
    ncu_lat1)  # Nsight Compute on a batch-1 decode's kernels, each replayed alone (NCU_SKIP, NCU_COUNT)
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      TAIL_LINES=10 stage ncu_lat1 400 "$NCU" --clock-control none --kernel-name regex:'decode_attention_kernel|_rms_norm_kernel|_skinny_gemm_kernel' --launch-skip "${NCU_SKIP:-20000}" --launch-count "${NCU_COUNT:-14}" --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats python3 benchmarks/device/batch1_generate.py "$M8" 300
      cp "$LOGS/ncu_lat1.log" "$OUT/" ;;
    first_token) TAIL_LINES=60 stage first_token 150 python3 benchmarks/device/first_token_profile.py "$M8" 32 5 ;;
    timeline_lat1) TAIL_LINES=100 stage timeline_lat1 200 python3 benchmarks/device/step_timeline.py "$M8" 1 32 256 ;;
    timeline_lat32) TAIL_LINES=100 stage timeline_lat32 200 python3 benchmarks/device/step_timeline.py "$M8" 32 32 256 ;;
    pgemm)    stage pgemm 150 python3 benchmarks/device/prefill_gemm_bench.py --ms "${PGEMM_MS:-512,2048,8192}" --blas "${PGEMM_BLAS:-cublas}" ;;
    pgemm_curve) stage pgemm_curve 240 python3 benchmarks/device/prefill_gemm_bench.py --quiet --ms "${PGEMM_MS:-1,2,4,8,16,32,64,128,192,224,240,256,272,288,304,320,352,384,416,448,512,576,640}" --blas cublas,cublaslt ;;
    serve)    serve_pair tm ;;
    cold_parallel*|warm_parallel*) start_up "$st" ;;
    cold_serial*|warm_serial*) start_up "$st" TOKENMILL_COMPILE_THREADS=1 ;;
    gputests_compile) stage gputests_compile 240 python3 -m pytest -q tests/gpu/test_parallel_compile_gpu.py tests/gpu/test_engine_gpu.py -k "compil or cuda_graphs_equal or rope_in_decode" -p no:cacheprovider --timeout 200 ;;
    diag_default) serve_diag default ;;
    diag_vllm) serve_diag vllm ;;
    diag_b4096) serve_diag b4096 --max-num-batched-tokens 4096 ;;
    diag_b2048) serve_diag b2048 --max-num-batched-tokens 2048 ;;
    diag_sync) serve_diag sync --no-async-scheduling ;;
    diag_pace[0-9]*) serve_diag "pace${st#diag_pace}" --prefill-pacing-mode prompt --prefill-pacing-tokens "${st#diag_pace}" ;;
    diag_step[0-9]*) serve_diag "$st" --prefill-pacing-mode step --prefill-pacing-tokens "${st#diag_step}" ;;
    sprof_pace[0-9]*) stage "$st" 240 python3 benchmarks/device/serving_profile.py "$M8" --pacing "${st#sprof_pace}" ;;
    sprof_step[0-9]*) TAIL_LINES=60 stage "$st" 240 python3 benchmarks/device/serving_profile.py "$M8" --pacing "${st#sprof_step}" --pacing-mode step --no-host ;;
    sprofdt_step[0-9]*) TAIL_LINES=60 stage "$st" 240 python3 benchmarks/device/serving_profile.py "$M8" --pacing "${st#sprofdt_step}" --pacing-mode step --no-host --decode-tile "${DTILE:-64:2:3}" ;;
    spsweep) stage spsweep 400 python3 benchmarks/device/serving_profile.py "$M8" --warm-requests 96 --sweep ${SWEEP:-256:0:0 256:65536:0 0:0:0} ;;
    diag_args) serve_diag "${DIAG_LABEL:-args}" $DIAG_ARGS ;;
    seqs_sweep) for n in ${SEQS:-60}; do LOADS=random serve_diag "seqs$n" --max-num-seqs "$n"; done ;;
    diag_nocascade) serve_diag nocascade --disable-cascade-attn ;;
    gputests_so) PYTHONPATH="$XGP" stage gputests_so 150 python3 -m pytest -q tests/gpu/test_engine_gpu.py -k "structured or mixed_step_graphs" -p no:cacheprovider --timeout 120 ;;
    mla_tp) stage mla_tp 900 python3 benchmarks/device/mla_throughput.py --out "$OUT" --engines tokenmill,vllm ;;
    mla_tp_tm) stage mla_tp_tm 450 python3 benchmarks/device/mla_throughput.py --out "$OUT" --engines tokenmill ;;
    mla_tp_tm_grouped) stage mla_tp_tm_grouped 450 python3 benchmarks/device/mla_throughput.py --out "$OUT/grouped" --engines tokenmill --extra '--kernel-config {"moe_prompt_experts":"grouped_gemm"}' ;;
    mla_tp_vllm) stage mla_tp_vllm 450 python3 benchmarks/device/mla_throughput.py --out "$OUT" --engines vllm ;;
    gputests_mla) stage gputests_mla 300 python3 -m pytest -q tests/gpu/test_mla_gpu.py -p no:cacheprovider --timeout 200 ;;
    mlabench) stage mlabench 200 python3 benchmarks/mla_bench.py ;;
    mlabench_sweep) TAIL_LINES=200 stage mlabench_sweep 400 python3 benchmarks/mla_bench.py --sweep --batches 1,64,256 --contexts 1280,4096 ;;
    vllm_serve) serve_pair vllm ;;
    tp_gptoss) gptoss_model; stage tp_gptoss 560 "${TM[@]}" bench throughput --model "$MGPTOSS" "${TPA[@]}" "${GPTOSS_TP[@]}" --output-json "$LOGS/tp_gptoss.json"; addjson tp_gptoss "$LOGS/tp_gptoss.json" ;;
    tp_gptoss_grouped) gptoss_model; stage tp_gptoss_grouped 560 "${TM[@]}" bench throughput --model "$MGPTOSS" "${TPA[@]}" "${GPTOSS_TP[@]}" --kernel-config '{"moe_prompt_experts": "grouped_gemm"}' --output-json "$LOGS/tp_gptoss_grouped.json"; addjson tp_gptoss_grouped "$LOGS/tp_gptoss_grouped.json" ;;
    vllm_tp_gptoss) gptoss_model; stage vllm_tp_gptoss 560 vllm bench throughput --model "$MGPTOSS" "${TPA[@]}" "${GPTOSS_TP[@]}" --output-json "$LOGS/vllm_tp_gptoss.json"; addjson vllm_tp_gptoss "$LOGS/vllm_tp_gptoss.json" ;;
    gputests_arch) stage gputests_arch 300 python3 -m pytest -q tests/gpu/test_triton_attention_gpu.py tests/gpu/test_fused_moe_gpu.py -p no:cacheprovider --timeout 200 --durations=5 ;;
    beam_sleep) TAIL_LINES=40 stage beam_sleep 1200 python3 benchmarks/device/beam_sleep_bench.py "$M8" --output-json "$OUT/beam_sleep.json" ;;
    kvoffload) stage kvoffload 900 python3 benchmarks/kv_offload_multiturn.py --model "$M8" --load-format dummy --conversations 48 --prompt-len 4096 --kv-cache-gib 8 --offload-gib 48 --output-json "$OUT/kvoffload.json" ;;
    gputests_beam) PYTHONPATH="$XGP" stage gputests_beam 300 python3 -m pytest -q tests/gpu/test_beam_sleep_offload_gpu.py tests/gpu/test_device_vmm_gpu.py -p no:cacheprovider --timeout 200 ;;
    timing_smoke) stage timing_smoke 60 python3 -c "import torch; from tokenmill.benchmarks.cuda_timing import graph_replay_ms as g; x = torch.ones(1 << 20, device='cuda'); print('GRAPH replay of 20 scales: %.4f ms' % g(lambda: [x.mul_(1.0) for _ in range(20)]))" ;;
    lora_kernels) TAIL_LINES=40 stage lora_kernels 150 python3 benchmarks/device/lora_kernel_bench.py ;;
    gputests_lora) stage gputests_lora 300 python3 -m pytest -q tests/gpu/test_lora_gpu.py -p no:cacheprovider --timeout 200 --durations=5 ;;
    lora_serve)
      lora_adapters
      serve_lora tm_nolora_serve tm 0
      serve_lora tm_lora_serve tm 1 "${LORA_ARGS[@]}" --lora-modules "${LORA_MODULES[@]}" ;;
    tm_lora_serve)
      lora_adapters
      serve_lora tm_lora_serve tm 1 "${LORA_ARGS[@]}" --lora-modules "${LORA_MODULES[@]}" ;;
    vllm_lora_serve)
      lora_adapters
      serve_lora vllm_lora_serve vllm 1 "${LORA_ARGS[@]}" --lora-modules "${LORA_MODULES[@]}" ;;
    vllm_tp_long)  stage vllm_tp_long 420 vllm bench throughput --model "$M8" "${TPA[@]}" --random-input-len 1024 --random-output-len 256 --num-prompts 1000 --output-json "$LOGS/vllm_tp_long.json"; addjson vllm_tp_long "$LOGS/vllm_tp_long.json" ;;
    vllm_tp_short) stage vllm_tp_short 420 vllm bench throughput --model "$M8" "${TPA[@]}" --random-input-len 128 --random-output-len 512 --num-prompts 1000 --output-json "$LOGS/vllm_tp_short.json"; addjson vllm_tp_short "$LOGS/vllm_tp_short.json" ;;
    vllm_tp_small) stage vllm_tp_small 300 vllm bench throughput --model "$M135" "${TPA[@]}" --random-input-len 256 --random-output-len 256 --num-prompts 2000 --output-json "$LOGS/vllm_tp_small.json"; addjson vllm_tp_small "$LOGS/vllm_tp_small.json" ;;
    pstep)    stage pstep 200 "${TM[@]}" bench latency --model "$M8" --load-format dummy --input-len 1024 --output-len 1 --batch-size 8 --num-iters-warmup 3 --num-iters 10 --output-json "$LOGS/pstep.json"; addjson pstep "$LOGS/pstep.json" ;;
    vllm_pstep) stage vllm_pstep 300 vllm bench latency --model "$M8" --load-format dummy --input-len 1024 --output-len 1 --batch-size 8 --num-iters-warmup 3 --num-iters 10 --output-json "$LOGS/vllm_pstep.json"; addjson vllm_pstep "$LOGS/vllm_pstep.json" ;;
    vllm_lat32) stage vllm_lat32 300 vllm bench latency --model "$M8" --load-format dummy --input-len 32 --output-len 256 --batch-size 32 --num-iters-warmup 3 --num-iters 10 --output-json "$LOGS/vllm_lat32.json"; addjson vllm_lat32 "$LOGS/vllm_lat32.json" ;;
    vllm_lat1) stage vllm_lat1 300 vllm bench latency --model "$M8" --load-format dummy --input-len 32 --output-len 256 --batch-size 1 --num-iters-warmup 3 --num-iters 10 --output-json "$LOGS/vllm_lat1.json"; addjson vllm_lat1 "$LOGS/vllm_lat1.json" ;;
    gputests_parallel) PYTHONPATH="$XGP" stage gputests_parallel 400 python3 -m pytest -q tests/gpu/test_parallel_gpu.py -p no:cacheprovider --timeout 300 --durations=5 ;;
    mgpu_*|vllm_mgpu_*)  # several GPUs beside vLLM, one engine a stage (multi_gpu.sh's cases)
      local eng=tm c; [ "${st#vllm_}" != "$st" ] && eng=vllm
      case "${st#*mgpu_}" in
        tp2_long) c=llama8b_tp2 ;;
        tp2_lat1) c=llama8b_tp2_batch1 ;;
        70b_tp[0-9]*) c="llama70b_tp${st##*_tp}" ;;
        ep[0-9]*) c="mixtral_${st##*_}" ;;
        *) say "unknown stage $st"; return ;;
      esac
      stage "$st" 560 env ENGINES=$eng OUT="$OUT/mgpu" bash benchmarks/device/multi_gpu.sh "$c"
      addjson "$st" "$OUT/mgpu/${eng}_$c.json" ;;
    *) say "unknown stage $st" ;;
  esac
}
# STAGE@VAR=VALUE[+VAR=VALUE...] runs STAGE with those variables set; its logs and results
# are labelled STAGE@VAR=VALUE... so it can run beside the plain stage.
for st in "$@"; do
  if [ "${st#*@}" != "$st" ]; then
    (
      IFS=+ read -ra kvs <<< "${st#*@}"
      for kv in "${kvs[@]}"; do export "${kv?}"; done
      SFX="@${st#*@}" run_stage "${st%%@*}"
    )
  else
    run_stage "$st"
  fi
done
tar -czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null
# few files come back from the machine: one archive for the serving diagnostics
# Several invocations may share one $OUT: each keeps its own archive.
TAR="$OUT/serve_diag.tar.gz"; i=1; while [ -e "$TAR" ]; do TAR="$OUT/serve_diag.$i.tar.gz"; i=$((i+1)); done
[ -d "$OUT/serve_diag" ] && tar -czf "$TAR" -C "$OUT" serve_diag && rm -rf "$OUT/serve_diag"
say "DONE $* in $(( $(date +%s) - T0 ))s"
