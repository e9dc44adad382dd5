#!/usr/bin/env bash
# mid-session call A: the merged helper branches (int) — GPU tests of the changed parts, then
# the kernel sweeps that set gemv.ROW_LIMITS and the MoE launch
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
cd .gpu/int
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
timeout 260 python3 -m pytest tests/gpu/test_structured_gpu.py tests/gpu/test_moe.py \
  tests/gpu/test_kernels.py tests/gpu/test_fp8.py -q -p no:cacheprovider -o addopts="" -rs \
  --maxfail=10 2>&1 | tee $OUT/tests.log | tail -n 25
timeout 280 python3 benchmarks/bench_kernels.py --sections gemv-rows,moe,moe-sweep \
  --out $OUT/kernels.md > $OUT/kernels.log 2>&1; tail -n 5 $OUT/kernels.log
