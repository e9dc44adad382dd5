#!/bin/bash
# session 21 calls: bash .gpu/s21.sh STAGE   (trees: .gpu/main21 = main 82841cd, .gpu/s21 = candidate)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a $OUT/env.txt
lat() {  # TREE LABEL ARGS...: one bench latency run, tagged
  local tree=$1 label=$2; shift 2
  (cd .gpu/$tree && timeout 150 python3 -m ostinato.cli bench latency --json "$@" 2>>$OUT/err.txt |
    sed "s|^{|{\"tree\": \"$tree\", \"label\": \"$label\", |") | tee -a $OUT/latency.jsonl
}
case $1 in
tests)
  (cd .gpu/s21 && timeout ${TESTS_S:-570} python3 -m pytest tests/gpu -q -p no:cacheprovider -o addopts="" -rs \
    --durations=10 2>&1 | tee $OUT/gpu-tests.log | tail -n 30)
  ;;
small)  # qwen3-0.6b: eager decode, decode per mode, start-up
  q=(--model random:qwen3-0.6b --input-len 512 --output-len 64 --iters 3 --max-model-len 2048)
  for rep in 1 2; do for t in main21 ${NEW:-s21}; do
    lat $t none "${q[@]}" --batch-size 1 --cuda-graph-mode none
  done; done
  for t in main21 ${NEW:-s21} main21 ${NEW:-s21}; do
    lat $t fp "${q[@]}" --batch-size 1,32 --cuda-graph-mode full_and_piecewise
    lat $t pw "${q[@]}" --batch-size 1 --cuda-graph-mode piecewise
  done
  for t in main21 ${NEW:-s21} main21 ${NEW:-s21}; do
    (cd .gpu/$t && timeout 90 python3 -m ostinato.cli bench startup --model random:qwen3-0.6b --json \
      --max-model-len 2048 --input-len 512 2>>$OUT/err.txt | sed "s|^{|{\"tree\": \"$t\", |") | tee -a $OUT/startup.jsonl
  done
  ;;
fp8)  # FP8 GPU tests and the gemv kernels' tests on s21, then llama-3.1-8b --quantization fp8 decode, main / s21 / main / s21
  (cd .gpu/s21 && timeout 200 python3 -m pytest tests/gpu/test_fp8.py tests/gpu/test_kernels.py -q -p no:cacheprovider \
    -o addopts="" -rs 2>&1 | tee $OUT/fp8-tests.log | tail -n 8)
  for t in main21 s21 main21 s21; do
    lat $t fp8 --model random:llama-3.1-8b --quantization fp8 --batch-size 1,8,32 --input-len 128 \
      --output-len 64 --iters 3 --max-model-len 2048 --cuda-graph-mode full_and_piecewise
  done
  ;;
lora)  # llama-3.1-8b: base, then LoRA 0/1/4 adapters, per tree
  c=(--model random:llama-3.1-8b --batch-size 1,32 --input-len 128 --output-len 64 --iters 3
     --max-model-len 2048 --cuda-graph-mode full_and_piecewise)
  for t in main21 s21; do
    lat $t base "${c[@]}"
    lat $t lora "${c[@]}" --num-loras 0,1,4 --lora-rank 16 --max-loras 4 --max-lora-rank 16
  done
  ;;
lora1)  # llama-3.1-8b batch 1: base and one adapter, per tree in $TREES
  c=(--model random:llama-3.1-8b --batch-size 1 --input-len 128 --output-len 64 --iters 3
     --max-model-len 2048 --cuda-graph-mode full_and_piecewise)
  for t in $TREES; do
    lat $t base "${c[@]}"
    lat $t lora "${c[@]}" --num-loras 1 --lora-rank 16 --max-loras 4 --max-lora-rank 16
  done
  ;;
subset)  # the final tree's GPU tests that cover its changes (launches, RoPE key, q/k/v split)
  (cd .gpu/s21 && timeout ${TESTS_S:-400} python3 -m pytest tests/gpu/test_kernels.py tests/gpu/test_engine_graphs.py \
    tests/gpu/test_lora.py tests/gpu/test_breakable.py tests/gpu/test_prefill_graphs.py \
    tests/gpu/test_full_prefill_graphs.py tests/gpu/test_check_graphs.py -q -p no:cacheprovider -o addopts="" -rs \
    --durations=5 2>&1 | tee $OUT/gpu-subset.log | tail -n 15)
  ;;
esac
grep -iE "error|traceback" $OUT/err.txt 2>/dev/null | grep -v "it/s\]" | tail -5
