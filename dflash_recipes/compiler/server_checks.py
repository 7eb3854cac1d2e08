"""The compile's cross-checks of the two sections that talk to a server, before any request:
`regenerate:` (the base URL, the API key's variable, server-only fields, the answer length, the
output path) and `target_server:` (the URLs, the storage folder, offline data, the length vLLM
must accept).

Torch-free and network-free. The URL and output rules themselves, which `dflash-recipe
regenerate` and `serve-target` apply too, are :mod:`~dflash_recipes.plan.regenerate_settings`'s
and :mod:`~dflash_recipes.plan.target_server_settings`'s.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs

from dflash_recipes.checkpoint.target_facts import TargetFacts
from dflash_recipes.diagnostics import Severity, register_code
from dflash_recipes.plan.regenerate_settings import (
    REGENERATE_OUTPUT_IS_INPUT,
    base_url_problem,
    output_problem,
)
from dflash_recipes.plan.target_server_settings import (
    server_identity,
    server_root,
    server_url_problem,
)
from dflash_recipes.recipe.sections import RegenerateSection, TargetServerSection
from dflash_recipes.records import Record

_E, _W = Severity.ERROR, Severity.WARNING

REGENERATE_BAD_URL = register_code(
    "regenerate-bad-url",
    _E,
    "regenerate.base_url is not the http(s) base URL of an OpenAI-compatible server",
)
REGENERATE_OUTPUT_IS_DATA = register_code(
    "regenerate-output-is-data",
    _W,
    "regenerate.output_path is data.data_path: fine to train on, but `regenerate` needs --input",
)
REGENERATE_TOO_LONG = register_code(
    "regenerate-max-new-tokens",
    _E,
    "regenerate.max_new_tokens exceeds training.training_seq_len: the answers could not be trained",
)
REGENERATE_API_KEY_UNSET = register_code(
    "regenerate-api-key-unset",
    _W,
    "the environment variable named by regenerate.api_key_env is not set where compile ran",
)
REGENERATE_SERVER_FIELD_UNUSED = register_code(
    "regenerate-server-field-unused",
    _W,
    "a server-only regenerate field is set but base_url is not (local generation ignores it)",
)
TARGET_SERVER_BAD_URL = register_code(
    "target-server-bad-url",
    _E,
    "a target_server.urls entry is not the http(s)://host:port address of a vLLM server",
)
TARGET_SERVER_DUPLICATE_URL = register_code(
    "target-server-duplicate-url",
    _E,
    "target_server.urls names the same server twice",
)
TARGET_SERVER_OFFLINE = register_code(
    "target-server-offline",
    _E,
    "target_server with data.hidden_states_path: offline training reads no target at all",
)
TARGET_SERVER_STORAGE_MISSING = register_code(
    "target-server-storage-missing",
    _E,
    "target_server.storage_dir does not exist where compile ran",
)
TARGET_SERVER_STORAGE_UNUSABLE = register_code(
    "target-server-storage-unusable",
    _E,
    "target_server.storage_dir is not a folder the trainer can read and delete files in",
)
TARGET_SERVER_MAX_MODEL_LEN = register_code(
    "target-server-max-model-len",
    _E,
    "training.training_seq_len + 1 (the served --max-model-len) exceeds the target's "
    "max_position_embeddings: vLLM would refuse to start",
)
TARGET_SERVER_FIELD_UNUSED = register_code(
    "target-server-field-unused",
    _W,
    "target_server.capture_dir is set but keep_files is delete (nothing is kept)",
)
TARGET_SERVER_API_KEY_UNSET = register_code(
    "target-server-api-key-unset",
    _W,
    "the environment variable named by target_server.api_key_env is not set where compile ran",
)


@attrs.frozen(repr=False, eq=False, slots=False)
class Finding(Record):
    """One problem with the regenerate settings (the compiler turns it into a Diagnostic)."""

    code: str
    severity: Severity
    path: str
    message: str
    hint: str


# ---------------------------------------------------------------------------------------------
# cross-checks and the plan
# ---------------------------------------------------------------------------------------------


def check_regenerate(
    section: RegenerateSection,
    *,
    training_seq_len: int,
    output: Path | None,
    source: Path | None,
    resolve: bool,
) -> list[Finding]:
    """Every finding about the `regenerate:` section; `resolve` allows looking at files."""
    findings: list[Finding] = []
    if section.base_url is not None:
        why = base_url_problem(section.base_url)
        if why is not None:
            findings.append(
                Finding(
                    REGENERATE_BAD_URL,
                    _E,
                    "regenerate.base_url",
                    f"regenerate.base_url {section.base_url!r} {why}",
                    "set regenerate.base_url to the server's OpenAI API, e.g. "
                    "http://localhost:8000/v1 (vLLM) or http://localhost:30000/v1 (SGLang)",
                )
            )
        if section.api_key_env is not None and section.api_key_env not in os.environ:
            findings.append(
                Finding(
                    REGENERATE_API_KEY_UNSET,
                    _W,
                    "regenerate.api_key_env",
                    f"regenerate.api_key_env names {section.api_key_env}, which is not set in "
                    "this environment; requests would be sent without an API key",
                    f"export {section.api_key_env}=... before `dflash-recipe regenerate`, or "
                    "set regenerate.api_key_env: null for a server without a key",
                )
            )
    else:
        defaults = RegenerateSection()
        for name in ("model", "api_key_env", "request_timeout_s", "max_retries"):
            if getattr(section, name) != getattr(defaults, name):
                findings.append(
                    Finding(
                        REGENERATE_SERVER_FIELD_UNUSED,
                        _W,
                        f"regenerate.{name}",
                        f"regenerate.{name} is set but regenerate.base_url is not: answers are "
                        f"generated locally with transformers, which ignores {name}",
                        "set regenerate.base_url to your server (e.g. http://localhost:8000/v1), "
                        f"or delete regenerate.{name}",
                    )
                )
    if section.max_new_tokens is not None and section.max_new_tokens > training_seq_len:
        findings.append(
            Finding(
                REGENERATE_TOO_LONG,
                _E,
                "regenerate.max_new_tokens",
                f"regenerate.max_new_tokens is {section.max_new_tokens} but "
                f"training.training_seq_len is {training_seq_len}: longer answers would be cut "
                "off in training, so generating them wastes the server's time",
                f"set regenerate.max_new_tokens to at most {training_seq_len} (leave room for "
                "the prompt), or raise training.training_seq_len",
            )
        )
    if resolve and output is not None:
        problem = output_problem(output, source)
        if problem is not None and problem[0] == REGENERATE_OUTPUT_IS_INPUT:
            # Training on the regenerated file is the point; only `regenerate` itself, which
            # reads data.data_path unless --input is given, must not write over its input.
            findings.append(
                Finding(
                    REGENERATE_OUTPUT_IS_DATA,
                    _W,
                    "regenerate.output_path",
                    f"regenerate.output_path {output} is data.data_path: `run` trains on the "
                    "regenerated file, but `dflash-recipe regenerate` would refuse to write "
                    "over the prompts it reads",
                    "to regenerate again, pass the prompts with --input FILE",
                )
            )
        elif problem is not None:
            code, message, hint = problem
            findings.append(Finding(code, _E, "regenerate.output_path", message, hint))
    return findings


# ---------------------------------------------------------------------------------------------
# target_server
# ---------------------------------------------------------------------------------------------

_URLS_HINT = (
    "write each server as http://HOST:PORT, e.g. http://localhost:8000 (one entry per vLLM "
    "replica, each started with the command `dflash-recipe serve-target` prints)"
)


def check_target_server(
    section: TargetServerSection,
    *,
    hidden_states_path: str | None,
    storage_dir: Path,
    capture_dir_set: bool,
    training_seq_len: int,
    facts: TargetFacts | None,
    resolve: bool,
) -> list[Finding]:
    """Every finding about the `target_server:` section; `resolve` allows looking at files
    (storage_dir, absolute) and `facts` are the target's, once read."""
    findings = _check_urls(section.urls)
    if hidden_states_path is not None:
        findings.append(
            Finding(
                TARGET_SERVER_OFFLINE,
                _E,
                "target_server",
                "target_server is set and so is data.hidden_states_path: a run from a capture "
                "reads the target's states from its shards and never asks a server",
                "delete data.hidden_states_path to train online through the server, or delete "
                "the target_server section to train offline from the capture",
            )
        )
    if capture_dir_set and section.keep_files != "capture":
        findings.append(
            Finding(
                TARGET_SERVER_FIELD_UNUSED,
                _W,
                "target_server.capture_dir",
                "target_server.capture_dir is set but target_server.keep_files is "
                f"{section.keep_files}: every file is deleted once read, nothing is kept there",
                "set target_server.keep_files: capture to keep the states as capture shards, "
                "or delete target_server.capture_dir",
            )
        )
    if section.api_key_env is not None and section.api_key_env not in os.environ:
        findings.append(
            Finding(
                TARGET_SERVER_API_KEY_UNSET,
                _W,
                "target_server.api_key_env",
                f"target_server.api_key_env names {section.api_key_env}, which is not set in "
                "this environment; requests would be sent without an API key",
                f"export {section.api_key_env}=... before `dflash-recipe run`, or set "
                "target_server.api_key_env: null for servers without a key",
            )
        )
    max_model_len = training_seq_len + 1
    if (
        facts is not None
        and facts.rope.rope_type == "default"  # a scaled RoPE lets vLLM derive a longer limit
        and max_model_len > facts.max_position_embeddings
    ):
        findings.append(
            Finding(
                TARGET_SERVER_MAX_MODEL_LEN,
                _E,
                "training.training_seq_len",
                f"the served target needs --max-model-len {max_model_len} "
                f"(training.training_seq_len {training_seq_len} plus the one token the server "
                f"generates), above the target's max_position_embeddings "
                f"{facts.max_position_embeddings}: vLLM refuses to start with it",
                f"set training.training_seq_len: {facts.max_position_embeddings - 1} or less",
            )
        )
    if resolve:
        problem = _storage_problem(storage_dir)
        if problem is not None:
            code, message, hint = problem
            findings.append(Finding(code, _E, "target_server.storage_dir", message, hint))
    return findings


def _check_urls(urls: tuple[str, ...]) -> list[Finding]:
    findings: list[Finding] = []
    seen: dict[tuple[str, str, int, str], int] = {}
    for index, url in enumerate(urls):
        path = f"target_server.urls.{index}"
        why = server_url_problem(url)
        if why is not None:
            message = f"target_server.urls[{index}] {url!r} {why}"
            findings.append(Finding(TARGET_SERVER_BAD_URL, _E, path, message, _URLS_HINT))
            continue
        identity = server_identity(url)
        first = seen.setdefault(identity, index)
        if first != index:
            findings.append(
                Finding(
                    TARGET_SERVER_DUPLICATE_URL,
                    _E,
                    path,
                    f"target_server.urls[{index}] {url!r} is the server of "
                    f"target_server.urls[{first}] ({server_root(urls[first])}) again; each "
                    "replica would be asked twice as often and count as two",
                    f"delete target_server.urls[{index}], or give the replica's own host:port",
                )
            )
    return findings


def _storage_problem(storage_dir: Path) -> tuple[str, str, str] | None:
    """(code, message, hint) when the trainer cannot use `storage_dir`, else None."""
    shared = (
        "the folder vLLM writes into, as the trainer sees it (the same path on the servers: "
        "/dev/shm/... on one node, a shared file system across nodes)"
    )
    try:
        if not storage_dir.exists():
            if storage_dir.is_symlink():
                message = f"target_server.storage_dir {storage_dir} is a link to nothing"
                return TARGET_SERVER_STORAGE_UNUSABLE, message, f"point it at {shared}"
            message = f"target_server.storage_dir {storage_dir} does not exist"
            hint = f"create it with `mkdir -p {storage_dir}`: {shared}"
            return TARGET_SERVER_STORAGE_MISSING, message, hint
        if not storage_dir.is_dir():
            message = f"target_server.storage_dir {storage_dir} is a file, not a folder"
            return TARGET_SERVER_STORAGE_UNUSABLE, message, f"set it to {shared}"
        if not os.access(storage_dir, os.R_OK | os.W_OK | os.X_OK):
            message = (
                f"target_server.storage_dir {storage_dir} is not readable and writable by this "
                "user: the trainer reads each file there and deletes it (and its lock) once read"
            )
            return TARGET_SERVER_STORAGE_UNUSABLE, message, f"`chmod u+rwx {storage_dir}`"
    except OSError as exc:
        message = f"target_server.storage_dir {storage_dir} cannot be inspected: {exc.strerror}"
        return TARGET_SERVER_STORAGE_UNUSABLE, message, f"set it to {shared}"
    return None


__all__ = [
    "REGENERATE_API_KEY_UNSET",
    "REGENERATE_BAD_URL",
    "REGENERATE_OUTPUT_IS_DATA",
    "REGENERATE_SERVER_FIELD_UNUSED",
    "REGENERATE_TOO_LONG",
    "TARGET_SERVER_API_KEY_UNSET",
    "TARGET_SERVER_BAD_URL",
    "TARGET_SERVER_DUPLICATE_URL",
    "TARGET_SERVER_FIELD_UNUSED",
    "TARGET_SERVER_MAX_MODEL_LEN",
    "TARGET_SERVER_OFFLINE",
    "TARGET_SERVER_STORAGE_MISSING",
    "TARGET_SERVER_STORAGE_UNUSABLE",
    "Finding",
    "check_regenerate",
    "check_target_server",
]
