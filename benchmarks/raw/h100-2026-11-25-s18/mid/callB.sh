#!/usr/bin/env bash
# mid-session call B: structured decode before (4e5eff0) vs after, prefill and decode on int
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
q=random:qwen3-0.6b
for tree in before int; do
  (cd .gpu/$tree && PYTHONPATH=.:/tmp/site timeout 80 python3 -m ostinato.cli bench latency \
    --model $q --json --batch-size 32 --input-len 128 --output-len 64 --iters 3 \
    --max-model-len 2048 --structured-output none,json 2>>$OUT/b.err | sed "s/^{/{\"tree\": \"$tree\", /" \
    | tee -a $OUT/structured.jsonl)
done
cd .gpu/int; export PYTHONPATH=.:/tmp/site
timeout 100 python3 -m ostinato.cli bench prefill --model $q --json --iters 3 --no-prefix-caching \
  --input-len 512,1024,2048 --cuda-graph-mode piecewise,full_and_piecewise 2>>$OUT/b.err | tee -a $OUT/prefill.jsonl
timeout 60 python3 -m ostinato.cli bench startup --model $q --json --max-model-len 2048 \
  --input-len 512 2>>$OUT/b.err | tee -a $OUT/startup.jsonl
grep -iE "error|traceback" $OUT/b.err | tail -n 10
