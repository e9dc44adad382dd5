#!/bin/bash
# session 23 calls: bash .gpu/s23.sh STAGE   (trees: .gpu/m0 = main 6d5dc40, .gpu/m1 = + host22b)
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
eager)  # host22b: qwen3-0.6b eager (none) and PIECEWISE batch 1, m0 / m1 interleaved; host profiles; memory
  q=(--model random:qwen3-0.6b --input-len 512 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1)
  for t in m0 m1 m0 m1; do lat $t none "${q[@]}" --cuda-graph-mode none; done
  for t in m0 m1 m0 m1; do lat $t pw "${q[@]}" --cuda-graph-mode piecewise; done
  prof m1 pwhost --model random:qwen3-0.6b --modes piecewise,none --batch-sizes 1 --sections decode,host
  for t in m0 m1; do (cd .gpu/$t && timeout 120 python3 -m ostinato.cli bench startup --json \
    --model random:qwen3-0.6b 2>>$OUT/err.txt | sed "s|^{|{\"tree\": \"$t\", |" | tee -a $OUT/startup.jsonl); done
  ;;
tests)
  gputests ${TREE:-m1}
  ;;
merge)  # eager merge of split KV (m2): its GPU kernel and engine tests, then none / PIECEWISE b1 A/B vs m1
  TESTS_S=330 gputests m2 tests/gpu/test_kernels.py tests/gpu/test_engine_graphs.py
  q=(--model random:qwen3-0.6b --input-len 512 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1)
  for t in m1 m2 m1 m2; do lat $t none "${q[@]}" --cuda-graph-mode none; done
  for t in m1 m2 m1 m2; do lat $t pw "${q[@]}" --cuda-graph-mode piecewise; done
  ;;
ab)  # the A/B again, pinned to 4 cores (the host's speed swung 50% between runs), 5 rounds each
  q=(--model random:qwen3-0.6b --input-len 512 --output-len 64 --iters 3 --max-model-len 2048 --batch-size 1)
  for r in 1 2 3 4 5; do for t in m1 m2; do PIN="taskset -c 8-11" lat $t none "${q[@]}" --cuda-graph-mode none; done; done
  for r in 1 2 3 4 5; do for t in m1 m2; do PIN="taskset -c 8-11" lat $t pw "${q[@]}" --cuda-graph-mode piecewise; done; done
  (cd .gpu/m2 && timeout 150 python3 -m pytest tests/gpu/test_kernels.py -q -p no:cacheprovider -o addopts="" -k merged \
    2>&1 | tee $OUT/merged-tests.log | tail -n 3)
  (cd .gpu/m2 && timeout 200 python3 benchmarks/bench_kernels.py --sections decode-sweep --out $OUT/decode-sweep.md \
     2>>$OUT/err.txt | tail -n 60)
  ;;
splits)  # 2 programs per SM (m3) vs 4 (m2): FULL decode qwen3-0.6b b1/8/32 and llama-3.1-8b b1/32
  q=(--model random:qwen3-0.6b --input-len 512 --output-len 64 --iters 3 --max-model-len 2048
     --batch-size 1,8,32 --cuda-graph-mode full_and_piecewise)
  for t in m2 m3 m2 m3; do lat $t full "${q[@]}"; done
  l=(--model random:llama-3.1-8b --input-len 512 --output-len 64 --iters 3 --max-model-len 2048
     --batch-size 1,32 --cuda-graph-mode full_and_piecewise)
  for t in m2 m3 m2 m3; do lat $t full "${l[@]}"; done
  (cd .gpu/m3 && timeout 120 python3 benchmarks/bench_kernels.py --sections decode --out $OUT/decode.md \
     2>>$OUT/err.txt | tail -n 20)
  ;;
issue17)  # issue 17's serving, prefill and offline numbers on the final tree (m4)
  q=random:qwen3-0.6b
  (cd .gpu/m4 && timeout 240 python3 -m ostinato.cli bench serve --launch --model $q --max-model-len 2048 \
    --request-rate 8,32,inf --num-prompts 80 --input-len 512 --output-len 128 \
    --len-spread 0.5 --logprobs 0 --json --server-log $OUT/serve.log 2>>$OUT/err.txt | tee -a $OUT/serve.jsonl)
  (cd .gpu/m4 && timeout 150 python3 -m ostinato.cli bench prefill --model $q --input-len 512,2048,8192 --iters 3 \
    --no-prefix-caching --json 2>>$OUT/err.txt | tee -a $OUT/prefill.jsonl)
  (cd .gpu/m4 && timeout 150 python3 -m ostinato.cli bench throughput --model $q --batch-size 256 --input-len 512 \
    --output-len 128 --json 2>>$OUT/err.txt | tee -a $OUT/throughput.jsonl)
  ;;
serve)  # issue 17's serving numbers (m4), then offline throughput m0 / m4 interleaved
  q=random:qwen3-0.6b
  (cd .gpu/m4 && timeout 300 python3 -m ostinato.cli bench serve --launch --model $q --max-model-len 2048 \
    --request-rate 8,32,inf --num-prompts 80 --input-len 512 --output-len 128 \
    --len-spread 0.5 --logprobs 0 --json --server-log $OUT/serve.log 2>>$OUT/err.txt | tee -a $OUT/serve.jsonl)
  for t in m0 m4 m0 m4; do (cd .gpu/$t && timeout 150 python3 -m ostinato.cli bench throughput --model $q \
    --batch-size 256 --input-len 512 --output-len 128 --json 2>>$OUT/err.txt |
    sed "s|^{|{\"tree\": \"$t\", |" | tee -a $OUT/throughput.jsonl); done
  ;;
fp8)  # llama-3.1-8b --quantization fp8 batch 1 / 32, m0 / m4 interleaved; qwen3-0.6b PIECEWISE b1/32 on m4
  f=(--model random:llama-3.1-8b --input-len 512 --output-len 64 --iters 3 --max-model-len 2048
     --batch-size 1,32 --cuda-graph-mode full_and_piecewise --quantization fp8)
  for t in m0 m4 m0 m4; do lat $t fp8 "${f[@]}"; done
  q=(--model random:qwen3-0.6b --input-len 512 --output-len 64 --iters 3 --max-model-len 2048
     --batch-size 1,8,32 --cuda-graph-mode piecewise)
  for t in m0 m4; do lat $t pw "${q[@]}"; done
  ;;
pw)  # PIECEWISE b1 / b8: m1 (no merge) / m2 (merge) / m4 (merge + 2 per SM), pinned, 2 rounds; m4's b8 kernels
  q=(--model random:qwen3-0.6b --input-len 512 --output-len 64 --iters 3 --max-model-len 2048
     --batch-size 1,8 --cuda-graph-mode piecewise)
  for t in m1 m2 m4 m1 m2 m4; do PIN="taskset -c 8-11" lat $t pw "${q[@]}"; done
  prof m4 pw8 --model random:qwen3-0.6b --modes piecewise --batch-sizes 8 --sections decode,kernels
  prof m1 pw8 --model random:qwen3-0.6b --modes piecewise --batch-sizes 8 --sections decode,kernels
  ;;
bn16)  # 4 KiB K tiles from a quarter of the SMs' programs (m5) vs m4: sweep, FULL decode A/B, start-up
  (cd .gpu/m4 && timeout 200 python3 benchmarks/bench_kernels.py --sections decode-sweep --out $OUT/decode-sweep-m4.md \
     2>>$OUT/err.txt | grep -E "decode (8|32) " | head -40)
  q=(--model random:qwen3-0.6b --input-len 512 --output-len 64 --iters 3 --max-model-len 2048
     --batch-size 1,8,32 --cuda-graph-mode full_and_piecewise)
  for t in m4 m5 m5 m4; do lat $t full "${q[@]}"; done
  l=(--model random:llama-3.1-8b --input-len 512 --output-len 64 --iters 3 --max-model-len 2048
     --batch-size 32 --cuda-graph-mode full_and_piecewise)
  for t in m4 m5 m5 m4; do lat $t full "${l[@]}"; done
  for t in m4 m5; do (cd .gpu/$t && timeout 120 python3 -m ostinato.cli bench startup --json \
    --model random:qwen3-0.6b 2>>$OUT/err.txt | sed "s|^{|{\"tree\": \"$t\", |" | tee -a $OUT/startup.jsonl); done
  ;;
esac
