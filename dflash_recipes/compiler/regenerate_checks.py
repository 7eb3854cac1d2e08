"""The compile's cross-checks of the recipe's `regenerate:` section, before any request: the
base URL, the API key's variable, server-only fields, the answer length and the output path.

Torch-free and network-free. The URL and output rules themselves, which `dflash-recipe
regenerate` applies too, are :mod:`~dflash_recipes.plan.regenerate_settings`'s.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs

from dflash_recipes.diagnostics import Severity, register_code
from dflash_recipes.plan.regenerate_settings import (
    REGENERATE_OUTPUT_IS_INPUT,
    base_url_problem,
    output_problem,
)
from dflash_recipes.recipe.sections import RegenerateSection
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


__all__ = [
    "REGENERATE_API_KEY_UNSET",
    "REGENERATE_BAD_URL",
    "REGENERATE_OUTPUT_IS_DATA",
    "REGENERATE_SERVER_FIELD_UNUSED",
    "REGENERATE_TOO_LONG",
    "Finding",
    "check_regenerate",
]
