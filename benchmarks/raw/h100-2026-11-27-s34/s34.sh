#!/bin/bash
# session 34 calls: bash .gpu/s34.sh STAGE   (trees under .gpu/: m0 = main 4318e08; m1 = m0 + the prefill sweep's chunk cases; m2 = m0 + the GPU fault tests of SIGSTOP and a stopped driver)
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
prefprof() {  # TREE LABEL [MODES]: qwen3-0.6b one-prompt prefill steps' kernels, timeline and trace at 512 and 2048
  mkdir -p $OUT/trace-$2
  (cd .gpu/$1 && timeout ${PROF_S:-150} python3 benchmarks/profile_step.py --model random:qwen3-0.6b --modes ${3:-full_and_piecewise} \
    --sections prefill --prefill-lengths 512,2048 --label $2 --json $OUT/prof.jsonl --trace-dir $OUT/trace-$2 > /dev/null 2>>$OUT/err.txt)
}
hostprof() {  # TREE LABEL MODE BATCH: cProfile of decode steps (profile_step --sections host), pinned
  (cd .gpu/$1 && timeout ${HOST_S:-120} taskset -c 8-11 python3 benchmarks/profile_step.py --model random:qwen3-0.6b --modes $3 \
    --batch-sizes $4 --sections decode,host --label $2 --json $OUT/host.jsonl > /dev/null 2>>$OUT/err.txt)
  python3 - "$2" <<'PY'
import json, os, sys
for line in open(os.path.join(os.environ["OUT"], "host.jsonl")):
    r = json.loads(line)
    if r.get("label") != sys.argv[1]:
        continue
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if not isinstance(v, (list, dict))})
    for f in r.get("top", [])[:30]:
        print("   ", f[:170])
PY
}
case $1 in
a)  # m0: the GPU test files not re-run since 51a0b99
  TESTS_S=540 gputests m0 tests/gpu/test_spec_graphs.py tests/gpu/test_async_graphs.py tests/gpu/test_structured_gpu.py \
    tests/gpu/test_lora.py tests/gpu/test_moe.py tests/gpu/test_fp8.py
  ;;
b)  # m0 baselines: mode none decode of qwen3-0.6b batch 1 (pinned, x3), its host profile; one-prompt prefill 512 and 2048
  q1=(--model random:qwen3-0.6b --input-len 512 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1 --cuda-graph-mode none)
  for i in 1 2 3; do LAT_S=80 lat m0 none1 "${q1[@]}"; done
  hostprof m0 m0none none 1
  PRE_S=120 prefill m0 512,2048 5
  ;;
c)  # m1 (m0 + the sweep's chunk cases): prefill attention launch configurations, fresh prompts and later chunks
  (cd .gpu/m1 && timeout 560 python3 benchmarks/bench_kernels.py --sections prefill-sweep --out $OUT/prefill-sweep.md 2>>$OUT/err.txt | tail -n 3)
  grep -E "default|^\| [a-z0-9.-]+ [0-9]+ x [0-9]+( after [0-9]+)? \| " $OUT/prefill-sweep.md | awk -F'|' '{c=$2; if (c!=last) {n=0; last=c} n++; if (n<=3 || /default/) print}'
  ;;
p)  # m0 on several GPUs: every test of tests/gpu/test_parallel.py (P=2, T=2, lazy T=2, P=2 x T=2 where four GPUs, faults)
  nvidia-smi topo -m | head -8 | tee $OUT/topo.txt
  python3 -c "import torch; print('gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version())" | tee -a $OUT/env.txt
  TESTS_S=570 gputests m0 tests/gpu/test_parallel.py
  ps -ef | grep -c "[m]ultiprocessing" | sed 's/^/processes left: /'
  ;;
d)  # m0: where an 8,192-token prefill's time goes (one PIECEWISE step, cuDNN attention between the pieces): qwen3-0.6b, llama-3.1-8b
  (cd .gpu/m0 && timeout 200 python3 benchmarks/profile_step.py --model random:qwen3-0.6b --modes full_and_piecewise \
    --sections prefill --prefill-lengths 8192 --label q8k --json $OUT/prof.jsonl > /dev/null 2>>$OUT/err.txt)
  (cd .gpu/m0 && timeout 300 python3 benchmarks/profile_step.py --model random:llama-3.1-8b --modes full_and_piecewise \
    --sections prefill --prefill-lengths 8192 --label l8k --json $OUT/prof.jsonl > /dev/null 2>>$OUT/err.txt)
  python3 - <<'PY'
import json, os
for line in open(os.path.join(os.environ["OUT"], "prof.jsonl")):
    r = json.loads(line)
    print(r["label"], r["tokens"], "wall", round(r["wall_ms"], 2), "device", round(r["device_ms"], 2), r["timeline"])
    for n, (c, us) in r["top"].items():
        print("   ", n[:60], c, round(us, 1))
PY
  ;;
e)  # m0: issue 17's bench table at the session's code (s33's stages i and v, less the GPU tests)
  (cd .gpu/m0 && timeout 100 taskset -c 8-11 python3 -m ostinato.cli bench prefill --model random:qwen3-0.6b --json --iters 3 --no-prefix-caching \
    --cuda-graph-mode none,full_and_piecewise 2>>$OUT/err.txt | tee -a $OUT/prefill.jsonl | cut -c1-400)
  (cd .gpu/m0 && timeout 60 taskset -c 8-11 python3 -m ostinato.cli bench startup --model random:qwen3-0.6b --max-model-len 2048 --input-len 512 \
    --json 2>>$OUT/err.txt | tee -a $OUT/startup.jsonl | cut -c1-600)
  (cd .gpu/m0 && timeout 90 taskset -c 8-11 python3 -m ostinato.cli bench latency --model random:qwen3-0.6b --batch-size 1,32 --input-len 512 \
    --output-len 64 --iters 3 --max-model-len 2048 --cuda-graph-mode none,piecewise,full_and_piecewise --json 2>>$OUT/err.txt | tee -a $OUT/decode.jsonl | cut -c1-300)
  for m in random:qwen3-0.6b random:llama-3.1-8b; do
    (cd .gpu/m0 && timeout 90 taskset -c 8-11 python3 -m ostinato.cli bench throughput --model $m --batch-size 256 --input-len 512 --output-len 128 \
      --json 2>>$OUT/err.txt | tee -a $OUT/throughput.jsonl | cut -c1-400)
  done
  (cd .gpu/m0 && timeout 120 taskset -c 8-11 python3 -m ostinato.cli bench prefill --model random:llama-3.1-8b --json --iters 3 --no-prefix-caching \
    --input-len 2048,8192 2>>$OUT/err.txt | tee -a $OUT/prefill.jsonl | cut -c1-400)
  ;;
q)  # m2 (m0 + the new fault tests) on two GPUs: a T=2 driver stopped mid-replays (SIGINT, SIGTERM, SIGKILL); a tensor rank
    # killed or stopped (SIGSTOP) during FULL replays
  python3 -c "import torch; print('gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version())" | tee -a $OUT/env.txt
  TESTS_S=560 gputests m2 tests/gpu/test_parallel.py -k "driver_stopped or lost_during"
  ps -ef | grep -c "[m]ultiprocessing" | sed 's/^/processes left: /'
  ;;
q2)  # m2 (the driver tests' PYTHONPATH fixed: the checkout, then the carried packages) on two GPUs: a T=2 driver stopped
    # mid-replays; the SIGSTOP test again, its warnings timed
  (cd .gpu/m2 && timeout 400 python3 -m pytest tests/gpu/test_parallel.py -k "driver_stopped or SIGSTOP" -q -p no:cacheprovider \
    -o addopts="" -rs --durations=10 -o log_cli=true --log-cli-level=WARNING \
    --log-cli-format="%(asctime)s.%(msecs)03d %(levelname)s %(name)s %(message)s" 2>&1 | tee $OUT/gpu-m2.log | tail -n 40)
  ps -ef | grep -c "[m]ultiprocessing" | sed 's/^/processes left: /'
  ;;
esac
grep -iE "error|Traceback" $OUT/err.txt 2>/dev/null | tail -5
