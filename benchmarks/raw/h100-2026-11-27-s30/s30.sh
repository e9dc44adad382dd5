#!/bin/bash
# session 30 calls: bash .gpu/s30.sh STAGE   (trees: .gpu/s0 = main 7f647e0; m1 = + the vectorized MERGE; m2 = m1 + graphs merge)
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
moeprof() {  # TREE LABEL [ARGS]: qwen3-30b-a3b batch 1 decode and its step's kernels (PDL off)
  local tree=$1 label=$2; shift 2
  (cd .gpu/$tree && timeout ${PROF_S:-200} python3 benchmarks/profile_step.py --model random:qwen3-30b-a3b --modes full_and_piecewise \
    --batch-sizes 1 --sections decode,step-kernels --no-pdl --label $label --json $OUT/prof.jsonl "$@" > /dev/null 2>>$OUT/err.txt)
}
summary() {
python3 - <<'PY'
import json, os
p = os.path.join(os.environ["OUT"], "prof.jsonl")
for line in open(p) if os.path.exists(p) else []:
    r = json.loads(line)
    if r["section"] == "decode":
        print(r["label"], r["model"], r["batch"], "decode", round(r["tpot_ms"], 3), round(r["ratio"], 3))
    elif r["section"] == "step-kernels":
        print(r["label"], r["model"], r["batch"], "step", round(r["device_ms_per_step"], 3), r["kernels_per_step"])
        for n, (c, us) in sorted(r["by_name"].items(), key=lambda kv: -kv[1][1])[:12]:
            print("   ", n[:60], c, us)
PY
}
a3b=(--model random:qwen3-30b-a3b --input-len 128 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1)
case $1 in
a)  # m1: decode-merge (combine vs the vectorized merge, three layer shapes); qwen3-30b-a3b batch 1 s0 / m2 x2
  (cd .gpu/m1 && timeout 200 python3 benchmarks/bench_kernels.py --sections decode-merge --out $OUT/decode-merge.md 2>>$OUT/err.txt | tail -n 40)
  for t in s0 m2 s0 m2; do LAT_S=95 lat $t moe "${a3b[@]}"; done
  ;;
b)  # p1 (= m1 + the packed step inputs): bench prefill, mode none decode, offline throughput, s0 / p1 interleaved; GPU tests
  for t in s0 p1 s0 p1; do
    (cd .gpu/$t && timeout 100 python3 -m ostinato.cli bench prefill --json --model random:qwen3-0.6b --no-prefix-caching \
      --input-len 512,2048 --iters 50 2>>$OUT/err.txt | sed "s|^{|{\"tree\": \"$t\", |" | tee -a $OUT/prefill.jsonl | cut -c1-300)
  done
  for t in s0 p1 s0 p1; do LAT_S=80 lat $t none --model random:qwen3-0.6b --cuda-graph-mode none --batch-size 1 --input-len 512 --output-len 64 --iters 3 --max-model-len 2048; done
  for t in s0 p1; do (cd .gpu/$t && timeout 100 python3 -m ostinato.cli bench throughput --model random:qwen3-0.6b --batch-size 256 --input-len 512 \
    --output-len 128 --json 2>>$OUT/err.txt | sed "s|^{|{\"tree\": \"$t\", |" | tee -a $OUT/throughput.jsonl | cut -c1-300); done
  ;;
c)  # load_bench.py s0 / p1; qwen3-30b-a3b batch 1: s0 / n1 (+ the router's gemv normalises for the experts) / n256 (n1 + one part up to 256 positions);
    # bench prefill 512 s0 / p1 pinned (taskset 8-11) x3; short_kv.py (k1: ONE_PART_KV switch)
  for t in s0 p1 s0 p1; do echo "== $t" | tee -a $OUT/load_bench.txt; (cd .gpu/$t && timeout 60 taskset -c 8-11 python3 ../load_bench.py 2>>$OUT/err.txt | tee -a $OUT/load_bench.txt); done
  for t in s0 n1 n256 n1 n256; do LAT_S=95 lat $t moe "${a3b[@]}"; done
  for t in s0 p1 s0 p1 s0 p1; do
    (cd .gpu/$t && timeout 60 taskset -c 8-11 python3 -m ostinato.cli bench prefill --json --model random:qwen3-0.6b --no-prefix-caching \
      --input-len 512 --iters 100 2>>$OUT/err.txt | sed "s|^{|{\"tree\": \"$t\", |" | tee -a $OUT/prefill.jsonl | cut -c1-200)
  done
  (cd .gpu/k1 && timeout 100 python3 ../short_kv.py 2>>$OUT/err.txt | tee $OUT/short_kv.txt)
  ;;
d)  # f (the session's final code: packed step inputs; the router's gemv normalises for the experts): qwen3-30b-a3b batch 1 s0 / f pinned x2; GPU tests
  for t in s0 f s0 f; do (cd .gpu/$t && timeout 80 taskset -c 8-11 python3 -m ostinato.cli bench latency --json "${a3b[@]}" 2>>$OUT/err.txt |
    sed "s|^{|{\"tree\": \"$t\", |") | tee -a $OUT/latency.jsonl | cut -c1-40,200-330; done
  TESTS_S=230 gputests f tests/gpu/test_moe.py tests/gpu/test_engine_graphs.py "tests/gpu/test_kernels.py::test_a_packed_step_arrives_in_the_cuda_buffers_as_on_the_cpu" \
    "tests/gpu/test_kernels.py::test_a_routers_gemv_stores_the_norm_for_the_experts" "tests/gpu/test_kernels.py::test_gemv_normed_bf16_in_a_graph" \
    "tests/gpu/test_kernels.py::test_gemv_norm_rounds_as_the_unfused_norm"
  ;;
e)  # f: the new GPU kernel tests call 4's time limit cut off
  TESTS_S=100 gputests f "tests/gpu/test_kernels.py::test_a_packed_step_arrives_in_the_cuda_buffers_as_on_the_cpu" \
    "tests/gpu/test_kernels.py::test_a_routers_gemv_stores_the_norm_for_the_experts" "tests/gpu/test_kernels.py::test_gemv_norm_rounds_as_the_unfused_norm"
  ;;
esac
grep -iE "error|Traceback" $OUT/err.txt 2>/dev/null | tail -5
