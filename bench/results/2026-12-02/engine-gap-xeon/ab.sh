#!/bin/bash
# As run from /tmp/x (pf.c, pf.py there); see README.md.
# alternate C and Python processes; each does 2 reps, the second counted
cd /work/main
M=$(ls ~/.cache/orchestrator/models/qwen3.5-0.8b-random-q4_k_m-*.gguf)
N=${N:-1024}; PAIRS=${PAIRS:-8}
for i in $(seq $PAIRS); do
  if (( RANDOM % 2 )); then order="c py"; else order="py c"; fi
  for w in $order; do
    if [ $w = c ]; then t=$(/tmp/x/pf $M $N 2 2>/dev/null | tail -1)
    else t=$(LLAMA_CPP_LIB_PATH=$PWD/bench/.llama-server/build-shared/bin PYTHONPATH=$PWD .venv/bin/python /tmp/x/pf.py $N 2 2>/dev/null | tail -1); fi
    echo "$i $w $t"
  done
done
