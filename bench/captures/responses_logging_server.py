"""A logging stand-in for POST /v1/responses, to capture what a client really sends.

    python bench/captures/responses_logging_server.py PORT OUT_DIR [TOOL_NAME]

Writes each request (method, path, headers, body as parsed JSON) to OUT_DIR/NNN.json and answers with a minimal
Responses API answer (an SSE stream when the request asks for one): a function_call of TOOL_NAME when the last
input item is a user message and TOOL_NAME is given, else the message "hi". So a client runs one tool round and
ends its turn. Captured with it (stdlib only, on loopback):

* bench/captures/codex/: Codex CLI 0.171.0, `codex exec "List the files"` then `codex exec "Say hi again"` in
  one scratch git repository, CODEX_HOME holding bench/captures/codex/config.toml, TOOL_NAME exec_command
  (001-002: the first run, 003-004: the second).
* bench/captures/openai-agents/: openai-agents 0.24.0, bench/captures/openai_agents_session.py URL (its default
  Responses model, one function tool, two turns), TOOL_NAME get_weather.
"""
import json, sys, os, itertools, http.server, time
OUT = sys.argv[2]; TOOLS = sys.argv[3] if len(sys.argv) > 3 else None; os.makedirs(OUT, exist_ok=True)
counter = itertools.count(1)
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def _log(self, body):
        n = next(counter)
        rec = {"method": self.command, "path": self.path, "headers": dict(self.headers), "body": body}
        with open(os.path.join(OUT, f"{n:03d}.json"), "w") as f:
            json.dump(rec, f, indent=1, ensure_ascii=False)
    def do_GET(self):
        self._log(None)
        data = json.dumps({"object": "list", "data": [{"id": "qwen", "object": "model"}], "models": []}).encode()
        self.send_response(200); self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data))); self.end_headers(); self.wfile.write(data)
    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("content-length", 0)))
        try: body = json.loads(raw)
        except Exception: body = raw.decode("utf-8", "replace")
        self._log(body)
        last = body["input"][-1] if isinstance(body, dict) and isinstance(body.get("input"), list) and body["input"] else {}
        rid = "resp_1"; msg = {"type": "message", "id": f"msg_{len(os.listdir(OUT))}", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": "hi", "annotations": []}]}
        resp = {"id": rid, "object": "response", "created_at": int(time.time()), "status": "completed", "model": "qwen",
                "output": [msg], "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
                "usage": {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 1,
                          "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 11}}
        if TOOLS and last.get("type", "message") == "message" and last.get("role") == "user":
            msg = {"type": "function_call", "id": f"fc_{len(os.listdir(OUT))}", "call_id": f"call_{len(os.listdir(OUT))}", "name": TOOLS,
                   "arguments": json.dumps({"cmd": "ls"} if TOOLS == "exec_command" else {"city": "Paris"}), "status": "completed"}
            resp["output"] = [msg]
        if isinstance(body, dict) and body.get("stream"):
            evs = [("response.created", {"response": dict(resp, status="in_progress", output=[], usage=None)}),
                   ("response.output_item.added", {"output_index": 0, "item": dict(msg, status="in_progress", content=[])}),
                   ("response.output_item.done", {"output_index": 0, "item": msg}),
                   ("response.completed", {"response": resp})]
            data = b"".join(f"event: {e}\ndata: {json.dumps(dict(type=e, sequence_number=i, **d))}\n\n".encode() for i, (e, d) in enumerate(evs))
            ctype = "text/event-stream"
        else:
            data = json.dumps(resp).encode(); ctype = "application/json"
        self.send_response(200); self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(data))); self.end_headers(); self.wfile.write(data)
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
