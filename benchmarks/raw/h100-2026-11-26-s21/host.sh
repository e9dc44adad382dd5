#!/bin/bash
# early call: mode none decode host time, main vs host21, interleaved; host profile of both
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
for rep in 1 2 3; do
  for tree in main21 host21; do
    (cd .gpu/$tree && PYTHONPATH=.:/tmp/site timeout 120 python3 -m ostinato.cli bench latency \
      --model random:qwen3-0.6b --json --batch-size 1 --input-len 128 --output-len 64 --iters 3 \
      --max-model-len 2048 --cuda-graph-mode none 2>>$OUT/err.txt | sed "s|^{|{\"tree\": \"$tree\", |") | tee -a $OUT/none.jsonl
  done
done
for tree in main21 host21; do
  (cd .gpu/$tree && PYTHONPATH=.:/tmp/site timeout 150 python3 benchmarks/profile_step.py \
    --model random:qwen3-0.6b --modes none --batch-sizes 1 --sections host --label $tree \
    --json $OUT/host.jsonl > $OUT/host-$tree.log 2>&1)
  tail -n 45 $OUT/host-$tree.log
done
grep -iE "error|traceback" $OUT/err.txt | tail -5
