#!/bin/bash
# session 24 calls: bash .gpu/s24.sh STAGE   (trees: .gpu/n0 = main 3d71009)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a $OUT/env.txt
prof() {  # TREE LABEL ARGS...: one profile_step run, tagged, into $OUT/profile.jsonl
  local tree=$1 label=$2; shift 2
  (cd .gpu/$tree && timeout 200 python3 benchmarks/profile_step.py --label "$tree/$label" \
     --json $OUT/profile.jsonl "$@" 2>>$OUT/err.txt | cut -c1-400)
}
lat() {  # TREE LABEL ARGS...: one bench latency run, tagged
  local tree=$1 label=$2; shift 2
  (cd .gpu/$tree && timeout 200 $PIN python3 -m ostinato.cli bench latency --json "$@" 2>>$OUT/err.txt |
    sed "s|^{|{\"tree\": \"$tree\", \"label\": \"$label\", |") | tee -a $OUT/latency.jsonl
}
gputests() {  # TREE [FILES...]: the GPU tests of a tree
  local tree=$1; shift
  (cd .gpu/$tree && timeout ${TESTS_S:-560} python3 -m pytest ${@:-tests/gpu} -q -p no:cacheprovider \
    -o addopts="" -rs --durations=10 2>&1 | tee $OUT/gpu-$tree.log | tail -n 25)
}
case $1 in
l2)  # L2 prefetch experiment (qwen3-0.6b-shaped 28-layer decode chain), then the FP8 GPU tests on n0
  (cd .gpu/n0 && timeout 200 python3 ../l2pf.py 2>>$OUT/err.txt | tee $OUT/l2pf.txt)
  TESTS_S=300 gputests n0 tests/gpu/test_fp8.py
  ;;
pf)  # the attention kernel's L2 prefetch (tree n1), qwen3-0.6b and llama-3.1-8b chains
  (cd .gpu/n1 && timeout 400 python3 ../l2pf.py 2>>$OUT/err.txt | tee $OUT/l2pf2.txt)
  ;;
servediag)  # serving at rate inf, diagnosed (servediag.sh)
  timeout 500 bash .gpu/servediag.sh
  ;;
stall)  # the serving stall offline (stall.py), prefix caching on, then off
  (cd .gpu/n0 && timeout 250 python3 ../stall.py 2>>$OUT/err.txt | tee $OUT/stall.txt)
  (cd .gpu/n0 && timeout 200 python3 ../stall.py --no-prefix-caching 2>>$OUT/err.txt | tee $OUT/stall-nopc.txt)
  ;;
warm)  # start-up compiles every eager attention kernel (n2) vs main (n0): cold start-ups first
  for t in n0 n2 n2; do (cd .gpu/$t && timeout 150 python3 -m ostinato.cli bench startup --json \
    --model random:qwen3-0.6b 2> >(sed "s|^|$t |" >> $OUT/startup.log) | sed "s|^{|{\"tree\": \"$t\", |" | tee -a $OUT/startup.jsonl); done
  grep -h "eager kernels\|captured" $OUT/startup.log
  TESTS_S=200 gputests n2 tests/gpu/test_warm_up.py
  (cd .gpu/n2 && timeout 150 python3 ../stall.py 2>>$OUT/err.txt | tee $OUT/stall.txt)
  TREE=n2 timeout 200 bash .gpu/servediag.sh
  ;;
tests2)  # GPU tests of the kernels and engine graphs on n2; mode none batch 1, n0 / n2 pinned
  TESTS_S=400 gputests n2 tests/gpu/test_kernels.py tests/gpu/test_engine_graphs.py
  q=(--model random:qwen3-0.6b --input-len 512 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1)
  for r in 1 2 3; do for t in n0 n2; do PIN="taskset -c 8-11" lat $t none "${q[@]}" --cuda-graph-mode none; done; done
  ;;
tests3)  # every other GPU test file on n2, and the lazy-capture tests again (warm-up skipped there)
  TESTS_S=560 gputests n2 $(ls tests/gpu/test_*.py | grep -v "test_kernels.py\|test_engine_graphs.py") \
    "tests/gpu/test_engine_graphs.py::test_lazy_capture_matches_eager_capture_token_for_token"
  ;;
final)  # the final tree (n3): start-up cold then warm, GPU tests the review asked for, serving as in s23's call 7
  for r in cold warm; do (cd .gpu/n3 && timeout 150 python3 -m ostinato.cli bench startup --json \
    --model random:qwen3-0.6b 2>>$OUT/err.txt | sed "s|^{|{\"run\": \"$r\", |" | tee -a $OUT/startup.jsonl); done
  TESTS_S=300 gputests n3 tests/gpu/test_warm_up.py tests/gpu/test_moe.py tests/gpu/test_fp8.py
  (cd .gpu/n3 && timeout 240 python3 -m ostinato.cli bench serve --launch --model random:qwen3-0.6b --max-model-len 2048 \
    --request-rate 8,32,inf --num-prompts 80 --input-len 512 --output-len 128 \
    --len-spread 0.5 --logprobs 0 --json --server-log $OUT/serve.log 2>>$OUT/err.txt | tee -a $OUT/serve.jsonl | cut -c1-700)
  ;;
compiles)  # exploratory: compiles after start-up with ngram speculation and with structured outputs (n3)
  for k in spec structured; do (cd .gpu/n3 && timeout 200 python3 ../compiles.py $k 2>>$OUT/err.txt | tail -2 | tee -a $OUT/compiles.txt); done
  ;;
bitmask)  # the aligned token bitmask (n4): compiles after start-up with structured outputs; its GPU tests
  (cd .gpu/n4 && timeout 200 python3 ../compiles.py structured 2>>$OUT/err.txt | tail -2 | tee -a $OUT/compiles.txt)
  TESTS_S=300 gputests n4 tests/gpu/test_structured_gpu.py
  ;;
review)  # after the review's mend (n5): warm-up, kernel and structured GPU tests; the warm-up test on the session's start (n0: must fail)
  TESTS_S=400 gputests n5 tests/gpu/test_warm_up.py tests/gpu/test_kernels.py tests/gpu/test_structured_gpu.py
  TESTS_S=150 gputests n0 tests/gpu/test_warm_up.py
  ;;
esac
