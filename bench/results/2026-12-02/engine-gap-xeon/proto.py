# As run: python3 proto.py MODEL.gguf 1024 8 8399, beside llama-server -c 1088 on port 8399 with the bench flags (see README.md).
# engine-gap's protocol with a long-lived C process (pfl.c) in place of the engine: alternate it with llama-server,
# random order, 1 s idle before each run, one warm-up round; same synthetic ids
import json, random, statistics, subprocess, sys, time, urllib.request
model, n, rounds, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
c = subprocess.Popen(["/tmp/x/pfl", model, str(n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
assert c.stdout.readline().strip() == "ready"
body = json.dumps({"prompt": [1000 + (i * 7919) % 100000 for i in range(n)], "n_predict": 1, "cache_prompt": False, "temperature": 0}).encode()
def srv():
    r = urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/completion", body, {"content-type": "application/json"}), timeout=600)
    return json.load(r)["timings"]["prompt_ms"] / 1000
def cee():
    c.stdin.write("go\n"); c.stdin.flush(); return float(c.stdout.readline())
rng = random.Random(2); ratios = []
for r in range(rounds + 1):
    out = {}
    for who in rng.sample(["c", "srv"], 2):
        time.sleep(1); out[who] = cee() if who == "c" else srv()
    if r:
        ratios.append(out["c"] / out["srv"]); print(r, f"c {out['c']:.3f} srv {out['srv']:.3f} c/srv {ratios[-1]:.3f}", flush=True)
print("median c/srv", round(statistics.median(ratios), 3))
