#!/bin/bash
# session 31 calls: bash .gpu/s31.sh STAGE   (trees under .gpu/: s0 = main 735fc76 + the two-shape prefill sweep)
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
prefprof() {  # TREE LABEL: qwen3-0.6b one-prompt prefill steps' kernels at 512, 1024, 2048
  (cd .gpu/$1 && timeout ${PROF_S:-150} python3 benchmarks/profile_step.py --model random:qwen3-0.6b --modes full_and_piecewise \
    --sections prefill --prefill-lengths 512,1024,2048 --label $2 --json $OUT/prof.jsonl > /dev/null 2>>$OUT/err.txt)
}
summary() {
python3 - <<'PY'
import json, os
p = os.path.join(os.environ["OUT"], "prof.jsonl")
for line in open(p) if os.path.exists(p) else []:
    r = json.loads(line)
    if "top" in r:
        print(r.get("label"), r["mode"], r["tokens"], "wall", round(r["wall_ms"], 3), "device", round(r["device_ms"], 3), r["kernels"])
        for n, (c, us) in list(r["top"].items())[:8]:
            print("   ", n[:60], c, us)
PY
}
case $1 in
a)  # s0: the GPU tests session 30 left unrun; prefill sweep and SDPA in two layer shapes; qwen3-0.6b prefill steps' kernels
  TESTS_S=200 gputests s0 "tests/gpu/test_engine_graphs.py::test_random_preset_generates_with_graphs" tests/gpu/test_kernels.py
  (cd .gpu/s0 && timeout 240 python3 benchmarks/bench_kernels.py --sections prefill-sweep,sdpa --out $OUT/prefill.md 2>>$OUT/err.txt | tail -n 120)
  prefprof s0 s0; summary
  ;;
b)  # upper bound of a decode step without its RoPE + store kernel: s0 / nr (rope_and_store skipped at <= 32 tokens; wrong tokens, right timing)
  a3b=(--model random:qwen3-30b-a3b --input-len 128 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1)
  q1=(--model random:qwen3-0.6b --input-len 512 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1)
  for t in s0 nr s0 nr; do LAT_S=100 lat $t q1 "${q1[@]}"; done
  for t in s0 nr s0 nr; do LAT_S=110 lat $t a3b "${a3b[@]}"; done
  ;;
c)  # r1 (decode attention rotates q and k and stores k and v itself): its GPU kernel tests; decode A/B s0 / r1 pinned, interleaved
  TESTS_S=120 gputests r1 tests/gpu/test_kernels.py -k "rotates or rope or decode or graph"
  q=(--model random:qwen3-0.6b --input-len 512 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1,32)
  a3b=(--model random:qwen3-30b-a3b --input-len 128 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1)
  for t in s0 r1 s0 r1; do LAT_S=90 lat $t q "${q[@]}"; done
  for t in r1 s0; do LAT_S=110 lat $t a3b "${a3b[@]}"; done
  ;;
e)  # r2 (r1 with the rotation over whole rows in q's layout, and the new token stored by the part that reads it, then read back):
    # its GPU kernel tests; decode A/B s0 / r2 pinned, interleaved
  TESTS_S=150 gputests r2 tests/gpu/test_kernels.py -k "rotates or rope or decode or graph"
  q=(--model random:qwen3-0.6b --input-len 512 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1,32)
  a3b=(--model random:qwen3-30b-a3b --input-len 128 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1)
  for t in s0 r2 s0 r2; do LAT_S=90 lat $t q "${q[@]}"; done
  for t in r2 s0; do LAT_S=110 lat $t a3b "${a3b[@]}"; done
  ;;
f)  # where r2's batch-1 time goes: the step's kernels with PDL off (each kernel alone), s0 / r2, qwen3-30b-a3b and qwen3-0.6b
  for t in s0 r2; do
    (cd .gpu/$t && timeout 150 python3 benchmarks/profile_step.py --model random:qwen3-30b-a3b --modes full_and_piecewise \
      --batch-sizes 1 --sections decode,step-kernels --no-pdl --label $t --json $OUT/stepprof.jsonl > /dev/null 2>>$OUT/err.txt)
    (cd .gpu/$t && timeout 100 python3 benchmarks/profile_step.py --model random:qwen3-0.6b --modes full_and_piecewise \
      --batch-sizes 1,32 --sections decode,step-kernels --no-pdl --label $t --json $OUT/stepprof.jsonl > /dev/null 2>>$OUT/err.txt)
  done
  python3 - <<'PY'
import json, os
for line in open(os.path.join(os.environ["OUT"], "stepprof.jsonl")):
    r = json.loads(line)
    if r["section"] == "decode":
        print(r["label"], r["model"], r["batch"], "decode", round(r["tpot_ms"], 3))
    elif r["section"] == "step-kernels":
        print(r["label"], r["model"], r["batch"], "step", round(r["device_ms_per_step"], 3), r["kernels_per_step"])
        for n, (c, us) in sorted(r["by_name"].items(), key=lambda kv: -kv[1][1])[:9]:
            print("   ", n[:50], c, us)
PY
  ;;
g)  # r3 (= r2, the ROPE launch without PDL's early launch) and r4 (= r2, the ROPE launch lets the next kernel launch only after its wait): a3b batch 1, qwen3-0.6b 1 and 32
  a3b=(--model random:qwen3-30b-a3b --input-len 128 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1)
  q=(--model random:qwen3-0.6b --input-len 512 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1,32)
  for t in s0 r3 r4; do LAT_S=100 lat $t a3b "${a3b[@]}"; done
  for t in s0 r3 r4; do LAT_S=80 lat $t q "${q[@]}"; done
  ;;
h)  # f (the session's code: decode steps of 2+ requests, and eager ones, rotate in the attention launch): the engine and MoE GPU tests, the kernel tests
    # of the rotating launch; then qwen3-0.6b batch 1 and 32 s0 / f, qwen3-30b-a3b batch 1 f, as time allows
  TESTS_S=420 gputests f tests/gpu/test_engine_graphs.py tests/gpu/test_moe.py "tests/gpu/test_kernels.py::test_a_decode_launch_rotates_and_stores_in_a_graph"
  q=(--model random:qwen3-0.6b --input-len 512 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1,32)
  a3b=(--model random:qwen3-30b-a3b --input-len 128 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1)
  for t in f s0; do LAT_S=70 lat $t q "${q[@]}"; done
  LAT_S=90 lat f a3b "${a3b[@]}"
  ;;
d)  # r1: the engine GPU tests (HF oracle and every graph mode against eager, MoE, speculative, async, LoRA); a3b A/B second pair
  TESTS_S=420 gputests r1 tests/gpu/test_engine_graphs.py tests/gpu/test_moe.py tests/gpu/test_spec_graphs.py tests/gpu/test_async_graphs.py
  a3b=(--model random:qwen3-30b-a3b --input-len 128 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1)
  for t in s0 r1; do LAT_S=100 lat $t a3b "${a3b[@]}"; done
  ;;
esac
grep -iE "error|Traceback" $OUT/err.txt 2>/dev/null | tail -5
