#!/bin/bash
# session 28 calls: bash .gpu/s28.sh STAGE   (trees: .gpu/s0 = main 6af31a6; f1 = s0 + branch fp8-fusions)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__); import os; print(os.cpu_count(), 'cpus')" | tee -a $OUT/env.txt
gputests() {  # TREE [FILES...]: the GPU tests of a tree
  local tree=$1; shift
  (cd .gpu/$tree && timeout ${TESTS_S:-560} python3 -m pytest ${@:-tests/gpu} -q -p no:cacheprovider \
    -o addopts="" -rs --durations=10 2>&1 | tee $OUT/gpu-$tree.log | tail -n 25)
}
lat() {  # TREE LABEL ARGS...: one bench latency run, tagged
  local tree=$1 label=$2; shift 2
  (cd .gpu/$tree && timeout ${LAT_S:-150} python3 -m ostinato.cli bench latency --json "$@" 2>>$OUT/err.txt |
    sed "s|^{|{\"tree\": \"$tree\", \"label\": \"$label\", |") | tee -a $OUT/latency.jsonl | cut -c1-60,330-700
}
q=(--model random:qwen3-0.6b --input-len 512 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1,32)
l=(--model random:llama-3.1-8b --input-len 512 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1,32)
case $1 in
a)  # f1: the FP8 and kernel GPU tests; llama-3.1-8b fp8 decode s0 / f1 interleaved; qwen3-0.6b bf16 s0 / f1 (gemv helpers moved)
  TESTS_S=200 gputests f1 tests/gpu/test_fp8.py tests/gpu/test_kernels.py
  for t in s0 f1 s0 f1; do LAT_S=100 lat $t fp8 "${l[@]}" --quantization fp8; done
  for t in s0 f1; do LAT_S=60 lat $t full "${q[@]}"; done
  ;;
b)  # llama-3.1-8b fp8 batch 1: s0 / f2 (FP8 row plan with the output add only) / f3 (+ the norm prologue, no SiLU)
  l1=(--model random:llama-3.1-8b --input-len 512 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1)
  for t in s0 f2 f3 s0 f2 f3; do LAT_S=90 lat $t fp8 "${l1[@]}" --quantization fp8; done
  ;;
c)  # d1 (prefill attention reads the new tokens' KV from k and v): direct_sweep.py; bench prefill s0 / d1 interleaved
  (cd .gpu/d1 && timeout 300 python3 ../direct_sweep.py 2>>$OUT/err.txt | tee $OUT/direct_sweep.txt)
  for t in s0 d1 s0 d1; do
    (cd .gpu/$t && timeout 100 python3 -m ostinato.cli bench prefill --json --model random:qwen3-0.6b \
      --no-prefix-caching 2>>$OUT/err.txt | sed "s|^{|{\"tree\": \"$t\", |" | tee -a $OUT/bench-prefill.jsonl | cut -c1-300)
  done
  ;;
d)  # d2 (DIRECT loop at DIRECT_STAGES = 3): direct_stages.py; bench prefill 1024,2048 s0 / d2 interleaved, 10 iterations
  (cd .gpu/d2 && timeout 200 python3 ../direct_stages.py 2>>$OUT/err.txt | tee $OUT/direct_stages.txt)
  for t in s0 d2 s0 d2; do
    (cd .gpu/$t && timeout 80 python3 -m ostinato.cli bench prefill --json --model random:qwen3-0.6b \
      --no-prefix-caching --input-len 512,1024,2048 --iters 10 2>>$OUT/err.txt | sed "s|^{|{\"tree\": \"$t\", |" | tee -a $OUT/bench-prefill.jsonl | cut -c1-250)
  done
  ;;
e)  # d3 (DIRECT for fresh prompts only): direct_stages.py; GPU tests of attention and prefill graphs
  (cd .gpu/d3 && timeout 150 python3 ../direct_stages.py 2>>$OUT/err.txt | tee $OUT/direct_stages.txt)
  TESTS_S=400 gputests d3 tests/gpu/test_kernels.py tests/gpu/test_prefill_graphs.py tests/gpu/test_full_prefill_graphs.py
  ;;
f)  # d3: engine graph tests (HF oracle, every mode against eager); bench prefill s0 / d3 interleaved
  TESTS_S=300 gputests d3 tests/gpu/test_engine_graphs.py
  for t in s0 d3 s0 d3; do
    (cd .gpu/$t && timeout 80 python3 -m ostinato.cli bench prefill --json --model random:qwen3-0.6b \
      --no-prefix-caching --input-len 512,1024,2048 --iters 10 2>>$OUT/err.txt | sed "s|^{|{\"tree\": \"$t\", |" | tee -a $OUT/bench-prefill.jsonl | cut -c1-250)
  done
  ;;
g)  # d4 (DIRECT by loop bounds: fresh prompts' loops read k and v, others the cache): direct_stages.py
  (cd .gpu/d4 && timeout 150 python3 ../direct_stages.py 2>>$OUT/err.txt | tee $OUT/direct_stages.txt)
  ;;
h)  # d5 (= d4 with its comments and a GPU test of DIRECT): GPU tests of attention, prefill graphs, engine graphs; bench prefill s0 / d5 interleaved
  TESTS_S=420 gputests d5 tests/gpu/test_kernels.py tests/gpu/test_prefill_graphs.py tests/gpu/test_full_prefill_graphs.py tests/gpu/test_engine_graphs.py
  for t in s0 d5 s0 d5; do
    (cd .gpu/$t && timeout 45 python3 -m ostinato.cli bench prefill --json --model random:qwen3-0.6b \
      --no-prefix-caching --input-len 512,1024,2048 --iters 10 2>>$OUT/err.txt | sed "s|^{|{\"tree\": \"$t\", |" | tee -a $OUT/bench-prefill.jsonl | cut -c1-250)
  done
  ;;
i)  # where a fresh prompt's first token goes, s0 / d5: profile_step's prefill section (device time by kernel)
  for t in s0 d5; do
    (cd .gpu/$t && timeout 120 python3 benchmarks/profile_step.py --sections prefill --modes full_and_piecewise \
      --prefill-lengths 512,1024,2048 --json $OUT/prefill-$t.jsonl 2>>$OUT/err.txt | cut -c1-400)
  done
  ;;
j)  # d5: bench_kernels prefill and sdpa sections; GPU tests: warm-up (no compile after start-up), FP8, MoE, LoRA
  (cd .gpu/d5 && timeout 120 python3 benchmarks/bench_kernels.py --sections prefill,sdpa --out $OUT/kernels-prefill.md 2>>$OUT/err.txt | tail -n 25)
  TESTS_S=430 gputests d5 tests/gpu/test_warm_up.py tests/gpu/test_fp8.py tests/gpu/test_moe.py tests/gpu/test_lora.py
  ;;
k)  # d5: the remaining single-GPU test files
  TESTS_S=560 gputests d5 tests/gpu/test_check_graphs.py tests/gpu/test_sampling_params_gpu.py tests/gpu/test_structured_gpu.py \
    tests/gpu/test_spec_graphs.py tests/gpu/test_async_graphs.py tests/gpu/test_breakable.py tests/gpu/test_lifecycle.py tests/gpu/test_device_deadline.py
  ;;
l)  # the illegal address of call 9: BURST with blocking launches, d5 then s0
  for t in d5 s0; do
    (cd .gpu/$t && CUDA_LAUNCH_BLOCKING=1 timeout 100 python3 ../burst.py 2>&1 | grep -v "^INFO" | tail -n 30 | tee $OUT/burst-$t.txt)
  done
  ;;
m)  # BURST with blocking launches: d5 (whole traceback), d6 (direct rows clamped to the request), d7 (direct loop without its own stages); d6's fresh-prompt kernel times
  for t in d5 d6 d7; do
    (cd .gpu/$t && CUDA_LAUNCH_BLOCKING=1 timeout 100 python3 ../burst.py 2>&1 | grep -v "^INFO" | grep -v "^frame" | head -n 40 | tee $OUT/burst-$t.txt)
  done
  (cd .gpu/d6 && timeout 150 python3 ../direct_stages.py 2>>$OUT/err.txt | tee $OUT/direct_stages-d6.txt)
  ;;
n)  # which warm-up faults (d5), blocking launches
  (cd .gpu/d5 && CUDA_LAUNCH_BLOCKING=1 timeout 100 python3 ../burst2.py 2>&1 | grep -v "^INFO\|^frame" | tail -n 45 | tee $OUT/burst2-d5.txt)
  ;;
o)  # d8 (d5 + loop bounds safe for warm-up batches whose seq_len is clamped below q_len): BURST, then warm-up, attention and prefill-graph GPU tests
  (cd .gpu/d8 && CUDA_LAUNCH_BLOCKING=1 timeout 100 python3 ../burst.py 2>&1 | grep -v "^INFO\|^frame" | tail -n 5 | tee $OUT/burst-d8.txt)
  TESTS_S=420 gputests d8 tests/gpu/test_warm_up.py tests/gpu/test_kernels.py tests/gpu/test_prefill_graphs.py tests/gpu/test_full_prefill_graphs.py
  ;;
esac
