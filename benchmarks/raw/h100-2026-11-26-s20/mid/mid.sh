python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site
timeout 300 python3 benchmarks/bench_kernels.py --sections moe-sweep --out $OUT/moe-sweep.md 2>$OUT/err.txt | grep -E "^\| (gate|down)" | head -40
lat() {  # TREE MODEL BATCHES [flags]
  t=$1; m=$2; b=$3; shift 3
  (cd $t && PYTHONPATH=.:/tmp/site timeout 150 python3 -m ostinato.cli bench latency --model $m --json --batch-size $b --input-len 128 --output-len 64 --iters 3 --max-model-len 2048 "$@" 2>>$OUT/err.txt) | python3 -c "
import json,sys
for r in map(json.loads, sys.stdin): print('$t', '$m', '$*', r['batch_size'], round(r['tpot_ms'],3), round(r['ratio_to_floor'],3))" | tee -a $OUT/ab.txt
}
lat .gpu/base random:llama-3.1-8b 1 --quantization fp8; lat . random:llama-3.1-8b 1 --quantization fp8
lat .gpu/base random:qwen3-0.6b 1,8; lat . random:qwen3-0.6b 1,8
lat .gpu/base random:llama-3.1-8b 1 --quantization fp8; lat . random:llama-3.1-8b 1 --quantization fp8
grep -iE "error|traceback" $OUT/err.txt | tail -3
