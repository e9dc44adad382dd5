#!/usr/bin/env bash
# Everything we run on a lent GPU, in one script, so a session spends its device time on work.
#   bash benchmarks/gpu_session.sh tests    # tests/gpu (kernels, breakable capture, engine, graphs)
#   bash benchmarks/gpu_session.sh kernels  # the kernel table (benchmarks/bench_kernels.py)
#   bash benchmarks/gpu_session.sh bench M  # latency / prefill / startup benches of model M
#   bash benchmarks/gpu_session.sh capture M   # start-up, capture and first token, eager vs lazy
#   bash benchmarks/gpu_session.sh serve M     # bench serve at three rates, each graph mode
#   bash benchmarks/gpu_session.sh generate M  # ostinato generate with model M
#   bash benchmarks/gpu_session.sh profile M   # step profile per graph mode (profile_step.py)
#   bash benchmarks/gpu_session.sh parallel    # two GPUs: pipeline / tensor parallel tests
#   bash benchmarks/gpu_session.sh parallel-bench M  # two GPUs: P=1 vs P=2 vs T=2 benches
#   bash benchmarks/gpu_session.sh hang       # two GPUs: stacks of a parallel test that does not finish
#   bash benchmarks/gpu_session.sh spec M   # inter-token latency with and without speculation
#   bash benchmarks/gpu_session.sh lora M   # LoRA tests, decode with rank-16 adapters vs base
#   bash benchmarks/gpu_session.sh async M  # decode with async scheduling on and off, per mode
#   bash benchmarks/gpu_session.sh structured M  # structured-output tests, decode constrained vs not
#   bash benchmarks/gpu_session.sh prefill  # prefill graphs: GPU tests, bench prefill, start-up,
#                                           # eager decode, prefill attention kernel sweep
#   bash benchmarks/gpu_session.sh decode   # small-batch decode: fused-kernel tests, latency, kernels/layer
#   bash benchmarks/gpu_session.sh moe      # the MoE and FP8 GPU tests
#   bash benchmarks/gpu_session.sh moe-bench  # issue 21's targets: FP8 llama-3.1-8b, qwen3-30b-a3b (its MoE kernels too)
#   bash benchmarks/gpu_session.sh diag     # FP8 vs its twin, host profile, prefill kernels, fusions
#   bash benchmarks/gpu_session.sh sdpa     # fresh prefill: torch SDPA backends vs ours, the
#                                           # prefill step's kernels and host profile
#   bash benchmarks/gpu_session.sh triage   # a session's first look: kernel/prefill tests, prefill
#                                           # and decode per mode, constrained decode's host profile
#   bash benchmarks/gpu_session.sh rows [TREE]   # GEMV 2-16 rows: tests, oracle, decode A/B
#   bash benchmarks/gpu_session.sh tail M...     # kernels of whole decode steps, tail included
#   bash benchmarks/gpu_session.sh decode-diag M # decode attention sweep, step kernels without PDL
#   bash benchmarks/gpu_session.sh fp8dot TREE   # FP8 x FP8 dot rows: tests, kernels, decode A/B
#   bash benchmarks/gpu_session.sh verify-tests  # all of tests/gpu, one log (a session's final check)
#   bash benchmarks/gpu_session.sh verify-bench  # the issues' benches side by side, one short run each
# Logs and tables go to $OUT (the device tool brings them back) or ./gpu-out.
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
stage=${1:-tests}

info() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
  git log -1 --format='commit %H %cd' 2>/dev/null || echo "commit (no git on device)"
}

wheels() {  # the runtime packages the GPU image lacks (llguidance, pyzmq, msgspec, fastapi,
  # uvicorn) and py-spy, from the wheels carried in .whl (WHEELS to point elsewhere)
  python3 -c "import fastapi, uvicorn, zmq, msgspec, llguidance" 2>/dev/null && [ -x /tmp/site/bin/py-spy ] ||
    python3 -m pip install -q --no-index --no-deps --target /tmp/site "${WHEELS:-.whl}"/*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/site
}

case "$stage" in
triage)  # a session's first call (~6 min): the kernel and prefill GPU tests, prefill per graph
  # mode at the host-bound sizes, decode per mode, and a host profile (cProfile, top functions
  # by own time) of batch-32 decode with every request under a JSON schema and without
  info | tee "$OUT/env.txt"
  wheels
  q=random:qwen3-0.6b
  timeout 200 python3 -m pytest tests/gpu/test_kernels.py tests/gpu/test_prefill_graphs.py -q \
    -p no:cacheprovider -o addopts="" -rs --maxfail=6 2>&1 | tee "$OUT/triage-tests.log" | tail -n 15
  timeout 100 python3 -m ostinato.cli bench prefill --model $q --json --iters 3 --no-prefix-caching \
    --input-len 512,1024,2048 --cuda-graph-mode piecewise,full,full_and_piecewise \
    2>>"$OUT/triage.err" | tee -a "$OUT/prefill.jsonl"
  timeout 80 python3 -m ostinato.cli bench latency --model $q --json --batch-size 1,32 \
    --input-len 512 --output-len 64 --iters 3 --max-model-len 2048 \
    --cuda-graph-mode piecewise,full_and_piecewise 2>>"$OUT/triage.err" | tee -a "$OUT/decode.jsonl"
  for so in none json; do
    timeout 60 python3 -m cProfile -o "$OUT/structured-$so.prof" -m ostinato.cli bench latency \
      --model $q --json --batch-size 32 --input-len 128 --output-len 64 --iters 3 \
      --max-model-len 2048 --structured-output $so 2>>"$OUT/triage.err" | tee -a "$OUT/structured.jsonl"
    python3 -c "import pstats, sys; pstats.Stats(sys.argv[1]).sort_stats('tottime').print_stats(30)" \
      "$OUT/structured-$so.prof" > "$OUT/structured-$so.txt"
  done
  grep -v "it/s\]" "$OUT/triage.err" | grep -iE "error|traceback" | tail -n 15
  ;;
rows)  # [BASELINE_TREE] issue 18 (~4 min): the small-batch projection kernel at 2-16 rows: its
  # GPU tests (the baseline tree's kernel under the new tests too, to see them fail), the HF
  # oracle and every graph mode against eager, then decode at batch 1-32 with one row vs the
  # rows ROW_LIMITS admits, twice in one process (the repeat is the control)
  info | tee "$OUT/env.txt"
  if [ -n "${2:-}" ]; then
    (cd "$2" && timeout 100 python3 -m pytest "$OLDPWD/tests/gpu/test_kernels.py" -k norm_rounds \
      -q -p no:cacheprovider -o addopts="" --rootdir . 2>&1 | tail -n 8) | tee "$OUT/baseline-tests.log"
  fi
  timeout 420 python3 -m pytest tests/gpu/test_kernels.py tests/gpu/test_engine_graphs.py -q \
    -p no:cacheprovider -o addopts="" -rs 2>&1 | tee "$OUT/rows-tests.log" | tail -n 15
  for rep in 1 2; do
    for rows in 1 16; do
      timeout 120 python3 benchmarks/profile_step.py --model random:qwen3-0.6b \
        --modes full_and_piecewise --batch-sizes 1,2,4,8,16,32 --sections decode --steps 64 \
        --gemv-rows $rows --label "rows$rows-rep$rep" --json "$OUT/decode-rows.jsonl" \
        2>>"$OUT/rows.err" | grep -v '^{'
    done
  done
  ;;
tail)  # MODEL... (~2 min each): the kernels of whole decode steps (forward, LM head, sampling)
  # at batch 1 and 32, full_and_piecewise: where a step's device time goes, tail included
  for model in "${@:2}"; do
    timeout 240 python3 benchmarks/profile_step.py --model "$model" --modes full_and_piecewise \
      --batch-sizes 1,32 --sections kernels,step-kernels --label tail \
      --json "$OUT/tail.jsonl" 2>>"$OUT/tail.err" | grep -v '^{'
  done
  ;;
decode-diag)  # MODEL (~4 min): where a small model's decode step spends its device time: decode
  # attention's launches at short contexts, and the step's kernels with PDL off (with PDL on a
  # kernel's time includes its wait for the one before), at batch 1, 8 and 32
  info | tee "$OUT/env.txt"
  timeout 200 python3 benchmarks/bench_kernels.py --sections decode-sweep --out "$OUT/decode-sweep.md" \
    2>>"$OUT/diag.err" | tail -n 60
  timeout 200 python3 benchmarks/profile_step.py --model "${2:-random:qwen3-0.6b}" \
    --modes full_and_piecewise --batch-sizes 1,8,32 --sections kernels --no-pdl \
    --label no-pdl --json "$OUT/kernels-no-pdl.jsonl" 2>>"$OUT/diag.err" | grep -v '^{'
  ;;
fp8dot)  # OFF_TREE (~8 min): the FP8 small-batch kernel's FP8 x FP8 dot rows: the FP8 GPU tests,
  # the kernel table and sweep, then llama-3.1-8b FP8 decode with the dot rows on, off (a copy
  # of the tree with fp8.FP8_DOT_ROWS = 0) and on again (the control)
  info | tee "$OUT/env.txt"
  timeout 150 python3 -m pytest tests/gpu/test_fp8.py -q -p no:cacheprovider -o addopts="" -rs \
    2>&1 | tee "$OUT/fp8-tests.log" | tail -n 12
  timeout 200 python3 benchmarks/bench_kernels.py --sections fp8,fp8-sweep --out "$OUT/fp8dot.md" \
    2>>"$OUT/fp8.err" | grep -A 30 "^## FP8" | head -n 60
  out=$(cd "$OUT" && pwd)
  for tree in . "${2:?OFF_TREE}" .; do
    (cd "$tree" && timeout 100 python3 -m ostinato.cli bench latency --model random:llama-3.1-8b \
      --quantization fp8 --json --batch-size 1,8,32 --input-len 128 --output-len 64 --iters 3 \
      --max-model-len 2048 --cuda-graph-mode full_and_piecewise 2>>"$out/fp8.err" |
      sed "s|^{|{\"tree\": \"$tree\", |") | tee -a "$OUT/fp8-latency.jsonl"
  done
  ;;
verify-tests)  # every GPU test in one run (about 9 minutes on an H100), the log whole
  info | tee "$OUT/env.txt"
  wheels
  timeout "${TESTS_S:-570}" python3 -m pytest tests/gpu -q -p no:cacheprovider -o addopts="" -rs \
    --durations=15 2>&1 | tee "$OUT/gpu-tests.log" | tail -n 40
  ;;
verify-bench)  # the benches of issues 17-21 on random weights, each under its own limit (~9 min)
  info | tee "$OUT/env.txt"
  wheels
  q=random:qwen3-0.6b
  b() { timeout "$1" python3 -m ostinato.cli bench "${@:2}" --json 2>>"$OUT/bench.err"; }
  b 100 prefill --model $q --iters 3 --no-prefix-caching --cuda-graph-mode none,full_and_piecewise \
    | tee -a "$OUT/prefill.jsonl"
  b 45 startup --model $q --max-model-len 2048 --input-len 512 | tee -a "$OUT/startup.jsonl"
  b 80 latency --model $q --batch-size 1,32 --input-len 512 --output-len 64 --iters 3 \
    --max-model-len 2048 --cuda-graph-mode none,piecewise,full_and_piecewise | tee -a "$OUT/decode.jsonl"
  b 50 throughput --model $q --batch-size 256 --input-len 512 --output-len 128 \
    | tee -a "$OUT/throughput.jsonl"
  b 50 latency --model $q --batch-size 32 --input-len 128 --output-len 64 --iters 3 \
    --max-model-len 2048 --structured-output none,json | tee -a "$OUT/structured.jsonl"
  for quant in "" "--quantization fp8"; do
    # shellcheck disable=SC2086  # $quant is two words or none
    b 60 latency --model random:llama-3.1-8b --batch-size 1,32 --input-len 128 --output-len 64 \
      --iters 3 --max-model-len 2048 $quant | tee -a "$OUT/fp8.jsonl"
  done
  timeout 150 python3 -m ostinato.cli bench serve --launch --model $q --max-model-len 2048 \
    --request-rate 8,32,inf --num-prompts "${SERVE_PROMPTS:-80}" --input-len 512 --output-len 128 \
    --len-spread 0.5 --logprobs 0 --json --server-log /tmp/serve.log 2>>"$OUT/bench.err" \
    | tee -a "$OUT/serve.jsonl"
  grep -v "it/s\]" "$OUT/bench.err" | grep -iE "error|traceback" | tail -n 15
  ;;
sdpa)  # which attention a fresh prefill should take, and where a prefill step's time goes
  info | tee "$OUT/env.txt"
  for arm in sdpa no-sdpa; do  # the engine's prefill step with and without the SDPA path
    flag=$([ $arm = no-sdpa ] && echo --no-sdpa)
    # shellcheck disable=SC2086
    timeout 150 python3 benchmarks/profile_step.py --modes "${AB_MODES:-none,full_and_piecewise}" \
      --sections prefill --prefill-lengths 2048,4096,8192 --label $arm $flag \
      --json "$OUT/profile.jsonl" 2>>"$OUT/sdpa.err" | grep -v '^{' | grep " prefill "
  done
  [ -n "${AB_ONLY:-}" ] && exit 0
  timeout 200 python3 benchmarks/bench_kernels.py --sections sdpa,prefill --out "$OUT/sdpa.md" \
    2>>"$OUT/sdpa.err" | tail -n 40
  timeout 120 python3 benchmarks/profile_step.py --modes full_and_piecewise --batch-sizes 1 \
    --sections prefill --json "$OUT/profile.jsonl" 2>>"$OUT/sdpa.err" | grep -v '^{' \
    | tee "$OUT/prefill.log" | grep -A16 "host time"
  grep -iE "error|traceback" "$OUT/sdpa.err" | tail -n 10
  ;;
diag)  # where the missed targets lose their time (~6 min): FP8 against its rounded-weight twin,
  # the host profile of an eager decode step, prefill kernels per size, decode fused vs not,
  # and where start-up capture goes
  info | tee "$OUT/env.txt"
  for len in 1 32; do
    timeout 150 python3 benchmarks/fp8_agreement.py --prompts 8 --tokens 16 --prompt-len $len \
      2>>"$OUT/diag.err" | tee -a "$OUT/fp8-agreement.jsonl"
  done
  timeout 120 python3 benchmarks/profile_step.py --modes none,full_and_piecewise --batch-sizes 1 \
    --sections host,prefill --json "$OUT/profile.jsonl" 2>>"$OUT/diag.err" | grep -v '^{' \
    | tee "$OUT/host-prefill.log" | head -n 120
  for fuse in fused no-fuse; do
    flag=$([ $fuse = no-fuse ] && echo --no-fuse)
    # shellcheck disable=SC2086
    timeout 90 python3 benchmarks/profile_step.py --modes full_and_piecewise --batch-sizes 1,32 \
      --sections decode,kernels --steps 48 --label $fuse $flag --json "$OUT/profile.jsonl" \
      2>>"$OUT/diag.err" | grep -v '^{' | tee "$OUT/decode-$fuse.log" | tail -n 16
  done
  timeout 90 python3 benchmarks/capture_profile.py --model random:qwen3-0.6b --max-model-len 2048 \
    --out "$OUT/capture-profile.jsonl" 2>>"$OUT/diag.err" | cut -c1-400
  grep -v "it/s\]" "$OUT/diag.err" | grep -iE "error|traceback" | tail -n 15
  ;;
tests)
  info | tee "$OUT/env.txt"
  wheels
  python3 -m pytest tests/gpu --maxfail=8 -q -p no:cacheprovider -o addopts="" -rs 2>&1 | tee "$OUT/gpu-tests.log"
  ;;
kernels)
  info | tee "$OUT/env.txt"
  python3 benchmarks/bench_kernels.py --out "$OUT/kernels.md" 2>&1 | tail -n 40
  ;;
bench)
  model=${2:?model}
  info | tee "$OUT/env.txt"
  python3 -m ostinato.cli bench latency --model "$model" --json --batch-size 1,8,32,64 \
    --input-len 128 --output-len 64 --iters 3 --max-model-len 2048 \
    --cuda-graph-mode none,piecewise,full_and_piecewise 2>>"$OUT/bench.err" | tee -a "$OUT/latency.jsonl"
  python3 -m ostinato.cli bench latency --model "$model" --json --batch-size 16 \
    --input-len 32 --output-len 1 --iters 3 --max-model-len 2048 \
    --cuda-graph-mode none,piecewise 2>>"$OUT/bench.err" | tee -a "$OUT/prefill.jsonl"
  python3 -m ostinato.cli bench startup --model "$model" --json --max-model-len 2048 \
    2>>"$OUT/bench.err" | tee -a "$OUT/startup.jsonl"
  grep -v "it/s\]" "$OUT/bench.err" | tail -n 15
  ;;
async)  # MODEL: decode latency with async scheduling on and off, side by side in one process
  # MODES and BATCHES narrow a run to the device time left
  model=${2:?model}
  info | tee "$OUT/env.txt"
  python3 -m ostinato.cli bench latency --model "$model" --json --batch-size "${BATCHES:-1,8,32,64}" \
    --input-len 128 --output-len 64 --iters 3 --max-model-len 2048 --async-scheduling on,off \
    --cuda-graph-mode "${MODES:-none,piecewise,full_and_piecewise}" 2>>"$OUT/bench.err" | tee -a "$OUT/async-latency.jsonl"
  grep -v "it/s\]" "$OUT/bench.err" | grep -iE "error|warn" | tail -n 15
  ;;
structured)  # MODEL: tests/gpu/test_structured_gpu.py, then decode with every request under one
  # JSON schema against none, with the host mask time per step (BATCHES narrows it)
  model=${2:?model}
  info | tee "$OUT/env.txt"
  python3 -m pytest tests/gpu/test_structured_gpu.py -q -p no:cacheprovider -o addopts="" -rs 2>&1 | tee "$OUT/structured-tests.log"
  python3 -m ostinato.cli bench latency --model "$model" --json --batch-size "${BATCHES:-1,32}" \
    --input-len 128 --output-len 64 --iters 3 --max-model-len 2048 --structured-output none,json \
    --cuda-graph-mode full_and_piecewise 2>>"$OUT/bench.err" | tee -a "$OUT/structured-latency.jsonl"
  grep -v "it/s\]" "$OUT/bench.err" | grep -iE "error|warn" | tail -n 15
  ;;
moe)  # tests/gpu/test_moe.py and test_fp8.py (kernels against float64 math, every graph mode
  # against eager with the checker on); about 2.5 minutes before issue 21's decode launches
  # added their tests, at most MOE_TESTS_S (300) seconds
  info | tee "$OUT/env.txt"
  timeout "${MOE_TESTS_S:-300}" python3 -m pytest tests/gpu/test_moe.py tests/gpu/test_fp8.py \
    --maxfail=6 -v -p no:cacheprovider -o addopts="" -rs --durations=12 2>&1 | tee "$OUT/moe-tests.log"
  ;;
moe-bench)  # issue 21's targets, side by side: llama-3.1-8b bf16 vs --quantization fp8 (decode
  # at batch 1 and 32 against its floor, token agreement and logits cosine), then
  # qwen3-30b-a3b decode eager vs graphs at batch 1 and 32 and its start-up; about 6 minutes,
  # after qwen3-30b-a3b's MoE GEMMs at 1, 8 and 32 tokens, its whole MoE block against the
  # kernel sequence before and the GEMMs' launch sweep (at most 5)
  info | tee "$OUT/env.txt"
  timeout 300 python3 benchmarks/bench_kernels.py --sections moe,moe-block,moe-sweep \
    --out "$OUT/moe-kernels.md" 2>>"$OUT/bench.err" | tail -n 60
  for quant in "" "--quantization fp8"; do
    # shellcheck disable=SC2086  # $quant is two words or none
    python3 -m ostinato.cli bench latency --model random:llama-3.1-8b --json --batch-size 1,32 \
      --input-len 128 --output-len 64 --iters 3 --max-model-len 2048 \
      --cuda-graph-mode full_and_piecewise $quant 2>>"$OUT/bench.err" | tee -a "$OUT/fp8-latency.jsonl"
  done
  python3 benchmarks/fp8_agreement.py --model random:llama-3.1-8b --prompts 32 --tokens 64 \
    2>>"$OUT/bench.err" | tee "$OUT/fp8-agreement.jsonl"
  python3 -m ostinato.cli bench latency --model random:qwen3-30b-a3b --json --batch-size 1,32 \
    --input-len 128 --output-len 64 --iters 3 --max-model-len 2048 \
    --cuda-graph-mode none,full_and_piecewise 2>>"$OUT/bench.err" | tee -a "$OUT/moe-latency.jsonl"
  python3 -m ostinato.cli bench startup --model random:qwen3-30b-a3b --json --max-model-len 2048 \
    2>>"$OUT/bench.err" | tee -a "$OUT/moe-startup.jsonl"
  grep -v "it/s\]" "$OUT/bench.err" | grep -iE "error|warn|traceback" | tail -n 15
  ;;
parallel)  # two GPUs (nvidia-h200-x2): parallel tests, then P=1 vs P=2 vs T=2 on one machine
  info | tee "$OUT/env.txt"
  wheels
  nvidia-smi topo -m | tee "$OUT/topology.txt"
  python3 -m pytest tests/gpu/test_parallel.py --maxfail=4 -q -p no:cacheprovider -o addopts="" -rs 2>&1 | tee "$OUT/parallel-tests.log"
  ;;
hang)  # two GPUs: parallel tests (K, a -k expression; stops at the first failure) under a
  # watch; after WAIT s still running, every process's Python and native stacks (py-spy from
  # .whl where ptrace is allowed; faulthandler on SIGABRT, in hang.log) and the GPUs' state go
  # to one file, $OUT/stacks.txt (the device tool brings back eight files at most), then the
  # tree is killed
  info | tee "$OUT/env.txt"
  wheels
  export PYTHONFAULTHANDLER=1 NCCL_DEBUG=${NCCL_DEBUG:-WARN}
  python3 -m pytest -s -x tests/gpu/test_parallel.py -k "${K:-tensor_ranks_equal and piecewise and not full}" \
    -p no:cacheprovider -o addopts="" -rs -v --durations=0 >"$OUT/hang.log" 2>&1 &
  root=$!
  for _ in $(seq "${WAIT:-200}"); do sleep 1; kill -0 "$root" 2>/dev/null || break; done
  if kill -0 "$root" 2>/dev/null; then
    tree() { echo "$1"; for c in $(ps -o pid= --ppid "$1"); do tree "$c"; done; }
    pids=$(tree "$root")
    ps -o pid,ppid,etime,time,stat,args -p "$(echo $pids | tr ' ' ,)" >"$OUT/stacks.txt"
    nvidia-smi >>"$OUT/stacks.txt" 2>&1
    for p in $pids; do
      timeout 20 /tmp/site/bin/py-spy dump --pid "$p" --native >>"$OUT/stacks.txt" 2>&1
      kill -ABRT "$p" 2>/dev/null
    done
    sleep 5; for p in $pids; do kill -9 "$p" 2>/dev/null; done
    echo "killed after ${WAIT:-200} s" >>"$OUT/hang.log"
  fi
  wait "$root"; tail -n 40 "$OUT/hang.log"
  ;;
parallel-bench)  # MODEL: decode latency at batch 1 and 32 per mode, throughput at batch 64
  # MODES, ITERS and SHAPES (flag sets separated by ";") narrow a run to the device time left
  model=${2:?model}
  info | tee "$OUT/env.txt"
  IFS=";" read -r -a shapes <<< "${SHAPES:---pipeline-parallel-size 1;--pipeline-parallel-size 2;--tensor-parallel-size 2}"
  for shape in "${shapes[@]}"; do
    # shellcheck disable=SC2086
    python3 -m ostinato.cli bench latency --model "$model" --json --batch-size 1,32 \
      --input-len 128 --output-len 64 --iters "${ITERS:-3}" --max-model-len 2048 $shape \
      --cuda-graph-mode "${MODES:-none,piecewise,full_and_piecewise}" 2>>"$OUT/bench.err" | tee -a "$OUT/parallel-latency.jsonl"
  done
  for shape in "--pipeline-parallel-size 1 --batch-size 64" "--pipeline-parallel-size 2 --batch-size 64" \
      "--pipeline-parallel-size 2 --batch-size 128"; do
    # shellcheck disable=SC2086
    python3 -m ostinato.cli bench throughput --model "$model" --json --input-len 128 \
      --output-len 128 --max-model-len 2048 $shape 2>>"$OUT/bench.err" | tee -a "$OUT/parallel-throughput.jsonl"
  done
  grep -v "it/s\]" "$OUT/bench.err" | grep -iE "error|warn" | tail -n 15
  ;;
prefill)  # issue 17, about 200 s on an H100: everything on random:qwen3-0.6b unless MODEL is set
  model=${2:-random:qwen3-0.6b}
  info | tee "$OUT/env.txt"
  timeout 150 python3 -m pytest tests/gpu/test_prefill_graphs.py --maxfail=4 -q -p no:cacheprovider \
    -o addopts="" -rs 2>&1 | tee "$OUT/prefill-tests.log" | tail -n 30
  timeout 120 python3 -m ostinato.cli bench prefill --model "$model" --json --iters 3 \
    --no-prefix-caching --cuda-graph-mode none,full_and_piecewise 2>>"$OUT/prefill.err" \
    | tee -a "$OUT/prefill.jsonl"
  timeout 60 python3 -m ostinato.cli bench startup --model "$model" --json --max-model-len 2048 \
    --input-len 512 2>>"$OUT/prefill.err" | tee -a "$OUT/startup.jsonl"
  # mode none decode at batch 1: the host time of an eager step
  timeout 60 python3 -m ostinato.cli bench latency --model "$model" --json --batch-size 1 \
    --input-len 128 --output-len 32 --iters 1 --max-model-len 2048 --cuda-graph-mode none \
    2>>"$OUT/prefill.err" | tee -a "$OUT/eager-latency.jsonl"
  timeout 150 python3 benchmarks/bench_kernels.py --sections prefill,prefill-sweep \
    --out "$OUT/prefill-kernels.md" 2>&1 | tail -n 40
  grep -v "it/s\]" "$OUT/prefill.err" | grep -iE "error|warn|traceback" | tail -n 15
  ;;
capture)
  model=${2:?model}
  info | tee "$OUT/env.txt"
  # a first start fills Triton's disk cache, so neither measured start compiles kernels;
  # each capture mode then starts in a process of its own
  for capture in eager eager lazy; do
    python3 -m ostinato.cli bench startup --model "$model" --json --max-model-len 2048 \
      --input-len 512 --cuda-graph-capture $capture 2>>"$OUT/startup.err" | tee -a "$OUT/startup.jsonl"
  done
  python3 benchmarks/capture_profile.py --model "$model" --max-model-len 2048 \
    --out "$OUT/capture-profile.jsonl" 2>>"$OUT/capture-profile.err" | cut -c1-600
  grep -v "it/s\]" "$OUT/startup.err" "$OUT/capture-profile.err" | grep -i -E "error|warn" | tail -n 10
  ;;
serve)
  model=${2:?model}
  info | tee "$OUT/env.txt"
  # the GPU image has no fastapi/uvicorn/pyzmq/msgspec: wheels travel in .whl (WHEELS to point
  # elsewhere), with their dependencies (fastapi 0.165 imports opentelemetry-api), or are
  # unpacked beforehand into a directory on PYTHONPATH
  python3 -c "import fastapi, uvicorn, zmq, msgspec" 2>/dev/null ||
    python3 -m pip install -q --no-index --find-links "${WHEELS:-.whl}" fastapi uvicorn pyzmq msgspec ||
    exit 1
  for mode in ${SERVE_MODES:-none piecewise full_and_piecewise}; do
    for sched in ${SERVE_ASYNC:-auto}; do  # SERVE_ASYNC="on off": async scheduling A/B
      # --logprobs 0: a chunk per token (a random preset's tokens have no text to stream)
      python3 -m ostinato.cli bench serve --launch --model "$model" --cuda-graph-mode $mode \
        --async-scheduling $sched --max-model-len 2048 --request-rate 8,32,inf \
        --num-prompts "${SERVE_PROMPTS:-100}" --input-len 512 --output-len 128 --len-spread 0.5 \
        --logprobs 0 --json --server-log "/tmp/serve-$mode-$sched.log" \
        2>>"$OUT/serve.err" | tee -a "$OUT/serve.jsonl"
    done
  done
  grep -i -E "error|traceback" "$OUT/serve.err" | tail -n 10
  ;;
spec)
  # Batch 1 and 8, copy-heavy and no-repeat workloads, plain decoding then n-gram speculation
  # (k = 4); benchmarks/spec_report.py pairs them against the targets of issue 12.
  model=${2:?model}
  info | tee "$OUT/env.txt"
  for workload in copy norepeat; do
    for spec in "" "--speculative-method ngram --num-speculative-tokens 4"; do
      # shellcheck disable=SC2086  # $spec is two flags or none
      python3 -m ostinato.cli bench latency --model "$model" --json --batch-size 1,8 \
        --input-len 512 --output-len 128 --iters 3 --max-model-len 2048 \
        --workload "$workload" $spec 2>>"$OUT/spec.err" | tee -a "$OUT/spec.jsonl"
    done
  done
  python3 benchmarks/spec_report.py "$OUT/spec.jsonl" | tee "$OUT/spec.md"
  grep -v "it/s\]" "$OUT/spec.err" | tail -n 15
  ;;
lora)  # MODEL: tests/gpu/test_lora.py, then the decode step with random rank-16 adapters
  model=${2:?model}
  info | tee "$OUT/env.txt"
  python3 -m pytest tests/gpu/test_lora.py --maxfail=4 -q -p no:cacheprovider -o addopts="" -rs 2>&1 | tee "$OUT/lora-tests.log"
  common=(--model "$model" --json --batch-size 1,32 --input-len 128 --output-len 64 --iters 3
    --max-model-len 2048 --cuda-graph-mode full_and_piecewise)
  # the base engine, then one with LoRA on: 0 adapters (base graphs), 1 and 4 adapters
  python3 -m ostinato.cli bench latency "${common[@]}" 2>>"$OUT/bench.err" | tee "$OUT/lora-latency.jsonl"
  python3 -m ostinato.cli bench latency "${common[@]}" --num-loras 0,1,4 --lora-rank 16 \
    --max-loras 4 --max-lora-rank 16 2>>"$OUT/bench.err" | tee -a "$OUT/lora-latency.jsonl"
  python3 -m ostinato.cli bench startup --model "$model" --json --max-model-len 2048 --enable-lora \
    --max-loras 4 --max-lora-rank 16 2>>"$OUT/bench.err" | tee "$OUT/lora-startup.jsonl"
  python3 - "$OUT/lora-latency.jsonl" <<'PY' | tee "$OUT/lora-verdict.txt"
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
base = {r["batch_size"]: r["tpot_ms"] for r in rows if "num_loras" not in r}
lora = {(r["batch_size"], r["num_loras"]): r["tpot_ms"] for r in rows if "num_loras" in r}
for batch, adapters, limit in ((1, 1, 1.15), (32, 4, 1.3)):
    ratio = lora[batch, adapters] / base[batch]
    print(f"batch {batch}, {adapters} adapter(s): {lora[batch, adapters]:.3f} ms vs base "
          f"{base[batch]:.3f} ms = {ratio:.3f}x (limit {limit}x: {'met' if ratio <= limit else 'MISSED'}); "
          f"LoRA engine without adapters {lora[batch, 0]:.3f} ms = {lora[batch, 0] / base[batch]:.3f}x")
PY
  ;;
decode)  # issue 18 (~5 min): the fused decode kernels' tests; qwen3-0.6b decode, fused vs not
  info | tee "$OUT/env.txt"
  timeout 240 python3 -m pytest tests/gpu/test_kernels.py tests/gpu/test_engine_graphs.py -q \
    -p no:cacheprovider -o addopts="" -rs --maxfail=8 \
    -k "gemv or paged_attention_decode or oracle_bfloat16 or every_mode" 2>&1 | tee "$OUT/decode-tests.log" | tail -n 25
  # the same tree with the norm / residual fusions off (--no-fuse), side by side
  for fuse in fused no-fuse; do
    flag=$([ $fuse = no-fuse ] && echo --no-fuse)
    # shellcheck disable=SC2086
    timeout 85 python3 benchmarks/profile_step.py --model random:qwen3-0.6b --modes full_and_piecewise \
      --batch-sizes 1,32 --sections decode,kernels --steps 48 --label $fuse $flag \
      --json "$OUT/profile.jsonl" 2>&1 | tee "$OUT/profile-$fuse.log" | grep -v '^{' | tail -n 16
  done
  ;;
profile)  # MODEL [BASELINE_TREE]: the step profile per mode; with a second checkout, it too
  model=${2:?model}
  info | tee "$OUT/env.txt"
  modes=none,piecewise,full_and_piecewise
  case "$model" in *8b*) modes=piecewise,full_and_piecewise ;; esac
  if [ -n "${3:-}" ]; then  # the same script over another tree (e.g. the commit before)
    (cd "$3" && PYTHONPATH=. python3 "$OLDPWD/benchmarks/profile_step.py" --model "$model" \
      --modes "$modes" --label before --json "$OUT/profile.jsonl" > "$OUT/profile-before.log" 2>&1)
  fi
  python3 benchmarks/profile_step.py --model "$model" --modes "$modes" --label after \
    --json "$OUT/profile.jsonl" 2>&1 | tee "$OUT/profile.log" | grep -v '^{' | tail -n 40
  ;;
generate)
  python3 -m ostinato.cli generate --model "${2:?model}" --max-tokens 16 --max-model-len 2048 \
    "The capital of France is" 2>&1 | tail -n 8 | tee "$OUT/generate.txt"
  ;;
*)
  echo "usage: $0 tests | kernels | bench MODEL | capture MODEL | serve MODEL | spec MODEL | profile MODEL [TREE] | generate MODEL | parallel | parallel-bench MODEL | lora MODEL | async MODEL | structured MODEL" >&2
  exit 2
  ;;
esac
