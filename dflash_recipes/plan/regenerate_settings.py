"""The `regenerate` settings a plan carries, and what `compile` and `regenerate` both check about
them before any request: the server's base URL and endpoints, and the output path.

Torch-free and network-free, below the compiler and the executor: the compiler cross-checks the
recipe's `regenerate:` section with these functions
(:mod:`~dflash_recipes.compiler.server_checks`), and `dflash-recipe regenerate` uses the same
ones for a `--output` given on the command line and for the requests it sends.

Output layout (:mod:`~dflash_recipes.files.regenerate_output`): ``OUTPUT`` is the final JSONL
(assembled at the end, atomically), its shards live in ``OUTPUT.parts/`` (one file per sealed
shard plus the open journal), and the summary is ``OUTPUT.summary.json``.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

from dflash_recipes.diagnostics import Severity, register_code
from dflash_recipes.files.regenerate_output import parts_dir
from dflash_recipes.plan.parts import RegeneratePlan
from dflash_recipes.recipe.sections import RegenerateSection

_E = Severity.ERROR

REGENERATE_OUTPUT_IS_INPUT = register_code(
    "regenerate-output-is-input",
    _E,
    "the regenerate output is the file the prompts are read from (--input / data.data_path)",
)
REGENERATE_OUTPUT_UNUSABLE = register_code(
    "regenerate-output-unusable",
    _E,
    "regenerate.output_path cannot be written (a directory, or a folder that is not writable)",
)


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
# the plan's settings
# ---------------------------------------------------------------------------------------------


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
        thinking=section.thinking,
    )


def default_regenerate_plan(training_seq_len: int) -> RegeneratePlan:
    """The settings of a recipe without a `regenerate:` section."""
    return regenerate_plan(RegenerateSection(), None, training_seq_len=training_seq_len)


__all__ = [
    "REGENERATE_OUTPUT_IS_INPUT",
    "REGENERATE_OUTPUT_UNUSABLE",
    "base_url_problem",
    "chat_completions_url",
    "default_regenerate_plan",
    "models_url",
    "output_problem",
    "regenerate_plan",
]
