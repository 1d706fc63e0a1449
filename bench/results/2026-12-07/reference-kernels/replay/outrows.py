import statistics, sys, time
import llama_cpp
from pathlib import Path
from orchestrator.engine import VERIFYING, Attention, Engine
model = sys.argv[1]
PROMPT = [1000 + (41 * i) % 5000 for i in range(1024)]
att = VERIFYING if (len(sys.argv) < 3 or sys.argv[2] == "verifying") else Attention()
e = Engine(Path(model), n_ctx=2048, n_batch=512, n_threads=2, n_seq_max=1, attention=att)
e.clear(0); e.decode(0, PROMPT, 0)
snap = e.save_state(0)
base = len(PROMPT)
def run(w, all_logits):
    ts = []
    for r in range(8):
        e.load_state(0, snap)
        b = e._batch
        for i in range(w):
            b.token[i] = 1300 + i; b.pos[i] = base + i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0
            b.logits[i] = 1 if (all_logits or i == w - 1) else 0
        b.n_tokens = w
        t = time.perf_counter(); rc = llama_cpp.llama_decode(e.ctx, b); ts.append(time.perf_counter() - t)
        assert rc == 0
    return 1000 * statistics.median(ts[2:])
for w in range(1, 9):
    print(w, "all %.1f ms" % run(w, True), "last %.1f ms" % run(w, False), flush=True)
