"""What the target-server client needs: the servers, the shared folder, the states it expects
and the request policy, as plain typed values (no plan, no recipe).

The layer ids are vLLM's (``docs``: id 0 the embeddings, id ``k`` the output of decoder layer
``k - 1``, id ``L`` the last decoder layer's output before the final norm): a DFlash tap ``t``
is id ``t + 1``. vLLM writes the layers in ascending id order with duplicates collapsed, so the
settings take them that way and the states come back in that order.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import httpx

from dflash_recipes.errors import TargetServerError
from dflash_recipes.recipe.choices import DTYPES, Dtype
from dflash_recipes.records import Record

#: The path suffixes of the OpenAI-compatible API a URL may be given with (``.../v1``).
_API_SUFFIXES = ("/v1/completions", "/v1")


def base_url(url: str) -> str:
    """`url` without a trailing ``/``, ``/v1`` or ``/v1/completions``: the server's root."""
    root = url.strip().rstrip("/")
    for suffix in _API_SUFFIXES:
        if root.endswith(suffix):
            return root[: -len(suffix)].rstrip("/")
    return root


def server_name(url: str) -> str:
    """``host:port`` of a server URL, as every message names it (the scheme's port if none)."""
    parsed = httpx.URL(base_url(url))
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    host = f"[{parsed.host}]" if ":" in parsed.host else parsed.host
    return f"{host}:{port}"


def _check_url(url: str) -> None:
    try:
        parsed = httpx.URL(base_url(url))
    except (httpx.InvalidURL, TypeError) as exc:
        msg = f"target server URL {url!r} is not a URL ({exc}); write it as http://HOST:PORT"
        raise TargetServerError(msg) from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        msg = f"target server URL {url!r} is not http(s)://HOST:PORT"
        raise TargetServerError(msg)


@attrs.frozen(repr=False, eq=False, slots=False)
class TargetServerSettings(Record):
    """One client's servers, shared folder, expected states and request policy.

    Raises TargetServerError for a value no request could work with (no URL, layer ids out of
    vLLM's order, a bound below 1).
    """

    #: One or more vLLM servers serving the same target (``http://host:port``, ``/v1`` allowed).
    urls: tuple[str, ...]
    #: The folder vLLM's connector writes into (``shared_storage_path``), as this process sees
    #: it: the client reads each file by its name from the answer, in this folder.
    storage_dir: Path
    #: ``--served-model-name`` of the servers: the ``model`` of every request.
    served_model_name: str
    #: The vLLM layer ids the servers were started with, ascending and distinct.
    layer_ids: tuple[int, ...]
    #: The target's hidden size (the last axis of every file).
    hidden_size: int
    #: The served dtype (``--dtype``): a file in another dtype is refused.
    dtype: Dtype
    #: Conversations in flight at once over every server, from request to file deleted (also the
    #: most hidden-states files this client has on disk at once).
    max_in_flight: int = 8
    #: Seconds one request may take, from sending to the whole answer (a stalled server is cut
    #: off here and retried).
    timeout_s: float = 120.0
    #: Retries of a failed request on the same server (5xx, refused, timed out, no file) before
    #: its work goes to the other servers.
    retries: int = 3
    #: The wait before the first retry; it doubles with each further one.
    backoff_s: float = 2.0
    #: Seconds to wait for vLLM's lock on a file after its answer (the file is written in a
    #: later engine step, then the lock released).
    lock_timeout_s: float = 60.0
    #: None: delete each file once read. A folder: keep each file that passed every check
    #: there, under its own name (moved from storage_dir; ``storage_dir`` itself keeps it where
    #: vLLM wrote it). Locks and files that failed a check are always deleted.
    keep_dir: Path | None = None
    #: Sent as ``Authorization: Bearer`` (the servers' ``--api-key``); never shown.
    api_key: str | None = attrs.field(default=None, repr=False)

    def __attrs_post_init__(self) -> None:
        for url in self.urls:
            _check_url(url)
        problems = self._problems()
        if problems:
            msg = "target server settings: " + "; ".join(problems)
            raise TargetServerError(msg)

    def _problems(self) -> list[str]:
        problems = []
        if not self.urls:
            problems.append("no URL (give at least one vLLM server as http://HOST:PORT)")
        names = [server_name(u) for u in self.urls]
        if len(set(names)) != len(names):
            problems.append(f"a server is named twice in urls {list(self.urls)}")
        ids = list(self.layer_ids)
        if not ids or ids != sorted(set(ids)) or ids[0] < 0:
            problems.append(
                f"layer_ids {ids} must be vLLM layer ids, ascending and distinct, from 0 "
                "(vLLM writes them in that order whatever order it was given)"
            )
        if self.hidden_size < 1:
            problems.append(f"hidden_size {self.hidden_size} must be at least 1")
        if self.dtype not in DTYPES:
            problems.append(f"dtype {self.dtype!r} must be one of {', '.join(DTYPES)}")
        if self.max_in_flight < 1:
            problems.append(f"max_in_flight {self.max_in_flight} must be at least 1")
        if self.retries < 0:
            problems.append(f"retries {self.retries} must be 0 or more")
        for name in ("timeout_s", "lock_timeout_s"):
            if not getattr(self, name) > 0:
                problems.append(f"{name} {getattr(self, name)} must be above 0")
        if not self.backoff_s >= 0:
            problems.append(f"backoff_s {self.backoff_s} must be 0 or more")
        return problems

    @property
    def server_names(self) -> tuple[str, ...]:
        """``host:port`` of each URL, in order."""
        return tuple(server_name(u) for u in self.urls)

    def backoff(self, retry: int) -> float:
        """Seconds to wait before retry number `retry` (1 for the first): doubling."""
        return self.backoff_s * 2.0 ** (retry - 1)


__all__ = ["TargetServerSettings", "base_url", "server_name"]
