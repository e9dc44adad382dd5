python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader
none() {  # TREE
  (cd $1 && PYTHONPATH=.:/tmp/site timeout 120 python3 -m ostinato.cli bench latency --model random:qwen3-0.6b --json --batch-size 1 --input-len 512 --output-len 64 --cuda-graph-mode none 2>>$OUT/err.txt) | python3 -c "
import json,sys
for r in map(json.loads, sys.stdin): print('$1 none b1', round(r['tpot_ms'],3))" | tee -a $OUT/none-ab.txt
}
none .gpu/pre; none .; none .gpu/pre; none .
timeout 420 bash benchmarks/gpu_session.sh lora random:llama-3.1-8b 2>&1 | tail -45
grep -iE "error|traceback" $OUT/err.txt | tail -3
