#!/bin/bash
# As run from /tmp/x (pf.c, pf.py there); see README.md.
# alternate: C process (2 reps, 2nd counted) vs a running llama-server (prompt_ms), same token ids
cd /work/main
M=$(ls ~/.cache/orchestrator/models/qwen3.5-0.8b-random-q4_k_m-*.gguf)
N=${N:-1024}; PAIRS=${PAIRS:-8}; BIN=${BIN:-bench/.llama-server/build-shared/bin/llama-server}
$BIN -m $M --host 127.0.0.1 --port 8399 -c $((N+64)) -t 2 -tb 2 -b 512 -ub 512 --no-repack -fa off --cache-ram 0 -np 1 --no-webui > /tmp/x/ls.log 2>&1 &
SP=$!
until curl -sf localhost:8399/health >/dev/null; do sleep 1; done
python3 -c "import json; print(json.dumps({'prompt':[1000+(i*7919)%100000 for i in range($N)],'n_predict':1,'cache_prompt':False,'temperature':0}))" > /tmp/x/req.json
curl -s localhost:8399/completion -d @/tmp/x/req.json > /dev/null
for i in $(seq $PAIRS); do
  if (( RANDOM % 2 )); then order="c srv"; else order="srv c"; fi
  for w in $order; do
    sleep 1
    if [ $w = c ]; then t=$(/tmp/x/pf $M $N 2 2>/dev/null | tail -1)
    else t=$(curl -s localhost:8399/completion -d @/tmp/x/req.json | python3 -c "import json,sys; print(round(json.load(sys.stdin)['timings']['prompt_ms']/1000,3))"); fi
    echo "$i $w $t"
  done
done
kill $SP
