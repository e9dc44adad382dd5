python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site
timeout 200 python3 benchmarks/bench_kernels.py --sections fp8-row-sweep --out $OUT/fp8-row-sweep.md 2>$OUT/err.txt | tail -8
lat() {  # TREE MODEL BATCHES
  (cd $1 && PYTHONPATH=.:/tmp/site timeout 150 python3 -m ostinato.cli bench latency --model $2 --json --batch-size $3 --input-len 128 --output-len 64 --iters 3 --max-model-len 2048 2>>$OUT/err.txt) | python3 -c "
import json,sys
for r in map(json.loads, sys.stdin): print('$1', '$2', r['batch_size'], round(r['tpot_ms'],3), round(r['ratio_to_floor'],3))" | tee -a $OUT/ab.txt
}
for m in random:qwen3-0.6b random:qwen3-30b-a3b; do lat .gpu/base $m 1,8; lat . $m 1,8; done
lat .gpu/base random:qwen3-0.6b 1; lat . random:qwen3-0.6b 1
lat .gpu/base random:llama-3.1-8b 1; lat . random:llama-3.1-8b 1
grep -iE "error|traceback" $OUT/err.txt | tail -3
