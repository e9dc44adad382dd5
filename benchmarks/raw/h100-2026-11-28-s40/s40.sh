#!/bin/bash
# session 40 calls: bash benchmarks/raw/h100-2026-11-28-s40/s40.sh STAGE   (trees under .gpu/: m = main 73e0081; q = m + FP8 x quantised by the norm kernel before q|k|v and gate|up at 2-32 rows)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
lat() {  # TREE ARGS...: one pinned bench latency run, tagged with its tree
  local tree=$1; shift
  (cd .gpu/$tree && timeout ${LAT_S:-150} taskset -c 8-11 python3 -m ostinato.cli bench latency --json --output-len 64 --iters 3 \
    --max-model-len 2048 "$@" 2>>$OUT/err.txt | sed "s|^{|{\"tree\": \"$tree\", |" | tee -a $OUT/latency.jsonl |
    grep -o '"tree[^,]*\|"quantization[^,]*\|"num_loras[^,]*\|"batch_size[^,]*\|"tpot_ms[^,]*\|"ratio_to_floor[^,]*' | paste -sd' ' | sed 's/"tree/\n"tree/g')
}
tests() {  # TREE TIMEOUT PYTEST-ARGS...
  local tree=$1 limit=$2; shift 2
  (cd .gpu/$tree && timeout $limit python3 -m pytest "$@" -q -p no:cacheprovider -o addopts="" -rs --durations=6 2>&1 |
    tee -a $OUT/gpu-$tree.log | tail -n 14)
}
prof() {  # TREE LABEL ARGS...: the kernels of a decode step (batch 1 unless BATCHES), PDL off
  local tree=$1 label=$2; shift 2
  (cd .gpu/$tree && timeout 150 python3 benchmarks/profile_step.py --modes full_and_piecewise --batch-sizes ${BATCHES:-1} \
    --sections step-kernels --steps 8 --no-pdl --label $label --json $OUT/prof.jsonl "$@" 2>>$OUT/err.txt | tail -n ${TAIL:-22} | tee $OUT/prof-$label.txt)
}
case $1 in
a)  # m: all of test_lora.py (session 39's landed LoRA code); step kernels, PDL off: LoRA (1 adapter), FP8, qwen3-30b-a3b at batch 1
  tests m 320 tests/gpu/test_lora.py
  prof m lora1 --model random:llama-3.1-8b --num-loras 1
  prof m fp8 --model random:llama-3.1-8b --quantization fp8
  prof m a3b --model random:qwen3-30b-a3b
  ;;
b)  # the FP8 x FP8 probe with x quantised before the kernel: llama-3.1-8b's FP8 weights as a chain at 32 and 16 rows
  cp benchmarks/raw/h100-2026-11-28-s40/fp8x_chain.py .gpu/m/benchmarks/
  (cd .gpu/m/benchmarks && PYTHONPATH=..:.:/tmp/site timeout 400 python3 fp8x_chain.py 32,16 2>>$OUT/err.txt | tee $OUT/fp8x-chain.md)
  ;;
c)  # q against m: llama-3.1-8b FP8 decode at batch 8 and 32, interleaved; q's FP8 GPU tests
  for tree in m q m q; do LAT_S=120 lat $tree --model random:llama-3.1-8b --quantization fp8 --input-len 128 --batch-size 8,32; done
  tests q 240 tests/gpu/test_fp8.py
  ;;
d)  # q: the chain probe again with fp8_gemv taking x quantised before it (gemv_config's launch, 4 warps, chunks of 256, the probe's split) at 32 and 8 rows
  cp benchmarks/raw/h100-2026-11-28-s40/fp8x_chain.py .gpu/q/benchmarks/
  (cd .gpu/q/benchmarks && PYTHONPATH=..:.:/tmp/site timeout 400 python3 fp8x_chain.py ${ROWS:-32,8} 2>>$OUT/err.txt | tee -a $OUT/fp8x-chain-q.md)
  ;;
e)  # m and q: the kernels of llama-3.1-8b FP8 decode steps at batch 8 and 32, PDL off
  for tree in m q; do BATCHES=8,32 TAIL=40 prof $tree fp8-$tree --model random:llama-3.1-8b --quantization fp8; done
  ;;
f)  # q as committed against m: llama-3.1-8b FP8 decode at batch 1, 4, 8, 16, 32, interleaved; q's new CPU-side tests on the GPU's Triton (interpreted), the FP8 GPU tests
  for tree in m q m q; do LAT_S=150 lat $tree --model random:llama-3.1-8b --quantization fp8 --input-len 128 --batch-size 1,8,16,32; done
  tests q 200 tests/gpu/test_fp8.py -k "dot_rows or every_mode_equals_eager_in_float32"
  ;;
esac
# call 10 ran by hand, in .gpu: for t in q m q: bench latency --model random:llama-3.1-8b --quantization fp8 --input-len 128 --batch-size 16 (pinned, as lat)
# call 11: ROWS=32 bash s40.sh d with fp8x_chain.py as archived (the probe's sum unrolled too)
