#!/bin/bash
# session 35 calls: bash .gpu/s35.sh STAGE   (trees under .gpu/: m0 = main b082bc1 + the SIGSTOP test; m1 = m0 + async GPU tests, the ranks' agreement asserted; m2 = m1 + NCCL's dump on timeout and heartbeat monitor off; m3 = m2 + NCCL groups time out after the engine's deadline)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, 'gpus', torch.cuda.device_count()); import os; print(os.cpu_count(), 'cpus')" | tee -a $OUT/env.txt
gputests() {  # TREE [FILES...]: the GPU tests of a tree
  local tree=$1; shift
  (cd .gpu/$tree && timeout ${TESTS_S:-560} python3 -m pytest "${@:-tests/gpu}" -q -p no:cacheprovider \
    -o addopts="" -rs --durations=10 2>&1 | tee $OUT/gpu-$tree.log | tail -n 25)
}
watch() {  # TREE K WAIT TAG: the parallel tests picked by K under a watch: after WAIT s still running, every
  # process's Python stack (py-spy) and the GPUs' state go to $OUT, then the tree is killed
  local tree=$1 k=$2 wait=$3 tag=$4
  (cd .gpu/$tree && PYTHONFAULTHANDLER=1 python3 -m pytest -s -x tests/gpu/test_parallel.py -k "$k" -p no:cacheprovider \
    -o addopts="" -rs -v --durations=0 -o log_cli=true --log-cli-level=WARNING \
    --log-cli-format="%(asctime)s.%(msecs)03d %(levelname)s %(name)s %(message)s" >$OUT/watch-$tag.log 2>&1) &
  local root=$!
  for _ in $(seq "$wait"); do sleep 1; kill -0 "$root" 2>/dev/null || break; done
  if kill -0 "$root" 2>/dev/null; then
    tree() { echo "$1"; for c in $(ps -o pid= --ppid "$1"); do tree "$c"; done; }
    local pids=$(tree "$root")
    ps -o pid,ppid,etime,time,stat,args -p "$(echo $pids | tr ' ' ,)" >$OUT/stacks-$tag.txt
    nvidia-smi >>$OUT/stacks-$tag.txt 2>&1
    for p in $pids; do timeout 20 /tmp/site/bin/py-spy dump --pid "$p" --native >>$OUT/stacks-$tag.txt 2>&1; done
    for p in $pids; do kill -ABRT "$p" 2>/dev/null; done
    sleep 5; for p in $pids; do kill -9 "$p" 2>/dev/null; done
    echo "killed after $wait s" >>$OUT/watch-$tag.log
  fi
  wait "$root"; tail -n 30 $OUT/watch-$tag.log
  ps -ef | grep -c "[m]ultiprocessing" | sed 's/^/processes left: /'
}
case $1 in
p)  # m0 on two GPUs: tests/gpu/test_parallel.py but the SIGSTOP case (cfb84de's shutdown branch, at every T=2 and P=2 test's end)
  python3 -c "import torch; print('nccl', torch.cuda.nccl.version())" | tee -a $OUT/env.txt
  TESTS_S=575 gputests m0 tests/gpu/test_parallel.py -k "not SIGSTOP"
  ps -ef | grep -c "[m]ultiprocessing" | sed 's/^/processes left: /'
  ;;
s)  # m0 on two GPUs: the SIGSTOP test alone under the watch, twice
  watch m0 SIGSTOP ${WAIT:-150} s1
  watch m0 SIGSTOP ${WAIT:-150} s2
  ;;
a)  # m1 on two GPUs: README check 5 (async scheduling over NCCL: equality tests, then decode with it on and off) and
    # check 1 (T=2 engines one after another in one process agree on warm-ups, drops and captures)
  TESTS_S=330 gputests m1 tests/gpu/test_parallel.py -k "async or two_tensor_ranks_equal or lazy"
  ps -ef | grep -c "[m]ultiprocessing" | sed 's/^/processes left: /'
  ;;
b)  # m2 on two GPUs: decode with async scheduling on and off (README check 5's speed-up): qwen3-0.6b P=2 and T=2, llama-3.1-8b P=2
  for run in "random:qwen3-0.6b --pipeline-parallel-size 2" "random:qwen3-0.6b --tensor-parallel-size 2" \
             "random:llama-3.1-8b --pipeline-parallel-size 2"; do
    (cd .gpu/m2 && timeout 170 python3 -m ostinato.cli bench latency --json --model $run --async-scheduling on,off \
      --batch-size 1,32 --input-len 512 --output-len 64 --iters 3 --max-model-len 2048 2>>$OUT/err.txt |
      sed "s|^{|{\"run\": \"$run\", |" | tee -a $OUT/async.jsonl | cut -c1-400)
  done
  ps -ef | grep -c "[m]ultiprocessing" | sed 's/^/processes left: /'
  ;;
c)  # m2 on two GPUs: the SIGSTOP test under the watch, twice; the async tests, lazy capture, T=2 agreement
  watch m2 SIGSTOP 120 s1
  grep -q "1 passed" $OUT/watch-s1.log && watch m2 SIGSTOP 120 s2
  TESTS_S=300 gputests m2 tests/gpu/test_parallel.py -k "async or lazy or (two_tensor_ranks_equal and full_and_piecewise)"
  ps -ef | grep -c "[m]ultiprocessing" | sed 's/^/processes left: /'
  ;;
d)  # m3 on two GPUs: the SIGSTOP test under the watch, twice; qwen3-0.6b T=2 decode with async scheduling on and off
  watch m3 SIGSTOP 100 s1
  grep -q "1 passed" $OUT/watch-s1.log && watch m3 SIGSTOP 100 s2
  (cd .gpu/m3 && timeout 120 python3 -m ostinato.cli bench latency --json --model random:qwen3-0.6b --tensor-parallel-size 2 \
    --async-scheduling on,off --batch-size 1,32 --input-len 512 --output-len 64 --iters 3 --max-model-len 2048 2>>$OUT/err.txt |
    tee -a $OUT/async.jsonl | cut -c1-300)
  ps -ef | grep -c "[m]ultiprocessing" | sed 's/^/processes left: /'
  ;;
esac
