"""Two chat turns (a 1,480-token system prompt, then a follow-up) against a server on port 8131; prints usage and
wall seconds per turn. python turns_4b.py"""
import json, time, urllib.request
def chat(msgs):
    body = json.dumps({"model": "m", "messages": msgs, "max_tokens": 8, "temperature": 0}).encode()
    t = time.time()
    r = json.load(urllib.request.urlopen(urllib.request.Request("http://localhost:8131/v1/chat/completions", body, {"Content-Type": "application/json"})))
    return r, time.time() - t
sys_ = "You are a coding agent. " + " ".join(f"Rule {i}: keep files tidy and tests green." for i in range(120))
msgs = [{"role": "system", "content": sys_}, {"role": "user", "content": "List the files in src/ and explain."}]
r1, t1 = chat(msgs)
print("turn1", r1["usage"], round(t1, 1))
msgs += [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]}, {"role": "user", "content": "Now open src/main.py please."}]
r2, t2 = chat(msgs)
print("turn2", r2["usage"], round(t2, 1))
