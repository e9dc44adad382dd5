#!/bin/bash
# session 22 calls: bash .gpu/s22.sh STAGE   (trees: .gpu/main22 = main 32e8b02, .gpu/s22 = candidate)
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
  (cd .gpu/$tree && timeout 200 python3 -m ostinato.cli bench latency --json "$@" 2>>$OUT/err.txt |
    sed "s|^{|{\"tree\": \"$tree\", \"label\": \"$label\", |") | tee -a $OUT/latency.jsonl
}
case $1 in
probe)  # llama-3.1-8b batch 1: fused norms or not; its LoRA step's kernels; qwen3-0.6b eager host profile
  l=(--model random:llama-3.1-8b --modes full_and_piecewise --batch-sizes 1 --sections decode,kernels)
  prof main22 fuse "${l[@]}"
  prof main22 nofuse "${l[@]}" --no-fuse
  prof main22 lora1 "${l[@]}" --num-loras 1
  prof main22 fuse "${l[@]}"
  prof main22 nofuse "${l[@]}" --no-fuse
  prof main22 host --model random:qwen3-0.6b --modes none --batch-sizes 1 --sections decode,host
  ;;
lora)  # llama-3.1-8b LoRA step kernels: batch 1 one adapter, batch 32 four; with and without PDL
  l=(--model random:llama-3.1-8b --modes full_and_piecewise --sections decode,kernels --lora-rank 16)
  prof main22 lora1 "${l[@]}" --batch-sizes 1 --num-loras 1
  prof main22 lora1-nopdl "${l[@]}" --batch-sizes 1 --num-loras 1 --no-pdl
  prof main22 lora4 "${l[@]}" --batch-sizes 32 --num-loras 4
  prof main22 base32 "${l[@]}" --batch-sizes 32
  ;;
lorasum)  # LoRA: the kernels' microbench, GPU LoRA tests on s22, then llama-3.1-8b LoRA decode A/B
  (cd .gpu/s22 && timeout 200 python3 benchmarks/bench_kernels.py --sections lora --out $OUT/lora-kernels.md \
     2>>$OUT/err.txt | grep -A40 "## LoRA")
  (cd .gpu/s22 && timeout 150 python3 -m pytest tests/gpu/test_lora.py -q -p no:cacheprovider -o addopts="" \
     2>&1 | tee $OUT/lora-tests.log | tail -n 4)
  c=(--model random:llama-3.1-8b --batch-size 1,32 --input-len 128 --output-len 64 --iters 3
     --max-model-len 2048 --cuda-graph-mode full_and_piecewise --num-loras 0,1,4 --lora-rank 16
     --max-loras 4 --max-lora-rank 16)
  for t in main22 s22; do lat $t lora "${c[@]}"; done
  ;;
lorasweep)
  (cd .gpu/s22 && timeout 400 python3 benchmarks/bench_kernels.py --sections lora --out $OUT/lora-sweep.md \
     2>>$OUT/err.txt | grep -A60 "## LoRA")
  ;;
lorab1)  # LoRA fused one-row epilogue A/B: llama-3.1-8b batch 1 and 32, base and adapters, per tree
  c=(--model random:llama-3.1-8b --batch-size 1,32 --input-len 128 --output-len 64 --iters 3
     --max-model-len 2048 --cuda-graph-mode full_and_piecewise --num-loras 0,1,4 --lora-rank 16
     --max-loras 4 --max-lora-rank 16)
  for t in ${TREES:-s22 lf22n lf22u}; do lat $t lora "${c[@]}"; done
  (cd .gpu/lf22u && timeout 150 python3 -m pytest tests/gpu/test_lora.py -q -p no:cacheprovider -o addopts="" \
     2>&1 | tee $OUT/lora-tests-lf22u.log | tail -n 4)
  ;;
lorab1x)  # the repeat: batch 1 only, trees interleaved
  c=(--model random:llama-3.1-8b --batch-size 1 --input-len 128 --output-len 64 --iters 3
     --max-model-len 2048 --cuda-graph-mode full_and_piecewise --num-loras 0,1,4 --lora-rank 16
     --max-loras 4 --max-lora-rank 16)
  for t in s22 lf22u s22 lf22u; do lat $t lora "${c[@]}"; done
  ;;
lss)  # LoRA shrink on a side stream: llama-3.1-8b batch 1 and 32 A/B, then its GPU LoRA tests
  c=(--model random:llama-3.1-8b --batch-size 1,32 --input-len 128 --output-len 64 --iters 3
     --max-model-len 2048 --cuda-graph-mode full_and_piecewise --num-loras 0,1,4 --lora-rank 16
     --max-loras 4 --max-lora-rank 16)
  for t in s22 lss; do lat $t lora "${c[@]}"; done
  (cd .gpu/lss && timeout 150 python3 -m pytest tests/gpu/test_lora.py -q -x -p no:cacheprovider -o addopts="" \
     2>&1 | tee $OUT/lora-tests-lss.log | tail -n 4)
  ;;
final)  # the final tree's GPU tests (covering this session's changes), the side-stream test on a tree
        # without the join (must fail), then qwen3-0.6b eager decode main22 / final interleaved
  (cd .gpu/final && timeout ${TESTS_S:-300} python3 -m pytest tests/gpu/test_lora.py tests/gpu/test_kernels.py \
    tests/gpu/test_engine_graphs.py tests/gpu/test_breakable.py tests/gpu/test_check_graphs.py \
    tests/gpu/test_prefill_graphs.py -q -p no:cacheprovider -o addopts="" -rs --durations=5 2>&1 |
    tee $OUT/gpu-final.log | tail -n 12)
  (cd .gpu/nojoin && timeout 60 python3 -m pytest tests/gpu/test_lora.py -q -p no:cacheprovider -o addopts="" \
    -k side_stream 2>&1 | tee $OUT/nojoin.log | tail -n 3)
  q=(--model random:qwen3-0.6b --input-len 512 --output-len 64 --iters 3 --max-model-len 2048
     --batch-size 1 --cuda-graph-mode none)
  for t in main22 final main22 final; do lat $t none "${q[@]}"; done
  ;;
join)  # the side-stream test on the final tree and on one without the join (must fail), eager pair
  for t in final nojoin; do
    (cd .gpu/$t && timeout 60 python3 -m pytest tests/gpu/test_lora.py -q -p no:cacheprovider -o addopts="" \
      -k side_stream 2>&1 | tee $OUT/join-$t.log | tail -n 3)
  done
  q=(--model random:qwen3-0.6b --input-len 512 --output-len 64 --iters 3 --max-model-len 2048
     --batch-size 1 --cuda-graph-mode none)
  for t in main22 final; do lat $t none "${q[@]}"; done
  ;;
eager)  # qwen3-0.6b eager decode, batch 1: final / main22, three rounds
  q=(--model random:qwen3-0.6b --input-len 512 --output-len 64 --iters 3 --max-model-len 2048
     --batch-size 1 --cuda-graph-mode none)
  for t in final main22 final main22 final main22; do lat $t none "${q[@]}"; done
  ;;
esac
grep -iE "error|traceback" $OUT/err.txt 2>/dev/null | grep -v "it/s\]" | tail -5
