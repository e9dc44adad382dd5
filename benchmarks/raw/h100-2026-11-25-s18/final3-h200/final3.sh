#!/usr/bin/env bash
# final call 3: the decode A/B of final 2 again in the other order, with main run twice (a
# control), and FP8 llama-3.1-8b decode after the small-batch kernels' shared helpers
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=.:/tmp/site
cp -r . /tmp/rows16 && sed -i "s/^ROW_LIMITS: .*/ROW_LIMITS: tuple[tuple[int, int], ...] = ((3 << 20, 16), (32 << 20, 1))/" /tmp/rows16/ostinato/kernels/gemv.py
for tree in . /tmp/rows16 .; do
  (cd $tree && timeout 90 python3 -m ostinato.cli bench latency --model random:qwen3-0.6b --json \
    --batch-size 1,8,32 --input-len 512 --output-len 64 --iters 3 --max-model-len 2048 \
    2>>$OUT/f3.err | sed "s#^{#{\"tree\": \"$tree\", #" | tee -a $OUT/decode-rows.jsonl | cut -c1-20 >/dev/null)
done
python3 - $OUT/decode-rows.jsonl <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line); print(r["tree"], r["batch_size"], round(r["tpot_ms"], 3))
PY
for quant in "" "--quantization fp8"; do
  # shellcheck disable=SC2086
  timeout 100 python3 -m ostinato.cli bench latency --model random:llama-3.1-8b --json --batch-size 1,32 \
    --input-len 128 --output-len 64 --iters 3 --max-model-len 2048 $quant 2>>$OUT/f3.err | tee -a $OUT/fp8.jsonl \
    | python3 -c "import json,sys; [print(r.get('quantization'), r['batch_size'], round(r['tpot_ms'],3), round(r['ratio_to_floor'],3)) for r in map(json.loads, sys.stdin)]"
done
grep -iE "error|traceback" $OUT/f3.err | tail -n 5
