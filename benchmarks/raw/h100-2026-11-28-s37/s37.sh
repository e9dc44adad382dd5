#!/bin/bash
# session 37 calls: bash benchmarks/raw/h100-2026-11-28-s37/s37.sh STAGE   (trees under .gpu/: m = main 30d2ca2;
# n1 = m + a normed projection the kernel refuses with its norm takes the norm kernel, then the kernel without a
# prologue (SiLU in its epilogue), PLAIN_ROW_LIMITS ((8M, 32), (MAX, 1)); n2 = n1 with ((8M, 32), (MAX, 16));
# n3 = n1 with ((MAX, 32)); n4 = n1 with ((3M, 32), (8M, 1), (MAX, 32)), its tests; m2 = b20bf57 (n4 landed); e1 = m2 + decode attention reads its first cache tile before the PDL wait (EARLY))
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, 'gpus', torch.cuda.device_count())" | tee -a $OUT/env.txt
lat() {  # TREE ARGS...: one pinned bench latency run, tagged with its tree
  local tree=$1; shift
  (cd .gpu/$tree && timeout ${LAT_S:-150} taskset -c 8-11 python3 -m ostinato.cli bench latency --json --output-len 64 --iters 3 \
    --max-model-len 2048 "$@" 2>>$OUT/err.txt | sed "s|^{|{\"tree\": \"$tree\", |" | tee -a $OUT/latency.jsonl |
    grep -o '"tree[^,]*\|"model[^,]*\|"batch_size[^,]*\|"tpot_ms[^,]*' | paste -sd' ' | sed 's/"tree/\n"tree/g')
}
qwen() { for tree in "$@"; do LAT_S=100 lat $tree --model random:qwen3-0.6b --input-len 512 --batch-size 1,4,8,16,32; done; }
llama() { for tree in "$@"; do LAT_S=140 lat $tree --model random:llama-3.1-8b --input-len 128 --batch-size 4,16,32; done; }
case $1 in
a)  # n1: every projection at 1-32 rows, normed ones also norm first (gemv-rows); qwen3-0.6b decode m against n1
  (cd .gpu/n1 && timeout 280 python3 benchmarks/bench_kernels.py --sections gemv-rows --out $OUT/gemv-rows.md 2>>$OUT/err.txt | tail -n 60)
  qwen m n1
  ;;
b)  # qwen3-0.6b decode n1 against m again at 4, 8, 32; llama-3.1-8b at 4-32 rows: m, n2, n3
  for tree in n1 m; do LAT_S=80 lat $tree --model random:qwen3-0.6b --input-len 512 --batch-size 4,8,32; done
  llama m n2 n3
  ;;
c)  # n4: the GPU tests of the small-batch kernel, the engine's graph modes (HF oracle, every mode against eager), MoE
  (cd .gpu/n4 && timeout 560 python3 -m pytest tests/gpu/test_kernels.py tests/gpu/test_engine_graphs.py tests/gpu/test_moe.py \
    -k "gemv or engine or graph or oracle or moe" -q -p no:cacheprovider -o addopts="" -rs --durations=8 2>&1 | tee $OUT/gpu-n4.log | tail -n 16)
  ;;
d)  # n4 against m: llama-3.1-8b at 4-32 rows, qwen3-0.6b, qwen3-30b-a3b at 1, 4 and 32
  llama n4 m
  for tree in m n4; do LAT_S=80 lat $tree --model random:qwen3-0.6b --input-len 512 --batch-size 1,4,8,32; done
  for tree in m n4; do LAT_S=150 lat $tree --model random:qwen3-30b-a3b --input-len 128 --batch-size 1,4,32; done
  ;;
e)  # e1: the attention kernels' and the engine's GPU tests; qwen3-0.6b decode m2 against e1, interleaved; LoRA on llama-3.1-8b (m2)
  (cd .gpu/e1 && timeout 260 python3 -m pytest tests/gpu/test_kernels.py tests/gpu/test_engine_graphs.py \
    -k "paged or rotat or merged or attention or engine" -q -p no:cacheprovider -o addopts="" -rs --durations=5 2>&1 | tee $OUT/gpu-e1.log | tail -n 10)
  for tree in m2 e1 m2 e1; do LAT_S=70 lat $tree --model random:qwen3-0.6b --input-len 512 --batch-size 1,4,32; done
  LAT_S=120 lat m2 --model random:llama-3.1-8b --input-len 128 --batch-size 1,32 --num-loras 0,1,4 --lora-rank 16 --max-loras 4 --max-lora-rank 16
  ;;
f)  # r = the review mend (Linear.plan makes the norm-first plan): the engine's HF oracle and mode tests, the new one included
  (cd .gpu/r && timeout 170 python3 -m pytest tests/gpu/test_engine_graphs.py -k "oracle_float32 or every_mode" \
    -q -p no:cacheprovider -o addopts="" -rs 2>&1 | tee $OUT/gpu-r.log | tail -n 4)
  ;;
esac
