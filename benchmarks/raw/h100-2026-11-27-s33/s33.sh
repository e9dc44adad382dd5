#!/bin/bash
# session 33 calls: bash .gpu/s33.sh STAGE   (trees under .gpu/: m0 = main b092a25 + profile_step --trace-dir; n1 = e8ca98c, the decode floor without the untied embedding table; n2 = the prefill timeline without the step's device range; n3 = n2 + greedy-only rows take the argmax of the bf16 logits)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__); import os; print(os.cpu_count(), 'cpus')" | tee -a $OUT/env.txt
gputests() {  # TREE [FILES...]: the GPU tests of a tree
  local tree=$1; shift
  (cd .gpu/$tree && timeout ${TESTS_S:-560} python3 -m pytest "${@:-tests/gpu}" -q -p no:cacheprovider \
    -o addopts="" -rs --durations=10 2>&1 | tee $OUT/gpu-$tree.log | tail -n 25)
}
lat() {  # TREE LABEL ARGS...: one pinned bench latency run, tagged
  local tree=$1 label=$2; shift 2
  (cd .gpu/$tree && timeout ${LAT_S:-150} taskset -c 8-11 python3 -m ostinato.cli bench latency --json "$@" 2>>$OUT/err.txt |
    sed "s|^{|{\"tree\": \"$tree\", \"label\": \"$label\", |") | tee -a $OUT/latency.jsonl | cut -c1-60,330-700
}
prefill() {  # TREE LENGTHS ITERS: pinned bench prefill, qwen3-0.6b
  (cd .gpu/$1 && timeout ${PRE_S:-100} taskset -c 8-11 python3 -m ostinato.cli bench prefill --json --model random:qwen3-0.6b \
    --no-prefix-caching --input-len $2 --iters $3 2>>$OUT/err.txt | sed "s|^{|{\"tree\": \"$1\", |" | tee -a $OUT/prefill.jsonl | cut -c1-300)
}
prefprof() {  # TREE LABEL [MODES]: qwen3-0.6b one-prompt prefill steps' kernels, timeline and trace at 512 and 2048
  mkdir -p $OUT/trace-$2
  (cd .gpu/$1 && timeout ${PROF_S:-150} python3 benchmarks/profile_step.py --model random:qwen3-0.6b --modes ${3:-full_and_piecewise} \
    --sections prefill --prefill-lengths 512,2048 --label $2 --json $OUT/prof.jsonl --trace-dir $OUT/trace-$2 > /dev/null 2>>$OUT/err.txt)
}
summary() {
python3 - <<'PY'
import json, os
p = os.path.join(os.environ["OUT"], "prof.jsonl")
for line in open(p) if os.path.exists(p) else []:
    r = json.loads(line)
    if "top" in r:
        print(r.get("label"), r["mode"], r["tokens"], "wall", round(r["wall_ms"], 3), "device", round(r["device_ms"], 3), r["kernels"])
        print("   timeline", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.get("timeline", {}).items()})
        for f in r.get("host_top", [])[:12]:
            print("   host", str(f)[:150])
        for n, (c, us) in list(r["top"].items())[:8]:
            print("   ", n[:60], c, us)
PY
}
case $1 in
a)  # m0: GPU tests not re-run since 66be23d / ee2c74e (part 1); the prefill step's timeline and trace
  TESTS_S=400 gputests m0 tests/gpu/test_engine_graphs.py tests/gpu/test_moe.py tests/gpu/test_lora.py
  prefprof m0 m0
  summary
  ;;
b)  # m0: GPU tests not re-run since 66be23d (part 2)
  TESTS_S=570 gputests m0 tests/gpu/test_prefill_graphs.py tests/gpu/test_full_prefill_graphs.py tests/gpu/test_fp8.py tests/gpu/test_breakable.py \
    tests/gpu/test_lifecycle.py tests/gpu/test_sampling_params_gpu.py tests/gpu/test_structured_gpu.py tests/gpu/test_device_deadline.py tests/gpu/test_kernels.py
  ;;
e)  # why a FULL prefill graph's replay costs the host ~0.5 ms: .gpu/launch_probe.py; then stage c
  (cd .gpu/m0 && timeout 150 python3 ../launch_probe.py 2>>$OUT/err.txt | cut -c1-250)
  a3b=(--model random:qwen3-30b-a3b --input-len 128 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1)
  for t in m0 w1 w2 ra w1 m0 w2; do LAT_S=60 lat $t a3b "${a3b[@]}"; done
  ;;
c)  # batch-1 decode of qwen3-30b-a3b, pinned, interleaved: m0 (main), w1 (one-row gemv: 8 weight rows a program in chunks of 1024
    # at 4 warps where 4 rows would need more than 8 programs per SM: one wave for a3b's and llama's QKV), w2 (w1 + rotating
    # attention launch at batch 1 in graphs), ra (rotating at batch 1 alone)
  a3b=(--model random:qwen3-30b-a3b --input-len 128 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1)
  for t in m0 w1 w2 ra w1 m0 w2; do LAT_S=100 lat $t a3b "${a3b[@]}"; done
  ;;
d)  # the same trees at batch 1 on qwen3-0.6b and llama-3.1-8b
  q1=(--model random:qwen3-0.6b --input-len 512 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1)
  l1=(--model random:llama-3.1-8b --input-len 128 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1)
  for t in m0 w1 m0 w1; do LAT_S=80 lat $t l1 "${l1[@]}"; done
  for t in m0 w2 ra w1 m0 w2 ra; do LAT_S=45 lat $t q1 "${q1[@]}"; done
  ;;
f)  # qwen3-0.6b decode at batch 16 and 32: cuBLAS projections (default) vs the tl.dot small-batch kernel at every row count
    # (--gemv-rows 32), interleaved; decode time and the step's kernels
  for rows in 0 32 0 32; do
    flag=(); [ $rows != 0 ] && flag=(--gemv-rows $rows)
    (cd .gpu/m0 && timeout 100 taskset -c 8-11 python3 benchmarks/profile_step.py --model random:qwen3-0.6b --modes full_and_piecewise \
      --batch-sizes 16,32 --sections decode,step-kernels --label rows$rows "${flag[@]}" --json $OUT/rows.jsonl 2>>$OUT/err.txt | grep -v "^{" | tail -4)
  done
  python3 - <<'PY'
import json, os
for line in open(os.path.join(os.environ["OUT"], "rows.jsonl")):
    r = json.loads(line)
    if r["section"] == "decode":
        print(r["label"], r["batch"], "tpot", round(r["tpot_ms"], 3), "ratio", round(r["ratio"], 2))
    else:
        print(r["label"], r["batch"], "kernels", r["kernels_per_step"], "device", round(r["device_ms_per_step"], 3))
        for n, (c, us) in list(r["by_name"].items())[:9]:
            print("   ", n[:60], c, us)
PY
  ;;
g)  # batch-1 decode with the attention launch rotating at batch 1 too (ra) vs main (m0): llama-3.1-8b (QKV: 1536 one-row
    # programs, as qwen3-30b-a3b's 1280 where rotating lost 8%) and qwen3-0.6b (256 programs, where it gained 2%), interleaved
  q1=(--model random:qwen3-0.6b --input-len 512 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1)
  l1=(--model random:llama-3.1-8b --input-len 128 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1)
  for t in m0 ra m0 ra; do LAT_S=80 lat $t l1 "${l1[@]}"; done
  for t in m0 ra m0 ra m0 ra; do LAT_S=45 lat $t q1 "${q1[@]}"; done
  ;;
b2)  # n1: GPU tests not re-run since 66be23d (part 2); llama-3.1-8b batch 1 and 32 against the corrected floor
  TESTS_S=330 gputests n1 tests/gpu/test_prefill_graphs.py tests/gpu/test_full_prefill_graphs.py tests/gpu/test_fp8.py tests/gpu/test_breakable.py \
    tests/gpu/test_lifecycle.py tests/gpu/test_sampling_params_gpu.py tests/gpu/test_structured_gpu.py tests/gpu/test_device_deadline.py
  LAT_S=120 lat n1 l8 --model random:llama-3.1-8b --input-len 128 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1,32
  ;;
h)  # n1: issue 21's targets against the corrected floor: qwen3-30b-a3b and llama-3.1-8b FP8 at batch 1 and 32; then test_kernels.py
  LAT_S=150 lat n1 a3b --model random:qwen3-30b-a3b --input-len 128 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1,32
  LAT_S=120 lat n1 fp8 --model random:llama-3.1-8b --quantization fp8 --input-len 128 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1,32
  TESTS_S=200 gputests n1 tests/gpu/test_kernels.py
  ;;
i)  # n1: the GPU tests of graph capture and warm-up paths ee2c74e touched; issue 17's prefill and start-up benches
  TESTS_S=300 gputests n1 tests/gpu/test_warm_up.py tests/gpu/test_spec_graphs.py tests/gpu/test_async_graphs.py tests/gpu/test_check_graphs.py
  (cd .gpu/n1 && timeout 100 taskset -c 8-11 python3 -m ostinato.cli bench prefill --model random:qwen3-0.6b --json --iters 3 --no-prefix-caching \
    --cuda-graph-mode none,full_and_piecewise 2>>$OUT/err.txt | tee -a $OUT/prefill.jsonl | cut -c1-400)
  (cd .gpu/n1 && timeout 60 taskset -c 8-11 python3 -m ostinato.cli bench startup --model random:qwen3-0.6b --max-model-len 2048 --input-len 512 \
    --json 2>>$OUT/err.txt | tee -a $OUT/startup.jsonl | cut -c1-600)
  ;;
v)  # n1: issue 17's decode, throughput and llama-3.1-8b prefill benches (gpu_session.sh verify-bench's, less serving)
  (cd .gpu/n1 && timeout 90 taskset -c 8-11 python3 -m ostinato.cli bench latency --model random:qwen3-0.6b --batch-size 1,32 --input-len 512 \
    --output-len 64 --iters 3 --max-model-len 2048 --cuda-graph-mode none,piecewise,full_and_piecewise --json 2>>$OUT/err.txt | tee -a $OUT/decode.jsonl | cut -c1-300)
  for m in random:qwen3-0.6b random:llama-3.1-8b; do
    (cd .gpu/n1 && timeout 90 taskset -c 8-11 python3 -m ostinato.cli bench throughput --model $m --batch-size 256 --input-len 512 --output-len 128 \
      --json 2>>$OUT/err.txt | tee -a $OUT/throughput.jsonl | cut -c1-400)
  done
  (cd .gpu/n1 && timeout 120 taskset -c 8-11 python3 -m ostinato.cli bench prefill --model random:llama-3.1-8b --json --iters 3 --no-prefix-caching \
    --input-len 2048,8192 2>>$OUT/err.txt | tee -a $OUT/prefill.jsonl | cut -c1-400)
  ;;
p)  # n2: one-prompt prefill steps' timeline (device range and CUPTI's first-activity stall out), kernels and host profile,
    # FULL graphs and mode none, 512 and 2048 tokens
  prefprof n2 n2 full_and_piecewise,none
  summary
  ;;
l)  # host µs per F.linear call at qwen3-0.6b's prefill shapes, by BLAS library (.gpu/linear_host.py)
  timeout 120 python3 .gpu/linear_host.py 2>>$OUT/err.txt | tee $OUT/linear_host.txt
  ;;
s)  # n2: issue 17's serving bench (gpu_session.sh verify-bench's): qwen3-0.6b, 512 +- 50% in, 128 out, rates 8, 32, inf
  python3 -c "import fastapi, uvicorn, zmq, msgspec" 2>>$OUT/err.txt && echo deps ok
  (cd .gpu/n2 && timeout 200 python3 -m ostinato.cli bench serve --launch --model random:qwen3-0.6b --max-model-len 2048 \
    --request-rate 8,32,inf --num-prompts 80 --input-len 512 --output-len 128 --len-spread 0.5 --logprobs 0 --json \
    --server-log $OUT/serve.log 2>>$OUT/err.txt | tee -a $OUT/serve.jsonl | cut -c1-700)
  ;;
g2)  # n3: the greedy argmax without the float32 cast: the GPU tests that sample greedily in graphs and warm up the tail;
    # the whole decode step's kernels at batch 1 and 32 (the cast kernel gone)
  TESTS_S=280 gputests n3 tests/gpu/test_engine_graphs.py tests/gpu/test_sampling_params_gpu.py tests/gpu/test_warm_up.py
  (cd .gpu/n3 && timeout 80 python3 benchmarks/profile_step.py --model random:qwen3-0.6b --modes full_and_piecewise --batch-sizes 1,32 \
    --sections step-kernels --label n3 --json $OUT/stepk.jsonl > /dev/null 2>>$OUT/err.txt)
  python3 - <<'PY'
import json, os
for line in open(os.path.join(os.environ["OUT"], "stepk.jsonl")):
    r = json.loads(line)
    print(r["label"], r["batch"], "kernels", r["kernels_per_step"], "device", round(r["device_ms_per_step"], 3))
    for n, (c, us) in list(r["by_name"].items())[-8:]:
        print("   ", n[:60], c, us)
PY
  ;;
esac
grep -iE "error|Traceback" $OUT/err.txt 2>/dev/null | tail -5
