#!/bin/bash
# session 26 calls: bash .gpu/s26.sh STAGE   (trees: .gpu/s0 = main a7527f8; n1.. = the session's trees)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__); import os; print(os.cpu_count(), 'cpus')" | tee -a $OUT/env.txt
gputests() {  # TREE [FILES...]: the GPU tests of a tree
  local tree=$1; shift
  (cd .gpu/$tree && timeout ${TESTS_S:-560} python3 -m pytest ${@:-tests/gpu} -q -p no:cacheprovider \
    -o addopts="" -rs --durations=10 2>&1 | tee $OUT/gpu-$tree.log | tail -n 25)
}
startup() {  # TREE: one bench startup, a JSON line tagged with the tree
  (cd .gpu/$1 && timeout 150 python3 -m ostinato.cli bench startup --json --model ${MODEL:-random:qwen3-0.6b} \
    2>>$OUT/err.txt | sed "s|^{|{\"tree\": \"$1\", |" | tee -a $OUT/startup.jsonl | cut -c1-420)
}
medians() {  # summary of startup.jsonl per tree
  python3 - $OUT/startup.jsonl <<'PY'
import json, statistics as st, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for t in dict.fromkeys(r["tree"] for r in rows):
    r = [x for x in rows if x["tree"] == t]
    keys = [k for k in r[0] if k.endswith("_s") and isinstance(r[0][k], float)]
    print(t, len(r), "runs;", "; ".join(f"{k} med {st.median(x[k] for x in r):.3f} min {min(x[k] for x in r):.3f}" for k in keys))
PY
}
spy() {  # TREE NAME [py-spy flags]: py-spy of one start-up (collapsed stacks)
  local tree=$1 name=$2; shift 2
  (cd .gpu/$tree && timeout 120 /tmp/site/bin/py-spy record -r 500 -f raw -o $OUT/$name.txt $@ -- \
    python3 -c "from ostinato import LLM; LLM('random:qwen3-0.6b')" > /dev/null 2>>$OUT/err.txt; echo "py-spy $name rc=$?")
}
case $1 in
measure)  # where start-up goes now: phases A/B (s0, n1 = LM-head padding + phase timers), py-spy of n1
  startup s0 > /dev/null  # fills Triton's cache
  for r in 1 2 3 4; do startup s0; startup n1; done
  medians | tee $OUT/medians.txt
  spy n1 spy-n1
  spy n1 spy-n1-native --native
  ;;
measure2)  # n2 = + the saved Triton key: A/B with s0, py-spy of n2 (summarised here), Triton's triton_key callers
  grep -rn "triton_key" $(python3 -c "import triton, os; print(os.path.dirname(triton.__file__))") --include=*.py | grep -v "^.*def triton_key" | cut -c1-200
  startup n2 > /dev/null  # saves the key
  for r in 1 2 3 4; do startup s0; startup n2; done
  medians | tee $OUT/medians.txt
  spy n2 spy-n2
  python3 .gpu/spysum.py $OUT/spy-n2.txt 70 > $OUT/spysum-n2.txt; gzip $OUT/spy-n2.txt; head -75 $OUT/spysum-n2.txt
  ;;
spy)  # py-spy of one n2 start-up, summarised here
  (cd .gpu/n2 && python3 -c "from ostinato import LLM; LLM('random:qwen3-0.6b')" 2>/dev/null)  # Triton cache, saved key
  spy n2 spy-n2
  python3 .gpu/spysum.py $OUT/spy-n2.txt 70 > $OUT/spysum-n2.txt; gzip $OUT/spy-n2.txt; head -75 $OUT/spysum-n2.txt
  ;;
ctime)  # capture_time.py on n2, three times (the first fills nothing new: the cache is warm from above)
  (cd .gpu/n2 && python3 -c "from ostinato import LLM; LLM('random:qwen3-0.6b')" 2>/dev/null)
  for r in 1 2 3; do (cd .gpu/n2 && timeout 100 python3 ../capture_time.py 2>>$OUT/err.txt | tee -a $OUT/ctime.txt); done
  ;;
tail)  # tail_first.py on n2: the LM head per row count and the sampler per path, at first use
  (cd .gpu/n2 && timeout 150 python3 ../tail_first.py 2>>$OUT/err.txt | tee $OUT/tail.txt)
  ;;
final)  # n3 (the session's code): start-up interleaved with s0, capture_time once, decode latency s0 / n3
  startup n3 > /dev/null  # saves the Triton key for this install
  for r in 1 2 3 4; do startup s0; startup n3; done
  medians | tee $OUT/medians.txt
  (cd .gpu/n3 && timeout 100 python3 ../capture_time.py 2>>$OUT/err.txt | tee -a $OUT/ctime.txt)
  for t in s0 n3 s0 n3; do (cd .gpu/$t && timeout 150 python3 -m ostinato.cli bench latency --json --model random:qwen3-0.6b \
    --batch-size 1,32,200 --input-len 512 --output-len 64 --iters 3 2>>$OUT/err.txt | sed "s|^{|{\"tree\": \"$t\", |" | tee -a $OUT/latency.jsonl | cut -c1-300); done
  ;;
tests)  # n3: the GPU tests (one GPU)
  TESTS_S=560 gputests n3 $(ls .gpu/n3/tests/gpu/test_*.py | grep -v test_parallel | sed 's|.gpu/n3/||')
  ;;
sampler)  # n4 (= n3 + top-k candidates ranked without a sort): the sampler's cost s0 / n4, start-up, the sampling GPU tests
  for t in s0 n4; do (cd .gpu/$t && timeout 120 python3 ../sampler_cost.py $t 2>>$OUT/err.txt | tee -a $OUT/sampler.txt); done
  startup n4 > /dev/null
  for r in 1 2 3; do startup n4; done
  medians | tee $OUT/medians.txt
  TESTS_S=300 gputests n4 tests/gpu/test_sampling_params_gpu.py tests/gpu/test_warm_up.py tests/gpu/test_async_graphs.py
  ;;
linear)  # host time of F.linear and a Triton launch, eager and under capture
  (cd .gpu/n4 && timeout 120 python3 ../linear_host.py 2>>$OUT/err.txt | tee $OUT/linear.txt)
  ;;
kvrec)  # n5 = n4 + the KV sizing's step recorded as warm: the new GPU test on n5 and on n4 (must fail); capture_time n4 / n5 twice
  TESTS_S=200 gputests n5 "tests/gpu/test_warm_up.py::test_the_kv_sizing_step_warms_the_largest_graph"
  TESTS_S=200 gputests n4 "tests/gpu/test_warm_up.py::test_the_kv_sizing_step_warms_the_largest_graph"
  for t in n4 n5 n4 n5; do echo "== $t"; (cd .gpu/$t && timeout 100 python3 ../capture_time.py 2>>$OUT/err.txt | tee -a $OUT/ctime-$t.txt | grep -E "startup|_warm_up|warm-ups|capture piecewise"); done
  ;;
nucleus)  # n6 = n4 + the nucleus kernel for top-p alone: its GPU test, the sampler's cost n4 / n6, sampling GPU tests
  TESTS_S=200 gputests n6 "tests/gpu/test_kernels.py::test_nucleus_mask_keeps_what_a_sort_keeps"
  for t in n4 n6; do (cd .gpu/$t && timeout 120 python3 ../sampler_cost.py $t 2>>$OUT/err.txt | tee -a $OUT/sampler.txt); done
  TESTS_S=300 gputests n6 tests/gpu/test_sampling_params_gpu.py tests/gpu/test_warm_up.py tests/gpu/test_structured_gpu.py
  ;;
ncost)  # the nucleus kernel by rows and SPLITS against the sort (n6)
  (cd .gpu/n6 && timeout 200 python3 ../nucleus_cost.py 2>>$OUT/err.txt | tee $OUT/ncost.txt)
  ;;
nucleus2)  # n7 = n6 with SPLITS 8 x 10 passes and a sort below 64 rows: GPU tests, the sampler's cost n4 / n7
  TESTS_S=300 gputests n7 "tests/gpu/test_kernels.py::test_nucleus_mask_keeps_what_a_sort_keeps" tests/gpu/test_sampling_params_gpu.py tests/gpu/test_warm_up.py
  for t in n4 n7; do (cd .gpu/$t && timeout 120 python3 ../sampler_cost.py $t 2>>$OUT/err.txt | tee -a $OUT/sampler.txt); done
  ;;
esac
