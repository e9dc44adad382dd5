#!/bin/bash
# session 39 calls: bash .gpu/s39.sh STAGE   (trees under .gpu/: m = main 7ccc8d0 (ec6cd35 in stage g); w = 2f578e6 + ROW_WARPS; L = ec6cd35 + LoRA at one row fused; V = L without the shrink's norm pass; f = m + FP8 weights (a scale a row)
# through gemv.py's fused one-row kernel (norm prologue, SiLU, residual epilogue), the weights widened by
# FP8_WIDEN: 1 cvt (Triton's conversion), 2 bits (integer ops in Triton), 3 asm (prmt/shr/and in inline PTX))
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
lat() {  # TREE WIDEN ARGS...: one pinned bench latency run, tagged with its tree and widening
  local tree=$1 widen=$2; shift 2
  (cd .gpu/$tree && timeout ${LAT_S:-150} taskset -c 8-11 python3 -c "import sys
if sys.argv[1] != '-':
    import ostinato.kernels.gemv as g; g.ROW_WARPS = int(sys.argv[1])
sys.argv = ['ostinato'] + sys.argv[2:]
from ostinato.cli import main; main()" $widen bench latency --json --output-len 64 --iters 3 \
    --max-model-len 2048 "$@" 2>>$OUT/err.txt | sed "s|^{|{\"tree\": \"$tree\", \"widen\": \"$widen\", |" | tee -a $OUT/latency.jsonl |
    grep -o '"tree[^,]*\|"widen[^,]*\|"quantization[^,]*\|"num_loras[^,]*\|"batch_size[^,]*\|"tpot_ms[^,]*\|"ratio_to_floor[^,]*' | paste -sd' ' | sed 's/"tree/\n"tree/g')
}
tests() {  # TREE TIMEOUT PYTEST-ARGS...
  local tree=$1 limit=$2; shift 2
  (cd .gpu/$tree && timeout $limit python3 -m pytest "$@" -q -p no:cacheprovider -o addopts="" -rs --durations=6 2>&1 |
    tee -a $OUT/gpu-$tree.log | tail -n 14)
}
case $1 in
a)  # f: the FP8 one-row tests (every widening), then the kernels: each widening's launches against fp8.py's kernel
  tests f 200 tests/gpu/test_fp8.py -k "one_row or fused" -x
  (cd .gpu/f && timeout 330 python3 benchmarks/bench_kernels.py --sections fp8-row --out $OUT/fp8-row.md 2>>$OUT/err.txt | tail -n 20)
  ;;
b)  # FP8 llama-3.1-8b decode: m against f in each widening, batch 1 and 32
  for run in "m -" "f 8" "f 4" "m -" "f 4"; do LAT_S=110 lat $run --model random:llama-3.1-8b --quantization fp8 --input-len 128 --batch-size 1,32; done
  ;;
c)  # f (cvt only, 4 warps at one row of FP8): every FP8 GPU test; the small-batch kernels and the engine's oracle and modes
  tests f 220 tests/gpu/test_fp8.py
  tests f 330 tests/gpu/test_kernels.py tests/gpu/test_engine_graphs.py -k "gemv or oracle_float32 or every_mode"
  ;;
d)  # f as committed: FP8 at one row, its launches against fp8.py's kernel; llama-3.1-8b FP8 decode at batch 1, m and f interleaved
  (cd .gpu/f && timeout 240 python3 benchmarks/bench_kernels.py --sections fp8-row --out $OUT/fp8-row-final.md 2>>$OUT/err.txt | tail -n 8)
  for run in "m -" "f -" "m -" "f -"; do LAT_S=90 lat $run --model random:llama-3.1-8b --quantization fp8 --input-len 128 --batch-size 1; done
  ;;
e)  # w = 2f578e6 + gemv.ROW_WARPS (the one-row kernel's warps over bf16 weights) set per run: 8 (as landed) against 4, batch 1
  for warps in 8 4 8 4; do LAT_S=80 lat w $warps --model random:qwen3-0.6b --input-len 512 --batch-size 1; done
  for warps in 8 4; do LAT_S=90 lat w $warps --model random:llama-3.1-8b --input-len 128 --batch-size 1; done
  for warps in 8 4; do LAT_S=150 lat w $warps --model random:qwen3-30b-a3b --input-len 128 --batch-size 1; done
  ;;
g)  # L = ec6cd35 + LoRA at one row keeping the base's fusions (the shrink normalises in its prologue, the expand applies SiLU): the LoRA GPU tests; LoRA batch-1 decode, m (= ec6cd35) and L interleaved
  tests L 250 tests/gpu/test_lora.py -x
  for tree in m L L m; do LAT_S=90 lat $tree - --model random:llama-3.1-8b --input-len 128 --batch-size 1 \
    --num-loras 0,1 --lora-rank 16 --max-loras 4 --max-lora-rank 16; done
  ;;
h)  # the kernels of LoRA batch-1 decode steps (one adapter), m and L (profile_step's step-kernels section)
  for tree in m L; do (cd .gpu/$tree && timeout 120 python3 benchmarks/profile_step.py --model random:llama-3.1-8b \
    --modes full_and_piecewise --batch-sizes 1 --num-loras 1 --sections step-kernels --steps 8 --label $tree \
    --json $OUT/prof.jsonl 2>>$OUT/err.txt | tail -n 25 | tee $OUT/prof-$tree.txt); done
  ;;
i)  # V = f501fb6 + L with the shrink's norm pass gone (it sums s * weight and keeps mean(s^2); the expands apply 1/rms):
    # LoRA batch-1 decode, V and m (= f501fb6), then V's LoRA GPU tests (the one-row ones, every mode with mixed adapters)
  for tree in V m; do LAT_S=70 lat $tree - --model random:llama-3.1-8b --input-len 128 --batch-size 1 \
    --num-loras 0,1 --lora-rank 16 --max-loras 4 --max-lora-rank 16; done
  tests V 90 tests/gpu/test_lora.py -x -k "one_row_kernels or one_request or every_mode or cold_kernel"
  ;;
esac
