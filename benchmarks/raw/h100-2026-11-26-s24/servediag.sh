#!/bin/bash
# serve at rate inf, diagnosed: one server, rate inf three times (and 8 once) against it; the
# server-side TTFT histogram after each (TREE: the tree, n0 by default)
q=random:qwen3-0.6b
cd .gpu/${TREE:-n0}
python3 -m ostinato.cli serve --model $q --max-model-len 2048 --port 8123 > /tmp/server.log 2>&1 &
SERVER=$!
python3 - <<'PY'
import time, urllib.request
for _ in range(240):
    try:
        urllib.request.urlopen("http://127.0.0.1:8123/health", timeout=1); break
    except Exception:
        time.sleep(0.5)
PY
metrics() { python3 -c "import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:8123/metrics').read().decode())" | grep -E "time_to_first_token_seconds_(sum|count)|steps|step_" | sed "s/^/$1 /" >> $OUT/metrics.txt; }
b=(--model $q --base-url http://127.0.0.1:8123 --num-prompts 80 --input-len 512 --output-len 128 --len-spread 0.5 --logprobs 0 --json)
python3 -m ostinato.cli bench serve "${b[@]}" --request-rate inf 2>>$OUT/err.txt | tee -a $OUT/serve.jsonl | cut -c1-900; metrics inf1
CORE=$(pgrep -P $SERVER -f spawn_main | head -1)
echo "server $SERVER core $CORE"; ps -ef | grep -v grep | grep -E "python3" | cut -c1-200 >> $OUT/metrics.txt
sleep 1
python3 -m ostinato.cli bench serve "${b[@]}" --request-rate inf 2>>$OUT/err.txt | tee -a $OUT/serve.jsonl | cut -c1-900; metrics inf2
sleep 4
python3 -m ostinato.cli bench serve "${b[@]}" --request-rate 8 2>>$OUT/err.txt | tee -a $OUT/serve.jsonl | cut -c1-900; metrics r8
python3 -m ostinato.cli bench serve "${b[@]}" --request-rate inf 2>>$OUT/err.txt | tee -a $OUT/serve.jsonl | cut -c1-900; metrics inf3
kill $SERVER; sleep 3; kill -9 $SERVER 2>/dev/null
grep -v 'POST /v1\|GET /' /tmp/server.log >> $OUT/metrics.txt
ls -la $OUT
