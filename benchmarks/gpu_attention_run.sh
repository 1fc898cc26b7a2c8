#!/bin/bash
# Issues 41 and 42's GPU measurements (../shared/gpu/README.md sets up .gpu/ and .whl/; call the
# device tool with carry [".whl", ".gpu"] and this script as the command). Besides the README's
# wheels, .whl/ needs `kvserve bench serve`'s client: add aiohttp aiohappyeyeballs aiosignal
# frozenlist multidict propcache yarl attrs to its `pip download` line (about 3 MB).
# Every step writes under $OUT through tee, so a run cut short still returns what it measured.
# Dry run on CPU first: DEV=cpu TRITON_INTERPRET=1 OUT=/tmp/out bash benchmarks/gpu_attention_run.sh --dry
# A session has 15 minutes of device time in all, start-up included: two calls, the figures that
# matter most first:  STEPS="1 2 5 6" (timeout_s ~540), then STEPS="4 7 3 8 9" with what is left.
# Steps run in the order STEPS gives, and each prints how long it took (for the next plan).
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The bench client honours proxy variables: never for the local servers. CUPTI kept up between
# profiles (step 6): tearing it down after graph replays has crashed CUDA before 12.6.
export no_proxy=127.0.0.1,localhost NO_PROXY=127.0.0.1,localhost TEARDOWN_CUPTI=0
G=$PWD/.gpu
DEV=${DEV:-cuda}
MODEL=/tmp/m1b; [ "$1" = "--dry" ] && MODEL=/tmp/mtiny
if [ "$1" != "--dry" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || { echo "wheel install failed" | tee -a $OUT/attention-log.txt; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
  missing=$(python3 -c "import importlib.util as u; print(' '.join(m for m in ('fastapi', 'uvicorn', 'pydantic', 'llguidance', 'gguf', 'aiohttp', 'httpx') if u.find_spec(m) is None))")
  [ -z "$missing" ] || echo "missing on the device (add their wheels to .whl/): $missing" | tee -a $OUT/attention-log.txt
fi
KV="python3 -m kvserve.cli"  # a command, not a shell function: `timeout` runs commands only
mkdir -p "$OUT"
# `timeout`, saying so when it struck (the line passes every step's filter).
limit() { timeout "$@"; local rc=$?; [ $rc -eq 124 ] && echo "Error: timed out after $1 s"; return $rc; }
# Wait for a server's /health; give up at once if its process died (its log's tail says why).
healthy() {  # port pid seconds log
  for i in $(seq 1 $3); do
    curl -sf -m 3 localhost:$1/health >/dev/null && return 0  # -m: the port listens before the model loads
    kill -0 $2 2>/dev/null || break
    sleep 1
  done
  echo "server on port $1 did not come up:"; tail -5 $4; return 1
}
# What the start-up log says of CUDA graphs: captured, failed, or why not used.
GRAPHS="CUDA graphs: |graph capture failed|CUDA graphs not used"
DRY=$([ "$1" = "--dry" ] && echo 1)
# The lines each step keeps of its tool's output, and the lines of any failure.
FAIL="error|Error|Traceback|Failed requests"
s1() {
echo "=== 1 float32 greedy parity with HF on CUDA, Triton backend (auto): CUDA graphs, --enforce-eager, --async-scheduling"
limit 240 python3 benchmarks/gpu_parity.py $MODEL --device $DEV 2>&1 | grep -E "PARITY|Attention backend|CUDA graph|$FAIL" | tail -10
}
s2() {
echo "=== 2 decode attention kernels: K/V bandwidth vs copy, fp8 vs bfloat16; RoPE + store vs rope_store"
limit 150 python3 benchmarks/triton_attention.py $([ -n "$DRY" ] && echo --smoke) 2>&1 | tail -16
}
s3() {
for backend in triton torch; do
  echo "=== 3 offline default workload, --attention-backend $backend (with HF on the first)"
  extra=$([ $backend = triton ] && echo "--backend kvserve,hf" || echo "--backend kvserve")
  limit 200 $KV bench throughput --model $MODEL --device $DEV $extra --attention-backend $backend --efficiency \
    $([ -n "$DRY" ] && echo "--num-prompts 2 --random-input-len 16 --random-output-len 4 --dataset-name random") \
    --output-json $OUT/throughput-$backend.json 2>&1 | grep -v -E "it/s\]|s/it\]" | tail -20
done
}
s4() {
echo "=== 4 offline 512 x 512/256, Triton backend: CUDA graphs, + --async-scheduling, --enforce-eager (HF beside the last, batches of 128)"
for mode in "" "--async-scheduling" "--enforce-eager"; do
  backends=$([ "$mode" = "--enforce-eager" ] && echo "kvserve,hf --hf-batch-size 128" || echo "kvserve")
  limit 240 $KV bench throughput --model $MODEL --device $DEV --backend $backends --attention-backend triton $mode \
    --dataset-name random $([ -n "$DRY" ] && echo "--num-prompts 2 --random-input-len 16 --random-output-len 4" || echo "--num-prompts 512 --random-input-len 512 --random-output-len 256") \
    2>&1 | grep -E "Workload|Throughput|Attention backend|$GRAPHS|$FAIL" | sed "s/^/[${mode:-graphs}] /"
done
}
s5() {
# (decode at 128 in these three modes: step 6, decode-only steps.) One sequence decodes through
# the batch-1 graph: capturing up to 8 leaves the figure as it is and saves start-up time.
echo "=== 5 one stream, 128 in / 256 out: CUDA graphs, + --async-scheduling, --enforce-eager"
for mode in "" "--async-scheduling" "--enforce-eager"; do
  limit 120 $KV bench throughput --model $MODEL --device $DEV --backend kvserve $mode --max-cudagraph-capture-size 8 \
    --dataset-name random $([ -n "$DRY" ] && echo "--num-prompts 1 --random-input-len 16 --random-output-len 4" || echo "--num-prompts 1 --random-input-len 128 --random-output-len 256") \
    2>&1 | grep -E "Throughput|$GRAPHS|$FAIL" | sed "s/^/[1 ${mode:-graphs}] /"
done
}
s6() {
echo "=== 6 decode-only steps at 128 requests, timed then profiled (issue 42: GPU busy >= 85%, >= 25,000 tok/s): graphs, + async scheduling, --enforce-eager"
for mode in "" "--async-scheduling" "--enforce-eager"; do
  limit 150 python3 benchmarks/gpu_decode_profile.py --model $MODEL --device $DEV $mode \
    $([ -n "$DRY" ] && echo "--batch 4 --prompt-len 16 --max-tokens 8") > $OUT/profile${mode:-graphs}.txt 2>&1
  grep -E "^\[|Self CUDA time total|$FAIL" $OUT/profile${mode:-graphs}.txt
done
}
s7() {
echo "=== 7 kvserve serve + kvserve bench serve, 256 x 512/128 at once: CUDA graphs, + --async-scheduling, --enforce-eager"
for mode in "" "--async-scheduling" "--enforce-eager"; do
  $KV serve --model $MODEL --device $DEV --port 8011 $mode > $OUT/serve${mode}.log 2>&1 &
  sp=$!
  healthy 8011 $sp 150 $OUT/serve${mode}.log && limit 120 $KV bench serve --base-url http://127.0.0.1:8011 --tokenizer $MODEL --dataset-name random --request-rate inf \
    --ignore-eos $([ -n "$DRY" ] && echo "--num-prompts 4 --random-input-len 16 --random-output-len 4" || echo "--num-prompts 256 --random-input-len 512 --random-output-len 128") \
    2>&1 | grep -E "throughput|TTFT|TPOT|Successful|Client CPU|$FAIL" | sed "s/^/[${mode:-graphs}] /"
  kill $sp; wait $sp 2>/dev/null; grep -E "Attention backend|$GRAPHS" $OUT/serve${mode}.log | head -3
  grep -E -i "traceback" $OUT/serve${mode}.log | head -3
done
}
s8() {
echo "=== 8 the 8B-shaped model (Llama-3.1-8B's shape, bf16): offline 512 x 512/256 and served 256 x 512/128, graphs + async"
M8=/tmp/m8b; [ -n "$DRY" ] && M8=$MODEL
[ -d $M8 ] || (cd $G && DEV=$DEV limit 150 python3 make_model.py m8b 2>&1 | grep -E "made|$FAIL")
limit 200 $KV bench throughput --model $M8 --device $DEV --backend kvserve --async-scheduling --dataset-name random \
  $([ -n "$DRY" ] && echo "--num-prompts 2 --random-input-len 16 --random-output-len 4" || echo "--num-prompts 512 --random-input-len 512 --random-output-len 256") \
  2>&1 | grep -E "Workload|Throughput|$GRAPHS|$FAIL" | sed "s/^/[8b offline] /"
$KV serve --model $M8 --device $DEV --port 8012 --async-scheduling > $OUT/serve-8b.log 2>&1 &
sp=$!
healthy 8012 $sp 180 $OUT/serve-8b.log && limit 120 $KV bench serve --base-url http://127.0.0.1:8012 --tokenizer $M8 --dataset-name random --request-rate inf \
  --ignore-eos $([ -n "$DRY" ] && echo "--num-prompts 4 --random-input-len 16 --random-output-len 4" || echo "--num-prompts 256 --random-input-len 512 --random-output-len 128") \
  2>&1 | grep -E "throughput|TTFT|TPOT|Successful|Client CPU|$FAIL" | sed "s/^/[8b served] /"
kill $sp; wait $sp 2>/dev/null; grep -E -i "traceback" $OUT/serve-8b.log | head -3
}
s9() {
echo "=== 9 --deterministic on CUDA (Triton GEMM, attention, fused ops), bf16: 32 prompts vs each alone, with and without"
limit 300 python3 benchmarks/deterministic.py outputs --max-tokens $([ -n "$DRY" ] && echo 4 || echo 16) \
  --model $MODEL --device $DEV --dtype $([ -n "$DRY" ] && echo float32 || echo bfloat16) --max-cudagraph-capture-size 32 2>&1 | grep -E "^\||deterministic=|$FAIL" | tail -16
}
{
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null; date -u
python3 -c "import torch, triton; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'triton', triton.__version__)"
[ -d $MODEL ] || (cd $G && DEV=$DEV limit 60 python3 make_model.py $(basename $MODEL) 2>&1 | grep -E "made|$FAIL")
# The steps in the order given (the figures that matter most first), each timed for the next plan.
for step in ${STEPS:-1 2 5 6 4 7 3 8 9}; do
  began=$(date +%s)
  s$step
  echo "=== step $step took $(( $(date +%s) - began )) s"
done
} 2>&1 | tee -a $OUT/attention-log.txt
