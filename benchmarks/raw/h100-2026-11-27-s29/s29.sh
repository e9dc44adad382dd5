#!/bin/bash
# session 29 calls: bash .gpu/s29.sh STAGE   (trees: .gpu/s0 = main 297a3a0)
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
case $1 in
a)  # s0: the single-GPU test files session 28 left unrun; qwen3-30b-a3b batch 1 profile
  TESTS_S=430 gputests s0 tests/gpu/test_check_graphs.py tests/gpu/test_sampling_params_gpu.py tests/gpu/test_structured_gpu.py \
    tests/gpu/test_spec_graphs.py tests/gpu/test_async_graphs.py tests/gpu/test_breakable.py tests/gpu/test_lifecycle.py \
    tests/gpu/test_device_deadline.py tests/gpu/test_full_prefill_graphs.py "tests/gpu/test_kernels.py::test_fresh_prompts_read_from_the_steps_k_and_v"
  PROF_S=150 moeprof s0 s0; summary
  ;;
b)  # r1 (a lone token routed in gate|up): moe-block; qwen3-30b-a3b batch 1 s0 / r1 interleaved; test_moe.py; r1 profile
  (cd .gpu/r1 && timeout 150 python3 benchmarks/bench_kernels.py --sections moe-block --out $OUT/moe-block.md 2>>$OUT/err.txt | tail -n 12)
  a=(--model random:qwen3-30b-a3b --input-len 128 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1)
  for t in s0 r1 s0 r1; do LAT_S=110 lat $t moe "${a[@]}"; done
  TESTS_S=150 gputests r1 tests/gpu/test_moe.py
  ;;
c)  # r2 (a lone token routed by ranking, no sort, its own kernel): moe-route, moe-block; qwen3-30b-a3b batch 1 s0 / r2; test_moe.py
  (cd .gpu/r2 && timeout 150 python3 benchmarks/bench_kernels.py --sections moe-route,moe-block --out $OUT/moe-route.md 2>>$OUT/err.txt | tail -n 32)
  a=(--model random:qwen3-30b-a3b --input-len 128 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1)
  for t in s0 r2 s0 r2; do LAT_S=110 lat $t moe "${a[@]}"; done
  TESTS_S=150 gputests r2 tests/gpu/test_moe.py
  ;;
d)  # r3 (route_and_align in one warp for one token): moe-route, moe-block; qwen3-30b-a3b batch 1 s0 / r3 x3; test_moe.py
  (cd .gpu/r3 && timeout 150 python3 benchmarks/bench_kernels.py --sections moe-route,moe-block --out $OUT/moe-route.md 2>>$OUT/err.txt | tail -n 24)
  a=(--model random:qwen3-30b-a3b --input-len 128 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1)
  for t in s0 r3 s0 r3 s0 r3; do LAT_S=100 lat $t moe "${a[@]}"; done
  TESTS_S=150 gputests r3 tests/gpu/test_moe.py
  ;;
e)  # w1 (launch.WARPS switch): bench_kernels warps; qwen3-0.6b batch 1 step kernels (PDL off); decode with small kernels in 1 and 2 warps
  (cd .gpu/w1 && timeout 200 python3 benchmarks/bench_kernels.py --sections warps --out $OUT/warps.md 2>>$OUT/err.txt | tail -n 40)
  (cd .gpu/w1 && timeout 90 python3 benchmarks/profile_step.py --model random:qwen3-0.6b --modes full_and_piecewise \
    --batch-sizes 1 --sections decode,step-kernels --no-pdl --label q-nopdl --json $OUT/prof.jsonl > /dev/null 2>>$OUT/err.txt)
  for w in "" 1 2 "" 1 2; do
    v=${w:+_rms_norm_kernel=$w,_rope_and_store_kernel=$w,_combine_kernel=$w}
    (cd .gpu/w1 && timeout 60 python3 benchmarks/profile_step.py --model random:qwen3-0.6b --modes full_and_piecewise \
      --batch-sizes 1 --sections decode --label "q-warps$w" --warps "$v" --json $OUT/prof.jsonl > /dev/null 2>>$OUT/err.txt)
  done
  summary
  ;;
f)  # s0 (= main f4bd1fa's runtime): where a 512-token prompt's time to first token goes on the host: py-spy (idle included) of bench prefill, 1500 TTFTs
  (cd .gpu/s0 && timeout 240 /tmp/site/bin/py-spy record -r 250 --nonblocking --idle -f raw -o $OUT/spy-ttft.txt -- python3 -m ostinato.cli bench prefill --json \
    --model random:qwen3-0.6b --no-prefix-caching --input-len 512 --iters 600 2>>$OUT/err.txt | cut -c1-300; echo "py-spy rc=$?")
  python3 .gpu/spyttft.py $OUT/spy-ttft.txt _first_token_s 70 > $OUT/spy-ttft-sum.txt; gzip $OUT/spy-ttft.txt; head -n 150 $OUT/spy-ttft-sum.txt
  ;;
g)  # s0: split KV for short fresh prefills (split_prefill.py)
  (cd .gpu/s0 && timeout 200 python3 ../split_prefill.py 2>>$OUT/err.txt | tee $OUT/split_prefill.txt)
  ;;
h)  # s0: is qwen3-0.6b's FULL batch-1 decode host-bound? py-spy (idle included) of bench latency, 512 output tokens
  (cd .gpu/s0 && timeout 200 /tmp/site/bin/py-spy record -r 250 --nonblocking --idle -f raw -o $OUT/spy-decode.txt -- python3 -m ostinato.cli bench latency --json \
    --model random:qwen3-0.6b --batch-size 1 --input-len 128 --output-len 512 --iters 4 --max-model-len 2048 2>>$OUT/err.txt | cut -c1-400; echo "py-spy rc=$?")
  python3 .gpu/spyttft.py $OUT/spy-decode.txt LLMEngine.step 60 > $OUT/spy-decode-sum.txt; gzip $OUT/spy-decode.txt; head -n 75 $OUT/spy-decode-sum.txt
  ;;
i)  # f (= cc55366, the session's final code): bench_kernels prefill (per-case targets, first run) and moe-route
  (cd .gpu/f && timeout 200 python3 benchmarks/bench_kernels.py --sections prefill,moe-route --out $OUT/kernels-final.md 2>>$OUT/err.txt | tail -n 40)
  ;;
j)  # t (c8ac201 + the DIRECT loops' k/v row pointers computed once): attention GPU tests
  TESTS_S=200 gputests t tests/gpu/test_kernels.py
  ;;
esac
grep -iE "error|Traceback" $OUT/err.txt 2>/dev/null | tail -5
