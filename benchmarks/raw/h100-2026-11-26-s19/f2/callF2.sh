# Session 19, call F2 (one nvidia-h100-x1 call): the post-attention norm folded into the MoE
# router's GEMV (branch moenorm). Trees: . = main + moenorm; .gpu/premoenorm = 4eb24d7.
out=$(cd "$OUT" && pwd)
timeout 200 python3 -m pytest tests/gpu/test_kernels.py tests/gpu/test_moe.py -k "gemv or moe" \
  -q -p no:cacheprovider -o addopts="" -rs 2>&1 | tee "$out/tests.log" | tail -n 8
timeout 150 python3 benchmarks/bench_kernels.py --sections moe-block --out "$out/moe-block.md" \
  2>>"$out/f2.err" | grep -A 12 "whole block"
for tree in . .gpu/premoenorm; do
  (cd "$tree" && timeout 150 python3 -m ostinato.cli bench latency --json --input-len 128 \
    --output-len 64 --iters 3 --max-model-len 2048 --cuda-graph-mode full_and_piecewise \
    --model random:qwen3-30b-a3b --batch-size 1,32 2>>"$out/f2.err" |
    sed "s|^{|{\"tree\": \"$tree\", |") | tee -a "$out/latency.jsonl"
done
grep -v "it/s\]" "$out/f2.err" | grep -iE "error|traceback" | tail -n 10
# Trees: . = main 4eb24d7 + branch moenorm 1f20cdf (fast-forward, then dropped); .gpu/premoenorm = 4eb24d7.
