#!/bin/bash
# session 25 calls: bash .gpu/s25.sh STAGE   (trees: .gpu/n0 = main ac78caa + the core seam + serve_path.py; n1 = the session's tree)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__); import os; print(os.cpu_count(), 'cpus')" | tee -a $OUT/env.txt
gputests() {  # TREE [FILES...]: the GPU tests of a tree
  local tree=$1; shift
  (cd .gpu/$tree && timeout ${TESTS_S:-560} python3 -m pytest ${@:-tests/gpu} -q -p no:cacheprovider \
    -o addopts="" -rs --durations=10 2>&1 | tee $OUT/gpu-$tree.log | tail -n 25)
}
path() {  # TREE: the serving path's cost (serve_path.py: scripted core, real server and client)
  (cd .gpu/$1 && timeout 120 python3 benchmarks/serve_path.py --label $1 --num-prompts 80 --input-len 512 \
    --output-len 128 --len-spread 0.5 --logprobs 0 2>>$OUT/err.txt | tee -a $OUT/path.jsonl)
}
serve() {  # TREE: bench serve --launch at rates 8, 32, inf (s24's call 9)
  (cd .gpu/$1 && timeout 240 python3 -m ostinato.cli bench serve --launch --model random:qwen3-0.6b --max-model-len 2048 \
    --request-rate 8,32,inf --num-prompts 80 --input-len 512 --output-len 128 \
    --len-spread 0.5 --logprobs 0 --json --server-log $OUT/serve-$1.log 2>>$OUT/err.txt | sed "s|^{|{\"tree\": \"$1\", |" | tee -a $OUT/serve.jsonl | cut -c1-600)
}
case $1 in
diag)  # where a burst's first tokens wait: the engine's step timeline (n0), the serving path (n0/n1), bench serve (n0/n1)
  (cd .gpu/n0 && ASYNC=1 SYNC=1 timeout 150 python3 ../timeline.py 2>>$OUT/err.txt | tee $OUT/timeline.txt)
  (cd .gpu/n0 && ASYNC=0 timeout 150 python3 ../timeline.py 2>>$OUT/err.txt | tee -a $OUT/timeline.txt)
  for t in n0 n1 n0 n1; do path $t; done
  for t in n0 n1; do serve $t; done
  ;;
burst)  # the first burst after start-up: allocator counters, then profiled rounds (n0)
  (cd .gpu/n0 && timeout 150 python3 ../burst_prof.py 2>>$OUT/err.txt | tee $OUT/burst.txt)
  (cd .gpu/n0 && PROF=1 timeout 200 python3 ../burst_prof.py 2>>$OUT/err.txt > $OUT/burst-prof.txt; grep "^round" $OUT/burst-prof.txt)
  ;;
tail)  # the tail warm-up (n2 = 824d28e): the first burst, start-up, serving (n0 baseline, n2), the warm-up test
  (cd .gpu/n2 && timeout 150 python3 ../burst_prof.py 2>>$OUT/err.txt | tee $OUT/burst-n2.txt)
  for t in n0 n2; do (cd .gpu/$t && timeout 150 python3 -m ostinato.cli bench startup --json \
    --model random:qwen3-0.6b 2>>$OUT/err.txt | sed "s|^{|{\"tree\": \"$t\", |" | tee -a $OUT/startup.jsonl | cut -c1-400); done
  for t in n0 n2; do serve $t; done
  TESTS_S=300 gputests n2 tests/gpu/test_warm_up.py
  ;;
final)  # the final tree (n3): GPU tests, the new burst test on main (n0b: must fail), the first burst, start-up, serving
  TESTS_S=400 gputests n3 tests/gpu/test_warm_up.py tests/gpu/test_sampling_params_gpu.py tests/gpu/test_async_graphs.py tests/gpu/test_structured_gpu.py tests/gpu/test_spec_graphs.py
  TESTS_S=120 gputests n0b "tests/gpu/test_warm_up.py::test_the_first_burst_finds_the_tails_memory_ready"
  (cd .gpu/n3 && timeout 150 python3 ../burst_prof.py 2>>$OUT/err.txt | tee $OUT/burst-n3.txt)
  for r in 1 2; do (cd .gpu/n3 && timeout 150 python3 -m ostinato.cli bench startup --json \
    --model random:qwen3-0.6b 2>>$OUT/err.txt | sed "s|^{|{\"tree\": \"n3\", |" | tee -a $OUT/startup.jsonl | cut -c1-400); done
  serve n3
  ;;
tailcost)  # what the tail warm-up costs (n3), every count, then a ladder first
  (cd .gpu/n3 && timeout 150 python3 ../tail_cost.py 2>>$OUT/err.txt | tee $OUT/tailcost.txt)
  (cd .gpu/n3 && LADDER=1 timeout 150 python3 ../tail_cost.py 2>>$OUT/err.txt | tee -a $OUT/tailcost.txt)
  ;;
startup)  # where start-up goes (n3): bench startup (fills the Triton cache), then a cProfile'd start-up
  (cd .gpu/n3 && timeout 150 python3 -m ostinato.cli bench startup --json --model random:qwen3-0.6b 2>>$OUT/err.txt | cut -c1-400)
  (cd .gpu/n3 && timeout 150 python3 ../startup_prof.py 2>>$OUT/err.txt > $OUT/startup-prof.txt; head -1 $OUT/startup-prof.txt)
  ;;
startup2)  # the start-up changes (n4 = 291657e) against n3, interleaved; graph-memory GPU tests on n4
  (cd .gpu/n3 && timeout 150 python3 -m ostinato.cli bench startup --json --model random:qwen3-0.6b > /dev/null 2>>$OUT/err.txt)
  for r in 1 2 3; do for t in n3 n4; do (cd .gpu/$t && timeout 150 python3 -m ostinato.cli bench startup --json \
    --model random:qwen3-0.6b 2>>$OUT/err.txt | sed "s|^{|{\"tree\": \"$t\", |" | tee -a $OUT/startup.jsonl | cut -c1-330); done; done
  TESTS_S=420 gputests n4 tests/gpu/test_warm_up.py tests/gpu/test_prefill_graphs.py tests/gpu/test_full_prefill_graphs.py tests/gpu/test_breakable.py
  ;;
startup3)  # more pairs: n3 / n4 interleaved, 6 rounds; triton_key's cost alone
  for r in 1 2 3; do python3 -c "import time; from triton.runtime import cache; t = time.perf_counter(); cache.triton_key(); print(f'triton_key {time.perf_counter() - t:.3f} s')"; done
  for r in 1 2 3 4 5 6; do for t in n3 n4; do (cd .gpu/$t && timeout 150 python3 -m ostinato.cli bench startup --json \
    --model random:qwen3-0.6b 2>>$OUT/err.txt | sed "s|^{|{\"tree\": \"$t\", |" >> $OUT/startup.jsonl); done; done
  python3 -c "
import json, statistics as st
rows = [json.loads(l) for l in open('$OUT/startup.jsonl')]
for t in ('n3', 'n4'):
    r = [x for x in rows if x['tree'] == t]
    print(t, {k: [round(x[k], 2) for x in r] for k in ('startup_s', 'load_s', 'capture_s', 'warm_up_s')}, 'median', round(st.median(x['startup_s'] for x in r), 3))
"
  ;;
prefill)  # where a short prompt's first token goes (n4): profile_step's prefill section; bench prefill
  (cd .gpu/n4 && timeout 250 python3 benchmarks/profile_step.py --sections prefill --modes full_and_piecewise \
    --prefill-lengths 512,1024,2048 --json $OUT/prefill.jsonl 2>>$OUT/err.txt | cut -c1-300)
  (cd .gpu/n4 && timeout 200 python3 -m ostinato.cli bench prefill --json --model random:qwen3-0.6b \
    --no-prefix-caching 2>>$OUT/err.txt | tee $OUT/bench-prefill.jsonl | cut -c1-400)
  ;;
attn)  # prefill attention configurations at qwen3-0.6b's shape (n4)
  (cd .gpu/n4 && timeout 300 python3 ../attn_sweep.py 2>>$OUT/err.txt | tee $OUT/attn-sweep.txt)
  ;;
final2)  # the final tree (n5 = e2e5bbe): GPU tests; the warm-up test on n4 (n4b: must fail at the bitmask); start-up; serving
  TESTS_S=420 gputests n5 tests/gpu/test_warm_up.py tests/gpu/test_structured_gpu.py tests/gpu/test_sampling_params_gpu.py tests/gpu/test_async_graphs.py tests/gpu/test_spec_graphs.py
  TESTS_S=120 gputests n4b "tests/gpu/test_warm_up.py::test_no_kernel_compiles_after_start_up[full_and_piecewise]"
  for r in 1 2 3; do (cd .gpu/n5 && timeout 150 python3 -m ostinato.cli bench startup --json \
    --model random:qwen3-0.6b 2>>$OUT/err.txt | sed "s|^{|{\"tree\": \"n5\", |" | tee -a $OUT/startup.jsonl | cut -c1-330); done
  serve n5
  ;;
dsweep)  # decode attention at offline throughput's batch sizes, qwen3-0.6b's shape (n5); offline throughput
  (cd .gpu/n5 && timeout 300 python3 ../decode_sweep.py 2>>$OUT/err.txt | tee $OUT/decode-sweep.txt)
  (cd .gpu/n5 && timeout 200 python3 -m ostinato.cli bench throughput --json --model random:qwen3-0.6b --batch-size 256 \
    --input-len 512 --output-len 128 2>>$OUT/err.txt | tee $OUT/throughput.jsonl | cut -c1-500)
  ;;
stages)  # 3 stages for crowded decode launches (n6 = 152a632) against n5: GPU tests, throughput, decode latency
  TESTS_S=450 gputests n6 tests/gpu/test_kernels.py tests/gpu/test_engine_graphs.py tests/gpu/test_warm_up.py
  for r in 1 2; do for t in n5 n6; do (cd .gpu/$t && timeout 150 python3 -m ostinato.cli bench throughput --json --model random:qwen3-0.6b \
    --batch-size 256 --input-len 512 --output-len 128 2>>$OUT/err.txt | sed "s|^{|{\"tree\": \"$t\", |" | tee -a $OUT/throughput.jsonl | cut -c1-300); done; done
  for t in n5 n6; do (cd .gpu/$t && timeout 200 python3 -m ostinato.cli bench latency --json --model random:qwen3-0.6b \
    --batch-size 64,256 --input-len 512 --output-len 64 --max-model-len 2048 2>>$OUT/err.txt | sed "s|^{|{\"tree\": \"$t\", |" | tee -a $OUT/latency.jsonl | cut -c1-300); done
  ;;
stages2)  # decode latency n5 / n6 again, interleaved, two rounds
  for r in 1 2; do for t in n6 n5; do (cd .gpu/$t && timeout 200 python3 -m ostinato.cli bench latency --json --model random:qwen3-0.6b \
    --batch-size 64,256 --input-len 512 --output-len 64 --max-model-len 2048 --iters 5 2>>$OUT/err.txt | sed "s|^{|{\"tree\": \"$t\", |" >> $OUT/latency.jsonl); done; done
  python3 -c "
import json
for l in open('$OUT/latency.jsonl'):
    d = json.loads(l); print(d['tree'], d['batch_size'], round(d['tpot_ms'], 3), round(d['ratio_to_floor'], 3))
"
  ;;
finaltests)  # the final code (n7 = 9213624): kernel and engine-graph GPU tests
  TESTS_S=400 gputests n7 tests/gpu/test_kernels.py tests/gpu/test_engine_graphs.py
  ;;
esac
