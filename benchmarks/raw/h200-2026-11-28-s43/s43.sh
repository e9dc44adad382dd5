#!/bin/bash
# session 43 calls: bash .gpu/s43.sh STAGE (a copy of this file; trees under .gpu/):
# m = main 62e3a2d; w = m + s42's split-sum-workspace.diff (split FP8 launches with as many rows
# as output tiles leave their K split's sum to the next norm, partials in one per-device buffer
# outside the graph pools); r = m with ROTATE_MIN_REQS = 1 (a graphed one-request decode rotates
# q/k and stores KV in the attention launch: no RoPE + store kernel); f (call 6) = main a839f48 + README
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
stamp() { echo "[$(date +%T)] $*"; }
lat() {  # TREE ARGS...: one pinned bench latency run, tagged with its tree
  local tree=$1; shift
  stamp "lat $tree $*"
  (cd .gpu/$tree && timeout ${LAT_S:-150} taskset -c 8-11 python3 -m ostinato.cli bench latency --json --output-len 64 --iters 3 \
    --max-model-len 2048 "$@" 2>>$OUT/err.txt | sed "s|^{|{\"tree\": \"$tree\", |" | tee -a $OUT/latency.jsonl |
    grep -o '"tree[^,]*\|"model[^,]*\|"cuda_graph_mode[^,]*\|"quantization[^,]*\|"batch_size[^,]*\|"tpot_ms[^,]*\|"ratio_to_floor[^,]*' | paste -sd' ' | sed 's/"tree/\n"tree/g')
}
tests() {  # TREE TIMEOUT PYTEST-ARGS...
  local tree=$1 limit=$2; shift 2
  stamp "tests $tree $*"
  (cd .gpu/$tree && PYTHONPATH=.:/tmp/site timeout $limit python3 -m pytest "$@" -q -p no:cacheprovider -o addopts="" -rs --durations=8 2>&1 |
    tee -a $OUT/gpu-$tree.log | tail -n 16)
}
case $1 in
a)  # FP8 llama-3.1-8b at 8 and 32 requests (128-token prompts), m w m w; then tests/gpu/test_fp8.py on w
  for tree in m w m w; do LAT_S=120 lat $tree --model random:llama-3.1-8b --quantization fp8 --input-len 128 --batch-size 8,32 --capture-sizes 8,32; done
  tests w 240 tests/gpu/test_fp8.py
  ;;
b)  # m: GPU test files not yet run on an H200 (first half)
  tests m 570 tests/gpu/test_engine_graphs.py tests/gpu/test_moe.py tests/gpu/test_prefill_graphs.py
  ;;
c)  # m: GPU test files not yet run on an H200 (second half)
  tests m 400 tests/gpu/test_lora.py tests/gpu/test_spec_graphs.py tests/gpu/test_structured_gpu.py tests/gpu/test_full_prefill_graphs.py tests/gpu/test_lifecycle.py
  ;;
d)  # batch 1, m r r m: FP8 and bf16 llama-3.1-8b (128-token prompts), qwen3-30b-a3b (128)
  for tree in m r r m; do LAT_S=90 lat $tree --model random:llama-3.1-8b --quantization fp8 --input-len 128 --batch-size 1 --capture-sizes 1; done
  for tree in m r r m; do LAT_S=120 lat $tree --model random:qwen3-30b-a3b --input-len 128 --batch-size 1 --capture-sizes 1; done
  ;;
e)  # where a PIECEWISE decode step of qwen3-0.6b at batch 1 goes (m, pinned as lat runs): decode, phases, the host's
    # functions, one break and one segment timed; then FP8 llama-3.1-8b's batch-32 step kernels (PDL off) on m and w
  (cd .gpu/m && timeout 200 taskset -c 8-11 python3 benchmarks/profile_step.py --model random:qwen3-0.6b --modes piecewise --batch-sizes 1 \
    --sections decode,phases,host,pieces --label pw 2>>$OUT/err.txt | grep -v "^{" | tee $OUT/piecewise.txt | head -n 60)
  for tree in m w; do
    (cd .gpu/$tree && timeout 150 python3 ../m/benchmarks/profile_step.py --modes full_and_piecewise --batch-sizes 32 --sections step-kernels \
      --steps 8 --no-pdl --label fp8-$tree --model random:llama-3.1-8b --quantization fp8 2>>$OUT/err.txt | grep -v "^{" | tee $OUT/prof-$tree.txt)
  done
  ;;
f)  # f = main with w landed (a839f48 + README): the norm kernel every model runs took new parameters; the kernels' tests,
    # the engine's graphs against eager and the HF oracle, FP8 engines in every mode
  tests f 380 tests/gpu/test_kernels.py tests/gpu/test_engine_graphs.py
  tests f 170 tests/gpu/test_fp8.py -k "every_mode or unsummed"
  ;;
esac
stamp done
