#!/bin/bash
# session 42 calls: bash benchmarks/raw/h200-2026-11-28-s42/s42.sh STAGE   (trees under .gpu/:
# call 1: m = main c11fcdb; d = m + split-sum-to-the-next-norm.diff (s41); d0 = d with
# Linear.unsummed always None; m, d and d0 print each split FP8 launch's partials address while
# capturing. From call 2: m = main c11fcdb; e = m + one-request decode attention reads its first
# cached KV tile before the PDL wait (EARLY, s37's early-kv-tile retried); r = m with
# ROTATE_MIN_REQS = 1 (a graphed one-request decode rotates in the attention launch, no RoPE +
# store kernel); g = m with graph launches merging a split KV in the attention kernel (MERGE, no
# combine kernel); rg = r + g (5 kernels a layer at batch 1); rge = rg + e. From call 4: f = the
# working tree (bench latency's TTFT and TPOT each their own median); r2, e2 = r, e with f's bench.py.
# From call 6: s2 = f with the split KV's count rounded up (ceil(2 x SMs / programs)): 2 splits
# where a decode launch has between 132 and 264 programs, e.g. 32 requests of 8 KV heads)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
lat() {  # TREE ARGS...: one pinned bench latency run, tagged with its tree
  local tree=$1; shift
  (cd .gpu/$tree && timeout ${LAT_S:-150} taskset -c 8-11 python3 -m ostinato.cli bench latency --json --output-len 64 --iters 3 \
    --max-model-len 2048 "$@" 2>>$OUT/err.txt | sed "s|^{|{\"tree\": \"$tree\", |" | tee -a $OUT/latency.jsonl |
    grep -o '"tree[^,]*\|"model[^,]*\|"cuda_graph_mode[^,]*\|"quantization[^,]*\|"batch_size[^,]*\|"tpot_ms[^,]*\|"ratio_to_floor[^,]*' | paste -sd' ' | sed 's/"tree/\n"tree/g')
}
tests() {  # TREE TIMEOUT PYTEST-ARGS...
  local tree=$1 limit=$2; shift 2
  (cd .gpu/$tree && timeout $limit python3 -m pytest "$@" -q -p no:cacheprovider -o addopts="" -rs --durations=6 2>&1 |
    tee -a $OUT/gpu-$tree.log | tail -n 14)
}
prof() {  # TREE LABEL ARGS...: the kernels of whole decode steps (batch 1 unless BATCHES), PDL off
  local tree=$1 label=$2; shift 2
  (cd .gpu/$tree && timeout ${PROF_S:-120} python3 benchmarks/profile_step.py --modes full_and_piecewise --batch-sizes ${BATCHES:-1} \
    --sections step-kernels --steps 8 --no-pdl --label $label --json $OUT/prof.jsonl "$@" 2>>$OUT/err-$label.txt |
    grep -v "^{" | tee $OUT/prof-$label.txt | cut -c1-110)
}
case $1 in
a)  # H200 step profiles on m (FP8 and bf16 llama-3.1-8b, qwen3-0.6b; batch 1 and 32); the batch-8 split-sum probe (d, d0); qwen3-0.6b's H200 latency
  BATCHES=1,32 prof m fp8 --model random:llama-3.1-8b --quantization fp8
  BATCHES=1,32 prof m bf16 --model random:llama-3.1-8b
  BATCHES=1,32 prof m q06 --model random:qwen3-0.6b
  for tree in d d0; do BATCHES=8 prof $tree fp8-b8-$tree --model random:llama-3.1-8b --quantization fp8; done
  grep -h "PARTS m=8 " $OUT/err-fp8-b8-d.txt | head -n 8; grep -h "PARTS m=8 " $OUT/err-fp8-b8-d0.txt | head -n 8
  LAT_S=120 lat m --model random:qwen3-0.6b --input-len 512 --batch-size 1,32
  LAT_S=120 lat m --model random:qwen3-0.6b --input-len 512 --batch-size 1 --cuda-graph-mode piecewise
  ;;
esac
case $1 in
b)  # batch 1 on the H200: m e r g rg rge, then reversed, qwen3-0.6b (512-token prompts); FP8 llama-3.1-8b m rg rge e
  for tree in m e r g rg rge rge rg g r e m; do LAT_S=60 lat $tree --model random:qwen3-0.6b --input-len 512 --batch-size 1 --capture-sizes 1; done
  for tree in m rg rge e; do LAT_S=60 lat $tree --model random:llama-3.1-8b --quantization fp8 --input-len 128 --batch-size 1 --capture-sizes 1; done
  ;;
esac
case $1 in
c)  # H200 decode attention: its KV rate against copy, the launch configurations' sweep, combine against merge (m)
  (cd .gpu/m && timeout 480 python3 benchmarks/bench_kernels.py --sections decode,decode-sweep,decode-merge --out $OUT/kernels.md 2>>$OUT/err.txt | tail -n 5)
  ;;
esac

case $1 in
d)  # f: the one-row kernel's launch sweeps (FP8 llama-3.1-8b; bf16 qwen3-0.6b and others); tests/gpu/test_kernels.py on the H200; qwen3-0.6b batch 1 f r2 e2 x2 with the medians fixed, 5 runs each
  (cd .gpu/f && timeout 300 python3 benchmarks/bench_kernels.py --sections fp8-row,gemv-row-sweep --out $OUT/rows.md 2>>$OUT/err.txt | tail -n 3)
  tests f 200 tests/gpu/test_kernels.py
  for tree in f r2 e2 f r2 e2; do LAT_S=60 lat $tree --model random:qwen3-0.6b --input-len 512 --batch-size 1 --capture-sizes 1 --iters 5; done
  ;;
esac
case $1 in
e)  # is qwen3-0.6b's batch-1 decode host-bound on the H200? f: decode, phases and host sections, pinned to cores 8-11 as lat runs, then unpinned
  (cd .gpu/f && timeout 150 taskset -c 8-11 python3 benchmarks/profile_step.py --model random:qwen3-0.6b --modes full_and_piecewise --batch-sizes 1 \
    --sections decode,phases,host --label pinned 2>>$OUT/err.txt | grep -v "^{" | tee $OUT/host-pinned.txt | head -n 40)
  (cd .gpu/f && timeout 150 python3 benchmarks/profile_step.py --model random:qwen3-0.6b --modes full_and_piecewise --batch-sizes 1 \
    --sections decode,phases --label unpinned 2>>$OUT/err.txt | grep -v "^{" | tee $OUT/host-unpinned.txt | head -n 12)
  ;;
esac
case $1 in
f)  # the FP8 kernel's launch sweep at 8 and 32 rows (f); decode attention split in 2 at batch 32 (s2) against f in the step: qwen3-0.6b (512-token prompts) x2, llama-3.1-8b bf16 (128)
  (cd .gpu/f && timeout 170 python3 benchmarks/bench_kernels.py --sections fp8-sweep --out $OUT/fp8-sweep.md 2>>$OUT/err.txt | tail -n 3)
  for tree in f s2 s2 f; do LAT_S=60 lat $tree --model random:qwen3-0.6b --input-len 512 --batch-size 32 --capture-sizes 32; done
  for tree in f s2; do LAT_S=70 lat $tree --model random:llama-3.1-8b --input-len 128 --batch-size 32 --capture-sizes 32; done
  ;;
esac
case $1 in
g)  # f (main + the bench fix): GPU tests not yet run on an H200: async scheduling in graphs, sampling parameters, structured outputs
    # (call 7: test_structured_gpu.py needs jsonschema, which the image lacks and .whl does not carry; calls 8-11 ran pytest directly
    # in .gpu/f: 8 without PYTHONPATH=.:/tmp/site (llguidance not found), then with it test_async_graphs.py + test_sampling_params_gpu.py,
    # test_breakable.py + test_check_graphs.py, test_warm_up.py + test_device_deadline.py)
  tests f 250 tests/gpu/test_async_graphs.py tests/gpu/test_sampling_params_gpu.py tests/gpu/test_structured_gpu.py
  ;;
esac
