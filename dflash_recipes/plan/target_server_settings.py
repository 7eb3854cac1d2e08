"""The `target_server` settings a plan carries, and what `compile`, `serve-target` and the client
derive from them: the servers' URLs, vLLM's layer ids for the taps, and the one `vllm serve`
command that serves exactly what a plan needs.

Torch-free and network-free, below the compiler and the executor: the compiler checks the
recipe's `target_server:` section with these rules
(:mod:`~dflash_recipes.compiler.server_checks`) and builds the plan's
:class:`~dflash_recipes.plan.parts.TargetServerPlan` here; `dflash-recipe serve-target` prints
:func:`vllm_serve_command`.

vLLM's conventions (vLLM >= 0.24; docs/dflash.md, "A target served by vLLM"): layer id ``k``
counts the decoder layers applied, so a DFlash tap ``t`` (the output of decoder layer ``t``) is
id ``t + 1``, and id ``num_hidden_layers`` is the last layer's output before the final norm,
the state the trainer normalises and projects into the target's logits. The file a request
writes holds the ids in ascending order, each once.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

from dflash_recipes.checkpoint.kinds.registry import needs_teacher
from dflash_recipes.checkpoint.model_paths import hub_id_from_cache_path
from dflash_recipes.plan.parts import BaseModelPlan, DraftPlan, TargetServerPlan, TrainingPlan
from dflash_recipes.recipe.sections import TargetServerSection

#: vLLM's own port when a URL names none of its own and ``--port`` is not given.
VLLM_DEFAULT_PORT = 8000
#: Where keep_files: capture keeps the shards when capture_dir is null (in training.output_dir).
KEPT_STATES_DIR = "target-states"
#: The last path segments that name an endpoint, not a server.
_ENDPOINTS = frozenset({"completions", "chat", "models", "health", "v1"})
_SCHEME_PORTS = {"http": 80, "https": 443}


# ---------------------------------------------------------------------------------------------
# URLs
# ---------------------------------------------------------------------------------------------


def server_url_problem(url: str) -> str | None:
    """Why `url` is not usable as a vLLM server's address, or None when it is."""
    try:
        parts = urlsplit(url.strip())
        parts.port  # noqa: B018 (raises ValueError on a bad port)
    except ValueError as exc:
        return f"is not a valid URL ({exc})"
    if parts.scheme not in _SCHEME_PORTS:
        shown = parts.scheme or "none"
        return f"must start with http:// or https:// (scheme: {shown})"
    if not parts.hostname:
        return "has no host name"
    if parts.username is not None or parts.password is not None:
        return "carries credentials (user:password@), which would be written into the plan"
    if parts.query or parts.fragment:
        return "must not carry a query (?...) or a fragment (#...)"
    segments = _prefix(parts.path).rsplit("/", 1)
    if segments[-1] in _ENDPOINTS:
        return "names an endpoint; give the server itself (http://host:port)"
    return None


def _prefix(path: str) -> str:
    """A URL's path without its trailing slash and one trailing /v1 (the OpenAI API root)."""
    path = path.rstrip("/")
    return path[: -len("/v1")] if path.endswith("/v1") else path


def server_root(url: str) -> str:
    """The server's root as the plan records it: scheme and host lower case, no trailing slash,
    no /v1 (the client appends /v1/completions and /health). `url` passed
    :func:`server_url_problem`."""
    parts = urlsplit(url.strip())
    return f"{parts.scheme.lower()}://{parts.netloc.lower()}{_prefix(parts.path)}"


def server_identity(url: str) -> tuple[str, str, int, str]:
    """What makes two URLs the same server: scheme, host, port (the scheme's when unstated) and
    path prefix; `url` passed :func:`server_url_problem`."""
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    port = parts.port if parts.port is not None else _SCHEME_PORTS[scheme]
    return scheme, (parts.hostname or "").lower(), port, _prefix(parts.path)


def server_address(url: str) -> str:
    """host:port of a server URL, as messages name a server."""
    _scheme, host, port, _path = server_identity(url)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def default_port(server: TargetServerPlan) -> int:
    """The port `serve-target` gives vLLM without ``--port``: the first URL's own port, else
    vLLM's default (8000)."""
    port = urlsplit(server.urls[0]).port
    return port if port is not None else VLLM_DEFAULT_PORT


# ---------------------------------------------------------------------------------------------
# layer ids
# ---------------------------------------------------------------------------------------------


def vllm_layer_ids(
    taps: Sequence[int], num_hidden_layers: int, *, teacher: bool
) -> tuple[int, ...]:
    """vLLM's eagle_aux_hidden_state_layer_ids for DFlash taps: each tap t as t + 1, plus
    num_hidden_layers (the last layer before the final norm) with a teacher; ascending, unique,
    the order of the file's layer axis."""
    ids = {tap + 1 for tap in taps}
    if teacher:
        ids.add(num_hidden_layers)
    return tuple(sorted(ids))


# ---------------------------------------------------------------------------------------------
# the plan's settings
# ---------------------------------------------------------------------------------------------


def default_served_model_name(base_model_path: str) -> str:
    """The name a served target answers to when the recipe names none: OWNER/NAME for a Hugging
    Face cache folder (as vLLM names a Hub model), else the folder's own name."""
    return (
        hub_id_from_cache_path(base_model_path, "models") or Path(base_model_path).name or "target"
    )


def target_server_plan(
    section: TargetServerSection,
    *,
    storage_dir: Path,
    capture_dir: Path | None,
    base_model: BaseModelPlan,
    training: TrainingPlan,
    draft: DraftPlan,
) -> TargetServerPlan:
    """The plan's `target_server` settings; paths absolute, `capture_dir` already resolved
    (None unless keep_files is capture). The layer ids and rows stay None until the taps and
    the target's layer count are known (a schema-level compile)."""
    taps, facts = draft.target_layer_ids, base_model.facts
    ids: tuple[int, ...] | None = None
    tap_rows: tuple[int, ...] | None = None
    final_row: int | None = None
    if taps is not None and facts is not None:
        teacher = needs_teacher(draft.architecture.projector_type, draft.objective)
        ids = vllm_layer_ids(taps, facts.num_hidden_layers, teacher=teacher)
        tap_rows = tuple(ids.index(tap + 1) for tap in taps)
        final_row = ids.index(facts.num_hidden_layers) if teacher else None
    return TargetServerPlan(
        urls=tuple(server_root(url) for url in section.urls),
        storage_dir=str(storage_dir),
        served_model_name=(
            section.served_model_name
            if section.served_model_name is not None
            else default_served_model_name(base_model.path)
        ),
        max_in_flight=section.max_in_flight,
        timeout_s=float(section.timeout_s),
        retries=section.retries,
        backoff_s=float(section.backoff_s),
        lock_timeout_s=float(section.lock_timeout_s),
        keep_files=section.keep_files,
        capture_dir=str(capture_dir) if capture_dir is not None else None,
        api_key_env=section.api_key_env,
        vllm_layer_ids=ids,
        tap_rows=tap_rows,
        final_row=final_row,
        dtype=base_model.dtype,
        max_model_len=training.training_seq_len + 1,
    )


# ---------------------------------------------------------------------------------------------
# the command that serves it
# ---------------------------------------------------------------------------------------------


def vllm_serve_command(
    target_path: str,
    server: TargetServerPlan,
    *,
    port: int,
    tensor_parallel_size: int | None = None,
) -> list[str]:
    """The `vllm serve` argv that serves what `server` needs (ValueError for an unresolved plan).

    The dtype is explicit (vLLM's `auto` serves a float32 checkpoint as bfloat16), the layer
    ids are the plan's, and the connector writes into the plan's storage_dir under its lock.
    """
    if server.vllm_layer_ids is None:
        msg = "the plan's target_server has no layer ids (a schema-level plan); compile it"
        raise ValueError(msg)
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {
            "hf_config": {"eagle_aux_hidden_state_layer_ids": list(server.vllm_layer_ids)}
        },
    }
    kv_transfer = {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "shared_storage_path": server.storage_dir,
            "use_synchronization_lock": True,
        },
    }
    argv = [
        "vllm",
        "serve",
        target_path,
        "--served-model-name",
        server.served_model_name,
        "--dtype",
        server.dtype,
        "--max-model-len",
        str(server.max_model_len),
        "--port",
        str(port),
    ]
    if tensor_parallel_size is not None:
        argv += ["--tensor-parallel-size", str(tensor_parallel_size)]
    argv += ["--speculative_config", _compact_json(speculative)]
    argv += ["--kv_transfer_config", _compact_json(kv_transfer)]
    return argv


def _compact_json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


__all__ = [
    "KEPT_STATES_DIR",
    "VLLM_DEFAULT_PORT",
    "default_port",
    "default_served_model_name",
    "server_address",
    "server_identity",
    "server_root",
    "server_url_problem",
    "target_server_plan",
    "vllm_layer_ids",
    "vllm_serve_command",
]
