import ctypes, statistics, sys, time
import numpy as np, llama_cpp, os
from pathlib import Path
from orchestrator.engine import VERIFYING, Attention, Engine
libdir = Path(llama_cpp.__file__).parent / "lib"
L = ctypes.CDLL(str(libdir / "libllama.so")); B = ctypes.CDLL(str(libdir / "libggml-base.so")); C = ctypes.CDLL(str(libdir / "libggml-cpu.so"))
get_sched = L["_ZNK13llama_context9get_schedEv"]; get_sched.restype = ctypes.c_void_p; get_sched.argtypes = [ctypes.c_void_p]
B.ggml_backend_sched_get_n_backends.restype = ctypes.c_int; B.ggml_backend_sched_get_n_backends.argtypes = [ctypes.c_void_p]
B.ggml_backend_sched_get_backend.restype = ctypes.c_void_p; B.ggml_backend_sched_get_backend.argtypes = [ctypes.c_void_p, ctypes.c_int]
B.ggml_backend_name.restype = ctypes.c_char_p; B.ggml_backend_name.argtypes = [ctypes.c_void_p]
C.ggml_backend_is_cpu.restype = ctypes.c_bool; C.ggml_backend_is_cpu.argtypes = [ctypes.c_void_p]
C.ggml_backend_cpu_set_use_ref.argtypes = [ctypes.c_void_p, ctypes.c_bool]
model, layout = sys.argv[1], sys.argv[2]
att = VERIFYING if layout == "verifying" else Attention()
e = Engine(Path(model), n_ctx=2048, n_batch=512, n_threads=2, n_seq_max=1, attention=att)
s = get_sched(e.ctx)
cpus = [B.ggml_backend_sched_get_backend(s, i) for i in range(B.ggml_backend_sched_get_n_backends(s))]
print("backends", [(B.ggml_backend_name(b), C.ggml_backend_is_cpu(b)) for b in cpus])
cpus = [b for b in cpus if C.ggml_backend_is_cpu(b)]
USE = os.environ.get("REF", "1") == "1"
def ref(on):
    for b in cpus: C.ggml_backend_cpu_set_use_ref(b, on and USE)
TOP = 17
for n in (40, 170, 300, 1000):
    prompt = [1000 + (41 * i + 7 * n) % 5000 for i in range(n)]
    nxt = [1500 + (59 * i + n) % 5000 for i in range(TOP)]
    e.clear(0); ref(False); e.decode(0, prompt, 0); start = e.save_state(0)
    ref(True); r = []
    for i, t in enumerate(nxt):
        e.decode(0, [t], n + i); r.append(e.logits())
    ex = []
    for w in range(2, TOP + 1):
        e.load_state(0, start); e.verify(0, nxt[:w], n)
        d = max(float(np.abs(e.logits(i) - r[i]).max()) for i in range(w))
        ex.append(w if d == 0 else f"{w}:{d:.1e}")
    print("ctx", n, ex, flush=True)
# costs
PROMPT = [1000 + (41 * i) % 5000 for i in range(1024)]
e.clear(0); ref(False); e.decode(0, PROMPT, 0); snap = e.save_state(0)
def t(fn, reps=8):
    ts = []
    for _ in range(reps):
        e.load_state(0, snap); a = time.perf_counter(); fn(); ts.append(time.perf_counter() - a)
    return 1000 * statistics.median(ts[2:])
import collections
acc = collections.defaultdict(list)
for rnd in range(3):
    for on in (False, True):
        ref(on)
        acc[(on, 1)].append(t(lambda: e.decode(0, [1234], 1024)))
        for w in (2, 4, 7, 8, 12, 16):
            acc[(on, w)].append(t(lambda: e.verify(0, [1300 + j for j in range(w)], 1024), 6))
for on in (False, True):
    d = sum(acc[(on, 1)])
    print("ref" if on else "default", "decode %.1f ms" % (d / 3), [round(x, 1) for x in acc[(on, 1)]], " ".join("v%d %.2f" % (w, sum(acc[(on, w)]) / d) for w in (2, 4, 7, 8, 12, 16)), flush=True)
