python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1; export PYTHONPATH=.:/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader
for rows in 16 32; do
  timeout 150 python3 benchmarks/profile_step.py --model random:llama-3.1-8b --quantization fp8 --modes full_and_piecewise --batch-sizes 32 --sections decode --fp8-dot-rows $rows --label dot$rows --json $OUT/fp8.jsonl > /dev/null 2>>$OUT/err.txt
  timeout 150 python3 benchmarks/profile_step.py --model random:llama-3.1-8b --quantization fp8 --modes full_and_piecewise --batch-sizes 32 --sections step-kernels --no-pdl --fp8-dot-rows $rows --label dot$rows-nopdl --json $OUT/fp8.jsonl > /dev/null 2>>$OUT/err.txt
done
timeout 200 python3 benchmarks/profile_step.py --model random:qwen3-30b-a3b --modes full_and_piecewise --batch-sizes 1 --sections decode,step-kernels --no-pdl --label moe-nopdl --json $OUT/moe.jsonl > /dev/null 2>>$OUT/err.txt
python3 - <<'PY'
import json, os
for f in ("fp8.jsonl", "moe.jsonl"):
    p = os.path.join(os.environ["OUT"], f)
    if not os.path.exists(p): continue
    for line in open(p):
        r = json.loads(line)
        if r["section"] == "decode":
            print(r["label"], "decode", round(r["tpot_ms"], 3), round(r["ratio"], 3))
        else:
            print(r["label"], "step", round(r["device_ms_per_step"], 3), r["kernels_per_step"])
            for n, (c, us) in sorted(r["by_name"].items(), key=lambda kv: -kv[1][1])[:14]:
                print("   ", n, c, us)
PY
grep -iE "error|Traceback" $OUT/err.txt | tail -5
