"""A local server that answers as vLLM does with the ExampleHiddenStatesConnector, for the
target_server tests (the protocol: ../shared/vllm-hidden-states.md).

It loads a tiny target from a local model directory with transformers (on the CPU, in
``--dtype``) and answers:

- ``GET /health``: 200, empty body; ``GET /v1/models``: the served name;
- ``POST /v1/completions`` with ``{"model", "prompt": [token ids], "max_tokens": 1,
  "return_token_ids": true}``: ``choices[0].prompt_token_ids`` and
  ``kv_transfer_params.hidden_states_path``. Before answering it creates ``<file>.lock`` and
  holds an exclusive flock on it; ``write_delay_ms`` after the answer it writes
  ``{storage}/cmpl-{rid}-0-{8 hex}.safetensors`` (``rid``: the ``X-Request-Id`` header, else the
  body's ``request_id``, else random) with ``hidden_states [T, n_layers, H]`` in the served dtype
  and ``token_ids [T]`` int64, then releases the lock. So the file does not exist yet when the
  answer arrives.

The layer ids are vLLM's (``--layer-ids``, ascending, duplicates collapsed): id 0 the
embeddings, id ``k`` the output of decoder layer ``k - 1`` taken by the product's own
:class:`~dflash_recipes.executor.model.target_states.TapRecorder` hooks (the residual stream, so
id ``L`` is the last decoder layer's output before the final norm). Errors are
``{"error": {"message", "type", "param", "code"}}``; an unknown model is a 404.

Faults, set at start (``--knobs JSON``) or at run time with ``POST /control`` (a JSON object of
any of these keys; ``POST /reset`` restores the start's knobs and zeroes the counters):

    delay_ms        sleep this long in every completion request, before the model runs
    write_delay_ms  how long after the answer the file is written (the lock held meanwhile)
    fail_500        answer the next N completion requests with HTTP 500
    stall           read every completion request and never answer it
    die             exit the process at the next completion request, without answering
    fail_write      the next N requests: lock taken and released, no file written
    wrong_token_at  the token at this position is another one, in the answer and the file, and
                    the states are of the changed prompt (-1: off): a template or BOS drift
    layer_ids       capture these vLLM ids instead of ``--layer-ids`` (a server started for
                    other taps; null: off)
    dtype           write the states in this dtype instead of the served one (null: off)
    nan             put a NaN into the states
    api_key         require ``Authorization: Bearer <api_key>`` on /v1 (401 otherwise; "": off)

``GET /stats`` returns ``{"requests", "answered", "in_flight", "max_in_flight", "files_written",
"max_files", "refused"}``: ``max_in_flight`` the most completion requests being handled at
once, ``max_files`` the most ``.safetensors`` files in the storage folder when one was written,
``refused`` the requests answered 401 (not counted in ``requests``).

Bounded: it listens on 127.0.0.1 only and answers only requests from there (403 otherwise), and
it exits when the process that started it ends.

    python tests/testkit/vllm_server.py --model-dir DIR --storage DIR --layer-ids 0,2,4 --port 0

prints ``PORT <n>`` on stdout once it listens. :func:`start_vllm_server` starts one from a test.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dflash_recipes.executor.target_server import TargetServerSettings

SERVED_NAME = "tiny-target"
LOCALHOST = "127.0.0.1"

#: The knobs a fresh server starts with.
DEFAULT_KNOBS: dict[str, Any] = {
    "delay_ms": 0,
    "write_delay_ms": 30,
    "fail_500": 0,
    "stall": False,
    "die": False,
    "fail_write": 0,
    "wrong_token_at": -1,
    "layer_ids": None,
    "dtype": None,
    "nan": False,
    "api_key": "",
}


def _error(message: str, kind: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class State:
    """The model, the knobs and the counters shared by the request threads."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from dflash_recipes.executor.model.convert import torch_dtype

        torch.set_num_threads(1)
        self.lock = threading.Lock()
        self.model_lock = threading.Lock()
        self.start_knobs: dict[str, Any] = {**DEFAULT_KNOBS, **json.loads(args.knobs)}
        self.knobs = dict(self.start_knobs)
        self.served = args.served_name
        self.storage = Path(args.storage)
        self.dtype = torch_dtype(args.dtype)
        self.model = AutoModelForCausalLM.from_pretrained(
            args.model_dir, local_files_only=True, dtype=self.dtype
        )
        self.model.train(False)
        self.num_layers = int(self.model.config.num_hidden_layers)
        self.max_model_len = int(args.max_model_len or self.model.config.max_position_embeddings)
        self.layer_ids = self.check_layer_ids([int(i) for i in args.layer_ids.split(",")])
        self.zero()

    def zero(self) -> None:
        self.requests = self.answered = self.in_flight = self.max_in_flight = 0
        self.files_written = self.max_files = self.refused = 0

    def check_layer_ids(self, ids: list[int]) -> list[int]:
        ids = sorted(set(ids))  # vLLM's file is in ascending id order, duplicates collapsed
        if not ids or ids[0] < 0 or ids[-1] > self.num_layers:
            got = len([i for i in ids if 0 <= i <= self.num_layers])
            msg = f"Expected {len(ids)} auxiliary hidden states, got {got}"
            raise ValueError(msg)
        return ids

    def take(self, knob: str) -> bool:
        """Consume one unit of a counting knob (fail_500, fail_write)."""
        with self.lock:
            if self.knobs[knob] > 0:
                self.knobs[knob] -= 1
                return True
            return False

    def states(self, ids: list[int], layer_ids: list[int]) -> Any:
        """``[T, n_layers, H]``: vLLM id 0 the embeddings, id k decoder layer k - 1's output."""
        import torch

        from dflash_recipes.executor.model.target_states import target_states

        x = torch.tensor([ids])
        taps = [k - 1 for k in layer_ids if k > 0]
        hidden = int(self.model.config.hidden_size)
        with self.model_lock, torch.no_grad():
            parts = []
            if 0 in layer_ids:
                parts.append(self.model.get_input_embeddings()(x))
            if taps:
                tapped = target_states(
                    self.model,
                    x,
                    torch.ones_like(x),
                    taps,
                    with_logits=False,
                    stop_after=max(taps),
                ).tapped
                parts.extend(torch.split(tapped, hidden, dim=-1))
        return torch.stack(parts, dim=2)[0].contiguous()

    def write_later(self, path: Path, fd: int, hidden: Any, ids: list[int], fail: bool) -> None:
        """The connector's later engine step: write the file, then release the lock."""
        import torch
        from safetensors.torch import save_file

        try:
            time.sleep(self.knobs["write_delay_ms"] / 1000)
            if not fail:
                tensors = {"hidden_states": hidden, "token_ids": torch.tensor(ids)}
                save_file(tensors, str(path))
                files = len(list(self.storage.glob("*.safetensors")))
                with self.lock:
                    self.files_written += 1
                    self.max_files = max(self.max_files, files)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def make_handler(state: State) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _json(self, status: int, payload: object) -> None:
            body = json.dumps(payload).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _body(self) -> Any:
            length = int(self.headers.get("Content-Length", "0"))
            raw = self.rfile.read(length) if length else b""
            return json.loads(raw) if raw else {}

        def _local(self) -> bool:
            if self.client_address[0] != LOCALHOST:
                self._json(403, _error("answers 127.0.0.1 only", "ForbiddenError", 403))
                return False
            key = state.knobs["api_key"]
            refused = self.headers.get("Authorization") != f"Bearer {key}"
            if key and self.path.startswith("/v1/") and refused:
                with state.lock:
                    state.refused += 1
                self._json(401, {"error": "Unauthorized"})  # vLLM's own body for it
                return False
            return True

        def do_GET(self) -> None:
            if not self._local():
                return
            if self.path == "/health":
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif self.path == "/v1/models":
                model = {"id": state.served, "object": "model", "owned_by": "vllm"}
                self._json(200, {"object": "list", "data": [model]})
            elif self.path == "/stats":
                with state.lock:
                    stats = {
                        "requests": state.requests,
                        "answered": state.answered,
                        "in_flight": state.in_flight,
                        "max_in_flight": state.max_in_flight,
                        "files_written": state.files_written,
                        "max_files": state.max_files,
                        "refused": state.refused,
                    }
                self._json(200, stats)
            else:
                self._json(404, _error(f"Not Found: {self.path}", "NotFoundError", 404))

        def do_POST(self) -> None:
            if not self._local():
                return
            body = self._body()
            if self.path == "/control":
                with state.lock:
                    state.knobs.update(body)
                self._json(200, state.knobs)
                return
            if self.path == "/reset":
                with state.lock:
                    state.knobs = dict(state.start_knobs)
                    state.zero()
                self._json(200, {})
                return
            if self.path != "/v1/completions":
                self._json(404, _error(f"Not Found: {self.path}", "NotFoundError", 404))
                return
            with state.lock:
                state.requests += 1
                state.in_flight += 1
                state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                self._completion(body)
            finally:
                with state.lock:
                    state.in_flight -= 1

        def _completion(self, body: dict[str, Any]) -> None:
            knobs = state.knobs
            if knobs["die"]:
                os._exit(3)
            if knobs["stall"]:
                time.sleep(3600)  # a daemon thread: the process still ends when killed
                return
            if knobs["delay_ms"]:
                time.sleep(knobs["delay_ms"] / 1000)
            if state.take("fail_500"):
                self._json(500, _error("injected engine failure", "InternalServerError", 500))
                return
            if body.get("model") != state.served:
                message = f"The model `{body.get('model')}` does not exist."
                self._json(404, _error(message, "NotFoundError", 404, "model"))
                return
            prompt = body.get("prompt")
            if not (isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)):
                message = "prompt must be a non-empty list of token ids"
                self._json(400, _error(message, "BadRequestError", 400, "prompt"))
                return
            if len(prompt) + int(body.get("max_tokens", 16)) > state.max_model_len:
                message = (
                    f"This model's maximum context length is {state.max_model_len} tokens. "
                    f"However, you requested {len(prompt)} tokens in the input"
                )
                self._json(400, _error(message, "BadRequestError", 400, "prompt"))
                return
            self._answer(list(prompt), body)

        def _answer(self, prompt: list[int], body: dict[str, Any]) -> None:
            import torch

            from dflash_recipes.executor.model.convert import torch_dtype

            knobs = state.knobs
            position = int(knobs["wrong_token_at"])
            if 0 <= position < len(prompt):  # the server tokenized it otherwise
                vocab = int(state.model.config.vocab_size)
                prompt[position] = (prompt[position] + 1) % vocab
            layer_ids = state.layer_ids
            if knobs["layer_ids"] is not None:
                layer_ids = state.check_layer_ids(list(knobs["layer_ids"]))
            hidden = state.states(prompt, layer_ids)
            if knobs["dtype"]:
                hidden = hidden.to(torch_dtype(knobs["dtype"]))
            if knobs["nan"]:
                hidden[len(prompt) // 2, -1, 0] = torch.nan
            rid = self.headers.get("X-Request-Id") or body.get("request_id") or uuid.uuid4().hex
            path = state.storage / f"cmpl-{rid}-0-{secrets.token_hex(4)}.safetensors"
            lock = path.with_name(path.name + ".lock")
            fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)  # before the answer, as vLLM's connector does
            fail = state.take("fail_write")
            try:
                self._json(
                    200,
                    {
                        "id": f"cmpl-{rid}",
                        "object": "text_completion",
                        "created": int(time.time()),
                        "model": state.served,
                        "choices": [
                            {
                                "index": 0,
                                "text": "",
                                "logprobs": None,
                                "finish_reason": "length",
                                "stop_reason": None,
                                "prompt_token_ids": prompt,
                                "token_ids": [0],
                            }
                        ],
                        "usage": {
                            "prompt_tokens": len(prompt),
                            "completion_tokens": 1,
                            "total_tokens": len(prompt) + 1,
                        },
                        "kv_transfer_params": {"hidden_states_path": str(path)},
                    },
                )
            finally:
                with state.lock:
                    state.answered += 1
                threading.Thread(
                    target=state.write_later, args=(path, fd, hidden, prompt, fail), daemon=True
                ).start()

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256


def _exit_with_parent() -> None:
    """End this process when the one that started it ends (its parent id changes)."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--storage", required=True, help="the connector's shared_storage_path")
    parser.add_argument("--layer-ids", required=True, help="vLLM layer ids, comma-separated")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--served-name", default=SERVED_NAME)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=0)
    parser.add_argument("--knobs", default="{}", help="JSON object of start knobs")
    args = parser.parse_args(argv)
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    state = State(args)
    server = _Server((LOCALHOST, args.port), make_handler(state))
    print(f"PORT {server.server_address[1]}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    return 0


# ---------------------------------------------------------------------------------------------
# the test side


class VllmServer:
    """A started server: its URL, its knobs and counters."""

    def __init__(self, process: subprocess.Popen[str], port: int, errors: IO[str]) -> None:
        self.process = process
        self.errors = errors
        self.port = port
        self.url = f"http://{LOCALHOST}:{port}"
        self.name = f"{LOCALHOST}:{port}"

    def control(self, **knobs: object) -> None:
        import httpx

        httpx.post(f"{self.url}/control", json=knobs, trust_env=False).raise_for_status()

    def reset(self) -> None:
        import httpx

        httpx.post(f"{self.url}/reset", trust_env=False).raise_for_status()

    def stats(self) -> dict[str, int]:
        import httpx

        data = httpx.get(f"{self.url}/stats", trust_env=False).json()
        assert isinstance(data, dict)
        return data

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        self.errors.close()


Launched = tuple[subprocess.Popen[str], IO[str]]


def launch(model_dir: Path, storage: Path, layer_ids: list[int], **options: object) -> Launched:
    """Start a server process (options: dtype, served_name, max_model_len, knobs as a dict) and
    the file its stderr goes to; :func:`wait_for_port` then reads its port."""
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--model-dir",
        str(model_dir),
        "--storage",
        str(storage),
        "--layer-ids",
        ",".join(map(str, layer_ids)),
    ]
    for key, value in options.items():
        shown = json.dumps(value) if isinstance(value, dict) else str(value)
        command += [f"--{key.replace('_', '-')}", shown]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # stderr to a file, not a pipe: nobody reads it while the server runs, and a full pipe
    # would block the server on its next warning
    errors = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by VllmServer.stop)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True, env=env)
    return process, errors


def wait_for_port(launched: Launched) -> VllmServer:
    """The server once it listens; AssertionError with its stderr if it did not start."""
    process, errors = launched
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith("PORT "):
        process.kill()
        process.wait()
        errors.seek(0)
        msg = f"the vLLM test server did not start: {line!r}\n{errors.read()[-3000:]}"
        errors.close()
        raise AssertionError(msg)
    return VllmServer(process, int(line.split()[1]), errors)


@dataclasses.dataclass(frozen=True)
class SavedTarget:
    """A tiny target in memory and the model directory it was saved to."""

    model: Any
    path: Path


@dataclasses.dataclass(frozen=True)
class ServerPair:
    """Two servers of one target writing into one storage folder (one node's /dev/shm)."""

    first: VllmServer
    second: VllmServer
    storage: Path


#: A fixture that makes client settings: ``make(*urls, **overrides)``.
SettingsFactory = Callable[..., "TargetServerSettings"]


def dead_url() -> str:
    """A URL nothing listens on (a port just bound and released): connections are refused."""
    with socket.socket() as sock:
        sock.bind((LOCALHOST, 0))
        port = sock.getsockname()[1]
    return f"http://{LOCALHOST}:{port}"


@contextlib.contextmanager
def start_vllm_server(
    model_dir: Path, storage: Path, layer_ids: list[int], **options: object
) -> Iterator[VllmServer]:
    """One server for the time of the ``with`` block (killed at its end)."""
    server = wait_for_port(launch(model_dir, storage, layer_ids, **options))
    try:
        yield server
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
