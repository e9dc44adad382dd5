#!/bin/bash
# session 38 calls: bash benchmarks/raw/h100-h200-2026-11-28-s38/s38.sh STAGE (the GPU trees ran it from benchmarks/raw/h100-2026-11-28-s38)   (trees under .gpu/: m = main 585bc1b;
# n = m + LoRA at one row in the one-row projection kernel (its first programs shrink, the others add the expand in
# their epilogue; LoRALinear.plan gives the wrapped projections the fused norm / SiLU / residual paths; the side
# stream joined in a finally); mc = m + n's tests/gpu/test_lora.py (the cold-shrink test without the join's finally);
# timing variants of n: v1 = the expand's loads of the shrink's sums through L1 (no .cg), v2 = no reset of the
# counts (no reader counts itself: after the first launch no program waits), v3 = both; k = m + what was kept of
# n: a LoRALinear's plan is its base's in a step without adapters (the fused paths), the side stream joined in a
# finally (the one-row LoRA kernel of n measured slower and dropped; mc updated to k's tests/gpu/test_lora.py);
# b = k (f04b68f) + the shrink as a launch of the one-row kernel over A's rows before the projection, whose
# programs read its sums beside x (after the PDL wait) and add the expand in their epilogue: no in-kernel wait
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, 'gpus', torch.cuda.device_count())" | tee -a $OUT/env.txt
lat() {  # TREE ARGS...: one pinned bench latency run, tagged with its tree
  local tree=$1; shift
  (cd .gpu/$tree && timeout ${LAT_S:-150} taskset -c 8-11 python3 -m ostinato.cli bench latency --json --output-len 64 --iters 3 \
    --max-model-len 2048 "$@" 2>>$OUT/err.txt | sed "s|^{|{\"tree\": \"$tree\", |" | tee -a $OUT/latency.jsonl |
    grep -o '"tree[^,]*\|"model[^,]*\|"num_loras[^,]*\|"batch_size[^,]*\|"tpot_ms[^,]*' | paste -sd' ' | sed 's/"tree/\n"tree/g')
}
lora() { for tree in "$@"; do LAT_S=130 lat $tree --model random:llama-3.1-8b --input-len 128 --batch-size 1,32 \
  --num-loras 0,1,4 --lora-rank 16 --max-loras 4 --max-lora-rank 16; done; }
tests() {  # TREE TIMEOUT PYTEST-ARGS...
  local tree=$1 limit=$2; shift 2
  (cd .gpu/$tree && timeout $limit python3 -m pytest "$@" -q -p no:cacheprovider -o addopts="" -rs --durations=6 2>&1 |
    tee -a $OUT/gpu-$tree.log | tail -n 14)
}
case $1 in
a)  # n: the LoRA GPU tests (the one-row test first), the small-batch kernel's and the engine's; then LoRA decode on n
  tests n 200 tests/gpu/test_lora.py -k "one_request or cold_shrink or kernels_match" -x
  tests n 330 tests/gpu/test_lora.py tests/gpu/test_kernels.py tests/gpu/test_engine_graphs.py \
    -k "not one_request and not cold_shrink and not kernels_match and (lora or gemv or oracle_float32 or every_mode)"
  tests mc 60 tests/gpu/test_lora.py -k cold_shrink
  lora n
  ;;
c)  # the cold-shrink test on mc (expected to fail) and n; LoRA batch 1 decode: m, n and n's timing variants
  tests mc 60 tests/gpu/test_lora.py -k cold_shrink
  tests n 60 tests/gpu/test_lora.py -k cold_shrink
  for tree in m n v1 v2 v3; do LAT_S=110 lat $tree --model random:llama-3.1-8b --input-len 128 --batch-size 1 \
    --num-loras 0,1 --lora-rank 16 --max-loras 4 --max-lora-rank 16; done
  ;;
d)  # k: the LoRA GPU tests; the cold-shrink test on mc (expected to fail); LoRA decode on llama-3.1-8b, m against k
  tests k 170 tests/gpu/test_lora.py
  tests mc 45 tests/gpu/test_lora.py -k cold_shrink
  lora m k
  ;;
e)  # the side-stream join test, rewritten (a cold projection kernel once the shrink is launched): k, then mc (expected to fail)
  tests k 60 tests/gpu/test_lora.py -k cold_kernel_beside
  tests mc 60 tests/gpu/test_lora.py -k cold_kernel_beside
  ;;
f)  # LoRA batch 1 decode, k against b; b's LoRA GPU tests (one request at a time against peft, every mode against eager)
  for tree in k b; do LAT_S=90 lat $tree --model random:llama-3.1-8b --input-len 128 --batch-size 1 \
    --num-loras 0,1 --lora-rank 16 --max-loras 4 --max-lora-rank 16; done
  tests b 100 tests/gpu/test_lora.py -k "one_request or every_mode" -x
  ;;
esac
