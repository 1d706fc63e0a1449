"""Bounded soak: mixed traffic against a `python -m orchestrator serve` subprocess on loopback.

Several client threads send, until --duration seconds have passed:
  * agent conversations that grow turn by turn (shared system prompt and tools), some streamed, some
    abandoned mid-stream (the client disconnects);
  * edits of an earlier message, tenants with their own cache_salt, plain /v1/completions;
  * bad requests (malformed JSON, unknown fields, n=2, an oversized body, a wrong API key), which must be 4xx.

Every few seconds it samples the server's RSS (psutil) and the cache's RAM and disk bytes (/v1/cache/stats).
Writes under --out (default bench/results/<UTC date>/soak/): samples.csv, summary.json and soak.png (RSS and cache
bytes over time; needs the `bench` extra: matplotlib).

An error is any response other than the expected one (200 for good requests, the expected 4xx for bad ones),
any 5xx, and any exception other than the disconnects the soak causes itself.

    python -m bench soak --duration 600
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
KEY = "soak-key"
WORDS = ("cache state token prefix layer model server request snapshot budget disk memory restore branch radix "
         "boundary template message system tool schema agent result function value 数据 🙂 {\"ok\": 1}").split()
TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n} over the repository", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
    for n in ("search_code", "read_file", "run_tests")]


@dataclass
class Counters:
    """Shared by the client threads (guarded by `lock`)."""

    requests: int = 0
    errors: int = 0
    bad_requests_refused: int = 0
    disconnects: int = 0
    cached_tokens: int = 0
    prompt_tokens: int = 0
    error_samples: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **kw) -> None:
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def error(self, what: str) -> None:
        with self.lock:
            self.errors += 1
            if len(self.error_samples) < 20:
                self.error_samples.append(what[:300])


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Client:
    """One client thread's traffic mix."""

    def __init__(self, url: str, seed: int, counters: Counters, system: str, max_tokens: int) -> None:
        self.rng = random.Random(seed)
        self.http = httpx.Client(base_url=url, timeout=300, headers={"Authorization": f"Bearer {KEY}"})
        self.c = counters
        self.system = system
        self.max_tokens = max_tokens
        self.conv: list[dict] = []
        self.salt = f"tenant-{seed % 3}"

    def _post(self, path: str, body, expect: int = 200, **kw) -> dict | None:
        self.c.add(requests=1)
        try:
            if isinstance(body, bytes):
                r = self.http.post(path, content=body, headers={"content-type": "application/json"}, **kw)
            else:
                r = self.http.post(path, json=body, **kw)
        except httpx.HTTPError as e:
            self.c.error(f"{path}: {type(e).__name__}: {e}")
            return None
        if r.status_code != expect:
            self.c.error(f"{path}: expected {expect}, got {r.status_code}: {r.text[:200]}")
            return None
        if expect != 200:
            self.c.add(bad_requests_refused=1)
            return None
        out = r.json()
        usage = out.get("usage") or {}
        self.c.add(prompt_tokens=usage.get("prompt_tokens", 0),
                   cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        return out

    def _chat_body(self, messages: list[dict], **kw) -> dict:
        return {"model": "soak", "messages": messages, "tools": TOOLS, "max_tokens": self.max_tokens,
                "temperature": 0, **kw}

    def agent_turn(self) -> None:
        if not self.conv or len(self.conv) > 24:
            self.conv = [{"role": "system", "content": self.system}]
        self.conv.append({"role": "user", "content": words(self.rng, self.rng.randint(5, 80))})
        out = self._post("/v1/chat/completions", self._chat_body(self.conv))
        if out is None:
            self.conv = []
            return
        msg = out["choices"][0]["message"]
        self.conv.append({"role": "assistant", "content": msg.get("content") or words(self.rng, 5)})

    def streamed(self, abandon: bool) -> None:
        self.c.add(requests=1)
        body = self._chat_body([{"role": "system", "content": self.system},
                                {"role": "user", "content": words(self.rng, 30)}], stream=True,
                               stream_options={"include_usage": True}, max_tokens=max(self.max_tokens, 16))
        try:
            with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    self.c.error(f"stream: {r.status_code}")
                    return
                for i, line in enumerate(r.iter_lines()):
                    if abandon and i == 2:
                        self.c.add(disconnects=1)
                        return  # closing the response drops the connection mid-stream
                    if line == "data: [DONE]":
                        return
            self.c.error("stream ended without [DONE]")
        except httpx.HTTPError as e:
            self.c.error(f"stream: {type(e).__name__}: {e}")

    def edit(self) -> None:
        if len(self.conv) < 4:
            return self.agent_turn()
        edited = [dict(m) for m in self.conv]
        i = self.rng.randrange(1, len(edited) - 1)
        edited[i]["content"] = "edited: " + words(self.rng, 10)
        if edited[-1]["role"] != "user":
            edited.append({"role": "user", "content": words(self.rng, 10)})
        self._post("/v1/chat/completions", self._chat_body(edited))

    def tenant(self) -> None:
        body = self._chat_body([{"role": "system", "content": self.system},
                                {"role": "user", "content": words(self.rng, 20)}], cache_salt=self.salt)
        self._post("/v1/chat/completions", body)

    def completion(self) -> None:
        self._post("/v1/completions", {"prompt": words(self.rng, self.rng.randint(10, 200)),
                                       "max_tokens": self.max_tokens, "temperature": 0.7, "seed": 1})

    def bad(self) -> None:
        kind = self.rng.randrange(5)
        good = self._chat_body([{"role": "user", "content": "hi"}])
        if kind == 0:
            self._post("/v1/chat/completions", b'{"messages": [', expect=400)
        elif kind == 1:
            self._post("/v1/chat/completions", {**good, "frobnicate": True}, expect=400)
        elif kind == 2:
            self._post("/v1/chat/completions", {**good, "n": 2}, expect=400)
        elif kind == 3:
            self._post("/v1/chat/completions", b'{"prompt": "' + b"x" * (2 << 20) + b'"}', expect=413)
        else:
            self._post("/v1/chat/completions", good, expect=401, headers={"Authorization": "Bearer wrong"})

    def step(self) -> None:
        r = self.rng.random()
        if r < 0.45:
            self.agent_turn()
        elif r < 0.55:
            self.streamed(abandon=self.rng.random() < 0.5)
        elif r < 0.65:
            self.edit()
        elif r < 0.75:
            self.tenant()
        elif r < 0.9:
            self.completion()
        else:
            self.bad()


def sample(http: httpx.Client, proc: psutil.Process, t0: float, c: Counters) -> dict:
    s = http.get("/v1/cache/stats").json()
    with c.lock:
        return {"t_s": round(time.time() - t0, 1), "rss_mib": round(proc.memory_info().rss / 2**20, 1),
                "ram_bytes": s["ram_bytes"], "disk_bytes": s["disk_bytes"], "ram_entries": s["ram_entries"],
                "disk_entries": s["disk_entries"], "evictions": s["evictions"], "requests": c.requests,
                "errors": c.errors}


def plot(rows: list[dict], ram_budget: int, path: Path, marks: dict[str, float | None], probe: list[dict]) -> None:
    """RSS, cache bytes and (with --probe) the server's live Python objects over time; `marks`: label -> seconds,
    drawn as vertical lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["t_s"] / 60 for r in rows]
    fig, axes = plt.subplots(3 if probe else 2, 1, figsize=(9, 8 if probe else 6), sharex=True)
    a, b = axes[0], axes[1]
    a.plot(t, [r["rss_mib"] for r in rows], color="tab:red")
    a.set_ylabel("server RSS (MiB)")
    a.grid(alpha=0.3)
    for (label, at), color in zip(marks.items(), ("tab:green", "tab:purple")):
        if at is not None:
            for ax in axes:
                ax.axvline(at / 60, color=color, ls=":", lw=1, label=label if ax is a else None)
    a.legend(loc="lower right")
    if probe:
        c = axes[2]
        c.plot([r["t_s"] / 60 for r in probe], [r["gc_objects"] for r in probe], color="tab:brown")
        c.set_ylabel("Python objects (gc)")
        c.grid(alpha=0.3)
    b.plot(t, [r["ram_bytes"] / 2**20 for r in rows], label="cache RAM")
    b.plot(t, [r["disk_bytes"] / 2**20 for r in rows], label="cache disk")
    b.axhline(ram_budget / 2**20, color="grey", ls="--", lw=1, label="RAM budget")
    b.set_ylabel("MiB")
    axes[-1].set_xlabel("minutes")
    b.legend()
    b.grid(alpha=0.3)
    fig.suptitle("orchestrator soak: RSS and snapshot cache bytes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def slope_with_error(rows: list[dict], key: str = "rss_mib") -> tuple[float, float]:
    """(least-squares slope of `key` per minute, its standard error); (0, 0) for fewer than 3 samples."""
    if len(rows) < 3:
        return 0.0, 0.0
    xs = [r["t_s"] / 60 for r in rows]
    ys = [r[key] for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    if not den:
        return 0.0, 0.0
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den
    resid = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys))
    return slope, (resid / (len(xs) - 2) / den) ** 0.5


def window_medians(rows: list[dict], start_s: float, width_s: float) -> list[list[float]]:
    """[minute the window starts, median RSS in MiB] for consecutive windows of `width_s` from `start_s`."""
    out = []
    while True:
        w = sorted(r["rss_mib"] for r in rows if start_s <= r["t_s"] < start_s + width_s)
        if not w:
            return out
        out.append([round(start_s / 60, 1), w[len(w) // 2]])
        start_s += width_s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=600, help="seconds of traffic (default 600)")
    p.add_argument("--model", type=Path, help="GGUF (default: the synthetic tiny preset, built once)")
    p.add_argument("--clients", type=int, default=3, help="concurrent client threads (default 3)")
    p.add_argument("--cache-ram", type=int, default=96, metavar="MiB", help="server RAM budget (default 96)")
    p.add_argument("--cache-disk", type=int, default=256, metavar="MiB", help="server disk budget (default 256)")
    p.add_argument("--max-tokens", type=int, default=8, help="completion tokens per request (default 8)")
    p.add_argument("--threads", type=int, default=2, help="server threads (default 2)")
    p.add_argument("--interval", type=float, default=5, help="seconds between samples (default 5)")
    p.add_argument("--out", type=Path, help="results directory (default bench/results/<UTC date>/soak)")
    p.add_argument("--mmap-threshold", type=int, metavar="BYTES",
                   help="set glibc's MALLOC_MMAP_THRESHOLD_ for the server (fixed threshold: freed snapshots go back "
                        "to the OS; default: glibc's dynamic threshold)")
    p.add_argument("--warmup", type=float, default=300, metavar="S",
                   help="seconds after both cache tiers are full that count as warm-up: KV pages first touched, "
                        "bounded memos filling, allocator arenas settling (default 300)")
    p.add_argument("--flat-slope", type=float, default=0.2, metavar="MiB/min",
                   help="RSS counts as flat after warm-up when its slope is at most this (default 0.2 MiB/min, "
                        "12 MiB an hour)")
    p.add_argument("--probe", action="store_true",
                   help="run the server under bench/memprobe.py: writes memprobe.jsonl (RSS split into heap, mmap, "
                        "file-backed and Python objects, and the allocation sites that grew)")
    a = p.parse_args(argv)
    if a.model is None:
        from orchestrator.models.synth import ensure_model
        a.model = ensure_model("tiny")
    out = a.out or ROOT / "bench" / "results" / datetime.now(timezone.utc).strftime("%Y-%m-%d") / "soak"
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        log = open(out / "server.log", "w")
        launcher = [str(ROOT / "bench" / "memprobe.py"), str(out / "memprobe.jsonl")] if a.probe else ["-m", "orchestrator"]
        if a.probe:
            (out / "memprobe.jsonl").unlink(missing_ok=True)
        cmd = [sys.executable, *launcher, "serve", "--model", str(a.model), "--port", str(port),
               "--ctx-size", "8192", "--threads", str(a.threads), "--cache-ram", str(a.cache_ram),
               "--cache-disk", str(a.cache_disk), "--cache-disk-dir", str(Path(tmp) / "snapshots"),
               "--max-body-size", "1", "--log-level", "warning"]
        env = {**os.environ, "ORCHESTRATOR_API_KEY": KEY, "PYTHONUNBUFFERED": "1"}
        if a.mmap_threshold is not None:
            env["MALLOC_MMAP_THRESHOLD_"] = str(a.mmap_threshold)
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        try:
            proc = psutil.Process(server.pid)
            http = httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {KEY}"})
            deadline = time.time() + 300
            while True:
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if server.poll() is not None or time.time() > deadline:
                    raise SystemExit(f"server did not start; see {out / 'server.log'}")
                time.sleep(0.5)
            counters = Counters()
            system = ("You are Orchard, an autonomous engineer. Work in small steps and check your work. "
                      + words(random.Random(0), 400))
            stop = threading.Event()
            t0 = time.time()

            def run(seed: int) -> None:
                client = Client(url, seed, counters, system, a.max_tokens)
                while not stop.is_set():
                    try:
                        client.step()
                    except Exception as e:  # noqa: BLE001 - counted, the soak goes on
                        counters.error(f"client: {type(e).__name__}: {e}")

            threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(a.clients)]
            for th in threads:
                th.start()
            rows = []
            while time.time() - t0 < a.duration:
                time.sleep(a.interval)
                rows.append(sample(http, proc, t0, counters))
                r = rows[-1]
                print(f"{r['t_s']:7.0f}s rss {r['rss_mib']:7.1f} MiB  ram {r['ram_bytes'] / 2**20:6.1f} MiB  "
                      f"disk {r['disk_bytes'] / 2**20:6.1f} MiB  requests {r['requests']}  errors {r['errors']}",
                      flush=True)
            stop.set()
            for th in threads:
                th.join(timeout=300)
            rows.append(sample(http, proc, t0, counters))
            alive = server.poll() is None and http.get("/health").status_code == 200
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
    budget = a.cache_ram * 2**20
    # Full: both tiers at 90% of their budgets (a tier with no budget counts as full).
    full_at = next((r["t_s"] for r in rows if r["ram_bytes"] >= 0.9 * budget
                    and r["disk_bytes"] >= 0.9 * a.cache_disk * 2**20), None)
    after_full = [r for r in rows if full_at is not None and r["t_s"] >= full_at]
    warm_at = full_at + a.warmup if full_at is not None else None
    after_warmup = [r for r in after_full if r["t_s"] >= warm_at]
    slope, slope_err = slope_with_error(after_warmup)
    probe = []
    if a.probe and (out / "memprobe.jsonl").exists():
        probe = [json.loads(line) for line in (out / "memprobe.jsonl").read_text().splitlines() if line.strip()]
    probe_warm = [r for r in probe if warm_at is not None and r["t_s"] >= warm_at]
    summary = {
        "duration_s": a.duration, "clients": a.clients, "model": str(a.model), "cache_ram_mib": a.cache_ram,
        "cache_disk_mib": a.cache_disk, "max_tokens": a.max_tokens, "malloc_mmap_threshold": a.mmap_threshold,
        "requests": counters.requests, "errors": counters.errors, "error_samples": counters.error_samples,
        "bad_requests_refused": counters.bad_requests_refused, "disconnects": counters.disconnects,
        "prompt_tokens": counters.prompt_tokens, "cached_tokens": counters.cached_tokens,
        "server_alive_at_end": alive,
        "cache_full_at_s": full_at, "warmup_s": a.warmup,
        "rss_mib_start": rows[0]["rss_mib"], "rss_mib_when_cache_full": after_full[0]["rss_mib"] if after_full else None,
        "rss_mib_after_warmup": after_warmup[0]["rss_mib"] if after_warmup else None,
        "rss_mib_end": rows[-1]["rss_mib"], "rss_mib_max": max(r["rss_mib"] for r in rows),
        "rss_mib_max_after_warmup": max((r["rss_mib"] for r in after_warmup), default=None),
        "rss_median_mib_per_5_min_after_full": window_medians(after_full, full_at, 300) if after_full else [],
        "rss_slope_mib_per_min_after_full": round(slope_with_error(after_full)[0], 3) if after_full else None,
        "rss_slope_mib_per_min_after_warmup": round(slope, 3) if after_warmup else None,
        "rss_slope_stderr_after_warmup": round(slope_err, 3) if after_warmup else None,
        "rss_flat_after_warmup": (slope <= a.flat_slope) if len(after_warmup) >= 3 else None,
        "flat_slope_mib_per_min": a.flat_slope,
        "py_objects_after_warmup": probe_warm[0]["gc_objects"] if probe_warm else None,
        "py_objects_end": probe[-1]["gc_objects"] if probe else None,
        "cache_ram_bytes_max": max(r["ram_bytes"] for r in rows), "cache_disk_bytes_max": max(r["disk_bytes"] for r in rows),
        "command": " ".join([sys.executable, "-m", "bench", "soak", *(argv if argv is not None else sys.argv[1:])]),
    }
    with open(out / "samples.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    try:
        plot(rows, budget, out / "soak.png", {"both tiers full": full_at, "warm-up over": warm_at}, probe)
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
    print(json.dumps({k: v for k, v in summary.items() if k != "error_samples"}, indent=2))
    return 0 if counters.errors == 0 and alive else 1


if __name__ == "__main__":
    sys.exit(main())
