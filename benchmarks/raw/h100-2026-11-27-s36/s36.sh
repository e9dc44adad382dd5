#!/bin/bash
# session 36 calls: bash .gpu/s36.sh STAGE   (trees under .gpu/: m0 = main cfd6597 + the GPU tests of README checks 3 (second half) and 4; m1 = f4ff908 + benchmarks/chain_floor.py; m2 = m1 with chain_floor.py's `ours R` chains; m3 = m2 with its tl.dot probes, plain and swapped; s1 = m3 + gemv.py's tl.dot rows swapped, 64 x 128 (DOT_TILE); s2 = s1 with ROW_LIMITS 32 rows up to MAX_WEIGHT_ELEMENTS; s3 = the swap only without a norm prologue, PLAIN_ROW_LIMITS 32 rows up to 3M elements)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, 'gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version()); import os; print(os.cpu_count(), 'cpus')" | tee -a $OUT/env.txt
nvidia-smi topo -m >>$OUT/env.txt 2>&1
ptests() {  # TREE GPUS TAG K S: test_parallel.py's tests picked by K on the GPUs listed, at most S seconds
  (cd .gpu/$1 && CUDA_VISIBLE_DEVICES=$2 timeout $5 python3 -m pytest tests/gpu/test_parallel.py -k "$4" -q \
    -p no:cacheprovider -o addopts="" -rs --durations=0 >$OUT/p-$3.log 2>&1; echo "rc=$?" >>$OUT/p-$3.log)
}
left() { ps -ef | grep -c "[m]ultiprocessing" | sed "s/^/processes left $1: /" | tee -a $OUT/env.txt; }
lat() {  # TREE ARGS...: one pinned bench latency run, tagged with its tree
  local tree=$1; shift
  (cd .gpu/$tree && timeout ${LAT_S:-150} taskset -c 8-11 python3 -m ostinato.cli bench latency --json --output-len 64 --iters 3 \
    --max-model-len 2048 "$@" 2>>$OUT/err.txt | sed "s|^{|{\"tree\": \"$tree\", |" | tee -a $OUT/latency.jsonl |
    grep -o '"tree[^,]*\|"batch_size[^,]*\|"tpot_ms[^,]*' | paste -sd' ' | sed 's/"tree/\n"tree/g')
}
case $1 in
a)  # m0 on four GPUs, two pytest runs at once on two pairs: every two-GPU test of test_parallel.py (the four-GPU one skips)
  ptests m0 0,1 pair01 "two_stages_equal or two_tensor_ranks_equal or lazy" 560 &
  ptests m0 2,3 pair23 "killed or stopped or lost or shutdown or loads_later or (async and not xP)" 560 &
  wait; tail -n 4 $OUT/p-pair01.log $OUT/p-pair23.log; left a
  ;;
b)  # m0 on four GPUs: T=2 x P=2 (equality, the checker on; async scheduling in two modes)
  ptests m0 0,1,2,3 quad "times_two or xP" 400
  tail -n 8 $OUT/p-quad.log; left b
  ;;
c)  # m1 on one GPU: the chain bounds (benchmarks/chain_floor.py) of the decode targets of issues 18 and 21
  for run in "random:qwen3-0.6b --rows 1,32" "random:llama-3.1-8b --rows 1,32" \
             "random:llama-3.1-8b --rows 1,32 --weight-bytes 1" "random:qwen3-30b-a3b --rows 1"; do
    (cd .gpu/m1 && taskset -c 8-11 timeout 150 python3 benchmarks/chain_floor.py --model $run --json $OUT/chain.jsonl \
      2>>$OUT/err.txt | tee -a $OUT/chain.md)
  done
  ;;
d)  # m1 on one GPU: the engine's decode in the same machine, beside the chains (bench latency, FULL graphs)
  for run in "random:qwen3-0.6b --input-len 512" "random:llama-3.1-8b --input-len 128" \
             "random:llama-3.1-8b --input-len 128 --quantization fp8" "random:qwen3-30b-a3b --input-len 128 --batch-size 1"; do
    (cd .gpu/m1 && taskset -c 8-11 timeout 140 python3 -m ostinato.cli bench latency --json --batch-size 1,32 \
      --output-len 64 --iters 3 --max-model-len 2048 --model $run 2>>$OUT/err.txt | sed "s|^{|{\"run\": \"$run\", |" |
      tee -a $OUT/latency.jsonl | cut -c1-300)
  done
  ;;
e)  # m1 on one GPU: qwen3-0.6b batch 1 again (call 4 had 2.05 ms against 0.92 in session 34): pinned twice, unpinned twice
  for pin in "taskset -c 8-11" "taskset -c 8-11" "" ""; do
    (cd .gpu/m1 && timeout 100 $pin python3 -m ostinato.cli bench latency --json --batch-size 1 --output-len 64 --iters 3 \
      --max-model-len 2048 --model random:qwen3-0.6b --input-len 512 2>>$OUT/err.txt | sed "s|^{|{\"pin\": \"$pin\", |" |
      tee -a $OUT/latency.jsonl | grep -o '"pin[^,]*\|"tpot_ms[^,]*')
  done
  nproc; uptime; ps -eo pid,pcpu,etime,args --sort=-pcpu | head -8
  ;;
f)  # m2 on one GPU: the chains again, with ostinato's own projections at 1 and 32 rows (bf16 and FP8)
  for run in "random:qwen3-0.6b --rows 1,32" "random:llama-3.1-8b --rows 1,32" "random:llama-3.1-8b --rows 1,32 --weight-bytes 1"; do
    (cd .gpu/m2 && taskset -c 8-11 timeout 150 python3 benchmarks/chain_floor.py --model $run --json $OUT/chain.jsonl \
      2>>$OUT/err.txt | tee -a $OUT/chain.md)
  done
  ;;
g)  # m3 on one GPU: 32 rows by tl.dot, x @ w.T (mma.sync) against w @ x.T (swapped: wgmma), beside cuBLAS and ours
  for run in "random:qwen3-0.6b" "random:llama-3.1-8b" "random:llama-3.1-8b --weight-bytes 1"; do
    (cd .gpu/m3 && taskset -c 8-11 timeout 150 python3 benchmarks/chain_floor.py --rows 32,16 --model $run --json $OUT/chain.jsonl \
      2>>$OUT/err.txt | tee -a $OUT/chain.md)
  done
  ;;
h)  # s1: every projection at 1-32 rows (gemv-rows: swapped default, other tiles, cuBLAS, unfused); qwen3-0.6b decode on m1 (main), s1, s2
  (cd .gpu/s1 && timeout 260 python3 benchmarks/bench_kernels.py --sections gemv-rows --out $OUT/gemv-rows.md 2>>$OUT/err.txt | tail -n 40)
  for tree in ${TREES:-m1 s1 s2 m1 s2}; do LAT_S=100 lat $tree --model random:qwen3-0.6b --input-len 512 --batch-size 1,4,8,16,32; done
  ;;
i)  # s3: qwen3-0.6b decode against m1 (main), interleaved; the GPU tests of the small-batch kernel and the engine's graph modes
  for tree in m1 s3 m1 s3; do LAT_S=100 lat $tree --model random:qwen3-0.6b --input-len 512 --batch-size 1,4,8,16,32; done
  (cd .gpu/s3 && timeout 300 python3 -m pytest tests/gpu/test_kernels.py tests/gpu/test_engine_graphs.py -k "gemv or engine or graph or oracle" \
    -q -p no:cacheprovider -o addopts="" -rs --durations=5 2>&1 | tee $OUT/gpu-s3.log | tail -n 12)
  ;;
j)  # s3 against m1 again at batch 4, 16 and 32 (call 10's first s3 run had outliers at 4 and 32)
  for tree in s3 m1 s3 m1; do LAT_S=80 lat $tree --model random:qwen3-0.6b --input-len 512 --batch-size 4,16,32; done
  ;;
esac
