"""A small OpenAI-compatible chat server for the tests and the benchmark of `regenerate`.

Answers ``POST /v1/chat/completions`` greedily with a local tiny target (``--model-dir``,
transformers) or with a fixed text (``--canned``), and lists its one model at
``GET /v1/models``. Knobs to misbehave, set at start or at run time with ``POST /control``
(a JSON object with any of these keys):

    latency_ms   sleep this long in every chat request (outside the model lock)
    fail_503     answer the next N chat requests with HTTP 503
    fail_503_on  answer every chat request whose last message contains this text with 503
    drop         close the connection of the next N chat requests without answering
    status_4xx   answer every chat request with this HTTP status (0: off)
    api_key      require `Authorization: Bearer <api_key>` (401 otherwise; "": no key)
    reasoning    return a `reasoning_content` field and a <think> block in the content (not
                 when the request sets chat_template_kwargs.enable_thinking false)
    tool_call_on when the request has `tools` and its last message is a user turn containing
                 this text, answer with a call of the first tool (arguments {"query": that
                 text}, id call_<request number>) and no text ("": off)
    not_json     answer every chat request with a 200 whose body is not JSON
    trickle      send the headers of a chat answer, then its body one byte a second
    hang         read every chat request and never answer it
    hang_after   answer this many more chat requests, then hang every later one (-1: off)
    oversized    answer every chat request with a 200 JSON body of this many bytes (0: off)

``GET /stats`` returns ``{"requests", "in_flight", "max_in_flight"}``; ``GET /requests`` the
bodies of the last chat requests (at most 64), oldest first; ``POST /reset`` zeroes both. The
chosen port is printed on stdout as ``PORT <n>`` once the server listens.

    python tools/openai_test_server.py --model-dir dflash_recipes/demo_data/target --port 8000
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SERVED_NAME = "tiny-target"


#: The knobs a fresh server starts with (``POST /control`` changes them; tests reset to these).
DEFAULT_KNOBS: dict[str, Any] = {
    "latency_ms": 0,
    "fail_503": 0,
    "fail_503_on": "",
    "drop": 0,
    "status_4xx": 0,
    "api_key": "",
    "reasoning": False,
    "not_json": False,
    "trickle": False,
    "hang": False,
    "hang_after": -1,
    "oversized": 0,
    "tool_call_on": "",
}
#: Chat request bodies kept for ``GET /requests``.
KEPT_REQUESTS = 64


class State:
    """Knobs and counters shared by the request threads."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.lock = threading.Lock()
        self.model_lock = threading.Lock()
        self.knobs: dict[str, Any] = {**DEFAULT_KNOBS, "latency_ms": args.latency_ms}
        self.requests = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[Any] = []
        self.canned: str | None = args.canned
        self.served = args.served_name
        self.model: Any = None
        self.tokenizer: Any = None
        if args.model_dir:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            torch.set_num_threads(1)
            self.tokenizer = AutoTokenizer.from_pretrained(args.model_dir, local_files_only=True)
            self.model = AutoModelForCausalLM.from_pretrained(
                args.model_dir, local_files_only=True, dtype=torch.float32
            )
            self.model.train(False)

    def take(self, knob: str) -> bool:
        """Consume one unit of a counting knob (fail_503, drop)."""
        with self.lock:
            if self.knobs[knob] > 0:
                self.knobs[knob] -= 1
                return True
            return False

    def past_hang_after(self) -> bool:
        """True when `hang_after` is on and spent; otherwise counts this request against it."""
        with self.lock:
            left = int(self.knobs["hang_after"])
            if left > 0:
                self.knobs["hang_after"] = left - 1
            return left == 0

    def generate(
        self, messages: list[dict[str, Any]], max_tokens: int, tools: Any = None
    ) -> tuple[str, int, bool]:
        """(text, tokens, cut at max_tokens)."""
        if self.model is None:
            text = self.canned or "ok"
            return text, len(text.split()), False
        import torch

        tok = self.tokenizer
        prompt = tok.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        room = int(self.model.config.max_position_embeddings) - int(ids.shape[1])
        budget = max(1, min(max_tokens, room))
        with self.model_lock, torch.no_grad():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=budget,
                do_sample=False,
                pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0,
                eos_token_id=tok.eos_token_id,
            )
        new = [int(t) for t in out[0, ids.shape[1] :].tolist()]
        stopped = tok.eos_token_id in new
        if stopped:
            new = new[: new.index(tok.eos_token_id)]
        return tok.decode(new, skip_special_tokens=True), len(new) + int(stopped), not stopped


def make_handler(state: State) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            # Headers and body go out in two writes; without TCP_NODELAY, Nagle's algorithm
            # and the client's delayed ACK add about 40 ms to every answer (servers such as
            # uvicorn, which vLLM and SGLang use, set it too).
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, status: int, payload: object) -> None:
            self._send(status, json.dumps(payload).encode("utf-8"))

        def _body(self) -> Any:
            length = int(self.headers.get("Content-Length", "0"))
            raw = self.rfile.read(length) if length else b""
            return json.loads(raw) if raw else {}

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": state.served}]})
            elif self.path == "/requests":
                with state.lock:
                    bodies = list(state.bodies)
                self._json(200, bodies)
            elif self.path == "/stats":
                with state.lock:
                    stats = {
                        "requests": state.requests,
                        "in_flight": state.in_flight,
                        "max_in_flight": state.max_in_flight,
                    }
                self._json(200, stats)
            else:
                self._json(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:
            body = self._body()
            if self.path == "/control":
                with state.lock:
                    state.knobs.update(body)
                self._json(200, state.knobs)
                return
            if self.path == "/reset":
                with state.lock:
                    state.requests = state.in_flight = state.max_in_flight = 0
                    state.bodies.clear()
                self._json(200, {})
                return
            if self.path != "/v1/chat/completions":
                self._json(404, {"error": {"message": f"no route {self.path}"}})
                return
            with state.lock:
                state.requests += 1
                state.bodies = [*state.bodies[-(KEPT_REQUESTS - 1) :], body]
                state.in_flight += 1
                state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                self._chat(body)
            finally:
                with state.lock:
                    state.in_flight -= 1

        def _chat(self, body: dict[str, Any]) -> None:
            knobs = state.knobs
            if state.take("drop"):
                self.close_connection = True
                self.connection.shutdown(2)  # the client sees the connection drop, no answer
                return
            if knobs["latency_ms"]:
                time.sleep(knobs["latency_ms"] / 1000)
            if knobs["api_key"] and self.headers.get("Authorization") != (
                f"Bearer {knobs['api_key']}"
            ):
                self._json(401, {"error": {"message": "Invalid API key"}})
                return
            if knobs["status_4xx"]:
                self._json(knobs["status_4xx"], {"error": {"message": "injected client error"}})
                return
            if body.get("model") != state.served:
                message = f"The model `{body.get('model')}` does not exist."
                self._json(404, {"error": {"message": message, "type": "NotFoundError"}})
                return
            last = (body["messages"][-1].get("content") or "") if body.get("messages") else ""
            if state.take("fail_503") or (knobs["fail_503_on"] and knobs["fail_503_on"] in last):
                self._json(503, {"error": {"message": "injected overload"}})
                return
            if knobs["not_json"]:
                self._send(200, b"<html>not an API</html>", "text/html")
                return
            if knobs["hang"] or state.past_hang_after():
                time.sleep(3600)  # a daemon thread: the server process still ends when killed
                return
            if knobs["oversized"]:
                padding = "x" * int(knobs["oversized"])
                self._json(200, {"choices": [{"message": {"content": padding}}]})
                return
            if knobs["trickle"]:
                self._trickle()
                return
            messages = body["messages"]
            tools = body.get("tools")
            trigger = knobs["tool_call_on"]
            reply: dict[str, Any]
            if trigger and tools and messages[-1].get("role") == "user" and trigger in last:
                name = tools[0].get("function", tools[0]).get("name", "tool")
                call = {
                    "id": f"call_{state.requests}",
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps({"query": last})},
                }
                reply = {"role": "assistant", "content": None, "tool_calls": [call]}
                tokens, cut = 8, False
            else:
                text, tokens, cut = state.generate(
                    messages, int(body.get("max_tokens", 256)), tools
                )
                reply = {"role": "assistant", "content": text}
            switches = body.get("chat_template_kwargs") or {}
            if knobs["reasoning"] and switches.get("enable_thinking") is not False:
                reply["reasoning_content"] = "the user wants a short answer"
                reply["content"] = "<think>let me think</think>\n\n" + (reply["content"] or "")
            self._json(
                200,
                {
                    "id": f"chatcmpl-{state.requests}",
                    "object": "chat.completion",
                    "model": state.served,
                    "choices": [
                        {
                            "index": 0,
                            "message": reply,
                            "finish_reason": "length" if cut else "stop",
                        }
                    ],
                    "usage": {"completion_tokens": tokens},
                },
            )

        def _trickle(self) -> None:
            body = json.dumps({"choices": [{"message": {"content": "ok" * 200}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.flush()
            for byte in body:
                try:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                except OSError:  # the client gave up
                    return
                time.sleep(1.0)

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # the benchmark opens 32+ connections at once


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--model-dir", help="a local tiny target to answer with (greedy)")
    parser.add_argument("--canned", help="answer every request with this text (no model)")
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--served-name", default=SERVED_NAME)
    args = parser.parse_args(argv)
    state = State(args)
    server = _Server(("127.0.0.1", args.port), make_handler(state))
    print(f"PORT {server.server_address[1]}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
