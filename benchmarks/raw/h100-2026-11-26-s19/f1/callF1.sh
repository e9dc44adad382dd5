# Session 19, call F1 (one nvidia-h100-x1 call): the MoE block (branch moek) and the FP8 dot
# launches, tests then A/Bs. Trees: . = main ea9e693; .gpu/premoe = 49932ef (before moek);
# .gpu/fp8off = ea9e693 with fp8.FP8_DOT = False.
out=$(cd "$OUT" && pwd)
bash benchmarks/gpu_session.sh moe 2>&1 | tail -n 12
timeout 150 python3 benchmarks/bench_kernels.py --sections moe,moe-block,fp8 --out "$out/kernels.md" \
  2>>"$out/f1.err" | grep -v "^$" | tail -n 45
lat() {  # TREE LABEL ARGS...: bench latency in TREE, each JSON line tagged with LABEL
  local tree=$1 label=$2; shift 2
  (cd "$tree" && timeout 150 python3 -m ostinato.cli bench latency --json --input-len 128 \
    --output-len 64 --iters 3 --max-model-len 2048 --cuda-graph-mode full_and_piecewise "$@" \
    2>>"$out/f1.err" | sed "s|^{|{\"tree\": \"$label\", |") | tee -a "$out/latency.jsonl"
}
lat . moek --model random:qwen3-30b-a3b --batch-size 1,32
lat .gpu/premoe before-moek --model random:qwen3-30b-a3b --batch-size 1,32
for tree in . .gpu/fp8off; do
  lat "$tree" "fp8dot-$tree" --model random:llama-3.1-8b --quantization fp8 --batch-size 1,8,32
done
grep -v "it/s\]" "$out/f1.err" | grep -iE "error|traceback" | tail -n 10
