#!/usr/bin/env bash
# final call 4 (H100): FP8 llama-3.1-8b decode before the small-batch kernels' shared helpers
# (d6d699d) and after (main), one process each, same machine
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
for tree in .gpu/before . .gpu/before; do
  (cd $tree && PYTHONPATH=.:/tmp/site timeout 100 python3 -m ostinato.cli bench latency --model random:llama-3.1-8b \
    --json --batch-size 1,32 --input-len 128 --output-len 64 --iters 3 --max-model-len 2048 \
    --quantization fp8 2>>$OUT/f4.err | sed "s#^{#{\"tree\": \"$tree\", #" | tee -a $OUT/fp8.jsonl \
    | python3 -c "import json,sys; [print(r['tree'], r['batch_size'], round(r['tpot_ms'],3), round(r['ratio_to_floor'],3)) for r in map(json.loads, sys.stdin)]")
done
grep -iE "error|traceback" $OUT/f4.err | tail -n 5
