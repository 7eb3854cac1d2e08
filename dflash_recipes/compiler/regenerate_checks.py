"""What `dflash-recipe regenerate` can check before any request, and the settings it runs with.

Torch-free and network-free: the compiler imports it to cross-check the recipe's
`regenerate:` section (URL syntax, the output path, lengths), and the executor uses the same
functions for a `--output` given on the command line. Also here: the content key that makes a
rerun skip conversations already answered.

Output layout: ``OUTPUT`` is the final JSONL (assembled at the end, atomically), its shards
live in ``OUTPUT.parts/`` (one file per sealed shard plus the open journal), and the summary
is ``OUTPUT.summary.json``.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

import attrs

from dflash_recipes.diagnostics import Severity, register_code
from dflash_recipes.files.regenerate_output import (
    PARTS_SUFFIX,
    SUMMARY_SUFFIX,
    parts_dir,
    prompt_key,
    summary_path,
)
from dflash_recipes.plan.run_plan import RegeneratePlan
from dflash_recipes.recipe.sections import RegenerateSection
from dflash_recipes.records import Record

_E, _W = Severity.ERROR, Severity.WARNING

REGENERATE_BAD_URL = register_code(
    "regenerate-bad-url",
    _E,
    "regenerate.base_url is not the http(s) base URL of an OpenAI-compatible server",
)
REGENERATE_OUTPUT_IS_INPUT = register_code(
    "regenerate-output-is-input",
    _E,
    "the regenerate output is the file the prompts are read from (--input / data.data_path)",
)
REGENERATE_OUTPUT_IS_DATA = register_code(
    "regenerate-output-is-data",
    _W,
    "regenerate.output_path is data.data_path: fine to train on, but `regenerate` needs --input",
)
REGENERATE_OUTPUT_UNUSABLE = register_code(
    "regenerate-output-unusable",
    _E,
    "regenerate.output_path cannot be written (a directory, or a folder that is not writable)",
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


@attrs.frozen(repr=False, eq=False, slots=False)
class Finding(Record):
    """One problem with the regenerate settings (the compiler turns it into a Diagnostic)."""

    code: str
    severity: Severity
    path: str
    message: str
    hint: str


# ---------------------------------------------------------------------------------------------
# URLs
# ---------------------------------------------------------------------------------------------


def base_url_problem(url: str) -> str | None:
    """Why `url` is not usable as an OpenAI-compatible base URL, or None when it is."""
    try:
        parts = urlsplit(url.strip())
        parts.port  # noqa: B018 (raises ValueError on a bad port)
    except ValueError as exc:
        return f"is not a valid URL ({exc})"
    if parts.scheme not in ("http", "https"):
        shown = parts.scheme or "none"
        return f"must start with http:// or https:// (scheme: {shown})"
    if not parts.hostname:
        return "has no host name"
    if parts.query or parts.fragment:
        return "must not carry a query (?...) or a fragment (#...)"
    if parts.path.rstrip("/").endswith("/chat/completions"):
        return "is the chat endpoint itself; give the base URL (ending in /v1)"
    return None


def _api_root(base_url: str) -> str:
    root = base_url.strip().rstrip("/")
    if not urlsplit(root).path:
        root += "/v1"  # `http://host:8000` means the server's OpenAI API at /v1
    return root


def chat_completions_url(base_url: str) -> str:
    """The `/chat/completions` endpoint of a base URL (`http://host:8000` gets `/v1`)."""
    return _api_root(base_url) + "/chat/completions"


def models_url(base_url: str) -> str:
    """The `/models` endpoint of a base URL."""
    return _api_root(base_url) + "/models"


# ---------------------------------------------------------------------------------------------
# the output
# ---------------------------------------------------------------------------------------------


def output_problem(output: Path, source: Path | None) -> tuple[str, str, str] | None:
    """(code, message, hint) when `output` cannot receive the regenerated data, else None.

    `output` and `source` are absolute. Touches the file system only to look (nothing is
    created).
    """
    hint_other = "set regenerate.output_path (or --output) to a new .jsonl file"
    try:
        if source is not None and (
            output == source or (output.exists() and source.exists() and output.samefile(source))
        ):
            message = (
                f"the output {output} is the input file itself; the prompts would be "
                "overwritten by their answers"
            )
            return REGENERATE_OUTPUT_IS_INPUT, message, hint_other
        if output.is_dir():
            return REGENERATE_OUTPUT_UNUSABLE, f"the output {output} is a directory", hint_other
        parts = parts_dir(output)
        if parts.exists() and not parts.is_dir():
            message = f"{parts} (where the output's shards go) is a file, not a folder"
            return REGENERATE_OUTPUT_UNUSABLE, message, f"move {parts} away, or {hint_other}"
        folder = output.parent
        while not folder.exists():
            folder = folder.parent
        if not folder.is_dir():
            message = f"the output {output} is under {folder}, which is a file, not a folder"
            return REGENERATE_OUTPUT_UNUSABLE, message, hint_other
        if not os.access(folder, os.W_OK | os.X_OK):
            message = f"the output's folder {folder} is not writable by this user"
            return REGENERATE_OUTPUT_UNUSABLE, message, f"make {folder} writable, or {hint_other}"
    except OSError as exc:
        message = f"the output {output} cannot be inspected: {exc.strerror or exc}"
        return REGENERATE_OUTPUT_UNUSABLE, message, hint_other
    return None


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


def regenerate_plan(
    section: RegenerateSection, output: Path | None, *, training_seq_len: int
) -> RegeneratePlan:
    """The plan's regenerate settings; `output` is the absolute output path (or None).

    An unset max_new_tokens becomes training_seq_len (longer answers could not be trained).
    """
    return RegeneratePlan(
        base_url=section.base_url.strip() if section.base_url is not None else None,
        model=section.model,
        api_key_env=section.api_key_env,
        max_concurrency=section.max_concurrency,
        temperature=float(section.temperature),
        top_p=float(section.top_p),
        max_new_tokens=(
            section.max_new_tokens if section.max_new_tokens is not None else training_seq_len
        ),
        request_timeout_s=float(section.request_timeout_s),
        max_retries=section.max_retries,
        reasoning=section.reasoning,
        first_turn_only=section.first_turn_only,
        output_path=str(output) if output is not None else None,
    )


def default_regenerate_plan(training_seq_len: int) -> RegeneratePlan:
    """The settings of a recipe without a `regenerate:` section."""
    return regenerate_plan(RegenerateSection(), None, training_seq_len=training_seq_len)


# ---------------------------------------------------------------------------------------------
# resume keys
# ---------------------------------------------------------------------------------------------


__all__ = [
    "PARTS_SUFFIX",
    "REGENERATE_API_KEY_UNSET",
    "REGENERATE_BAD_URL",
    "REGENERATE_OUTPUT_IS_DATA",
    "REGENERATE_OUTPUT_IS_INPUT",
    "REGENERATE_OUTPUT_UNUSABLE",
    "REGENERATE_SERVER_FIELD_UNUSED",
    "REGENERATE_TOO_LONG",
    "SUMMARY_SUFFIX",
    "Finding",
    "base_url_problem",
    "chat_completions_url",
    "check_regenerate",
    "default_regenerate_plan",
    "models_url",
    "output_problem",
    "parts_dir",
    "prompt_key",
    "regenerate_plan",
    "summary_path",
]
