#!/bin/bash
# session 32 calls: bash .gpu/s32.sh STAGE   (trees under .gpu/: m0 = main 7238fa9)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__); import os; print(os.cpu_count(), 'cpus')" | tee -a $OUT/env.txt
gputests() {  # TREE [FILES...]: the GPU tests of a tree
  local tree=$1; shift
  (cd .gpu/$tree && timeout ${TESTS_S:-560} python3 -m pytest "${@:-tests/gpu}" -q -p no:cacheprovider \
    -o addopts="" -rs --durations=10 2>&1 | tee $OUT/gpu-$tree.log | tail -n 25)
}
lat() {  # TREE LABEL ARGS...: one pinned bench latency run, tagged
  local tree=$1 label=$2; shift 2
  (cd .gpu/$tree && timeout ${LAT_S:-150} taskset -c 8-11 python3 -m ostinato.cli bench latency --json "$@" 2>>$OUT/err.txt |
    sed "s|^{|{\"tree\": \"$tree\", \"label\": \"$label\", |") | tee -a $OUT/latency.jsonl | cut -c1-60,330-700
}
prefill() {  # TREE LENGTHS ITERS: pinned bench prefill, qwen3-0.6b
  (cd .gpu/$1 && timeout ${PRE_S:-100} taskset -c 8-11 python3 -m ostinato.cli bench prefill --json --model random:qwen3-0.6b \
    --no-prefix-caching --input-len $2 --iters $3 2>>$OUT/err.txt | sed "s|^{|{\"tree\": \"$1\", |" | tee -a $OUT/prefill.jsonl | cut -c1-300)
}
prefprof() {  # TREE LABEL: qwen3-0.6b one-prompt prefill steps' kernels at 512, 1024, 2048
  (cd .gpu/$1 && timeout ${PROF_S:-150} python3 benchmarks/profile_step.py --model random:qwen3-0.6b --modes full_and_piecewise \
    --sections prefill --prefill-lengths 512,1024,2048 --label $2 --json $OUT/prof.jsonl > /dev/null 2>>$OUT/err.txt)
}
summary() {
python3 - <<'PY'
import json, os
p = os.path.join(os.environ["OUT"], "prof.jsonl")
for line in open(p) if os.path.exists(p) else []:
    r = json.loads(line)
    if "top" in r:
        print(r.get("label"), r["mode"], r["tokens"], "wall", round(r["wall_ms"], 3), "device", round(r["device_ms"], 3), r["kernels"])
        for n, (c, us) in list(r["top"].items())[:8]:
            print("   ", n[:60], c, us)
PY
}
case $1 in
a)  # m0: the engine GPU tests on the final rotation rule (session 31 ran them on an earlier rule)
  TESTS_S=570 gputests m0 tests/gpu/test_engine_graphs.py tests/gpu/test_moe.py tests/gpu/test_spec_graphs.py tests/gpu/test_async_graphs.py tests/gpu/test_lora.py
  ;;
b)  # m0: the remaining single-GPU test files
  TESTS_S=570 gputests m0 tests/gpu/test_check_graphs.py tests/gpu/test_prefill_graphs.py tests/gpu/test_full_prefill_graphs.py tests/gpu/test_breakable.py \
    tests/gpu/test_warm_up.py tests/gpu/test_lifecycle.py tests/gpu/test_sampling_params_gpu.py tests/gpu/test_structured_gpu.py tests/gpu/test_fp8.py tests/gpu/test_device_deadline.py
  ;;
c)  # batch-1 decode, pinned, interleaved: m0 (main), ra (decode of one request rotates in the attention launch too), gb (the one-row
    # gemv lets its successor launch only after its FMAs, not at its start), rb (= ra + gb)
  a3b=(--model random:qwen3-30b-a3b --input-len 128 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1)
  q1=(--model random:qwen3-0.6b --input-len 512 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1)
  for t in m0 ra rb gb m0 rb; do LAT_S=60 lat $t q1 "${q1[@]}"; done
  for t in m0 rb ra; do LAT_S=110 lat $t a3b "${a3b[@]}"; done
  ;;
d)  # n1 (the rotation rule on the key's uniform query length; eager steps of one request rotate too): the GPU tests that failed
    # on m0 and those that decode in graphs; then qwen3-0.6b batch 1 in mode none and FULL, m0 / n1 interleaved
  TESTS_S=330 gputests n1 tests/gpu/test_spec_graphs.py tests/gpu/test_warm_up.py tests/gpu/test_engine_graphs.py tests/gpu/test_async_graphs.py \
    tests/gpu/test_check_graphs.py "tests/gpu/test_kernels.py::test_a_decode_launch_rotates_and_stores_in_a_graph"
  q1=(--model random:qwen3-0.6b --input-len 512 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1)
  for t in m0 n1 m0 n1; do LAT_S=45 lat $t none "${q1[@]}" --cuda-graph-mode none; done
  for t in n1 m0; do LAT_S=45 lat $t q1 "${q1[@]}"; done
  ;;
e)  # n2 (= n1 + the graph checker's test swapping input_ids): that test file; a CUDA graph's replay host time by kernel count
    # and PDL; qwen3-0.6b batch 1 FULL and mode none, m0 / n2 interleaved (FULL first: call 4's first q1 run looked slow)
  TESTS_S=120 gputests n2 tests/gpu/test_check_graphs.py
  (cd .gpu/n2 && timeout 60 python3 benchmarks/graph_launch.py --kernels 64,256,1024 --json $OUT/graph_launch.jsonl 2>>$OUT/err.txt)
  q1=(--model random:qwen3-0.6b --input-len 512 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1)
  for t in m0 n2 m0 n2; do LAT_S=45 lat $t q1 "${q1[@]}"; done
  for t in n2 m0 n2 m0; do LAT_S=45 lat $t none "${q1[@]}" --cuda-graph-mode none; done
  ;;
f)  # a CUDA graph's replay host time by kernel count and PDL (call 5's run stopped at its own miscount)
  (cd .gpu/n2 && timeout 90 python3 benchmarks/graph_launch.py --kernels 64,256,1024 --json $OUT/graph_launch.jsonl 2>>$OUT/err.txt)
  ;;
esac
grep -iE "error|Traceback" $OUT/err.txt 2>/dev/null | tail -5
