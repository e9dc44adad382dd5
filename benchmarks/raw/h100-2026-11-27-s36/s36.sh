#!/bin/bash
# session 36 calls: bash .gpu/s36.sh STAGE   (trees under .gpu/: m0 = main cfd6597 + the GPU tests of README checks 3 (second half) and 4)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, 'gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version()); import os; print(os.cpu_count(), 'cpus')" | tee -a $OUT/env.txt
nvidia-smi topo -m >>$OUT/env.txt 2>&1
ptests() {  # TREE GPUS TAG K S: test_parallel.py's tests picked by K on the GPUs listed, at most S seconds
  (cd .gpu/$1 && CUDA_VISIBLE_DEVICES=$2 timeout $5 python3 -m pytest tests/gpu/test_parallel.py -k "$4" -q \
    -p no:cacheprovider -o addopts="" -rs --durations=0 >$OUT/p-$3.log 2>&1; echo "rc=$?" >>$OUT/p-$3.log)
}
left() { ps -ef | grep -c "[m]ultiprocessing" | sed "s/^/processes left $1: /" | tee -a $OUT/env.txt; }
case $1 in
a)  # m0 on four GPUs, two pytest runs at once on two pairs: every two-GPU test of test_parallel.py (the four-GPU one skips)
  ptests m0 0,1 pair01 "two_stages_equal or two_tensor_ranks_equal or lazy" 560 &
  ptests m0 2,3 pair23 "killed or stopped or lost or shutdown or loads_later or (async and not xP)" 560 &
  wait; tail -n 4 $OUT/p-pair01.log $OUT/p-pair23.log; left a
  ;;
b)  # m0 on four GPUs: T=2 x P=2 (equality, the checker on; async scheduling in two modes)
  ptests m0 0,1,2,3 quad "times_two or xP" 400
  tail -n 8 $OUT/p-quad.log; left b
  ;;
esac
