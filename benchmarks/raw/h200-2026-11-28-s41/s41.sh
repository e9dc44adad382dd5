#!/bin/bash
# session 41 calls: bash benchmarks/raw/h200-2026-11-28-s41/s41.sh STAGE   (trees under .gpu/: m = main (09076fa for a-c, 794cdcb for d); q = m + the X_FP8 loop reading its span's x scales before the loop + the split argmax; p = q with the scales loaded a group ahead instead; d = 794cdcb + SplitSum)
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
a)  # the argmax probe (q); q's GPU tests of the split argmax and all of test_fp8.py (the new bit-exact test included); llama-3.1-8b bf16 decode at batch 1 and 32, m q
  (cd .gpu/q && timeout 120 python3 benchmarks/raw/h200-2026-11-28-s41/argmax_probe.py 2>>$OUT/err.txt | tee $OUT/argmax-probe.md)
  tests q 60 tests/gpu/test_kernels.py -k argmax
  tests q 240 tests/gpu/test_fp8.py
  for tree in m q; do LAT_S=150 lat $tree --model random:llama-3.1-8b --input-len 128 --batch-size 1,32; done
  ;;
b)  # q against m: llama-3.1-8b FP8 decode at batch 1, 8, 16, 32, interleaved
  for tree in m q m q; do LAT_S=140 lat $tree --model random:llama-3.1-8b --quantization fp8 --input-len 128 --batch-size 1,8,16,32; done
  ;;
esac
case $1 in
c)  # p = q with each group's x scales loaded a group ahead (loop-carried) instead of the span's before the loop; m q p p q m FP8 batch 8, 16, 32; p's FP8 kernel GPU tests
  for tree in m q p p q m; do LAT_S=100 lat $tree --model random:llama-3.1-8b --quantization fp8 --input-len 128 --batch-size 8,16,32; done
  tests p 200 tests/gpu/test_fp8.py -k "norm_kernels or dot_rows or every_mode_equals_eager_in_float32"
  ;;
esac
case $1 in
d)  # m = 794cdcb (the argmax and the scales a group ahead landed); d = m + o and down's K split left unsummed to the next norm kernel (SplitSum); m d m d FP8 batch 1, 8, 16, 32; d's FP8 GPU tests
  for tree in m d m d; do LAT_S=100 lat $tree --model random:llama-3.1-8b --quantization fp8 --input-len 128 --batch-size 1,8,16,32; done
  tests d 300 tests/gpu/test_fp8.py
  ;;
esac
case $1 in
e)  # d = 794cdcb + SplitSum where rows >= the projection's tiles (llama-3.1-8b's o and down: 32 rows); m d m d FP8 batch 8, 32; d's new GPU test and the checker's
  for tree in m d m d; do LAT_S=90 lat $tree --model random:llama-3.1-8b --quantization fp8 --input-len 128 --batch-size 8,32; done
  tests d 200 tests/gpu/test_fp8.py -k "unsummed or checker"
  ;;
esac
case $1 in
f)  # why d's batch 8 (not deferred there) ran 2.4% slower: d0 = d with Linear.unsummed always None (no SplitSum anywhere); m d d0 d0 d m FP8 batch 8; bf16 batch 8 m d
  for tree in m d d0 d0 d m; do LAT_S=80 lat $tree --model random:llama-3.1-8b --quantization fp8 --input-len 128 --batch-size 8; done
  for tree in m d; do LAT_S=80 lat $tree --model random:llama-3.1-8b --input-len 128 --batch-size 8; done
  ;;
esac
case $1 in
g)  # m = main with the split argmax in the sampler: the HF oracle (greedy tokens) and every mode against eager
  tests m 215 tests/gpu/test_engine_graphs.py -k "oracle or every_mode" -x
  ;;
esac
