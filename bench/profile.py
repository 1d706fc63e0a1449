"""Where a request's time goes: py-spy profiles of a cold 2,000-token request and of a warm agent turn (issue 12,
item 1).

    python bench/profile.py                    # synthetic qwen3.5-0.8b, 2 threads; needs py-spy (pip install py-spy)
    python bench/profile.py --model my.gguf --rate 200

Starts `python -m orchestrator serve` as the side-by-side bench does (bench/systems.py), then, each under
`py-spy record --native --threads` (needs ptrace: root, or kernel.yama.ptrace_scope 0):

    cold   one user message of about --tokens tokens, nothing cached, 1 token out
    turn   a conversation of a system message and 6 messages is sent once (not profiled); then the next turn,
           an assistant answer and a ~450-token tool result added, as W2 does, 1 token out (profiled)

Writes, per profile, the raw collapsed stacks (`profile-<name>.txt`, for flamegraph.pl or speedscope) and a summary
(`profile-<name>.md`): samples per thread, and the frames that hold the most samples of the server's worker
thread (inclusive), next to the server's own per-phase breakdown from its log line. Output goes to
bench/results/<date>/. Not a test.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import signal
import subprocess
import sys
import time
import uuid
from datetime import date
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.ab_cold import _text, prompts  # noqa: E402
from bench.run import default_model  # noqa: E402
from bench.systems import SYSTEMS, launch  # noqa: E402


def summarize(raw: Path, log_line: str, top: int = 30) -> str:
    """Markdown: samples per thread, and the `top` frames of the worker thread by inclusive samples."""
    threads: collections.Counter[str] = collections.Counter()
    worker: collections.Counter[str] = collections.Counter()
    worker_total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        threads[frames[0]] += int(n)
        if "orchestrator-worker" in frames[0]:
            worker_total += int(n)
            for f in set(frames[1:]):
                worker[f] += int(n)
    out = [f"server log: `{log_line.strip()}`", "", "| thread | samples |", "|---|---|"]
    out += [f"| {t} | {n} |" for t, n in threads.most_common()]
    out += ["", f"worker thread, inclusive (of {worker_total} samples):", "", "| samples | share | frame |", "|---|---|---|"]
    out += [f"| {n} | {n / max(worker_total, 1):.0%} | `{f[:120]}` |" for f, n in worker.most_common(top)]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    ap.add_argument("--port", type=int, default=18800)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        ap.error("py-spy not found: pip install py-spy")
    out_dir = a.out or ROOT / "bench" / "results" / str(date.today())
    out_dir.mkdir(parents=True, exist_ok=True)
    model = a.model or default_model()
    server = launch(SYSTEMS["orchestrator"], model, a.port, a.threads, 8192, ROOT / "bench" / "results" / "logs")
    url = server.url + "/v1/chat/completions"
    nonce = uuid.uuid4().hex[:12]
    conversation = [{"role": "system", "content": f"{nonce} You are a careful assistant."}] + [
        {"role": "user" if i % 2 == 0 else "assistant", "content": _text(i + 40, 40)} for i in range(6)]
    turn = conversation + [{"role": "assistant", "content": _text(90, 20)},
                           {"role": "user", "content": "Tool result: " + _text(91, 60)}]
    cases = [("cold", prompts(nonce, a.tokens)["single"]["messages"], None),
             ("turn", turn, conversation)]
    try:
        with httpx.Client(timeout=600) as client:
            for name, messages, before in cases:
                if before is not None:
                    client.post(url, json={"messages": before, "max_tokens": 1, "temperature": 0})
                server.wait_idle()
                raw = out_dir / f"profile-{name}.txt"
                spy_proc = subprocess.Popen([spy, "record", "-p", str(server.popen.pid), "-r", str(a.rate),
                                             "--native", "--threads", "-f", "raw", "-o", str(raw)],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1.0)  # py-spy attaches
                client.post(url, json={"messages": messages, "max_tokens": 1, "temperature": 0})
                server.wait_idle()
                spy_proc.send_signal(signal.SIGINT)
                spy_proc.wait(30)
                line = [ln for ln in server.log.read_text().splitlines() if "total_ms=" in ln][-1]
                (out_dir / f"profile-{name}.md").write_text(summarize(raw, line))
                print(f"{name}: {line.split('INFO ')[-1]}\n  wrote {raw} and {raw.with_suffix('.md')}")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
