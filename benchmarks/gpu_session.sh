#!/usr/bin/env bash
# Everything we run on a lent GPU, in one script, so a session spends its device time on work.
#   bash benchmarks/gpu_session.sh tests    # tests/gpu (kernels, breakable capture, engine, graphs)
#   bash benchmarks/gpu_session.sh kernels  # the kernel table (benchmarks/bench_kernels.py)
#   bash benchmarks/gpu_session.sh bench M  # latency / prefill / startup benches of model M
#   bash benchmarks/gpu_session.sh generate M  # ostinato generate with model M
#   bash benchmarks/gpu_session.sh parallel    # two GPUs: pipeline / tensor parallel tests
#   bash benchmarks/gpu_session.sh parallel-bench M  # two GPUs: P=1 vs P=2 vs T=2 benches
# Logs and tables go to $OUT (the device tool brings them back) or ./gpu-out.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
stage=${1:-tests}

info() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
  git log -1 --format='commit %H %cd' 2>/dev/null || echo "commit (no git on device)"
}

case "$stage" in
tests)
  info | tee "$OUT/env.txt"
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
parallel)  # two GPUs (nvidia-h200-x2): parallel tests, then P=1 vs P=2 vs T=2 on one machine
  info | tee "$OUT/env.txt"
  nvidia-smi topo -m | tee "$OUT/topology.txt"
  python3 -m pytest tests/gpu/test_parallel.py --maxfail=4 -q -p no:cacheprovider -o addopts="" -rs 2>&1 | tee "$OUT/parallel-tests.log"
  ;;
parallel-bench)  # MODEL: decode latency at batch 1 and 32 per mode, throughput at batch 64
  model=${2:?model}
  info | tee "$OUT/env.txt"
  for shape in "--pipeline-parallel-size 1" "--pipeline-parallel-size 2" "--tensor-parallel-size 2"; do
    # shellcheck disable=SC2086
    python3 -m ostinato.cli bench latency --model "$model" --json --batch-size 1,32 \
      --input-len 128 --output-len 64 --iters 3 --max-model-len 2048 $shape \
      --cuda-graph-mode none,piecewise,full_and_piecewise 2>>"$OUT/bench.err" | tee -a "$OUT/parallel-latency.jsonl"
  done
  for shape in "--pipeline-parallel-size 1 --batch-size 64" "--pipeline-parallel-size 2 --batch-size 64" \
      "--pipeline-parallel-size 2 --batch-size 128"; do
    # shellcheck disable=SC2086
    python3 -m ostinato.cli bench throughput --model "$model" --json --input-len 128 \
      --output-len 128 --max-model-len 2048 $shape 2>>"$OUT/bench.err" | tee -a "$OUT/parallel-throughput.jsonl"
  done
  grep -v "it/s\]" "$OUT/bench.err" | grep -iE "error|warn" | tail -n 15
  ;;
generate)
  python3 -m ostinato.cli generate --model "${2:?model}" --max-tokens 16 --max-model-len 2048 \
    "The capital of France is" 2>&1 | tail -n 8 | tee "$OUT/generate.txt"
  ;;
*)
  echo "usage: $0 tests | kernels | bench MODEL | generate MODEL | parallel | parallel-bench MODEL" >&2
  exit 2
  ;;
esac
