#!/bin/bash
# Issues 41 and 42's GPU measurements in one device call (../shared/gpu/README.md sets up .gpu/ and .whl/;
# call the device tool with carry [".whl", ".gpu"] and this script as the command, timeout ~560 s).
# Every step writes under $OUT through tee, so a run cut short still returns what it measured.
# Dry run on CPU first: DEV=cpu TRITON_INTERPRET=1 OUT=/tmp/out bash benchmarks/gpu_attention_run.sh --dry
# STEPS="1 2 3" runs only those steps (all seven take about as long as one call may: split them if needed).
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
G=$PWD/.gpu
DEV=${DEV:-cuda}
MODEL=/tmp/m1b; [ "$1" = "--dry" ] && MODEL=/tmp/mtiny
if [ "$1" != "--dry" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
fi
KV="python3 -m kvserve.cli"  # a command, not a shell function: `timeout` runs commands only
want() { [[ " ${STEPS:-1 2 3 4 5 6 7} " == *" $1 "* ]]; }
DRY=$([ "$1" = "--dry" ] && echo 1)
{
(cd $G && DEV=$DEV timeout 60 python3 make_model.py $(basename $MODEL) 2>&1 | grep made)
if want 1; then
echo "=== 1 float32 greedy parity with HF on CUDA, Triton backend (auto), CUDA graphs on (the default)"
DEV=$DEV timeout 120 python3 $G/parity.py $MODEL float32 2>&1 | grep -E "PARITY|Error|Attention backend|CUDA graph" | tail -5
fi; if want 2; then
echo "=== 2 decode attention kernels: K/V bandwidth vs copy, fp8 vs bfloat16"
timeout 150 python3 benchmarks/triton_attention.py $([ -n "$DRY" ] && echo --smoke) 2>&1 | tail -12
fi; if want 3; then
for backend in triton torch; do
  echo "=== 3 offline default workload, --attention-backend $backend (with HF on the first)"
  extra=$([ $backend = triton ] && echo "--backend kvserve,hf" || echo "--backend kvserve")
  timeout 150 $KV bench throughput --model $MODEL --device $DEV $extra --attention-backend $backend --efficiency \
    $([ -n "$DRY" ] && echo "--num-prompts 2 --random-input-len 16 --random-output-len 4 --dataset-name random") \
    --output-json $OUT/throughput-$backend.json 2>&1 | grep -v -E "it/s\]|s/it\]" | tail -14
done
fi; if want 4; then
echo "=== 4 offline 512 x 512/256, Triton backend"
timeout 120 $KV bench throughput --model $MODEL --device $DEV --backend kvserve --attention-backend triton \
  --dataset-name random $([ -n "$DRY" ] && echo "--num-prompts 2 --random-input-len 16 --random-output-len 4" || echo "--num-prompts 512 --random-input-len 512 --random-output-len 256") \
  2>&1 | grep -E "Workload|Throughput|Attention backend"
fi; if want 5; then
echo "=== 5 CUDA graphs (issue 42) vs --enforce-eager: one stream, then 128 at once (decode-heavy)"
for eager in "" "--enforce-eager"; do
  for n in 1 128; do
    timeout 120 $KV bench throughput --model $MODEL --device $DEV --backend kvserve $eager --dataset-name random \
      $([ -n "$DRY" ] && echo "--num-prompts 2 --random-input-len 16 --random-output-len 4" || echo "--num-prompts $n --random-input-len 128 --random-output-len 256") \
      2>&1 | grep -E "Throughput|CUDA graphs|capture" | sed "s/^/[$n ${eager:-graphs}] /"
  done
done
fi; if want 6; then
echo "=== 6 torch profile of 32 decode steps at 128 requests, CUDA graphs on (issue 42: GPU busy >= 85%)"
[ -n "$DRY" ] && echo "(skipped in a dry run: prof.py loads /tmp/m1b on CUDA)" || \
  timeout 120 python3 $G/prof.py 2>&1 | grep -E "out tok/s|GPU busy|CUDA graphs|Self CUDA time total|Self CPU time total"
fi; if want 7; then
echo "=== 7 kvserve serve + kvserve bench serve, 256 x 512/128 at once: CUDA graphs, then --enforce-eager"
for eager in "" "--enforce-eager"; do
  $KV serve --model $MODEL --device $DEV --port 8011 $eager > $OUT/serve${eager}.log 2>&1 &
  sp=$!
  for i in $(seq 1 120); do curl -sf localhost:8011/health >/dev/null && break; sleep 1; done
  timeout 150 $KV bench serve --base-url http://127.0.0.1:8011 --tokenizer $MODEL --dataset-name random --request-rate inf \
    --ignore-eos $([ -n "$DRY" ] && echo "--num-prompts 4 --random-input-len 16 --random-output-len 4" || echo "--num-prompts 256 --random-input-len 512 --random-output-len 128") \
    2>&1 | grep -E "throughput|TTFT|TPOT|Successful" | sed "s/^/[${eager:-graphs}] /"
  kill $sp; wait $sp 2>/dev/null; grep -E "CUDA graphs|Attention backend" $OUT/serve${eager}.log | head -2
  grep -E -i "traceback" $OUT/serve${eager}.log | head -3
done
fi
} 2>&1 | tee $OUT/attention-log.txt
