# As run from /tmp/x: PYTHONPATH=<repo> python threadpool.py 2048 5 (see README.md).
import ctypes, random, statistics, sys, time
import llama_cpp
from bench.common import load_engine, filler_tokens
from bench.engine_gap import engine_prefill

class TPP(ctypes.Structure):
    _fields_ = [("cpumask", ctypes.c_bool * 512), ("n_threads", ctypes.c_int), ("prio", ctypes.c_int),
                ("poll", ctypes.c_uint32), ("strict_cpu", ctypes.c_bool), ("paused", ctypes.c_bool)]
import pathlib
base = pathlib.Path(llama_cpp.__file__).parent / "lib"
cpu = ctypes.CDLL(str(base / "libggml-cpu.so"))
ggml = ctypes.CDLL(str(base / "libggml-base.so"))
ggml.ggml_threadpool_params_default.restype = TPP
ggml.ggml_threadpool_params_default.argtypes = [ctypes.c_int]
cpu.ggml_threadpool_new.restype = ctypes.c_void_p
cpu.ggml_threadpool_new.argtypes = [ctypes.POINTER(TPP)]
lib = llama_cpp.llama_cpp._lib
lib.llama_attach_threadpool.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
lib.llama_detach_threadpool.argtypes = [ctypes.c_void_p]
n = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
path, engine = load_engine(None, 2, n + 64, 512, calibrate="off")
p = ggml.ggml_threadpool_params_default(2)
tp = cpu.ggml_threadpool_new(ctypes.byref(p))
toks = filler_tokens(engine, n)
res = {"none": [], "pool": []}
rng = random.Random(0)
for r in range(reps + 1):
    order = ["none", "pool"]; rng.shuffle(order)
    for who in order:
        if who == "pool":
            lib.llama_attach_threadpool(engine.ctx, tp, None)
        else:
            lib.llama_detach_threadpool(engine.ctx)
        time.sleep(1)
        s = engine_prefill(engine, toks)
        if r: res[who].append(s)
        print(who, round(s, 3), flush=True)
for k, v in res.items():
    print(k, "median", round(statistics.median(v), 3), "sum", round(sum(v), 3))
print("pool/none per round", [round(a / b, 3) for a, b in zip(res["pool"], res["none"])])
