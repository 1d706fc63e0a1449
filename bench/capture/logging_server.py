"""A loopback HTTP server that records every request an agent CLI sends (method, path, headers, JSON body) and
answers with a fixed short reply in the shape of the route, so the CLI finishes its turn and saves its session.

    python -m bench.capture.logging_server --port 8765 --out /tmp/cap   # one JSON file per request
    python -m bench.capture.logging_server --port 8765 --out /tmp/cap --tool exec_command

Routes answered: POST /v1/messages (JSON or SSE, Anthropic's events), POST /v1/messages/count_tokens,
POST /v1/chat/completions (JSON or SSE, OpenAI's chunks), POST /v1/responses (JSON or SSE, the Responses events),
GET /v1/models; anything else 404. With --tool NAME, /v1/responses answers a request whose last input item is a user
message with a function_call of NAME (arguments `{"cmd": "ls"}` for exec_command, else `{"city": "Paris"}`), so a
client runs one tool round and ends its turn. Used to capture the request shapes under
tests/fixtures/captures/<client>/ (see tests/fixtures/captures/README.md).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
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


def _responses(body: dict, n: int, tool: str | None) -> tuple[bytes, str]:
    item = {"type": "message", "id": f"msg_{n}", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": REPLY, "annotations": []}]}
    last = body["input"][-1] if isinstance(body.get("input"), list) and body["input"] else {}
    if tool and last.get("type", "message") == "message" and last.get("role") == "user":
        args = {"cmd": "ls"} if tool == "exec_command" else {"city": "Paris"}
        item = {"type": "function_call", "id": f"fc_{n}", "call_id": f"call_{n}", "name": tool,
                "arguments": json.dumps(args), "status": "completed"}
    resp = {"id": "resp_capture", "object": "response", "created_at": int(time.time()), "status": "completed",
            "model": body.get("model", "local"), "output": [item], "parallel_tool_calls": True,
            "tool_choice": "auto", "tools": [],
            "usage": {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 1,
                      "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 11}}
    if not body.get("stream"):
        return json.dumps(resp).encode(), "application/json"
    events = [("response.created", {"response": dict(resp, status="in_progress", output=[], usage=None)}),
              ("response.output_item.added", {"output_index": 0, "item": dict(item, status="in_progress", content=[])}),
              ("response.output_item.done", {"output_index": 0, "item": item}),
              ("response.completed", {"response": resp})]
    return "".join(f"event: {e}\ndata: {json.dumps(dict(type=e, sequence_number=i, **d))}\n\n"
                   for i, (e, d) in enumerate(events)).encode(), "text/event-stream"


def make_handler(out: Path, tool: str | None = None):
    lock = threading.Lock()
    counter = [0]

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def _record(self, body) -> int:
            with lock:
                counter[0] += 1
                n = counter[0]
            rec = {"method": self.command, "path": self.path, "headers": dict(self.headers.items()), "body": body}
            (out / f"{n:03d}.json").write_text(json.dumps(rec, indent=1, ensure_ascii=False))
            return n

        def _send(self, status: int, payload: bytes, ctype: str) -> None:
            self.send_response(status)
            self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self):
            self._record(None)
            if self.path.startswith("/v1/models"):
                self._send(200, json.dumps({"object": "list", "data": [{"id": "local", "object": "model"}],
                                            "models": []}).encode(), "application/json")
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
            n = self._record(body)
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
            elif path.endswith("/responses") and isinstance(body, dict):
                self._send(200, *_responses(body, n, tool))
            else:
                self._send(404, b"{}", "application/json")

    return Handler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tool", help="/v1/responses: answer a user turn with a function_call of this tool")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(args.out, args.tool)).serve_forever()


if __name__ == "__main__":
    main()
