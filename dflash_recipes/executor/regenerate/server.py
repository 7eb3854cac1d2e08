"""The server backend of `regenerate`: any OpenAI-compatible ``/v1/chat/completions``.

vLLM (``vllm serve``) and SGLang (``python -m sglang.launch_server``) serve this API. One
httpx.AsyncClient keeps ``max_concurrency`` requests in flight (that many workers, each
answering one conversation turn by turn). A request that fails with 429, a 5xx, a timeout or
a connection error is retried ``max_retries`` times with exponential backoff (jittered; a
numeric ``Retry-After`` is honoured); then its conversation is recorded as failed and the run
goes on. Another 4xx fails the conversation at once.

Each request carries the conversation so far in the OpenAI format (tool calls with their
arguments as JSON text, tool results with their call ids), the row's ``tools``, and
``chat_template_kwargs.enable_thinking`` when the job sets a thinking switch (vLLM and SGLang
pass it to the chat template). The answer's ``tool_calls`` are kept as returned; a call whose
arguments are not a JSON object is a bad response.

``request_timeout_s`` is a deadline for the whole request (connect, send, the first byte and
the whole body), not for each read: a server that trickles its answer a byte at a time is cut
off there like one that never answers, and retried. The body is bounded by what a chat
completion of ``max_new_tokens`` tokens can be (:func:`max_body_bytes`); a larger one is
refused (the conversation fails, or the run stops on the first request) without reading on.

The first request is a probe: if the server is unreachable, answers it with a 4xx (wrong model
name, bad key), or answers with something that is not a chat completion, the run stops with one
clear error naming the URL and the fix, before any more work is sent. The API key is read from
the environment variable named by ``regenerate.api_key_env``; it is never in a recipe or plan.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from collections.abc import Callable, Sequence

import httpx

from dflash_recipes.data.conversations import ToolCall, openai_messages
from dflash_recipes.errors import RegenerateError
from dflash_recipes.executor.regenerate.types import (
    Answer,
    Job,
    Outcome,
    TurnFailed,
    apply_reasoning,
    calls_match,
    finished_outcome,
    kept_reasoning,
)
from dflash_recipes.plan.regenerate_settings import chat_completions_url, models_url
from dflash_recipes.plan.run_plan import RegeneratePlan

#: Longest wait between two attempts of one request.
_MAX_BACKOFF_S = 60.0
#: How much of an error body a message quotes.
_BODY_SHOWN = 300
#: Room for the JSON around the answer (ids, usage, logprobs a server adds unasked).
_BODY_OVERHEAD = 64 * 1024
#: The most bytes one generated token can take in the JSON body: a token is at most a few
#: characters, each at most a 6-byte ``\uXXXX`` escape, and a reasoning parser may return the
#: thinking twice (``reasoning_content`` and the content).
_BYTES_PER_TOKEN = 256
_START_HINT = (
    "start the server first (e.g. `vllm serve MODEL --port 8000` or `python -m "
    "sglang.launch_server --model-path MODEL --port 30000`), or fix regenerate.base_url"
)


class _BadResponse(Exception):
    """A 200 answer that is not a chat completion."""


class _TooLarge(Exception):
    """A body longer than a chat completion of max_new_tokens tokens can be."""


def max_body_bytes(max_new_tokens: int) -> int:
    """The largest response body accepted for a completion of `max_new_tokens` tokens."""
    return _BODY_OVERHEAD + _BYTES_PER_TOKEN * max_new_tokens


async def _bounded(
    client: httpx.AsyncClient, method: str, url: str, limit: int, **kwargs: object
) -> httpx.Response:
    """One request read to its end, at most `limit` body bytes (_TooLarge beyond that)."""
    async with client.stream(method, url, **kwargs) as streamed:  # type: ignore[arg-type]
        declared = streamed.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            msg = f"it declares a body of {declared} bytes"
            raise _TooLarge(msg)
        chunks: list[bytes] = []
        size = 0
        async for chunk in streamed.aiter_bytes():
            size += len(chunk)
            if size > limit:
                msg = f"its body passed {limit} bytes"
                raise _TooLarge(msg)
            chunks.append(chunk)
    headers = [
        (k, v)
        for k, v in streamed.headers.multi_items()
        if k.lower() not in ("content-encoding", "content-length", "transfer-encoding")
    ]
    return httpx.Response(
        streamed.status_code, headers=headers, content=b"".join(chunks), request=streamed.request
    )


def _excerpt(response: httpx.Response) -> str:
    text = response.text.strip().replace("\n", " ")
    return text[:_BODY_SHOWN] + ("..." if len(text) > _BODY_SHOWN else "") or "(empty body)"


def parse_completion(payload: object, policy: str) -> Answer:
    """The Answer in a chat-completion JSON; _BadResponse says what is missing."""
    if not isinstance(payload, dict):
        msg = f"the JSON is a {type(payload).__name__}, not an object"
        raise _BadResponse(msg)
    choices = payload.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        msg = "the JSON has no 'choices' list"
        raise _BadResponse(msg)
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, dict):
        msg = "choices[0] has no 'message' object"
        raise _BadResponse(msg)
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        msg = f"choices[0].message.content is a {type(content).__name__}, not text"
        raise _BadResponse(msg)
    # vLLM's reasoning parsers return `reasoning_content` (newer versions: `reasoning`).
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    usage = payload.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    thinking = reasoning if isinstance(reasoning, str) else None
    return Answer(
        content=apply_reasoning(content or "", thinking, policy),
        tokens=tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else 0,
        truncated=choice.get("finish_reason") == "length",
        tool_calls=_tool_calls(message.get("tool_calls")),
        reasoning=kept_reasoning(thinking, policy),
    )


def _tool_calls(raw: object) -> tuple[ToolCall, ...]:
    """The tool calls of an answer's message; _BadResponse names what is malformed."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        msg = f"choices[0].message.tool_calls is a {type(raw).__name__}, not a list"
        raise _BadResponse(msg)
    calls = []
    for index, item in enumerate(raw):
        where = f"choices[0].message.tool_calls[{index}]"
        function = item.get("function") if isinstance(item, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(function, dict) or not isinstance(name, str) or not name:
            msg = f"{where} has no function name"
            raise _BadResponse(msg)
        arguments = function.get("arguments", "{}")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            msg = f"{where}.function.arguments is not a JSON object: {str(arguments)[:80]}"
            raise _BadResponse(msg)
        call_id = item.get("id")
        calls.append(
            ToolCall(
                name,
                json.dumps(parsed, ensure_ascii=False),
                call_id if isinstance(call_id, str) else None,
            )
        )
    return tuple(calls)


class ServerClient:
    """Chat requests to one server with the plan's settings, retries and the probe rule."""

    def __init__(
        self, client: httpx.AsyncClient, settings: RegeneratePlan, *, backoff_base_s: float
    ) -> None:
        assert settings.base_url is not None
        self.client = client
        self.settings = settings
        self.url = chat_completions_url(settings.base_url)
        self.model = settings.model or ""
        self.backoff_base_s = backoff_base_s

    async def first_model(self) -> str:
        """The first model the server lists (regenerate.model unset); RegenerateError."""
        url = models_url(self.settings.base_url or "")
        deadline = self.settings.request_timeout_s
        try:
            response = await asyncio.wait_for(
                _bounded(self.client, "GET", url, _BODY_OVERHEAD * 16), deadline
            )
        except (httpx.HTTPError, TimeoutError, _TooLarge) as exc:
            why = (
                f"no complete answer within request_timeout_s={deadline:g}"
                if isinstance(exc, TimeoutError)
                else repr(exc)
            )
            msg = f"cannot reach the generation server at {url} ({why}); {_START_HINT}"
            raise RegenerateError(msg) from exc
        try:
            model: object = response.json()["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError):
            model = None
        if response.is_error or not isinstance(model, str):
            msg = (
                f"{url} did not list a model (HTTP {response.status_code}: "
                f"{_excerpt(response)}); set regenerate.model to the served model name"
            )
            raise RegenerateError(msg)
        return model

    def _delay(self, attempt: int, response: httpx.Response | None) -> float:
        if response is not None:
            try:
                stated = float(response.headers.get("retry-after", ""))
            except ValueError:
                stated = -1.0
            if 0 <= stated <= _MAX_BACKOFF_S:
                return stated
        base = min(_MAX_BACKOFF_S, self.backoff_base_s * 2.0**attempt)
        return base * (0.5 + random.random())

    async def answer(
        self,
        messages: list[dict[str, object]],
        *,
        strict: bool,
        tools: str | None = None,
        thinking: bool | None = None,
    ) -> Answer:
        """One assistant turn; TurnFailed after the retries (RegenerateError when `strict`).
        `tools`: the row's schemas (JSON text); `thinking`: the switch sent, None for none."""
        s = self.settings
        body: dict[str, object] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": s.max_new_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
        }
        if tools is not None:
            body["tools"] = json.loads(tools)
        if thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": thinking}
        attempt = 0
        limit = max_body_bytes(s.max_new_tokens)
        while True:
            response: httpx.Response | None = None
            try:
                response = await asyncio.wait_for(
                    _bounded(self.client, "POST", self.url, limit, json=body),
                    s.request_timeout_s,
                )
            except _TooLarge as exc:
                why = (
                    f"{self.url} answered with more than a chat completion of "
                    f"max_new_tokens={s.max_new_tokens} tokens can be ({exc}; at most {limit} "
                    "bytes are read)"
                )
                if strict:
                    msg = (
                        f"{why}; point regenerate.base_url at an OpenAI-compatible API such as "
                        "http://localhost:8000/v1"
                    )
                    raise RegenerateError(msg) from None
                raise TurnFailed(f"refused: {why}") from None
            except httpx.ConnectError as exc:
                if strict:
                    msg = f"cannot reach the generation server at {self.url} ({exc}); {_START_HINT}"
                    raise RegenerateError(msg) from exc
                problem = f"connection error: {exc}"
            except (httpx.TimeoutException, TimeoutError):
                problem = (
                    f"timeout: {self.url} gave no complete answer within "
                    f"request_timeout_s={s.request_timeout_s:g} (a deadline for the whole request)"
                )
            except httpx.TransportError as exc:
                problem = f"connection error: {type(exc).__name__}: {exc}"
            else:
                code = response.status_code
                if code == 429 or code >= 500:
                    problem = f"HTTP {code}: {_excerpt(response)}"
                elif code >= 400:
                    if strict:
                        raise RegenerateError(self._client_error(response))
                    raise TurnFailed(f"HTTP {code}: {_excerpt(response)}")
                else:
                    try:
                        return parse_completion(response.json(), s.reasoning)
                    except (ValueError, _BadResponse) as exc:
                        why = (
                            str(exc)
                            if isinstance(exc, _BadResponse)
                            else "the body is not JSON: " + _excerpt(response)
                        )
                        if strict:
                            msg = (
                                f"{self.url} answered HTTP {code} but not with a chat "
                                f"completion ({why}); point regenerate.base_url at an "
                                "OpenAI-compatible API such as http://localhost:8000/v1"
                            )
                            raise RegenerateError(msg) from None
                        problem = f"bad response: {why}"
            if attempt >= s.max_retries:
                tries = f"{attempt + 1} attempt{'s' if attempt else ''}"
                if strict:
                    msg = (
                        f"the first request to {self.url} failed ({tries}): {problem}; check "
                        "the server's log, or raise regenerate.max_retries if it is still "
                        "starting"
                    )
                    raise RegenerateError(msg)
                raise TurnFailed(f"{problem} (after {tries})")
            await asyncio.sleep(self._delay(attempt, response))
            attempt += 1

    def _client_error(self, response: httpx.Response) -> str:
        code = response.status_code
        said = f"{self.url} refused the first request with HTTP {code}: {_excerpt(response)}"
        if code in (401, 403):
            key = self.settings.api_key_env
            fix = (
                f"check the key in ${key}"
                if key
                else "set regenerate.api_key_env to the NAME of the variable holding the key "
                "and export it"
            )
            return f"{said}; the server wants an API key: {fix}"
        if code == 404:
            return (
                f"{said}; check regenerate.model {self.model!r} (the name the server serves: "
                "the model given to `vllm serve`, or --served-model-name) and that "
                "regenerate.base_url ends with /v1"
            )
        return (
            f"{said}; fix the request settings the server rejects (regenerate.model, "
            "max_new_tokens, temperature, top_p)"
        )

    async def conversation(self, job: Job, *, strict: bool) -> Outcome:
        """Answer every assistant turn of `job` in order, feeding earlier answers back (and
        the tool results, with the ids of the target's calls they answer)."""
        answers: list[Answer] = []
        for position, message in enumerate(job.messages):
            if message.role != "assistant":
                continue
            # the turns before this one: the target's earlier answers, the row's other turns
            history = openai_messages(finished_outcome(job, answers).messages)
            try:
                answer = await self.answer(
                    history,
                    strict=strict and not answers,
                    tools=job.tools,
                    thinking=job.thinking,
                )
            except TurnFailed as exc:
                return Outcome(job=job, failure=str(exc))
            answers.append(answer)
            if not calls_match(answer, job.messages, position):
                break  # the row's tool results answer other calls: the conversation ends here
        return finished_outcome(job, answers)


def api_key(settings: RegeneratePlan) -> str | None:
    """The API key from the environment variable the recipe names; RegenerateError if unset."""
    name = settings.api_key_env
    if name is None:
        return None
    value = os.environ.get(name)
    if not value:
        msg = (
            f"regenerate.api_key_env names the environment variable {name}, which is not set; "
            f"export {name}=<key> before `dflash-recipe regenerate`, or set "
            "regenerate.api_key_env: null for a server without a key"
        )
        raise RegenerateError(msg)
    return value


async def _regenerate(
    settings: RegeneratePlan,
    todo: Sequence[Job],
    done: Callable[[Outcome], None],
    key: str | None,
    backoff_base_s: float,
) -> str:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    n = settings.max_concurrency
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    timeout = httpx.Timeout(settings.request_timeout_s)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
        server = ServerClient(client, settings, backoff_base_s=backoff_base_s)
        if not server.model:
            server.model = await server.first_model()
        jobs = iter(todo)
        first = next(jobs, None)
        if first is None:
            return server.model
        done(await server.conversation(first, strict=True))

        async def worker() -> None:
            for job in jobs:  # one shared iterator: each job goes to exactly one worker
                done(await server.conversation(job, strict=False))

        await asyncio.gather(*(worker() for _ in range(min(n, len(todo) - 1))))
        return server.model


def regenerate_with_server(
    settings: RegeneratePlan,
    todo: Sequence[Job],
    done: Callable[[Outcome], None],
    *,
    backoff_base_s: float = 0.5,
) -> str:
    """Answer `todo` through the server; `done` gets every finished conversation at once.

    Returns the model name used. Raises RegenerateError when the first request shows the
    server cannot be used (module docstring).
    """
    key = api_key(settings)
    return asyncio.run(_regenerate(settings, todo, done, key, backoff_base_s))


__all__ = [
    "ServerClient",
    "api_key",
    "max_body_bytes",
    "parse_completion",
    "regenerate_with_server",
]
