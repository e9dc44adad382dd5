#!/usr/bin/env bash
# final call 2: decode at 1-32 rows with gemv.ROW_LIMITS as set vs one row (a copy with the old
# limit), qwen3-30b-a3b decode, the MoE kernel section at the set launch
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=.:/tmp/site
timeout 150 python3 -m pytest tests/gpu/test_engine_graphs.py tests/gpu/test_spec_graphs.py -q -p no:cacheprovider \
  -o addopts="" -k "oracle_bfloat16 or speculation" 2>&1 | tail -n 4 | tee $OUT/fix-tests.log
cp -r . /tmp/rows16 && sed -i "s/^ROW_LIMITS: .*/ROW_LIMITS: tuple[tuple[int, int], ...] = ((3 << 20, 16), (32 << 20, 1))/" /tmp/rows16/ostinato/kernels/gemv.py
grep -n "^ROW_LIMITS" /tmp/rows16/ostinato/kernels/gemv.py ostinato/kernels/gemv.py
for tree in /tmp/rows16 .; do
  (cd $tree && timeout 100 python3 -m ostinato.cli bench latency --model random:qwen3-0.6b --json \
    --batch-size 1,8,16,32 --input-len 512 --output-len 64 --iters 3 --max-model-len 2048 \
    2>>$OUT/f2.err | sed "s#^{#{\"tree\": \"$tree\", #" | tee -a $OUT/decode-rows.jsonl)
done
timeout 120 python3 -m ostinato.cli bench latency --model random:qwen3-30b-a3b --json --batch-size 1,32 \
  --input-len 128 --output-len 64 --iters 3 --max-model-len 2048 --cuda-graph-mode full_and_piecewise \
  2>>$OUT/f2.err | tee -a $OUT/moe-latency.jsonl
timeout 100 python3 benchmarks/bench_kernels.py --sections moe --out $OUT/moe.md > $OUT/moe.log 2>&1
grep -A12 "^| GEMM" $OUT/moe.md
grep -iE "error|traceback" $OUT/f2.err | tail -n 5
