#!/bin/bash
# session 27 calls: bash .gpu/s27.sh STAGE   (trees: .gpu/s0 = main 0dbdba6; n1.. = the session's trees)
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
a)  # n1 (rope + KV store inside decode attention): its GPU tests; FULL decode s0 / n1 for qwen3-0.6b
  TESTS_S=330 gputests n1 tests/gpu/test_kernels.py tests/gpu/test_warm_up.py tests/gpu/test_engine_graphs.py
  for t in s0 n1 s0 n1; do lat $t full "${q[@]}"; done
  ;;
b)  # llama-3.1-8b bf16 and fp8, s0 / n1
  for t in s0 n1 s0 n1; do LAT_S=140 lat $t full "${l[@]}"; done
  for t in s0 n1; do LAT_S=140 lat $t fp8 "${l[@]}" --quantization fp8; done
  ;;
ab)  # qwen3-0.6b FULL decode s0 / n2 (+ new token from registers) / n3 (+ metadata before the PDL wait), then llama-3.1-8b bf16 and fp8 s0 / n3
  for t in s0 n2 n3 s0 n2 n3; do lat $t full "${q[@]}"; done
  for t in s0 n3; do LAT_S=100 lat $t full "${l[@]}"; done
  for t in s0 n3; do LAT_S=100 lat $t fp8 "${l[@]}" --quantization fp8; done
  ;;
ab2)  # s0 / n1 (rope + store in decode attention, read back) / n4 (s0 + attention metadata before the PDL wait)
  for t in s0 n1 n4 s0 n1 n4; do lat $t full "${q[@]}"; done
  for t in s0 n1 n4; do LAT_S=100 lat $t full "${l[@]}"; done
  ;;
final)  # n5 (= n4, the kept change with its comments): GPU tests of attention, graphs, eager, speculative, async, warm-up
  TESTS_S=560 gputests n5 tests/gpu/test_kernels.py tests/gpu/test_engine_graphs.py tests/gpu/test_warm_up.py \
    tests/gpu/test_breakable.py tests/gpu/test_spec_graphs.py tests/gpu/test_async_graphs.py
  ;;
mlp)  # llama-3.1-8b's MLP at one row: mlp_row.py on n5; bench latency llama b1 n5 / n6 (one-row kernel limits raised to the MLP)
  (cd .gpu/n5 && timeout 150 python3 ../mlp_row.py 2>>$OUT/err.txt | tee $OUT/mlp_row.txt)
  l1=(--model random:llama-3.1-8b --input-len 512 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1)
  for t in n5 n6 n5 n6; do LAT_S=100 lat $t full "${l1[@]}"; done
  ;;
final2)  # n7 = 092f162 (the session's code): the kernel GPU tests; decode s0 / n7: qwen3-0.6b, llama-3.1-8b bf16 and fp8, batch 1 and 32
  TESTS_S=200 gputests n7 tests/gpu/test_kernels.py
  for t in s0 n7; do lat $t full "${q[@]}"; done
  for t in s0 n7; do LAT_S=100 lat $t full "${l[@]}"; done
  for t in s0 n7; do LAT_S=100 lat $t fp8 "${l[@]}" --quantization fp8; done
  ;;
warm)  # n8 (+ the KV sizing's LM head over its input buffer): the warm-up and start-up memory tests
  TESTS_S=170 gputests n8 tests/gpu/test_warm_up.py
  ;;
esac
