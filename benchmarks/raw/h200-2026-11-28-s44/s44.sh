#!/bin/bash
# session 44 calls: bash .gpu/s44.sh STAGE (a copy of this file; trees under .gpu/):
# m = main 5c329ef; p = m + profile_step.py's timeline section; b = p + a graph break's attention launch bound
# once and called at later replays (breakable.replay_memo, Launch.bind, PagedAttention.bind); c = main 55e1bf6
# (b landed, and SplitSum.settle through a cached Launch); bc = c + break-combine.diff (a PIECEWISE break
# takes an instance that leaves a split KV to the combine launch, both launches bound)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
stamp() { echo "[$(date +%T)] $*"; }
lat() {  # TREE ARGS...: one pinned bench latency run, tagged with its tree
  local tree=$1; shift
  stamp "lat $tree $*"
  (cd .gpu/$tree && timeout ${LAT_S:-150} taskset -c 8-11 python3 -m ostinato.cli bench latency --json --output-len 64 --iters 3 \
    --max-model-len 2048 "$@" 2>>$OUT/err.txt | sed "s|^{|{\"tree\": \"$tree\", |" | tee -a $OUT/latency.jsonl |
    grep -o '"tree[^,]*\|"model[^,]*\|"cuda_graph_mode[^,]*\|"quantization[^,]*\|"batch_size[^,]*\|"tpot_ms[^,]*\|"ratio_to_floor[^,]*' | paste -sd' ' | sed 's/"tree/\n"tree/g')
}
tests() {  # TREE TIMEOUT PYTEST-ARGS...
  local tree=$1 limit=$2; shift 2
  stamp "tests $tree $*"
  (cd .gpu/$tree && PYTHONPATH=.:/tmp/site timeout $limit python3 -m pytest "$@" -q -p no:cacheprovider -o addopts="" -rs --durations=8 2>&1 |
    tee -a $OUT/gpu-$tree.log | tail -n 16)
}
case $1 in
a)  # where a PIECEWISE decode step of qwen3-0.6b at batch 1 goes, host times alone; the issue's own
    # number (bench latency, default async scheduling, 512-token prompts) piecewise and FULL
  (cd .gpu/m && timeout 200 taskset -c 8-11 python3 benchmarks/profile_step.py --model random:qwen3-0.6b --modes piecewise --batch-sizes 1 \
    --sections decode,phases,pieces,host --label pw 2>>$OUT/err.txt | grep -v "^{" | tee $OUT/piecewise-m.txt | head -n 40)
  LAT_S=150 lat m --model random:qwen3-0.6b --input-len 512 --batch-size 1 --cuda-graph-mode piecewise,full_and_piecewise
  ;;
b)  # async scheduling on and off in a PIECEWISE step (a: async 1.605 ms, profile_step without 1.351);
    # the step's device timeline (busy, idle)
  for tree in m m; do LAT_S=150 lat $tree --model random:qwen3-0.6b --input-len 512 --batch-size 1 --cuda-graph-mode piecewise --async-scheduling on,off; done
  (cd .gpu/m && timeout 200 taskset -c 8-11 python3 benchmarks/profile_step.py --model random:qwen3-0.6b --modes piecewise --batch-sizes 1 \
    --sections kernels --label pw 2>>$OUT/err.txt | grep -v "^{" | tee $OUT/piecewise-kernels-m.txt | head -n 40)
  ;;
c)  # one decode forward's timeline (device busy, idle, idle by the gap's ends): PIECEWISE with and without
    # PDL, FULL, at batch 1
  for pdl in "" --no-pdl; do
    (cd .gpu/p && timeout 200 taskset -c 8-11 python3 benchmarks/profile_step.py --model random:qwen3-0.6b --modes piecewise,full_and_piecewise \
      --batch-sizes 1 --sections timeline --label "tl$pdl" $pdl 2>>$OUT/err.txt | grep -v "^{" | tee -a $OUT/timeline-p.txt)
  done
  ;;
d)  # b against m: PIECEWISE qwen3-0.6b batch 1, async scheduling on and off, m b m b; b's pieces and
    # timeline; then b's GPU tests of what it touched (bound launches, breaks, every mode against eager)
  for tree in m b m b; do LAT_S=150 lat $tree --model random:qwen3-0.6b --input-len 512 --batch-size 1 --cuda-graph-mode piecewise --async-scheduling on,off; done
  (cd .gpu/b && timeout 200 taskset -c 8-11 python3 benchmarks/profile_step.py --model random:qwen3-0.6b --modes piecewise --batch-sizes 1 \
    --sections decode,phases,pieces,timeline --label b 2>>$OUT/err.txt | grep -v "^{" | tee $OUT/piecewise-b.txt)
  tests b 120 tests/gpu/test_kernels.py -k "bound or direct_launches or cuda_graph_replays" tests/gpu/test_breakable.py
  tests b 300 tests/gpu/test_engine_graphs.py
  ;;
e)  # c on nvidia-h200-x2 (GPU 0): the GPU tests of the other PIECEWISE breaks (prefill's DIRECT launches,
    # verify steps, LoRA, MoE) and of the FP8 settle launch
  tests c 300 tests/gpu/test_prefill_graphs.py tests/gpu/test_moe.py tests/gpu/test_spec_graphs.py tests/gpu/test_lora.py
  tests c 100 tests/gpu/test_fp8.py -k "every_mode or unsummed"
  ;;
f)  # c on nvidia-h200-x2: two-GPU tests (K selects; stops after 3 failures), topology first
  nvidia-smi topo -m | tee $OUT/topology.txt | head -n 4
  tests c 430 tests/gpu/test_parallel.py --maxfail=3 -k "$K"
  ;;
g)  # c on nvidia-h200-x2: what e's time limits cut (LoRA's tests after the seventh), then two-GPU tests: T=2
    # in the PIECEWISE modes (the breaks' memo under tensor parallelism), P=2 full_and_piecewise, a killed stage
  tests c 170 tests/gpu/test_lora.py
  tests c 230 tests/gpu/test_parallel.py --maxfail=2 \
    -k "(two_tensor_ranks_equal and piecewise) or (two_stages_equal and full_and_piecewise) or killed_stage"
  ;;
h)  # c on nvidia-h200-x2: the FP8 test e's limit cut; more two-GPU tests
  tests c 60 tests/gpu/test_fp8.py -k block_wise_fp8_checkpoint_every_mode
  tests c 150 tests/gpu/test_parallel.py --maxfail=2 -k "(two_stages_equal and piecewise and not full) or lazy or (lost and SIGKILL)"
  ;;
i)  # bc against c: PIECEWISE qwen3-0.6b batch 1 (async scheduling on), c bc c bc; bc's bound-launch and
    # every-mode tests
  for tree in c bc c bc; do LAT_S=45 lat $tree --model random:qwen3-0.6b --input-len 512 --batch-size 1 --cuda-graph-mode piecewise; done
  tests bc 70 tests/gpu/test_kernels.py tests/gpu/test_engine_graphs.py -k "bound or every_mode or checker_passes"
  ;;
esac
stamp done
