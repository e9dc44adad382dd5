#!/usr/bin/env bash
# run on the device from the lead's checkout root; my tree is in .carry/perf
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
ROOT=$PWD; MINE=$ROOT/.carry/perf
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee $OUT/env.txt
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a $OUT/env.txt
Q="--model random:qwen3-0.6b --steps 48"
L="--model random:llama-3.1-8b --modes full_and_piecewise --sections decode,phases,kernels --steps 32"
cd $ROOT && PYTHONPATH=. timeout 120 python3 $MINE/benchmarks/profile_step.py $Q --label main --json $OUT/profile.jsonl > $OUT/profile-main-qwen.log 2>&1; echo "main qwen rc=$?"
cd $MINE && PYTHONPATH=. timeout 100 python3 -m pytest tests/gpu/test_kernels.py -x -q -p no:cacheprovider -o addopts="" 2>&1 | tail -n 25 | tee $OUT/tests-kernels.log
cd $MINE && PYTHONPATH=. timeout 120 python3 benchmarks/profile_step.py $Q --label perf --json $OUT/profile.jsonl > $OUT/profile-perf-qwen.log 2>&1; echo "perf qwen rc=$?"
cd $ROOT && PYTHONPATH=. timeout 60 python3 $MINE/benchmarks/profile_step.py $L --label main --json $OUT/profile.jsonl > $OUT/profile-main-llama.log 2>&1; echo "main llama rc=$?"
cd $MINE && PYTHONPATH=. timeout 60 python3 benchmarks/profile_step.py $L --label perf --json $OUT/profile.jsonl > $OUT/profile-perf-llama.log 2>&1; echo "perf llama rc=$?"
cd $MINE && timeout 100 python3 scratch/proto.py pdl gemv > $OUT/proto.log 2>&1; echo "proto rc=$?"
cd $MINE && PYTHONPATH=. timeout 110 python3 -m pytest tests/gpu/test_engine_graphs.py -x -q -p no:cacheprovider -o addopts="" -k "every_mode or oracle_bfloat16" 2>&1 | tail -n 25 | tee $OUT/tests-engine.log
tail -n 3 $OUT/profile-*.log
grep -v "^{" $OUT/profile-*-qwen.log | head -80
grep -v "^{" $OUT/profile-*-llama.log | head -60
cat $OUT/proto.log | tail -45
