"""A tool loop's next turn after a short tool result, with `-fa on` (min_segment 64): what it restores and its
time to first token, when the after-generation probe says the next request adds 14 tokens (a Qwen3.5 tool result
around empty content: the answer's repeat point is stored) against 64 (as before: the answer's end only).

    PYTHONPATH=. python bench/results/2026-12-07/answer-repeat-point/short_turn.py PRESET ROUNDS ANSWER_TOKENS

One runtime (flash attention on, speculation off, one slot); per round and variant, interleaved: the cache
cleared, turn 1 (a 1,000-token prompt, greedy answer of ANSWER_TOKENS), its after-generation work drained (timed),
then turn 2: turn 1 + the answer + a 17-token tool-result turn, one token generated (timed: its TTFT).
Turn 2 must equal its cold run (tokens and first-step logits)."""
import json
import pathlib
import sys
import time

import numpy as np

from orchestrator.models.synth import ensure_model
from orchestrator.request import Job
from orchestrator.runtime import Runtime
from orchestrator.sampling import SamplingParams
from tests.conftest import make_config

preset, rounds, answer_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cal = pathlib.Path("/tmp/answer-repeat-point-calibration.json")
rt = Runtime.start(make_config(ensure_model(preset), ctx_size=4096, parallel=1, flash_attn="on",
                               speculative="off", calibration_file=cal))
greedy = SamplingParams(temperature=0.0)
words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
user = " ".join(words[(7 * i) % 10] + str(i % 13) for i in range(330))
first = rt.engine.tokenize("<|im_start|>system\nYou are a coding agent.<|im_end|>\n<|im_start|>user\n" + user
                           + "<|im_end|>\n<|im_start|>assistant\n")
tool = rt.engine.tokenize("\n<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n"
                          "<|im_start|>assistant\n")
rows = []
for rnd in range(rounds):
    for added in (14, 64):
        rt.cache.clear()
        r1 = rt.scheduler.run(Job(first, max_tokens=answer_tokens, sampling=greedy,
                                  restorable_after=lambda g, a=added: a))
        t = time.perf_counter()
        rt.scheduler.drain()
        store_s = time.perf_counter() - t
        eog = [rt.engine.eog_id] if r1.finish_reason == "stop" else rt.engine.tokenize("<|im_end|>")
        second = first + r1.completion_tokens + eog + tool
        t = time.perf_counter()
        warm = rt.scheduler.run(Job(second, max_tokens=1, sampling=greedy, want_logits=True))
        ttft = time.perf_counter() - t
        rt.scheduler.drain()
        cold = rt.scheduler.run(Job(second, max_tokens=1, sampling=greedy, want_logits=True, use_cache=False))
        rt.scheduler.drain()
        same = warm.completion_tokens == cold.completion_tokens and np.array_equal(warm.first_logits,
                                                                                  cold.first_logits)
        row = dict(round=rnd, added=added, prompt=len(second), answer_end=len(first) + len(r1.completion_tokens) + 1,
                   cached=warm.cached_tokens, prefilled=len(second) - warm.cached_tokens, ttft_s=round(ttft, 3),
                   after_generation_s=round(store_s, 3), same_as_cold=same)
        rows.append(row)
        print(json.dumps(row), flush=True)
print("min_segment", rt.engine.min_segment, rt.engine.attention.describe())
for added in (14, 64):
    ts = [r["ttft_s"] for r in rows if r["added"] == added]
    ss = [r["after_generation_s"] for r in rows if r["added"] == added]
    print(f"added {added}: TTFT sum {sum(ts):.3f} s (min {min(ts):.3f}, max {max(ts):.3f}); "
          f"after-generation sum {sum(ss):.3f} s; all same as cold: {all(r['same_as_cold'] for r in rows)}")
rt.close()
