"""A loopback HTTP server that records every request an agent CLI sends (method, path, headers, JSON body) and
answers with a fixed short reply in the shape of the route, so the CLI finishes its turn and saves its session.

    python -m bench.captures.logging_server --port 8765 --out /tmp/cap   # one JSON file per request

Routes answered: POST /v1/messages (JSON or SSE, Anthropic's events), POST /v1/messages/count_tokens,
POST /v1/chat/completions (JSON or SSE, OpenAI's chunks), GET /v1/models; anything else 404. Used to capture the
request shapes under bench/captures/<client>/ (see bench/captures/README.md).
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPLY = "Hi."


def _sse_anthropic(model: str) -> bytes:
    events = [
        ("message_start", {"type": "message_start", "message": {
            "id": "msg_capture", "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 10, "output_tokens": 1}}}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": REPLY}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                           "usage": {"output_tokens": 2}}),
        ("message_stop", {"type": "message_stop"}),
    ]
    return "".join(f"event: {n}\ndata: {json.dumps(d)}\n\n" for n, d in events).encode()


def _sse_openai(model: str) -> bytes:
    base = {"id": "chatcmpl-capture", "object": "chat.completion.chunk", "created": 0, "model": model}
    chunks = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": REPLY},
                                    "finish_reason": None}]},
              {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
              {**base, "choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}}]
    return ("".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n").encode()


def make_handler(out: Path):
    lock = threading.Lock()
    counter = [0]

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def _record(self, body):
            with lock:
                counter[0] += 1
                n = counter[0]
            rec = {"method": self.command, "path": self.path, "headers": dict(self.headers.items()), "body": body}
            (out / f"{n:03d}.json").write_text(json.dumps(rec, indent=1, ensure_ascii=False))

        def _send(self, status: int, payload: bytes, ctype: str) -> None:
            self.send_response(status)
            self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self):
            self._record(None)
            if self.path.startswith("/v1/models"):
                self._send(200, json.dumps({"object": "list", "data": [{"id": "local", "object": "model"}]}).encode(),
                           "application/json")
            else:
                self._send(404, b"{}", "application/json")

        def do_HEAD(self):
            self._record(None)
            self._send(200, b"", "text/plain")

        def do_POST(self):
            raw = self.rfile.read(int(self.headers.get("content-length") or 0))
            try:
                body = json.loads(raw)
            except ValueError:
                body = raw.decode("utf-8", "replace")
            self._record(body)
            path = self.path.split("?")[0]
            model = body.get("model", "local") if isinstance(body, dict) else "local"
            stream = isinstance(body, dict) and body.get("stream")
            if path.endswith("/messages/count_tokens"):
                self._send(200, b'{"input_tokens": 10}', "application/json")
            elif path.endswith("/messages"):
                if stream:
                    self._send(200, _sse_anthropic(model), "text/event-stream")
                else:
                    self._send(200, json.dumps({
                        "id": "msg_capture", "type": "message", "role": "assistant", "model": model,
                        "content": [{"type": "text", "text": REPLY}], "stop_reason": "end_turn",
                        "stop_sequence": None, "usage": {"input_tokens": 10, "output_tokens": 2}}).encode(),
                        "application/json")
            elif path.endswith("/chat/completions"):
                if stream:
                    self._send(200, _sse_openai(model), "text/event-stream")
                else:
                    self._send(200, json.dumps({
                        "id": "chatcmpl-capture", "object": "chat.completion", "created": 0, "model": model,
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": REPLY},
                                     "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}}).encode(),
                        "application/json")
            else:
                self._send(404, b"{}", "application/json")

    return Handler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(args.out)).serve_forever()


if __name__ == "__main__":
    main()
