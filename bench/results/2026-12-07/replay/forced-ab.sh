#!/bin/bash
# A/B of rollback replays: before (HEAD~1 worktree) vs after (main), alternating rounds
M=$(ls /root/.cache/orchestrator/models/qwen3.5-0.8b-*.gguf)
for r in 1 2 3; do
  for side in before after; do
    dir=/work/main; [ $side = before ] && dir=/tmp/before
    echo "== round $r $side"
    (cd $dir && PYTHONPATH=$dir timeout 900 /work/main/.venv/bin/python -m bench speculative --model $M --template chatml \
       --forced 10,25 --only tool --reps 1 --max-tokens 200 --out /tmp/prof/ab-$side-$r 2>&1 | grep "tokens/s")
  done
done
