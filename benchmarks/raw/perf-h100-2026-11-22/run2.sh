#!/usr/bin/env bash
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
ROOT=$PWD; MINE=$ROOT/.carry/perf
cd $MINE
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee $OUT/env.txt
T="-q -p no:cacheprovider -o addopts= --maxfail=5"
PYTHONPATH=. timeout 110 python3 -m pytest tests/gpu/test_kernels.py $T > $OUT/tests.log 2>&1; echo "kernel tests rc=$?"; tail -n 4 $OUT/tests.log
P="python3 benchmarks/profile_step.py --model random:qwen3-0.6b --steps 48 --json $OUT/profile.jsonl"
PYTHONPATH=. timeout 80 $P --label perf --modes piecewise,full_and_piecewise >> $OUT/profile.log 2>&1; echo "qwen rc=$?"
PYTHONPATH=. timeout 40 $P --label no-gemv --no-gemv --modes full_and_piecewise --sections decode,phases,kernels >> $OUT/profile.log 2>&1; echo "nogemv rc=$?"
PYTHONPATH=. timeout 40 $P --label no-pdl --no-pdl --modes full_and_piecewise --sections decode,phases,kernels >> $OUT/profile.log 2>&1; echo "nopdl rc=$?"
PYTHONPATH=. timeout 60 python3 benchmarks/profile_step.py --model random:llama-3.1-8b --modes full_and_piecewise --sections decode,phases,kernels --steps 32 --label perf --json $OUT/profile.jsonl >> $OUT/profile.log 2>&1; echo "llama rc=$?"
PYTHONPATH=. timeout 120 python3 -m pytest tests/gpu/test_engine_graphs.py tests/gpu/test_breakable.py $T >> $OUT/tests.log 2>&1; echo "engine tests rc=$?"; tail -n 4 $OUT/tests.log
PYTHONPATH=. timeout 80 python3 benchmarks/bench_kernels.py --sections gemv,decode,fused --out $OUT/kernels.md > /dev/null 2>$OUT/kernels.err; echo "bench rc=$?"
PYTHONPATH=. timeout 50 python3 scratch/ab_attention.py $ROOT/ostinato/kernels/paged_attention.py > $OUT/ab.log 2>&1; echo "ab rc=$?"
grep -E "passed|failed|Error" $OUT/tests.log | tail -n 8
grep -v "^{" $OUT/profile.log | grep -v -i "warn" | head -n 90
cat $OUT/kernels.md | tail -n 45
cat $OUT/ab.log
