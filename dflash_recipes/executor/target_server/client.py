"""The client that gets a batch's tap states from vLLM servers: requests in flight over every
server, retries and failover, each answer checked and its file read under vLLM's lock.

**One conversation** is one ``POST /v1/completions`` (``max_tokens: 1``, ``return_token_ids``),
with an ``X-Request-Id`` of the client's own so that the file of an abandoned request can be
found by name (``cmpl-{id}-*``) and deleted. The answer's ``prompt_token_ids`` must be the ids
sent; its ``kv_transfer_params.hidden_states_path`` names the file, which is read from
``storage_dir`` by that name (the server may see the folder under another path) once vLLM's
lock is free (:mod:`.states_file`).

**In flight.** At most ``max_in_flight`` conversations are between request and deleted file at
once, over all servers and all batches (an asyncio semaphore). Each request goes to the least
loaded server, ties in turn; one that fails (5xx, 429, refused or dropped connection, no answer
within ``timeout_s``, no file under the lock) is retried on the same server ``retries`` times,
waiting ``backoff_s`` and then twice as long each time; then the server is marked down and the
conversation goes to the next server. A server marked down gets new work only when no other is
up (one try, which brings it back up if it answers). When every server has failed a
conversation, :class:`~dflash_recipes.errors.TargetServerUnavailable` names each as
``host:port`` with what it did. An answer that differs from what was asked
(:class:`~dflash_recipes.errors.ServedStatesError`) or a request the server refuses (another
4xx) is not retried: the batch stops at once, its other requests are cancelled.

**Prefetching.** The requests run on an event loop in a background thread of the client, so
a batch can be asked for before it is needed and collected later::

    with TargetServerClient(settings) as client:
        ahead = client.prefetch(batches[0])
        for step, batch in enumerate(batches):
            states = ahead.result()            # waits only if the server is slower than a step
            if step + 1 < len(batches):
                ahead = client.prefetch(batches[step + 1])   # in flight during this step
            train(batch, states)

or ``for states in client.stream(batches, ahead=1)``, which keeps ``ahead`` batches requested
beyond the one being trained on. A handle holds its batch's tensors until ``result()``: how far
ahead a caller asks is the memory it spends (``max_in_flight`` bounds only what is in flight).

**No file left behind.** A file is deleted as soon as it is read (or kept, verified, with
``keep_dir``), and on every failure. A request whose batch failed or was cancelled is not cut
off: it runs to its answer in the background (``timeout_s`` at most), and what the server then
writes is swept by the request's id, after every batch and at
:meth:`~TargetServerClient.close`, which waits for those requests and for files vLLM is still
writing (their lock held), up to ``timeout_s + lock_timeout_s`` after the request was given up.
Only a request cut off at ``timeout_s`` (a stalled server) whose server writes a file after
the client has closed can leave one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import time
import uuid
from collections import deque
from collections.abc import Coroutine, Iterable, Iterator, Sequence
from pathlib import Path, PurePosixPath
from threading import Thread
from typing import Any, TypeVar

import httpx

from dflash_recipes.errors import TargetServerError, TargetServerUnavailable
from dflash_recipes.executor.target_server.settings import (
    TargetServerSettings,
    base_url,
    server_name,
)
from dflash_recipes.executor.target_server.states_file import (
    ExpectedStates,
    ServedStates,
    StatesFileFailure,
    sweep_request_files,
    take_states_file,
    token_mismatch,
)

_T = TypeVar("_T")

#: HTTP statuses that say "try again" (overloaded, timed out, a server-side error).
_RETRY_STATUSES = frozenset({408, 429})
#: How much of an error body a message quotes.
_BODY_SHOWN = 300
#: How a server that gives hidden states is started.
_SERVE = (
    "the command `dflash-recipe serve-target` prints for this plan (vLLM with the "
    "extract_hidden_states speculative config and the ExampleHiddenStatesConnector)"
)


class _AttemptFailed(Exception):
    """One attempt on one server failed in a way worth retrying; the text says how."""


class _Server:
    """One URL's state (read and written on the client's loop only)."""

    def __init__(self, url: str, index: int) -> None:
        self.index = index
        self.root = base_url(url)
        self.name = server_name(url)
        self.in_flight = 0
        self.down = False


def _excerpt(response: httpx.Response) -> str:
    """The message of an error answer (vLLM's ``{"error": {"message"}}``, or its text)."""
    try:
        payload: object = response.json()
    except ValueError:
        payload = None
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        error = error.get("message")
    text = error if isinstance(error, str) else response.text.strip().replace("\n", " ")
    return (text[:_BODY_SHOWN] + ("..." if len(text) > _BODY_SHOWN else "")) or "(empty body)"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' * (n != 1)}"


class Prefetch:
    """A batch requested ahead (:meth:`TargetServerClient.prefetch`)."""

    def __init__(self, future: concurrent.futures.Future[list[ServedStates]]) -> None:
        self._future = future

    def done(self) -> bool:
        """True once the batch's states are all read, or the batch failed."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> list[ServedStates]:
        """The batch's states, one per conversation in order; waits for them (`timeout`
        seconds at most, then TimeoutError). Raises what the batch raised
        (TargetServerError and its subclasses)."""
        return self._future.result(timeout)

    def cancel(self) -> None:
        """Stop the batch's requests (their files are still deleted)."""
        self._future.cancel()


class TargetServerClient:
    """Tap states of conversations from one or more vLLM servers (see the module docstring).

    Use as a context manager, or call :meth:`close`: the client owns a thread, an event loop,
    a connection pool and a few reader threads. Raises TargetServerError at start when
    `settings.storage_dir` (or `keep_dir`) is not a folder.
    """

    def __init__(self, settings: TargetServerSettings) -> None:
        if not settings.storage_dir.is_dir():
            msg = (
                f"target server storage_dir {settings.storage_dir} is not a folder: it must be "
                "the folder vLLM's connector writes into (shared_storage_path), as this machine "
                "sees it"
            )
            raise TargetServerError(msg)
        if settings.keep_dir is not None and not settings.keep_dir.is_dir():
            msg = f"target server keep_dir {settings.keep_dir} is not a folder: create it first"
            raise TargetServerError(msg)
        self.settings = settings
        self._expected = ExpectedStates(settings.layer_ids, settings.hidden_size, settings.dtype)
        self._servers = [_Server(url, i) for i, url in enumerate(settings.urls)]
        self._turn = 0
        self._abandoned: dict[str, float] = {}
        self._batches: set[asyncio.Task[list[ServedStates]]] = set()
        self._drains: set[asyncio.Task[None]] = set()
        self._closed = False
        self._readers = concurrent.futures.ThreadPoolExecutor(
            max_workers=settings.max_in_flight, thread_name_prefix="target-server-read"
        )
        self._loop = asyncio.new_event_loop()
        self._thread = Thread(target=self._loop.run_forever, name="target-server", daemon=True)
        self._thread.start()
        self._http, self._slots = self._call(self._open())

    # -- the caller's side (any thread) ---------------------------------------------------------

    def states(
        self, conversations: Sequence[Sequence[int]], *, indices: Sequence[int] | None = None
    ) -> list[ServedStates]:
        """The states of each conversation (its token ids), in order: ``prefetch(...).result()``."""
        return self.prefetch(conversations, indices=indices).result()

    def prefetch(
        self, conversations: Sequence[Sequence[int]], *, indices: Sequence[int] | None = None
    ) -> Prefetch:
        """Request a batch now and return at once; :meth:`Prefetch.result` collects it.

        `indices` are what messages call each conversation (say, its row in the data set);
        by default its position in the batch. Raises TargetServerError for an empty
        conversation or a closed client.
        """
        if self._closed:
            msg = "the target server client is closed"
            raise TargetServerError(msg)
        names = list(indices) if indices is not None else list(range(len(conversations)))
        if len(names) != len(conversations):
            msg = f"{len(names)} indices for {len(conversations)} conversations"
            raise TargetServerError(msg)
        prompts = [[int(t) for t in ids] for ids in conversations]
        empty = [n for n, p in zip(names, prompts, strict=True) if not p]
        if empty:
            msg = f"conversations {empty} have no tokens: vLLM refuses an empty prompt"
            raise TargetServerError(msg)
        return Prefetch(asyncio.run_coroutine_threadsafe(self._submit(prompts, names), self._loop))

    def stream(
        self, batches: Iterable[Sequence[Sequence[int]]], *, ahead: int = 1
    ) -> Iterator[list[ServedStates]]:
        """Each batch's states in order, keeping `ahead` later batches requested while the
        caller works on the current one. Leaving the loop early cancels what was asked ahead."""
        if ahead < 0:
            msg = f"ahead {ahead} must be 0 or more"
            raise TargetServerError(msg)
        pending: deque[Prefetch] = deque()
        source = iter(batches)
        try:
            while True:
                while len(pending) <= ahead:
                    batch = next(source, None)
                    if batch is None:
                        break
                    pending.append(self.prefetch(batch))
                if not pending:
                    return
                yield pending.popleft().result()
        finally:
            for handle in pending:
                handle.cancel()

    def probe(self) -> tuple[str, ...]:
        """``host:port`` of each server that answers ``GET /v1/models`` listing
        `served_model_name`; the others are marked down (tried last). TargetServerUnavailable
        when none answers; TargetServerError when one answers without the model."""
        return self._call(self._probe())

    def close(self) -> None:
        """Stop every request, delete what they left (waiting for files vLLM is still writing,
        up to ``timeout_s + lock_timeout_s`` after their request was given up), and end the
        client's thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self._shutdown())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
            self._readers.shutdown(wait=True)

    def __enter__(self) -> TargetServerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    # -- the loop's side ----------------------------------------------------------------------

    async def _open(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        s = self.settings
        headers = {"Authorization": f"Bearer {s.api_key}"} if s.api_key else {}
        client = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(s.timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=s.max_in_flight),
            trust_env=False,  # the servers share a folder with this machine: no proxy between
        )
        return client, asyncio.Semaphore(s.max_in_flight)

    async def _submit(self, prompts: list[list[int]], names: list[int]) -> list[ServedStates]:
        task = asyncio.ensure_future(self._batch(prompts, names))
        self._batches.add(task)
        task.add_done_callback(self._batches.discard)
        return await task

    async def _batch(self, prompts: list[list[int]], names: list[int]) -> list[ServedStates]:
        stop = asyncio.Event()
        jobs = [
            asyncio.ensure_future(self._conversation(n, p, stop))
            for n, p in zip(names, prompts, strict=True)
        ]
        finished: list[asyncio.Future[ServedStates]] = []  # in the order they ended
        for job in jobs:
            job.add_done_callback(finished.append)
        try:
            await asyncio.wait(jobs, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            unfinished = [job for job in jobs if not job.done()]
            for job in unfinished:
                job.cancel()
            await asyncio.gather(*unfinished, return_exceptions=True)
            await self._sweep(final=False)
        # the first to fail is the error: later ones may only be the cancellation's echo
        failed = [job for job in finished if not job.cancelled() and job.exception() is not None]
        if failed:
            error = failed[0].exception()
            assert error is not None
            raise error
        return [job.result() for job in jobs]

    def _pick(self, tried: dict[_Server, str]) -> _Server | None:
        candidates = [s for s in self._servers if s not in tried]
        if not candidates:
            return None
        self._turn += 1
        n = len(self._servers)
        return min(candidates, key=lambda s: (s.down, s.in_flight, (s.index - self._turn) % n))

    async def _conversation(
        self, index: int, prompt: list[int], stop: asyncio.Event
    ) -> ServedStates:
        """One conversation of a batch, holding one of the ``max_in_flight`` slots; none is
        sent once another conversation of its batch has failed."""
        async with self._slots:
            if stop.is_set():
                raise asyncio.CancelledError
            try:
                return await self._served(index, prompt)
            except BaseException:
                stop.set()  # before the slot is free for the batch's next conversation
                raise

    async def _served(self, index: int, prompt: list[int]) -> ServedStates:
        """The states of one conversation: retries on a server, then the next server."""
        s = self.settings
        tried: dict[_Server, str] = {}
        while (server := self._pick(tried)) is not None:
            attempts = 1 if server.down else s.retries + 1
            failure = ""
            for attempt in range(attempts):
                if attempt:
                    await asyncio.sleep(s.backoff(attempt))
                try:
                    states = await self._attempt(server, index, prompt)
                except _AttemptFailed as exc:
                    failure = str(exc)
                    continue
                server.down = False
                return states
            server.down = True
            tried[server] = f"{failure} ({_plural(attempts, 'attempt')})"
        what = "; ".join(f"{srv.name}: {why}" for srv, why in tried.items())
        msg = (
            f"no target server gave the states of conversation {index} ({len(prompt)} tokens): "
            f"{what}. Start the servers with {_SERVE}, or fix the server URLs "
            "(target_server.urls)"
        )
        raise TargetServerUnavailable(msg)

    async def _attempt(self, server: _Server, index: int, prompt: list[int]) -> ServedStates:
        s = self.settings
        request_id = f"dflash-{uuid.uuid4().hex}"
        body = {
            "model": s.served_model_name,
            "prompt": prompt,
            "max_tokens": 1,
            "return_token_ids": True,
        }
        server.in_flight += 1
        settled = False
        try:
            request = asyncio.ensure_future(
                self._http.post(
                    f"{server.root}/v1/completions",
                    json=body,
                    headers={"X-Request-Id": request_id},
                )
            )
            try:
                response = await asyncio.wait_for(asyncio.shield(request), s.timeout_s)
            except TimeoutError:
                request.cancel()
                msg = f"no answer within timeout_s={s.timeout_s:g}"
                raise _AttemptFailed(msg) from None
            except asyncio.CancelledError:
                self._drain(request)
                raise
            except httpx.ConnectError as exc:
                msg = f"refused the connection ({exc})"
                raise _AttemptFailed(msg) from None
            except httpx.HTTPError as exc:
                msg = f"dropped the request ({type(exc).__name__}: {exc})"
                raise _AttemptFailed(msg) from None
            path, served = self._answer(server, index, prompt, response)
            read = functools.partial(
                take_states_file,
                path,
                prompt,
                expected=self._expected,
                server=server.name,
                conversation=index,
                deadline=time.monotonic() + s.lock_timeout_s,
                keep_dir=s.keep_dir,
            )
            try:
                states = await asyncio.get_running_loop().run_in_executor(self._readers, read)
            except StatesFileFailure as exc:
                what = str(exc).removeprefix(f"{server.name}: ")
                where = "" if str(path) == served else f" (the server wrote {served})"
                raise _AttemptFailed(f"{what}{where}") from None
            settled = True
            return states
        finally:
            server.in_flight -= 1
            if not settled:
                self._abandoned[request_id] = time.monotonic() + s.timeout_s + s.lock_timeout_s

    def _answer(
        self, server: _Server, index: int, prompt: list[int], response: httpx.Response
    ) -> tuple[Path, str]:
        """The local path of an answer's file (and the path the server wrote), its token ids
        checked; _AttemptFailed for a status worth retrying, TargetServerError otherwise."""
        s = self.settings
        status = response.status_code
        if status >= 500 or status in _RETRY_STATUSES:
            msg = f"HTTP {status}: {_excerpt(response)}"
            raise _AttemptFailed(msg)
        if status in (401, 403):
            msg = (
                f"{server.name} refused the request (HTTP {status}: {_excerpt(response)}): set "
                "the API key to the servers' --api-key"
            )
            raise TargetServerError(msg)
        if status == 404:
            msg = (
                f"{server.name} does not serve the model {s.served_model_name!r} (HTTP 404: "
                f"{_excerpt(response)}); set the served model name to the server's "
                "--served-model-name (GET /v1/models lists it)"
            )
            raise TargetServerError(msg)
        if status >= 400:
            msg = (
                f"{server.name} refused conversation {index} ({len(prompt)} tokens): HTTP "
                f"{status}: {_excerpt(response)}; a conversation longer than the server's "
                "--max-model-len needs a server started with a larger one"
            )
            raise TargetServerError(msg)
        try:
            payload: object = response.json()
        except ValueError:
            payload = None
        params = payload.get("kv_transfer_params") if isinstance(payload, dict) else None
        served = params.get("hidden_states_path") if isinstance(params, dict) else None
        if not isinstance(served, str) or not served:
            msg = (
                f"{server.name} answered conversation {index} without "
                f"kv_transfer_params.hidden_states_path ({_excerpt(response)}): it does not "
                f"write hidden states: start it with {_SERVE}"
            )
            raise TargetServerError(msg)
        choices = payload.get("choices") if isinstance(payload, dict) else None
        choice = choices[0] if isinstance(choices, list) and choices else None
        echoed = choice.get("prompt_token_ids") if isinstance(choice, dict) else None
        if isinstance(echoed, list):
            error = token_mismatch(
                prompt,
                echoed,
                conversation=index,
                server=server.name,
                where=f"its answer's prompt_token_ids; file {served}",
            )
            if error is not None:
                raise error
        name = PurePosixPath(served).name
        if not (name.startswith("cmpl-") and name.endswith(".safetensors")):
            msg = (
                f"{server.name} named the file {served!r}, not a cmpl-*.safetensors file of "
                "vLLM's hidden-states connector"
            )
            raise TargetServerError(msg)
        return s.storage_dir / name, served

    def _drain(self, request: asyncio.Future[httpx.Response]) -> None:
        """Let a request whose conversation was cancelled run to its answer (``timeout_s`` at
        most), so that the file the server then writes is found by the sweep, not left."""

        async def drain() -> None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(request, self.settings.timeout_s)

        task = asyncio.ensure_future(drain())
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)

    async def _sweep(self, *, final: bool) -> bool:
        """Delete what abandoned requests left; forget a request once nothing of it is left
        and its server can no longer answer it (`final`: once nothing is left). True while a
        request's file is still being written within its deadline."""
        if not self._abandoned:
            return False
        ids = list(self._abandoned)
        storage = self.settings.storage_dir

        def sweep() -> list[str]:
            return [i for i in ids if sweep_request_files(storage, i)]

        cleared = set(await asyncio.get_running_loop().run_in_executor(self._readers, sweep))
        now = time.monotonic()
        for request_id in ids:
            if request_id in cleared and (final or now > self._abandoned[request_id]):
                del self._abandoned[request_id]
        return any(now < self._abandoned[i] for i in ids if i not in cleared)

    async def _shutdown(self) -> None:
        for task in list(self._batches):
            task.cancel()
        await asyncio.gather(*self._batches, return_exceptions=True)
        await asyncio.gather(*self._drains, return_exceptions=True)
        # a file vLLM still writes (its lock held) is waited for until its request's deadline
        while await self._sweep(final=True):
            await asyncio.sleep(0.02)
        await self._http.aclose()

    async def _probe(self) -> tuple[str, ...]:
        s = self.settings
        live: list[str] = []
        failures: list[str] = []
        for server in self._servers:
            try:
                response = await asyncio.wait_for(
                    self._http.get(f"{server.root}/v1/models"), s.timeout_s
                )
            except (TimeoutError, httpx.HTTPError) as exc:
                why = (
                    f"no answer within timeout_s={s.timeout_s:g}"
                    if isinstance(exc, TimeoutError)
                    else f"{type(exc).__name__}: {exc}"
                )
                server.down = True
                failures.append(f"{server.name}: {why}")
                continue
            if response.is_error:
                server.down = True
                failures.append(f"{server.name}: HTTP {response.status_code}")
                continue
            try:
                listing: object = response.json()
            except ValueError:
                listing = None
            data = listing.get("data") if isinstance(listing, dict) else None
            served = [m.get("id") for m in data if isinstance(m, dict)] if data else []
            if s.served_model_name not in served:
                msg = (
                    f"{server.name} serves {served}, not {s.served_model_name!r}: set the served "
                    "model name to the server's --served-model-name, or point urls at the "
                    "target's servers"
                )
                raise TargetServerError(msg)
            server.down = False
            live.append(server.name)
        if not live:
            msg = f"no target server answers: {'; '.join(failures)}. Start them with {_SERVE}"
            raise TargetServerUnavailable(msg)
        return tuple(live)


__all__ = ["Prefetch", "TargetServerClient"]
